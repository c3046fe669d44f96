"""int8 weights times bf16 x quantized to int8 (csrc/cpu/int8_q8_gemm.cpp): int8_linear with the
weight's tiles, at every row count on every CPU path, against reference.int8_linear_q8 (the same
quantization of x, the sums exact) to one bf16 rounding; a row's result the same bits whatever else
shares its call; float32 x, batch-invariant mode, tiles of another width and a weight whose inputs
are not whole blocks take the float path. Then bugs planted in a copy of the source, each of which
the same check must catch."""

import ctypes

import pytest
import torch

from conftest import (
    assert_amx_bug_caught,
    assert_amx_gives_vnni_s_bits,
    assert_caught_where_it_lives,
    build_planted,
    skip_without_amx_int8,
)
from kernels import reference
from test_gemm import ROWS

# (n_out, n_in): outputs past a tile of 8 and of 16; one block; many
SHAPES = [(70, 320), (16, 32), (40, 576)]


def int8_weight(n_out, n_in, seed=0):
    """q over all of -128..127 (-128 too: a checkpoint's quantizer stops at -127, the kernel must
    not rely on it), a float32 scale per output."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n_out, n_in), generator=g, dtype=torch.int8)
    return q, torch.rand(n_out, generator=g) * 0.02


def check_q8(y, x, q, scale, what=""):
    """y (bf16) against the reference in float32: one rounding to bf16 apart (2^-8 of the value),
    plus float32's rounding of the sums in another order, bounded by their magnitude."""
    expected = reference.int8_linear_q8(x.float(), q, scale)
    bound = 2.0**-8 * 1.01 * expected.abs() + 1e-5 * (x.float().abs() @ (q.float().abs() * scale[:, None]).T)
    diff = (y.float() - expected).abs()
    assert (diff <= bound).all(), f"{what}: |y - expected| {diff.max():.4g}, worst relative {(diff / bound).max():.3g}"


def tiles_of(ops, q):
    tiles = ops.int8_tiles(q)
    assert tiles.numel() > 0, f"no tiles at {ops.cpu_isa()}"
    # [ceil(n_out / F), n_in / 32, 32 F]: one byte a weight, as q itself
    (n_out, n_in), width = q.shape, tiles.shape[2] // 32
    assert width in (8, 16) and tuple(tiles.shape) == (-(-n_out // width), n_in // 32, 32 * width), tiles.shape
    return tiles


def weight_and_tiles(ops, isa, seed):
    if isa == "scalar":
        pytest.skip("no tiles in portable C++")
    w = int8_weight(70, 320, seed=seed)
    return w, tiles_of(ops, w[0])


def test_every_row_count_on_every_cpu_path(ops, isa):
    if isa == "scalar":
        assert ops.int8_tiles(int8_weight(16, 64)[0]).numel() == 0  # no integer path in portable C++
        return
    for n_out, n_in in SHAPES:
        q, scale = int8_weight(n_out, n_in, seed=n_out)
        tiles = tiles_of(ops, q)
        x_all = torch.randn(max(ROWS), n_in, generator=torch.Generator().manual_seed(n_in)).bfloat16()
        for rows in ROWS:
            x = x_all[:rows]
            check_q8(ops.int8_linear(x, q, scale, tiles), x, q, scale, f"{isa} {rows} x {n_in} -> {n_out}")


def test_a_row_gets_the_same_bits_alone_and_amid_others(ops, isa):
    (q, scale), tiles = weight_and_tiles(ops, isa, seed=6)
    x = torch.randn(37, 320, generator=torch.Generator().manual_seed(6)).bfloat16()
    together = ops.int8_linear(x, q, scale, tiles)
    for start, rows in [(0, 1), (5, 1), (36, 1), (3, 2), (10, 3), (17, 4), (20, 16), (1, 36)]:
        alone = ops.int8_linear(x[start : start + rows], q, scale, tiles)
        assert torch.equal(alone, together[start : start + rows]), f"{isa}: rows {start}..{start + rows - 1}"


def test_float32_x_and_batch_invariant_mode_leave_the_tiles_alone(ops, isa):
    (q, scale), tiles = weight_and_tiles(ops, isa, seed=3)
    x = torch.randn(40, 320)
    assert torch.equal(ops.int8_linear(x, q, scale, tiles), ops.int8_linear(x, q, scale))
    ops.set_batch_invariant(True)
    try:
        xb = x.bfloat16()
        assert torch.equal(ops.int8_linear(xb, q, scale, tiles), ops.int8_linear(xb, q, scale))
    finally:
        ops.set_batch_invariant(False)


def test_extreme_weights_zero_blocks_and_outliers(ops, isa):
    # Weights at -128 and 127 against x at +-max (xq = +-127): AVX2's pairs of products reach
    # 2 * 128 * 127, one below the 16-bit limit, and VNNI's unsigned weights reach 255. A block of
    # zeros (dx 0), one value far above its block, ties of rounding.
    if isa == "scalar":
        pytest.skip("no tiles in portable C++")
    q, scale = int8_weight(40, 320, seed=4)
    q[0] = -128
    q[1] = 127
    q[2, ::2], q[2, 1::2] = -128, 127
    tiles = tiles_of(ops, q)
    x = torch.randn(20, 320)
    x[0] = 3.0
    x[1] = -3.0
    x[2, :32] = 0
    x[3, 40] = 1e4
    x[4, 96:128] = torch.arange(32) - 15.875
    x[5] = 0
    x = x.bfloat16()
    y = ops.int8_linear(x, q, scale, tiles)
    assert torch.isfinite(y).all()
    check_q8(y, x, q, scale, f"{isa} edges")


def test_inputs_that_are_not_whole_blocks_get_no_tiles(ops):
    if ops.best_cpu_isa() == "scalar":
        pytest.skip("no tiles in portable C++")
    assert ops.int8_tiles(int8_weight(16, 48)[0]).numel() == 0  # 48 inputs: a block and a half


def test_tiles_of_another_width_are_passed_over(ops):
    if ops.best_cpu_isa() != "avx512_bf16":
        pytest.skip("needs a CPU with both tile widths (AVX512-BF16)")
    q, scale = int8_weight(70, 320, seed=5)
    wide = tiles_of(ops, q)
    x = torch.randn(32, 320).bfloat16()
    ops.set_cpu_isa("avx2")
    try:
        narrow = tiles_of(ops, q)
        assert narrow.shape[2] * 2 == wide.shape[2], (narrow.shape, wide.shape)
        assert torch.equal(ops.int8_linear(x, q, scale, wide), ops.int8_linear(x, q, scale))
    finally:
        ops.set_cpu_isa("avx512_bf16")


def test_tiles_that_are_not_the_weight_s_are_refused(ops):
    if ops.best_cpu_isa() == "scalar":
        pytest.skip("no tiles in portable C++")
    q, scale = int8_weight(70, 320)
    other = tiles_of(ops, int8_weight(70, 256)[0])
    with pytest.raises(RuntimeError, match="are not int8_tiles of a"):
        ops.int8_linear(torch.randn(20, 320).bfloat16(), q, scale, other)
    int4_like = torch.zeros(other.shape[0], 10, 20 * (other.shape[2] // 32), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="are not int8_tiles of a"):
        ops.int8_linear(torch.randn(20, 320).bfloat16(), q, scale, int4_like)


def test_the_one_call_layer_s_linear_takes_the_tiles(ops):
    if ops.best_cpu_isa() == "scalar":
        pytest.skip("no tiles in portable C++")
    q, scale = int8_weight(70, 320, seed=6)
    tiles = tiles_of(ops, q)
    linear = ops.Linear("int8", [q, scale, tiles])
    x = torch.randn(24, 320).bfloat16()
    assert torch.equal(linear(x), ops.int8_linear(x, q, scale, tiles))
    with pytest.raises(RuntimeError, match="takes 2 weight tensors"):
        ops.Linear("int8", [q, scale, tiles, tiles])


# --- planted bugs: the CPU half compiled on its own (it is torch-free), with a bug put into a copy ---

def test_amx_tiles_give_vnni_s_bits_at_every_row_count(ops):
    # On a CPU with AMX-INT8 every 16 rows of x go to the tiles (a VNNI tile's block is already their
    # B), the rest to VNNI, with the VNNI tile's correction and scaling after exact sums.
    skip_without_amx_int8(ops)  # before any tiles: a CPU without them has none at its level
    for n_out, n_in in SHAPES:
        q, scale = int8_weight(n_out, n_in, seed=n_out + 1)
        tiles = tiles_of(ops, q)
        x_all = torch.randn(max(ROWS), n_in, generator=torch.Generator().manual_seed(n_in + 1)).bfloat16()

        def linear(r):
            return ops.int8_linear(x_all[:r], q, scale, tiles), x_all[:r]

        def check(y, x):
            check_q8(y, x, q, scale, f"AMX {x.shape[0]} x {n_in} -> {n_out}")

        assert_amx_gives_vnni_s_bits(ops, linear, check, [r for r in ROWS if r >= 15])


SHIM = """
#include "cpu_kernels.h"
using namespace kernels;
int planted_bug = -1;
extern "C" {
void set_bug(int b) { planted_bug = b; }
int set_isa(int level) { try { cpu::set_isa(cpu::Isa(level)); return 0; } catch (...) { return 1; } }
int width() { return cpu::q8_tile_width(); }
void tiles(uint8_t* t, const int8_t* q, int n_in, int n_out, int w) { cpu::int8_tiles(t, q, n_in, n_out, w); }
void gemm(void* y, const void* x, const uint8_t* t, const float* s, int rows, int n_in, int n_out, int w) {
    cpu::int8_q8_gemm(y, x, t, s, rows, n_in, n_out, w, DType::bf16); }
int set_amx(int on) { try { cpu::set_amx(on); return 0; } catch (...) { return 1; } }
}
"""
# Each bug: (the correct text, the text with the bug), the call that shows it ((n_out, n_in), row
# counts) and the tile widths whose code it lives in.
PLANTED = {
    "VNNI forgets to take x's sum back off": (
        ("_mm512_sub_epi32(sum, _mm512_set1_epi32(128 * xq_sum[rb]))",
         "_mm512_sub_epi32(sum, _mm512_set1_epi32(BUG ? 0 : 128 * xq_sum[rb]))"), (16, 64), [16], (16,)),
    "AVX2 multiplies x without the weight's sign": (
        ("_mm256_sign_epi8(_mm256_set1_epi32(x), w.sign)",
         "(BUG ? _mm256_set1_epi32(x) : _mm256_sign_epi8(_mm256_set1_epi32(x), w.sign))"), (16, 64), [16], (8,)),
    "the tiles swap two inputs of a part": (
        ("+ b * kBlock + 4 * j + k]) ^ flip", "+ b * kBlock + 4 * j + (BUG ? k ^ 1 : k)]) ^ flip"),
        (16, 64), [16], (8, 16)),
    "one or two rows drop the odd parts' chain": (
        ("if constexpr (C == 2) block = D::add(block, isum[r][1]);",
         "if constexpr (C == 2) block = BUG ? block : D::add(block, isum[r][1]);"), (16, 64), [1, 2], (8, 16)),
    # in q8_tiles.h (its walk over the tiles and its stores test_int4_q8_gemm.py plants bugs in)
    "the weight's scale is that of the tile's first output": (
        ("q8_tiles.h", "sums[r * F + f] * a.scale[o0 + f]", "sums[r * F + f] * a.scale[o0 + (BUG ? 0 : f)]"),
        (16, 64), [16], (8, 16)),
}  # fmt: skip
# The same in the AMX path (on for these only: the bugs above live where 16 rows would go to it)
AMX_PLANTED = {
    "AMX forgets to take x's sum back off": (
        ("_mm512_set1_epi32(128 * xq_sum)", "_mm512_set1_epi32(BUG ? 0 : 128 * xq_sum)"), (16, 64), [16, 20]),
    "AMX gathers x's scales of the rows' first block only": (
        ("q8_tiles.h", "dx[at] = a.dx[rb];", "dx[at] = a.dx[BUG ? rb - b : rb];"), (16, 128), [16]),
}  # fmt: skip


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    bugs = [change for change, *_ in [*PLANTED.values(), *AMX_PLANTED.values()]]
    changes = [(*change[:-1], change[-1].replace("BUG", f"(planted_bug == {i})")) for i, change in enumerate(bugs)]
    also = ("int4_q8_gemm.cpp", "gemm.cpp", "quant_linear.cpp", "lora.cpp", "isa.cpp")
    lib = build_planted(tmp_path_factory.mktemp("planted_i8q8"), "int8_q8_gemm.cpp", changes, SHIM, also,
                        prologue="extern int planted_bug;\n")  # fmt: skip
    lib.set_amx(0)  # on for the AMX bugs only
    return lib


def planted_call(lib, x, q, scale):
    n_out, n_in = q.shape
    width = lib.width()
    tiles = torch.zeros((n_out + width - 1) // width, n_in // 32, 32 * width, dtype=torch.uint8)
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    lib.tiles(ptr(tiles), ptr(q), n_in, n_out, width)
    y = torch.full((x.shape[0], n_out), float("nan"), dtype=x.dtype)
    lib.gemm(ptr(y), ptr(x), ptr(tiles), ptr(scale), x.shape[0], n_in, n_out, width)
    return y, width


def checked_call(planted, n_out, n_in, seed, bug):
    """call(r) for the checks below: r rows of x through the planted copy of a [n_out, n_in] weight
    -> (the tiles' width, whether the result passes check_q8)."""
    q, scale = int8_weight(n_out, n_in, seed=seed)

    def call(r):
        x = torch.randn(r, n_in).bfloat16()
        y, width = planted_call(planted, x, q, scale)
        try:
            check_q8(y, x, q, scale, bug)
        except AssertionError:
            return width, False
        return width, True

    return call


@pytest.mark.parametrize("bug", PLANTED)
def test_a_planted_bug_fails_the_check(ops, planted, bug):
    _, (n_out, n_in), rows, widths = PLANTED[bug]
    call = checked_call(planted, n_out, n_in, 7, bug)
    assert_caught_where_it_lives(ops, planted, list(PLANTED).index(bug), bug, rows, widths, call)


@pytest.mark.parametrize("bug", AMX_PLANTED)
def test_a_planted_amx_bug_fails_the_check(ops, planted, bug):
    _, (n_out, n_in), rows = AMX_PLANTED[bug]
    call = checked_call(planted, n_out, n_in, 8, bug)
    assert_amx_bug_caught(ops, planted, len(PLANTED) + list(AMX_PLANTED).index(bug), bug, rows, call)
