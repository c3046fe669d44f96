"""The fast path (torch's packed int kernels) equals the reference (dequantize, then multiply)."""

import warnings

import pytest
import torch

import qmatmul
from qmatmul import Int4PackedLinear, Int8PackedLinear, ReferenceLinear, fast_path_missing, linear, prepare
from quant import quantize_int4, quantize_int8

# Shapes of SmolLM2's matmuls (qkv, gate_up, down) and odd ones; activations of 1 token (decode),
# 7 tokens (a prefill) and a [batch, new, hidden] 3-D input.
SHAPES = [(960, 576), (3072, 576), (576, 1536), (48, 96)]
X_SHAPES = [(1,), (7,), (2, 3)]


def make(kind: str, n_out: int, n_in: int):
    w = torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(n_out + n_in)) * 0.05
    if kind == "int8":
        return quantize_int8(w)
    g = 64 if kind == "int4 G64" else 32
    return quantize_int4(w, g, symmetric=kind.endswith("sym"))


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("kind", ["int8", "int4", "int4 G64", "int4 sym"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_path_equals_the_reference(kind, shape, dtype, device):
    if device.type == "mps":
        pytest.skip("no packed int kernels on MPS: the reference runs there")
    w = make(kind, *shape)
    if fast_path_missing(w, device, dtype):
        pytest.skip(fast_path_missing(w, device, dtype))
    fast = prepare(w, device, dtype, "fast")
    assert isinstance(fast, Int8PackedLinear if kind == "int8" else Int4PackedLinear)
    ref = prepare(w, device, dtype, "reference")
    for x_shape in X_SHAPES:
        x = torch.randn(*x_shape, shape[1], generator=torch.Generator().manual_seed(3)).to(device, dtype)
        y_fast, y_ref = linear(x, fast), linear(x, ref)
        assert y_fast.shape == (*x_shape, shape[0]) and y_fast.dtype == dtype
        # The exact answer: float64 x times the float64 dequantized weight.
        exact = x.double() @ w.dequantize(torch.float64).to(device).T
        # fp32: rounding only. bf16: the kernels round scales and zeros to bf16 (8 bits of mantissa)
        # and accumulate differently from F.linear; both paths must stay within bf16 rounding.
        tol = 1e-5 if dtype == torch.float32 else 1.5e-2
        assert relative_error(y_fast, exact) < tol, (kind, shape, x_shape)
        assert relative_error(y_ref, exact) < tol


def test_an_unaligned_int8_weight_is_copied_before_the_kernel_reads_it():
    # What a safetensors file gives: a tensor 24 bytes past a 64-byte boundary. The kernel read it
    # out of bounds (segfault) for inputs of more than one row; aligned() copies it.
    w = make("int8", 1536, 576)
    buffer = torch.empty(w.q.numel() + 64, dtype=torch.int8)
    start = (-buffer.data_ptr()) % 64 + 24
    q = buffer[start : start + w.q.numel()].view_as(w.q).copy_(w.q)
    assert q.data_ptr() % 64 == 24
    fast = prepare(type(w)(q, w.scale), torch.device("cpu"), torch.bfloat16)
    assert fast.q.data_ptr() % 64 == 0
    x = torch.randn(16, 576).bfloat16()
    assert relative_error(fast(x), x.double() @ w.dequantize(torch.float64).T) < 1.5e-2


def test_reference_path_is_dequantize_then_multiply():
    w = make("int4", 40, 96)
    x = torch.randn(3, 96)
    assert torch.equal(ReferenceLinear(w)(x), x @ w.dequantize().T)


def test_a_missing_op_falls_back_to_the_reference_with_a_warning(monkeypatch):
    class NoOps:  # torch without the private kernels
        pass

    monkeypatch.setattr(qmatmul, "OPS", NoOps())
    monkeypatch.setattr(qmatmul, "_warned", set())
    w = make("int4", 48, 96)
    reason = fast_path_missing(w, torch.device("cpu"), torch.bfloat16)
    assert reason == "torch has no aten._weight_int4pack_mm_for_cpu"
    with pytest.warns(UserWarning, match="falls back to dequantize-and-multiply: torch has no"):
        prepared = prepare(w, torch.device("cpu"), torch.bfloat16)
    assert isinstance(prepared, ReferenceLinear)
    x = torch.randn(2, 96)
    assert torch.allclose(prepared(x), x @ w.dequantize().T)
    with warnings.catch_warnings():  # one warning per reason, not one per layer
        warnings.simplefilter("error")
        prepare(w, torch.device("cpu"), torch.bfloat16)


def test_int8_rows_torch_misreads_in_bfloat16_run_the_reference():
    # torch 2.13's aten._weight_int8pack_mm reads past a bfloat16 row of 100 inputs: NaN, garbage or
    # a segfault from run to run (`--quant int8` on a model of that width). Such weights take the
    # reference path, with the warning; float32 rows keep the kernel, which reads them right.
    w = make("int8", 48, 100)
    assert "not a multiple of 16" in fast_path_missing(w, torch.device("cpu"), torch.bfloat16)
    assert fast_path_missing(w, torch.device("cpu"), torch.float32) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare(w, torch.device("cpu"), torch.bfloat16)
    assert isinstance(prepared, ReferenceLinear)


def test_a_shape_the_int4_kernels_cannot_tile_runs_the_reference():
    w = make("int4", 40, 96)  # 40 rows: not a multiple of the kernels' 16
    assert "multiples of 16" in fast_path_missing(w, torch.device("cpu"), torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare(w, torch.device("cpu"), torch.bfloat16)
    assert isinstance(prepared, ReferenceLinear)


def test_unknown_path_is_an_error():
    with pytest.raises(ValueError, match="'fast', 'reference' or 'auto'"):
        prepare(make("int8", 40, 96), torch.device("cpu"), torch.float32, "turbo")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_auto_takes_the_packed_kernel_for_few_rows_and_the_dense_copy_for_many(kind, monkeypatch):
    """Chapter 05: per call, the packed kernel up to PACKED_MAX_ROWS rows, a dense GEMM beyond;
    both equal the reference."""
    w = make(kind, 64, 96)
    cpu = torch.device("cpu")
    auto = prepare(w, cpu, torch.bfloat16, "auto")
    assert isinstance(auto, qmatmul.PerStepLinear)
    limit = qmatmul.PACKED_MAX_ROWS[type(w)]
    assert auto.max_rows == limit and auto.dense.dtype == torch.bfloat16
    ref = prepare(w, cpu, torch.bfloat16, "reference")
    calls = []
    real_packed = auto.packed
    auto.packed = lambda x: calls.append(x.shape[0]) or real_packed(x)
    for rows in (1, limit, limit + 1, 64):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
        torch.testing.assert_close(linear(x, auto), linear(x, ref), rtol=2e-2, atol=2e-2)
    assert calls == [1, limit]  # the two small calls went through the packed kernel, the others did not
