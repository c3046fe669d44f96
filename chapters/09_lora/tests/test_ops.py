"""The library's linears as KernelOps.quant_linear builds them, per --matmul path, against
dequantize-and-multiply."""

import pytest
import torch

from ops import KERNEL_MAX_ROWS, KernelInt4Linear, KernelInt8Linear, resolve
from qmatmul import PerStepLinear, ReferenceLinear, linear, prepare
from quant import quantize_int4, quantize_int8

from common.tools.testing import cpu_isa  # noqa: F401  (a fixture: each test below runs on each level)

CPU = torch.device("cpu")


def make(kind: str, n_out: int = 64, n_in: int = 96):
    w = torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(n_out + n_in)) * 0.05
    return quantize_int8(w) if kind == "int8" else quantize_int4(w, 32)


def close_to_the_reference(prepared, w, rows):
    ref = prepare(w, CPU, torch.bfloat16, "reference")
    for n in rows:
        x = torch.randn(n, w.shape[1], generator=torch.Generator().manual_seed(n)).bfloat16()
        torch.testing.assert_close(linear(x, prepared), linear(x, ref), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_auto_on_a_cpu_takes_the_library_kernel_alone_at_every_row_count(kind, cpu_isa):
    # No dense copy beside the codes: the library multiplies a prompt chunk itself, as a matrix
    # product from gemm_min_rows rows on. On a GPU the dense copy stays (PerStepLinear).
    import kernels

    w, n = make(kind), kernels.load().gemm_min_rows
    auto = resolve("on", CPU).quant_linear(w, CPU, torch.bfloat16, "auto")
    assert isinstance(auto, (KernelInt4Linear, KernelInt8Linear))
    close_to_the_reference(auto, w, (1, n - 1, n, 40))
    ops = resolve("on", CPU)
    ops.device = torch.device("cuda")  # no GPU here: only what quant_linear decides from the device
    on_gpu = ops.quant_linear(w, CPU, torch.bfloat16, "auto")
    assert isinstance(on_gpu, PerStepLinear) and on_gpu.max_rows == KERNEL_MAX_ROWS[type(w)]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_fast_and_batch_invariant_auto_take_the_kernel_alone(kind, cpu_isa):
    w = make(kind)
    fast = resolve("on", CPU).quant_linear(w, CPU, torch.bfloat16, "fast")
    invariant_ops = resolve("on", CPU, batch_invariant=True)
    try:
        invariant = invariant_ops.quant_linear(w, CPU, torch.bfloat16, "auto")
        for prepared in (fast, invariant):
            assert isinstance(prepared, (KernelInt4Linear, KernelInt8Linear))  # no dense copy at any row count
            close_to_the_reference(prepared, w, (1, 16))
    finally:
        invariant_ops._ext.set_batch_invariant(False)  # a switch of the library, process-wide


def test_the_reference_path_and_the_torch_ops_are_qmatmul_s():
    w = make("int4")
    assert isinstance(resolve("on", CPU).quant_linear(w, CPU, torch.bfloat16, "reference"), ReferenceLinear)
    auto = resolve("off", CPU).quant_linear(w, CPU, torch.bfloat16, "auto")
    assert isinstance(auto, PerStepLinear) and not isinstance(auto.packed, (KernelInt4Linear, KernelInt8Linear))
    with pytest.raises(ValueError, match="'fast', 'reference' or 'auto'"):
        resolve("on", CPU).quant_linear(w, CPU, torch.bfloat16, "turbo")

