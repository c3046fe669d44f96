"""A quantized SmolLM2 end to end: it still answers, it moves logits only where the model was unsure,
and every entry point (generate, parity, the server) takes --quant or a quantized directory."""

import functools
import json
from pathlib import Path

import pytest
import torch

from common.hf_reference import hf_hidden_states
from common.models import resolve_model
from common.tokenizer import Tokenizer
from common.tools.testing import dequantized_once
from common.tools.warm_python import run_python
from model import forward_sequence, load_model
from parity import DEFAULT_TEXT
from quant import QuantSpec

CHAPTER = Path(__file__).resolve().parents[1]
PROMPT = "What is the capital of France? Answer in one sentence."


def run(script, *args):
    return run_python([script, *args], cwd=CHAPTER, timeout=600)


# The tests that run a script say so (common/tools/carried.py); the others reach what they import.
@pytest.mark.reaches("generate.py")
@pytest.mark.parametrize("quant", [("--quant", "int8"), ("--quant", "int4", "--group-size", "32")])
def test_quantized_smollm2_answers_the_chat_prompt(quant):
    # float32 activations: the exact answer, whatever the CPU's bf16 kernels (see chapter 02's README)
    r = run("generate.py", "--chat", "--prompt", PROMPT, "--max-new-tokens", "12", "--dtype", "float32", *quant)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert ("int8" if "int8" in quant else "int4 G=32") in r.stderr


@pytest.mark.reaches("generate.py")
def test_quantized_smollm2_answers_in_its_default_bfloat16():
    r = run("generate.py", "--chat", "--prompt", PROMPT, "--max-new-tokens", "12", "--quant", "int4")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "cpu bfloat16, int4 G=32" in r.stderr


@pytest.fixture(scope="module")
def smollm2_parity():
    d = resolve_model("smollm2-135m")
    ids = Tokenizer(d).encode(DEFAULT_TEXT)
    hf = torch.from_numpy(hf_hidden_states(d, ids)["logits"])  # [n, vocab], HF fp32

    def ours(spec):
        model = load_model(d, "cpu", torch.float32, spec)
        with torch.inference_mode():
            return forward_sequence(model, ids)  # [n, vocab]

    return hf, ours


def flips(hf: torch.Tensor, ours: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement with HF, the largest HF top-2 margin at which our pick differs)."""
    agree = ours.argmax(-1) == hf.argmax(-1)
    top2 = hf.topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]
    return agree.float().mean().item(), (margin[~agree].max().item() if (~agree).any() else 0.0)


def test_int8_moves_top1_only_at_near_ties(smollm2_parity):
    # Measured on this 56-token text: int8 agrees 92.9% with HF fp32 (4 flips), every flip where
    # HF's own top-2 margin is at most 0.27 logits; on 512 tokens of prose 93.8%, margins <= 0.57.
    # The 99% asked for is not reached: int8 per channel errs 0.9% per weight here, 5x more than
    # int4 G=32 (these weights sit on a 4-bit grid), enough to swap near-tied tokens. A broken
    # int8 (a wrong scale, a swapped row) flips tokens the model is sure of, far above 1 logit.
    hf, ours = smollm2_parity
    agreement, worst = flips(hf, ours(QuantSpec(8)))
    assert agreement >= 0.90 and worst < 1.0, (agreement, worst)


def test_int4_g32_reproduces_the_q4_1_weights(smollm2_parity):
    hf, ours = smollm2_parity
    agreement, worst = flips(hf, ours(QuantSpec(4, 32, head_bits=None)))
    # measured 96.4%, flips at margins <= 0.10: bf16 rounding of the checkpoint, nothing more
    assert agreement >= 0.94 and worst < 0.3, (agreement, worst)


@pytest.mark.reaches("parity.py")
def test_parity_cli_prints_the_table_for_int8():
    r = run("parity.py", "--quant", "int8")
    assert r.returncode == 0, r.stderr
    assert "int8 vs HF transformers fp32" in r.stdout and "layer.29" in r.stdout and "logits" in r.stdout


@pytest.mark.reaches("quantize.py")
def test_a_group_size_for_int8_is_refused(tmp_path):
    r = run("quantize.py", "--model", "tiny-llama3", "--bits", "8", "--group-size", "64", "--out", str(tmp_path / "q"))
    assert r.returncode == 2 and "--group-size is for int4 weights (--bits 4, or --lm-head int4)" in r.stderr, r.stderr
    assert not (tmp_path / "q").exists()
    # --symmetric too: it was written into the int8 checkpoint's config and changed nothing
    r = run("quantize.py", "--model", "tiny-llama3", "--bits", "8", "--symmetric", "--out", str(tmp_path / "s"))
    assert r.returncode == 2 and "--symmetric is for int4 weights" in r.stderr and not (tmp_path / "s").exists()
    # an int4 head of int8 weights takes it (quantizing on load does too)
    out = tmp_path / "int4-head"
    int4_head = ["--bits", "8", "--lm-head", "int4", "--group-size", "64"]
    r = run("quantize.py", "--model", "tiny-llama3", *int4_head, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 64


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"group_size": 64}, "--group-size goes with --quant int8 or int4"),
        ({"symmetric": True, "lm_head": "none"}, "--symmetric, --lm-head goes with --quant int8 or int4"),
        ({"quant": "int8", "group_size": 64}, "--group-size is for int4 weights"),
        ({"quant": "int8", "symmetric": True}, "--symmetric is for int4 weights"),
    ],
)
def test_quant_flags_that_would_change_nothing_are_refused(flags, message):
    # cli.py, generate.py and the server ran a plain model unquantized, or int8 without groups,
    # with these flags given and no word
    from argparse import Namespace

    from common.errors import UserError
    from loading import quant_spec

    defaults = {"quant": None, "group_size": 32, "symmetric": False, "lm_head": "int8"}
    with pytest.raises(UserError, match=message):
        quant_spec(Namespace(**defaults | flags))
    int4_head = Namespace(**defaults | {"quant": "int8", "group_size": 64, "lm_head": "int4"})
    assert quant_spec(int4_head).name == "int8, int4 G=64 head"  # where they apply, they are taken


def test_a_matmul_path_for_unquantized_weights_is_refused():
    # generate.py, cli.py, the server and perplexity.py took --matmul reference (and
    # --no-int8-activations) for a plain model, and it changed nothing
    from common.errors import UserError
    from loading import load
    from qmatmul import ReferenceLinear

    with pytest.raises(UserError, match=r"^--matmul reference: for quantized weights .*; tiny-llama3 runs unquantized$"):
        load("tiny-llama3", "cpu", "float32", None, "reference")
    from ops import KernelFlags

    with pytest.raises(UserError, match=r"^--matmul reference, --no-int8-activations: for quantized weights"):
        load("tiny-llama3", "cpu", "float32", None, "reference", KernelFlags("auto", False, False))
    model, _ = load("tiny-llama3", "cpu", "float32", QuantSpec(8), "reference")  # where it applies, taken
    assert isinstance(model.layers[0].wqkv, ReferenceLinear)


def test_a_quant_flag_the_run_leaves_nothing_to_change_is_refused():
    # taken, and changed nothing: --no-int8-activations with float32 activations (parity.py's default),
    # with --matmul reference or --batch-invariant (float products already); --matmul fast on a CPU
    # with the kernels on (the int matmul that auto runs there)
    from common.errors import UserError
    from loading import load
    from ops import KernelFlags
    from qmatmul import PerStepLinear

    int8, float_x = QuantSpec(8), KernelFlags("auto", False, False)
    for dtype, matmul, flags, why in [
        ("float32", "auto", float_x, "float32 activations"),
        ("auto", "reference", float_x, "--matmul reference"),
        ("auto", "auto", KernelFlags("auto", True, False), "--batch-invariant"),
    ]:
        with pytest.raises(UserError, match=rf"^--no-int8-activations: with {why}.* multiplied in floats already$"):
            load("tiny-llama3", "cpu", dtype, int8, matmul, flags)
    with pytest.raises(UserError, match=r"^--matmul fast: on a CPU the kernels .* as --matmul auto does$"):
        load("tiny-llama3", "cpu", "auto", int8, "fast", KernelFlags("on"))
    # where they change something, taken: float x for bf16 activations; fast with chapter 05's packed ops
    model, _ = load("tiny-llama3", "cpu", "auto", int8, "auto", float_x)
    assert model.dtype == torch.bfloat16 and not model.ops.int8_x
    model, _ = load("tiny-llama3", "cpu", "auto", int8, "fast", KernelFlags("off"))
    assert not isinstance(model.layers[0].wqkv, PerStepLinear)  # auto: a dense copy for larger steps


@pytest.mark.reaches("quantize.py", "parity.py")
def test_parity_refuses_a_quantized_reference(tmp_path):
    out = tmp_path / "q"
    assert run("quantize.py", "--model", "tiny-llama3", "--bits", "8", "--out", str(out)).returncode == 0
    r = run("parity.py", "--model", str(out))
    assert r.returncode == 2 and "which HF transformers does not read" in r.stderr


@pytest.mark.reaches("generate.py")
@pytest.mark.parametrize(
    "args, message",
    [
        (["--quant", "int3"], "invalid choice: 'int3'"),
        (["--quant", "int4", "--group-size", "48"], "invalid choice: 48"),
        (["--model", "/nope/x.gguf"], "no such GGUF file"),
    ],
)
def test_bad_quant_flags_are_clear_errors(args, message):
    r = run("generate.py", "--prompt", "hi", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.fixture(scope="module")
def macbeth_ppl():
    """Perplexity on Macbeth's first 768 tokens (2 windows of 384) for a format.
    float32 activations and the reference matmul, so the figures do not depend on the CPU's bf16
    kernels; the weights are what changes."""
    from perplexity import perplexity, read_text

    d = resolve_model("smollm2-135m")
    ids = Tokenizer(d).encode(read_text(None))[:768]

    @functools.cache  # the bf16 baseline serves three tests
    def ppl(spec):
        # each weight dequantized once, not in each of the 2 windows' 121 matmuls: the same products
        model = dequantized_once(load_model(d, "cpu", torch.float32, spec, matmul="reference"))
        return perplexity(model, ids, context=384, stride=384).ppl

    return ppl


def test_int8_perplexity_is_within_1_percent_of_bf16(macbeth_ppl):
    # The checkpoint's own weights are bf16: that is the baseline. Measured: 56.48 -> int8 56.55 (+0.1%).
    base, int8 = macbeth_ppl(None), macbeth_ppl(QuantSpec(8))
    assert base < int8 < base * 1.01, (base, int8)


def test_int4_g128_costs_what_was_measured(macbeth_ppl):
    # The bundled weights sit on a Q4_1 grid of 32: G=32 keeps it, G=128 must re-round it and loses
    # much. Measured: bf16 56.48, int4 G=32 56.84, G=128 83.05 (+47%); the bound leaves 5% margin.
    base, g32, g128 = macbeth_ppl(None), macbeth_ppl(QuantSpec(4, 32)), macbeth_ppl(QuantSpec(4, 128))
    assert abs(g32 / base - 1) < 0.01, (base, g32)
    assert base * 1.3 < g128 < 83.05 * 1.05, (base, g128)
