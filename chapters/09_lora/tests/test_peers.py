"""The llama.cpp peer: the BF16 GGUF written from the Q4_1 one, and llama.cpp decoding sequences
together (one llama_decode per step, a sequence id each) with the same greedy tokens as alone.

The conversion needs only the `gguf` package and runs everywhere; the llama.cpp runs skip where
the optional llama_cpp binding is not installed (peers.INSTALL says how; it is not in
requirements.txt).
"""

import numpy as np
import pytest

import peers
from common.models import resolve_model
from common.prepare_models import find_gguf
from common.tokenizer import Tokenizer
from common.tools.testing import shared

needs_llama_cpp = pytest.mark.skipif(
    peers.llama_cpp_available() is not None, reason=f"optional llama.cpp peer: {peers.llama_cpp_available()}"
)


# --- the BF16 GGUF (the conversion is chapter 04's) ----------------------------------------------


@pytest.fixture(scope="module")
def readers(tmp_path_factory):
    """(Q4_1 reader, reader of a fresh BF16 conversion): the code under test, not a cached file."""
    gguf = pytest.importorskip("gguf")
    path = peers.convert_gguf(find_gguf(), tmp_path_factory.mktemp("gguf") / "model.BF16.gguf", "BF16")
    return shared(gguf.GGUFReader, find_gguf()), gguf.GGUFReader(path)  # the Q4_1 one parsed once, with test_gguf.py


def test_bf16_gguf_same_metadata_and_tensors_within_rounding(readers):
    import gguf

    q4, out = readers
    expected = {k: f.contents() for k, f in q4.fields.items() if not k.startswith("GGUF.")}
    got = {k: f.contents() for k, f in out.fields.items() if not k.startswith("GGUF.")}
    assert got.pop("general.file_type") == 32 and expected.pop("general.file_type") == 3  # MOSTLY_BF16, _Q4_1
    assert got == expected
    assert [t.name for t in out.tensors] == [t.name for t in q4.tensors]
    for a, b in zip(q4.tensors, out.tensors):
        assert b.tensor_type == (
            gguf.GGMLQuantizationType.F32 if len(a.shape) == 1 else gguf.GGMLQuantizationType.BF16
        ), a.name
        x = gguf.quants.dequantize(a.data, a.tensor_type)
        y = gguf.quants.dequantize(b.data, b.tensor_type)
        # bf16 keeps 7 mantissa bits: round to nearest is within half a unit in the last place, 2^-8
        assert (np.abs(y - x) <= 2.0**-8 * np.abs(x)).all(), a.name


def test_gguf_path_rejects_unknown_format():
    with pytest.raises(ValueError, match="Q4_1, F16, BF16"):
        peers.gguf_path("Q8_0")


def test_llama_cpp_available_says_how_to_install():
    reason = peers.llama_cpp_available()
    assert reason is None or "pip install" in reason and "llama-cpp-python" in reason


# --- llama.cpp, batched --------------------------------------------------------------------------

QUESTIONS = [
    "Name the largest ocean on Earth.",
    "Say just the word yes.",
]  # "Yes." then <|im_end|> (EOS) by its 3rd token: the peer must go on


@pytest.fixture(scope="module")
def chats():
    tok = Tokenizer(resolve_model("smollm2-135m"))
    return tok, [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


# One thread: these check results, not speed, and stay quick on a busy machine (llama.cpp's
# threads spin at barriers, which crawls when they outnumber free cores).
@needs_llama_cpp
def test_batched_greedy_tokens_are_batch_one_tokens(chats):
    tok, prompts = chats
    path = peers.gguf_path("Q4_1")
    alone = [peers.run_llama_cpp(path, p, n_decode=4, threads=1)["ids"] for p in prompts]  # chapter 04's runner
    assert tok.eos_id in alone[1], tok.decode(alone[1])  # so the batched run below has to ignore EOS

    r = peers.run_llama_cpp_batched(path, prompts, max_tokens=4, threads=1)
    assert r["ids"] == alone, [tok.decode(ids) for ids in r["ids"]]
    assert r["sequences"] == 2 and r["new_tokens"] == 8 and r["prompt_tokens"] == [len(p) for p in prompts]
    assert len(r["step_ms"]) == 3 and r["tok_s"] > 0 and r["decode_tok_s"] > 0 and r["prefill_ms"] > 0
    assert r["slots"] == 2 and r["n_ctx_seq"] >= max(map(len, prompts)) + 4 and r["kv_unified"] is False


@needs_llama_cpp
def test_context_is_reused_across_calls(chats):
    # The bench keeps one context per GGUF and calls generate with N = 1 and N = slots, in turn: each
    # call starts from an empty KV cache, and a sequence's tokens do not depend on the others'.
    _, prompts = chats
    with peers.BatchedLlamaCpp(
        peers.gguf_path("Q4_1"),
        slots=2,
        ctx_per_seq=max(map(len, prompts)) + 4,
        max_batch_tokens=sum(map(len, prompts)),
        threads=1,
    ) as peer:
        both = peer.generate(prompts, 4)["ids"]
        assert peer.generate(prompts[1:], 4)["ids"] == both[1:]
        assert peer.generate(prompts, 4)["ids"] == both
        with pytest.raises(ValueError, match="3 prompts for 2 slots"):
            peer.generate(prompts + prompts[:1], 4)
        with pytest.raises(ValueError, match="do not fit"):
            peer.generate(prompts, peer.n_ctx_seq)


@needs_llama_cpp
def test_one_slot_decodes_as_batch_one(chats):
    # The batch-1 peer of chapter 06's bench: one slot, one llama_decode per token.
    tok, prompts = chats
    path = peers.gguf_path("Q4_1")
    alone = peers.run_llama_cpp(path, prompts[0], n_decode=4, threads=1)["ids"]
    with peers.BatchedLlamaCpp(
        path, slots=1, ctx_per_seq=len(prompts[0]) + 4, max_batch_tokens=len(prompts[0]), threads=1
    ) as peer:
        r = peer.generate(prompts[:1], 4)
    assert r["ids"] == [alone], tok.decode(r["ids"][0])
    assert len(r["step_ms"]) == 3 and r["decode_tok_s"] > 0 and r["prefill_ms"] > 0
