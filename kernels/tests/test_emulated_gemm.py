"""The CUDA matrix product (csrc/cuda/gemm.cu: int4_gemm, int8_gemm, bf16_gemm) run on the CPU by the
emulator (kernels/emulator.py) against reference.py: row counts that fill each row tile (16, 32 and
64 rows) and leave a tail of one, outputs that end inside a block's 64, inputs that end inside a
step of 32 or off the 16-byte loads, in float32, bf16 and fp16; then bugs planted in a copy of
gemm.cu, each of which the same check must catch. (The library launches the product from
kGemmMinRows rows, csrc/ops.cpp; here it runs at every row count, 1 included.)"""

import pytest
import torch
from conftest import assert_close
from test_gemm import check
from test_quant_linear import int4_weight

from kernels import emulator, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]
ROWS = [1, 15, 16, 17, 33, 100]  # tiles of 16, 32, 64 rows: one row, full tiles, one row past, partial ones
# (n_out, n_in): 70 outputs end 6 into the second block of 64. int8 and bf16: 100 inputs end 4 into
# the fourth step of 32 and are no multiple of 8 (the weights' element-wise path); 104 is a
# multiple of 8 (one 8- or 16-byte load per run) that still ends inside a step; 13 is less than a
# step. int4 rows are multiples of the group size, itself of 32 (the contract).
SHAPES = {"int4": [(70, 320)], "int8": [(70, 100), (33, 104)], "bf16": [(70, 104), (21, 13)]}


def weights(kind, n_out, n_in, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "int4":
        return int4_weight(n_out, n_in, 32 if seed % 2 else 64, seed=seed)  # G = 32 and 64 in turn
    if kind == "int8":
        q = torch.randint(-127, 128, (n_out, n_in), generator=g, dtype=torch.int8)
        return q, torch.rand(n_out, generator=g) * 0.01  # sums of |q| ~ 127 terms: results near 1
    return ((torch.randn(n_out, n_in, generator=g) * 0.05).bfloat16(),)  # a model's scale: sums near 1


def gemm(emu, kind, x, w):
    if kind == "int4":
        packed, scale, min_ = w
        return emu.int4_gemm(x, packed, scale, min_, packed.shape[1] * 2 // scale.shape[1])
    return emu.int8_gemm(x, *w) if kind == "int8" else emu.bf16_gemm(x, *w)


@pytest.mark.parametrize("kind", ["int4", "int8", "bf16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gemm_every_tile_tail(emu, kind, dtype):
    for n_out, n_in in SHAPES[kind]:
        for rows in ROWS:
            w = weights(kind, n_out, n_in, seed=rows)
            x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(rows)).to(dtype)
            check(gemm(emu, kind, x, w), kind, x, w, f"{kind} {rows} x {n_in} -> {n_out}")


def test_gemm_unaligned(emu):
    # x and W at odd addresses: the element-wise loads of both.
    x = torch.randn(17 * 256 + 1, generator=torch.Generator().manual_seed(0))[1:].view(17, 256)
    for kind in ("int4", "int8", "bf16"):
        w = weights(kind, 20, 256, seed=1)
        odd = tuple(torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape).copy_(t) for t in w[:1]) + w[1:]
        check(gemm(emu, kind, x, odd), kind, x, w, kind)


def test_the_row_tile_follows_the_call(emu):
    # Blocks of 64 outputs by 16, 32 or 64 rows: the smallest tile that holds the call's rows.
    w = weights("bf16", 70, 64)
    for rows, blocks in ((1, 2 * 1), (16, 2 * 1), (17, 2 * 1), (32, 2 * 1), (33, 2 * 1), (100, 2 * 2)):
        before = emu.blocks_run
        emu.bf16_gemm(torch.randn(rows, 64), *w)
        assert emu.blocks_run - before == blocks, rows


def test_a_row_is_the_same_whatever_tile_it_lands_in(emu):
    # Each output sums its inputs in one order, step by step, whichever row tile and block computes
    # it: a row's bits do not depend on the rows beside it in the call.
    w = weights("int8", 70, 100)
    x = torch.randn(100, 100).bfloat16()
    y = emu.int8_gemm(x, *w)
    for rows in (1, 16, 17, 33):
        assert torch.equal(emu.int8_gemm(x[:rows], *w), y[:rows]), rows


def test_bad_arguments_are_refused(emu):
    packed, scale, min_ = int4_weight(16, 96, 32)
    with pytest.raises(emulator.EmulatorError, match="cudaError 1"):  # G = 48: a step of 32 would span two groups
        emu.int4_gemm(torch.randn(20, 96), packed, scale, min_, 48)


# --- planted bugs: each fails the check above -------------------------------------------------------------
PLANTED = {
    # threads multiply tiles other threads have not finished staging
    "missing __syncthreads after staging": (
        "        __syncthreads();  // both tiles are complete\n",
        "",
    ),
    # x staged one row over: row m lands where row m + 1 is read (and row 0's slot is never written)
    "shared-memory tile index off by one": (
        "for (int e = 0; e < kXRun; ++e) xs[(k + e) * XS + m] = v[e];",
        "for (int e = 0; e < kXRun; ++e) xs[(k + e) * XS + m + 1] = v[e];",
    ),
    # the last step of inputs, shorter than BK, is left out
    "inputs past the last whole step dropped": (
        "for (int k0 = 0; k0 < n_in; k0 += BK) {",
        "for (int k0 = 0; k0 + BK <= n_in; k0 += BK) {",
    ),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_a_planted_bug_fails_the_gemm_check(emu, bug):
    broken = emulator.load(plant=[("gemm.cu", *PLANTED[bug])])
    # 100 rows (a tile of 64, then a partial one), 100 inputs (a partial last step): every bug above shows
    w = weights("bf16", 70, 100, seed=3)
    x = torch.randn(100, 100)
    assert_close(emu.bf16_gemm(x, *w), reference.bf16_linear(x, *w), "the unbroken kernel")
    with pytest.raises(AssertionError):
        assert_close(broken.bf16_gemm(x, *w), reference.bf16_linear(x, *w), bug)
