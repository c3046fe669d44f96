"""The llama.cpp peer: the F16/BF16 GGUFs written from the Q4_1 one, and llama.cpp running them.

The conversion needs only the `gguf` package and runs everywhere; the llama.cpp runs skip where
the optional llama_cpp binding is not installed (peers.INSTALL says how).
"""

import numpy as np
import pytest

import peers
from common.models import resolve_model
from common.prepare_models import find_gguf
from common.tokenizer import Tokenizer
from common.tools.testing import shared

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

# Largest rounding error when a float32 x is stored in the format: half a unit in the last place
# (relative 2^-11 for fp16's 10 stored mantissa bits, 2^-8 for bf16's 7), plus half the smallest
# fp16 subnormal, 2^-25, for tiny values.
ROUNDING = {"F16": (2.0**-11, 2.0**-25), "BF16": (2.0**-8, 0.0)}

needs_llama_cpp = pytest.mark.skipif(peers.llama_cpp_available() is not None, reason=str(peers.llama_cpp_available()))


@pytest.fixture(scope="module")
def q4():
    return shared(gguf.GGUFReader, find_gguf())  # parsed once, with test_gguf.py


@pytest.fixture(scope="module", params=["F16", "BF16"])
def converted(request, q4, tmp_path_factory):
    """(format, reader) of a fresh conversion: the code under test, not a cached file."""
    fmt = request.param
    path = peers.convert_gguf(find_gguf(), tmp_path_factory.mktemp("gguf") / f"model.{fmt}.gguf", fmt)
    return fmt, gguf.GGUFReader(path)


def test_same_metadata_and_tokenizer(q4, converted):
    fmt, out = converted
    expected = {k: f.contents() for k, f in q4.fields.items() if not k.startswith("GGUF.")}
    got = {k: f.contents() for k, f in out.fields.items() if not k.startswith("GGUF.")}
    assert got.pop("general.file_type") == {"F16": 1, "BF16": 32}[fmt]
    assert expected.pop("general.file_type") == 3  # MOSTLY_Q4_1
    assert got == expected
    for k in expected:  # and with the same types: llama.cpp reads e.g. block_count as a UINT32
        assert out.fields[k].types == q4.fields[k].types, k


def test_same_tensors_within_rounding(q4, converted):
    fmt, out = converted
    assert [t.name for t in out.tensors] == [t.name for t in q4.tensors]
    rel, tiny = ROUNDING[fmt]
    max_err = 0.0
    for a, b in zip(q4.tensors, out.tensors):
        assert list(b.shape) == list(a.shape), a.name
        assert b.tensor_type == (T.F32 if len(a.shape) == 1 else T[fmt]), a.name
        x = gguf.quants.dequantize(a.data, a.tensor_type)
        y = gguf.quants.dequantize(b.data, b.tensor_type)
        assert y.shape == x.shape, a.name
        err = np.abs(y - x)
        assert (err <= rel * np.abs(x) + tiny).all(), f"{a.name}: max error {err.max()}"
        max_err = max(max_err, float(err.max()))
    # Rounding did happen (Q4_1's d*q+m needs more mantissa bits than fp16 has), so the bound
    # above was tested, not trivially met by identical values.
    assert max_err > 0


def test_weight_bytes_per_token(q4):
    # Every tensor is read once per token; the tied embedding is the LM head, so it is read whole.
    n_bytes = peers.weight_bytes_per_token(find_gguf())
    assert n_bytes == sum(int(t.n_bytes) for t in q4.tensors)
    # Q4_1: 32 weights in 20 bytes (16 of 4-bit values, an fp16 scale and an fp16 minimum);
    # the embedding is Q8_0: 32 weights in 34 bytes; the norms are float32.
    per_weight = {T.Q4_1: 20 / 32, T.Q8_0: 34 / 32, T.F32: 4}
    assert n_bytes == sum(int(t.n_elements) * per_weight[t.tensor_type] for t in q4.tensors)


def test_gguf_path_rejects_unknown_format():
    with pytest.raises(ValueError, match="Q4_1, F16, BF16"):
        peers.gguf_path("Q8_0")


def test_llama_cpp_available_says_how_to_install():
    reason = peers.llama_cpp_available()
    assert reason is None or "pip install" in reason and "llama-cpp-python" in reason


def chat(text):
    tok = Tokenizer(resolve_model("smollm2-135m"))
    return tok, tok.encode_chat([{"role": "user", "content": text}])


# One thread: these check results, not speed, and stay quick on a busy machine (llama.cpp's
# threads spin at barriers, which crawls when they outnumber free cores).
@needs_llama_cpp
@pytest.mark.parametrize("fmt", peers.FORMATS)
def test_llama_cpp_answers_greedily(fmt):
    # A question whose greedy answer is no near-tie: "What is the capital of France?" starts
    # "L'Étoile" in Q4_1 under llama.cpp (it rounds activations to 8 bits for Q4_1 matmuls) and
    # "The capital of France is Paris." in F16/BF16. All three formats must agree here.
    tok, prompt = chat("Name the largest ocean on Earth.")
    r = peers.run_llama_cpp(peers.gguf_path(fmt), prompt, n_decode=12, threads=1)
    assert len(r["ids"]) == r["new_tokens"] == 12 and r["prompt_tokens"] == len(prompt)
    assert tok.decode(r["ids"]).startswith("The largest ocean on Earth is the Pacific Ocean."), tok.decode(r["ids"])
    assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and len(r["step_ms"]) == 11
    assert r["file_bytes"] == peers.gguf_path(fmt).stat().st_size
    assert r["model_bytes"] == peers.weight_bytes_per_token(peers.gguf_path(fmt))  # tied LM head


@needs_llama_cpp
def test_llama_cpp_does_not_stop_at_eos():
    # The answer "Yes." ends with <|im_end|> (EOS) after 3 tokens; the runner must go on to
    # exactly n_decode tokens, so every format and engine is timed over the same count.
    tok, prompt = chat("Say just the word yes.")
    r = peers.run_llama_cpp(peers.gguf_path("Q4_1"), prompt, n_decode=10, threads=1)
    assert len(r["ids"]) == 10
    assert tok.eos_id in r["ids"][:5], tok.decode(r["ids"])
