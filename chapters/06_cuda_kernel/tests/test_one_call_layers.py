"""A decoder layer's decode step in one C++ call (ops.KernelOps.build_one_call_layer, the library's
DecoderLayer): the same kernels in the same order as the Python loop body, so the same logits bit
for bit, for every kind of weight; and steps that are not all decodes stay in Python."""

import contextlib

import pytest
import torch
from batch import Work, build_step
from model import forward, load_model
from ops import TorchOps, resolve
from paged_cache import PagedKVCache
from qmatmul import linear
from quant import QuantSpec

from common.models import resolve_model
from common.tools.testing import CPU_ISAS, cpu_isa, shared  # noqa: F401  (cpu_isa: a fixture)

CPU = torch.device("cpu")
# kind -> (model, dtype, quant[, int8 activations]): int4 G=32 and int8 (each with the dense copy
# for big steps), the same with x as int8 (the weights' tiles, in the layer's Linear too), bf16
# weights (the bf16 kernel, torch's GEMM above 8 rows), float32 weights (torch's GEMM only).
CASES = {
    "int4 smollm2": ("smollm2-135m", torch.bfloat16, QuantSpec(4, 32)),
    "int4": ("tiny-llama3", torch.bfloat16, QuantSpec(4, 32)),
    "int8": ("tiny-llama3", torch.bfloat16, QuantSpec(8)),
    "int4 int8-x": ("tiny-llama3", torch.bfloat16, QuantSpec(4, 32), True),
    "int8 int8-x": ("tiny-llama3", torch.bfloat16, QuantSpec(8), True),
    "bf16": ("tiny-llama3", torch.bfloat16, None),
    "fp32": ("tiny-llama3", torch.float32, None),
}
# (kind, instruction-set level, sequences): each kind on tiny-llama3 on every level of the library
# this CPU has, in steps of 1 and 3 decodes (the matvec kernels); 12 (above their rows: torch's dense
# GEMM, which no level of the library reaches) and int4 on SmolLM2's shapes at the level in use.
TINY = [kind for kind in CASES if kind != "int4 smollm2"]
LEVELS = [(kind, isa, n) for kind in TINY for isa in CPU_ISAS for n in (1, 3)]
LEVELS += [(kind, None, 12) for kind in TINY] + [("int4 smollm2", None, n) for n in (1, 3, 12)]


def load(name, dtype, quant, int8_x=False, ops=None):
    """The model with the kernels on (x as int8 where `int8_x`), loaded once per case for the whole
    run (tests that change it put it back); with other `ops`, a fresh one."""
    if ops is not None:
        return load_model(resolve_model(name), CPU, dtype, quant, ops=ops)
    ops = shared(resolve, "on", CPU, int8_x=True) if int8_x else shared(resolve, "on", CPU)
    return shared(load_model, resolve_model(name), CPU, dtype, quant, ops=ops)


@contextlib.contextmanager
def without_one_call(model):
    """The same model object with its layers called op by op from Python, for the block."""
    saved = [layer.one_call for layer in model.layers]
    for layer in model.layers:
        layer.one_call = None
    try:
        yield
    finally:
        for layer, one_call in zip(model.layers, saved):
            layer.one_call = one_call


def steps(model, n_seqs: int):
    """Prompts of different lengths, prefilled, then three steps of one decode each -> the logits of
    each decode step, [n_seqs, vocab] each."""
    g = torch.Generator().manual_seed(n_seqs)
    block_size, per_seq = 16, 4
    cache = PagedKVCache(model.config, n_seqs * per_seq, block_size, CPU, model.dtype)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(n_seqs)]
    lens = [5 + 4 * s for s in range(n_seqs)]  # the longest, 49 + 3 decodes, within 4 blocks
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    forward(model, build_step([Work(p, 0, t) for p, t in zip(prompts, tables)], block_size, CPU), cache)
    out = []
    for k in range(3):
        work = [Work([int(p[-1]) + k], n + k, t) for p, n, t in zip(prompts, lens, tables)]
        out.append(forward(model, build_step(work, block_size, CPU), cache))
    return out


@pytest.mark.parametrize("kind, cpu_isa, n_seqs", LEVELS, indirect=["cpu_isa"])
def test_one_call_equals_the_python_loop_bit_for_bit(kind, cpu_isa, n_seqs):
    model = load(*CASES[kind])
    assert all(layer.one_call is not None for layer in model.layers)
    fused = steps(model, n_seqs)
    with without_one_call(model):
        python = steps(model, n_seqs)
    for a, b in zip(fused, python):
        assert torch.equal(a, b)


def counting(model, monkeypatch):
    """-> a dict counting the Python calls of the model's add_rms_norm."""
    calls = {"add_rms_norm": 0}
    real = model.ops.add_rms_norm

    def count(*args):
        calls["add_rms_norm"] += 1
        return real(*args)

    monkeypatch.setattr(model.ops, "add_rms_norm", count)
    return calls


def test_decode_steps_take_the_one_call_path_and_prompt_chunks_do_not(monkeypatch):
    model = load("tiny-llama3", torch.float32, None)
    calls = counting(model, monkeypatch)
    cache = PagedKVCache(model.config, 4, 16, CPU, model.dtype)
    forward(model, build_step([Work([1, 2, 3], 0, [0, 1])], 16, CPU), cache)
    layers = model.config.num_hidden_layers
    assert calls["add_rms_norm"] == 2 * layers + 1  # a prompt: Python's loop, two norms a layer
    calls["add_rms_norm"] = 0
    forward(model, build_step([Work([4], 3, [0, 1]), Work([5], 0, [2])], 16, CPU), cache)
    assert calls["add_rms_norm"] == 1  # decodes: the first norm only, the layers' in C++
    calls["add_rms_norm"] = 0
    forward(model, build_step([Work([6], 4, [0, 1]), Work([7, 8], 1, [2])], 16, CPU), cache)
    assert calls["add_rms_norm"] == 2 * layers + 1  # a decode beside a prompt chunk: Python's loop


def test_kernels_off_the_reference_matmul_and_a_gpu_keep_the_python_loop():
    model = load("tiny-llama3", torch.float32, None, ops=TorchOps())
    assert all(layer.one_call is None for layer in model.layers)
    reference = load_model(
        resolve_model("tiny-llama3"), CPU, torch.bfloat16, QuantSpec(8), "reference", resolve("on", CPU)
    )
    assert all(layer.one_call is None for layer in reference.layers)  # dequantize-and-multiply: no kernel to call
    ops = resolve("on", CPU)
    ops.device = torch.device("cuda")  # no GPU here: only what build_one_call_layer decides from the device
    assert ops.build_one_call_layer(model.layers[0], model.config) is None  # CUDA graphs replay decode steps there


@pytest.mark.parametrize("kind", CASES)
def test_each_library_linear_multiplies_as_the_prepared_weight(kind, cpu_isa):
    dtype = CASES[kind][1]
    model = load(*CASES[kind])
    layer = model.layers[0]
    for rows in (1, 5, 20):  # 20: the matrix product (gemm.cpp; bf16 on an AMX CPU torch's), as in a prompt chunk
        x = torch.randn(rows, model.config.hidden_size).to(dtype)
        library = model.ops._library_linear(layer.wqkv)
        assert torch.equal(library(x), linear(x, layer.wqkv)), (library.kind, rows)


def test_a_bad_linear_is_a_clear_error():
    ext = resolve("on", CPU)._ext
    with pytest.raises(RuntimeError, match="kind must be int4, int8, bf16 or dense, got int5"):
        ext.Linear("int5", [])
    with pytest.raises(RuntimeError, match=r"int8 takes 2 weight tensors \(or 3: with its tiles\), got 1"):
        ext.Linear("int8", [torch.zeros(2, 2, dtype=torch.int8)])
    with pytest.raises(RuntimeError, match="a dense layer needs its dense weight"):
        ext.Linear("dense", [])
