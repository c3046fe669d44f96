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
    import kernels

    ref, dense = prepare(w, CPU, torch.bfloat16, "reference"), w.dequantize().abs()
    for n in rows:
        x = torch.randn(n, w.shape[1], generator=torch.Generator().manual_seed(n)).bfloat16()
        expected = linear(x, ref).float()
        bound = 2e-2 + 2e-2 * expected.abs()
        if getattr(prepared, "tiles", None) is not None and not kernels.load().batch_invariant():
            # bf16 x meets the weights as int8 (csrc/cpu/int4_q8_gemm.cpp, int8_q8_gemm.cpp): an input
            # moves by at most half its block's step, max|x| over the block of 32 / 254
            step = x.float().abs().view(n, -1, 32).amax(-1).repeat_interleave(32, dim=-1) / 254
            bound = bound + step @ dense.T
        diff = (linear(x, prepared).float() - expected).abs()
        assert (diff <= bound).all(), f"{n} rows: |y - reference| {diff.max():.4g}"


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


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_int8_activations_are_for_quantized_weights_and_bf16_x_on_a_cpu(kind, cpu_isa):
    # --int8-activations (the default): int4 and int8 weights get the library's tiles where the CPU
    # has an integer product, and bf16 x is multiplied as int8 at every row count, each row by itself;
    # off, or float32 x: no tiles.
    import argparse

    import ops as ops_module

    ap = argparse.ArgumentParser()
    ops_module.add_arguments(ap)
    assert ops_module.from_args(ap.parse_args([])).int8_x and ops_module.KernelFlags("on").int8_x
    assert not ops_module.from_args(ap.parse_args(["--no-int8-activations"])).int8_x
    w = make(kind, 40, 256)
    ops_on, ops_off, ops_f32 = resolve("on", CPU, int8_x=True), resolve("on", CPU), resolve("on", CPU, int8_x=True)
    on = ops_on.quant_linear(w, CPU, torch.bfloat16, "auto")
    off = ops_off.quant_linear(w, CPU, torch.bfloat16, "auto")
    f32 = ops_f32.quant_linear(w, CPU, torch.float32, "auto")
    assert off.tiles is None and f32.tiles is None
    assert (on.tiles is not None) == (cpu_isa != "scalar"), cpu_isa
    # the startup line names the product and the tiles' memory where there are tiles
    assert ("int8 activations" in ops_on.describe()) == (cpu_isa != "scalar"), ops_on.describe()
    assert "int8" not in ops_off.describe() and "int8" not in ops_f32.describe()
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    if on.tiles is not None:
        assert not torch.equal(on(x[:1]), off(x[:1]))  # x rounded to int8 is another product, for decode's
        assert not torch.equal(on(x), off(x))  # one row as for a prompt chunk's many ...
        for start, rows in [(0, 1), (7, 1), (3, 5), (0, 16)]:  # ... and a row's result is the same in both
            assert torch.equal(on(x[start : start + rows]), on(x)[start : start + rows]), (start, rows)
    close_to_the_reference(on, w, (1, 3, 40))


def test_no_int8_activations_where_no_cpu_kernel_runs_is_refused():
    # --kernels off (chapter 05's PyTorch) and a GPU multiply in floats already: the flag was taken
    # and changed nothing
    from common.errors import UserError
    from ops import KernelFlags, TorchOps

    for choice, device in (("off", CPU), ("auto", torch.device("meta"))):
        with pytest.raises(UserError, match=r"^--no-int8-activations is for the CPU kernels"):
            KernelFlags(choice, False, False).ops(device)
    # --kernels auto falling back to PyTorch on a CPU (here: a head size the decode kernel lacks)
    with pytest.raises(UserError, match=r"^--no-int8-activations .*cannot run here: kernels/ decodes heads of"):
        KernelFlags("auto", False, False).ops(CPU, head_dim=7)
    assert isinstance(KernelFlags("off").ops(CPU), TorchOps)  # the default (on) is no request
