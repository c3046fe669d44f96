"""The CUDA linears at every row count from 1 to 300 against the reference, on a GPU: below
kGemmMinRows rows the matrix-vector kernels (cuda/quant_linear.cu), from there the tiled matrix
product (cuda/gemm.cu), so the sweep crosses the hand-over in ops.cpp and every row tile's tail (16,
32 and 64 rows). int4, int8 and bf16 weights; float32, bf16 and fp16 x; outputs and inputs that end
inside a tile. Without a GPU every case skips (the emulator runs the same kernels on the CPU:
test_emulated_gemm.py)."""

import pytest
import torch
from test_gemm import check, weights
from test_quant_linear import int4_weight


ROWS = [*range(1, 20), 23, 31, 32, 33, 47, 63, 64, 65, 100, 127, 128, 129, 255, 300]
# (n_out, n_in): outputs past a block of 64; inputs past a step of 32 (int8, bf16: 100 is also no
# multiple of 8, the weights' element-wise loads); SmolLM2's qkv for a real-sized one
SHAPES = {"int4": [(70, 320), (960, 576)], "int8": [(70, 100), (960, 576)], "bf16": [(70, 100), (21, 33), (960, 576)]}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("kind", ["int4", "int8", "bf16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
def test_every_row_count_on_cuda(ops, cuda, kind, dtype):
    call = {
        "int4": lambda x, w: ops.int4_linear(x, *w, 32),
        "int8": lambda x, w: ops.int8_linear(x, *w),
        "bf16": lambda x, w: ops.bf16_linear(x, *w),
    }[kind]
    for n_out, n_in in SHAPES[kind]:
        w = weights(kind, n_out, n_in, seed=n_out)
        w_gpu = [t.to(cuda) for t in w]
        x_all = torch.randn(max(ROWS), n_in, generator=torch.Generator().manual_seed(n_in)).to(dtype)
        for rows in ROWS:
            x = x_all[:rows]
            y = call(x.to(cuda), w_gpu).cpu()
            what = f"{kind} {rows} x {n_in} -> {n_out}"
            check(y, kind, x, w, what)


def test_the_matrix_product_is_the_same_kernel_for_every_row_tile_on_cuda(ops, cuda):
    # Within the matrix product a row's sums do not depend on its neighbours: its inputs are summed in
    # the same order whichever tile (16, 32 or 64 rows) and block it lands in. So from kGemmMinRows
    # (16) rows on, a row's bits are the same in a call of 16 rows and of 300.
    packed, scale, min_ = (t.to(cuda) for t in int4_weight(70, 320, 32))
    x = torch.randn(300, 320, device=cuda).bfloat16()
    y = ops.int4_linear(x, packed, scale, min_, 32)
    for rows in (16, 17, 33, 64, 100):
        assert torch.equal(ops.int4_linear(x[:rows], packed, scale, min_, 32), y[:rows]), rows
