"""LoRA inside the library's one-call decoder layer (kernels/csrc/decoder_layer.cpp): a decode step
with adapter rows runs each layer as one C++ call that adds the deltas after each matmul, with the
same shrink and expand kernels in the same order as the Python loop, so the same logits bit for bit;
for every weight kind, rows of several adapters and of the base model mixed, and adapters that
change only some projections."""

import pytest
import torch
from batch import Work, build_step
from lora import LoraWeights, read_adapter
from model import forward, load_model
from ops import resolve
from paged_cache import PagedKVCache
from quant import QuantSpec

from common.models import resolve_model
from common.tools.testing import CPU_ISAS, cpu_isa  # noqa: F401  (cpu_isa: a fixture)
from peft_adapters import hf_base, make_adapter

CPU = torch.device("cpu")
# (dtype, quantization, int8 activations): with them, int4 and int8 matmuls run the integer product,
# whose own team of threads adds the deltas in the one-call layer (cpu::q8::run)
CASES = {
    "int4": (torch.bfloat16, QuantSpec(4, 32), False),
    "int8": (torch.bfloat16, QuantSpec(8), False),
    "int4, int8 activations": (torch.bfloat16, QuantSpec(4, 32), True),
    "int8, int8 activations": (torch.bfloat16, QuantSpec(8), True),
    "bf16": (torch.bfloat16, None, False),
    "fp32": (torch.float32, None, False),
}
# every projection at rank 8; q, v and down at rank 4; the other four at rank 16 (the table's r_max)
SPECS = [
    dict(rank=8, seed=1),
    dict(rank=4, targets=["q_proj", "v_proj", "down_proj"], seed=2),
    dict(rank=16, targets=["k_proj", "o_proj", "gate_proj", "up_proj"], seed=3, alpha=8),
]


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root, base = tmp_path_factory.mktemp("adapters"), hf_base()
    return [make_adapter(root / f"a{i}", base=base, size=0.2, **spec) for i, spec in enumerate(SPECS)]


def with_adapters(kind, adapter_dirs):
    """tiny-llama3 with the kernels on and the three adapters in slots 0, 1, 2."""
    dtype, quant, int8_x = CASES[kind]
    model = load_model(resolve_model("tiny-llama3"), CPU, dtype, quant, ops=resolve("on", CPU, int8_x=int8_x))
    model.lora = LoraWeights(model.config, 4, 16, dtype, CPU)
    for slot, path in enumerate(adapter_dirs):
        model.lora.load(slot, read_adapter(path, model.config, 16, dtype))
    return model


def decode_steps(model, row_slots: list[int]) -> list[torch.Tensor]:
    """A prompt per row (its own adapter), prefilled, then three steps of one decode per row -> the
    logits of each decode step, [rows, vocab] each."""
    g = torch.Generator().manual_seed(len(row_slots))
    block_size, per_seq, n = 16, 3, len(row_slots)
    cache = PagedKVCache(model.config, n * per_seq, block_size, CPU, model.dtype)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(n)]
    lens = [6 + 5 * s for s in range(n)]
    prompts = [torch.randint(0, model.config.vocab_size, (k,), generator=g).tolist() for k in lens]
    prompt_work = [Work(p, 0, t, s) for p, t, s in zip(prompts, tables, row_slots)]
    forward(model, build_step(prompt_work, block_size, CPU), cache)
    out = []
    for k in range(3):
        work = [Work([p[-1] + k], m + k, t, s) for p, m, t, s in zip(prompts, lens, tables, row_slots)]
        out.append(forward(model, build_step(work, block_size, CPU), cache))
    return out


def python_loop(model, row_slots):
    saved = [layer.one_call for layer in model.layers]
    for layer in model.layers:
        layer.one_call = None
    try:
        return decode_steps(model, row_slots)
    finally:
        for layer, one_call in zip(model.layers, saved):
            layer.one_call = one_call


# Rows of three adapters and the base, mixed (segments of one row and of two); one adapter alone; the
# adapter of four projections alone (the other three skipped in C++ as in Python).
ROWS = [[0, -1, 1, 1, 2, -1, 0], [0], [2]]


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("rows", ROWS, ids=["mixed", "one adapter", "some projections"])
def test_decode_steps_with_adapters_equal_the_python_loop_bit_for_bit(kind, rows, adapter_dirs):
    model = with_adapters(kind, adapter_dirs)
    assert all(layer.one_call is not None for layer in model.layers)
    for fused, python in zip(decode_steps(model, rows), python_loop(model, rows)):
        assert torch.equal(fused, python)
    model.lora.free(0)  # a slot emptied after the C++ tables were made: they are views of the table
    base = [-1 if s == 0 else s for s in rows]
    for fused, python in zip(decode_steps(model, rows), python_loop(model, base)):
        assert torch.equal(fused, python)


@pytest.mark.parametrize("kind", ["int4", "int4, int8 activations"])
@pytest.mark.parametrize("cpu_isa", CPU_ISAS, indirect=True)
def test_on_every_instruction_set_level(cpu_isa, kind, adapter_dirs):
    model = with_adapters(kind, adapter_dirs)
    for fused, python in zip(decode_steps(model, ROWS[0]), python_loop(model, ROWS[0])):
        assert torch.equal(fused, python)


def test_the_deltas_are_there(adapter_dirs):
    # Against the base model: an adapter row's logits move, a base row's stay bit for bit.
    model = with_adapters("fp32", adapter_dirs)
    with_lora = decode_steps(model, [0, -1])
    model.lora = None
    without = decode_steps(model, [-1, -1])
    assert not torch.allclose(with_lora[-1][0], without[-1][0], atol=1e-3)
    assert torch.equal(with_lora[-1][1], without[-1][1])
