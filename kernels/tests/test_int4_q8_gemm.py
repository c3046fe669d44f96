"""int4 weights times bf16 x quantized to int8 (csrc/cpu/int4_q8_gemm.cpp): int4_linear with the
weight's tiles, at every row count on every CPU path, against reference.int4_linear_q8 (the same
quantization of x, the codes' sums exact) to one bf16 rounding; a row's result the same bits whatever
else shares its call; for float32 x and in batch-invariant mode the float path answers as if there
were no tiles. Then the tiles' own checks, and bugs planted in a copy of the source, each of which
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
from test_quant_linear import int4_weight

# (n_out, n_in, group_size): outputs past a tile of 8 and of 16; groups of two blocks
SHAPES = [(70, 320, 32), (16, 64, 32), (40, 256, 64)]


def check_q8(y, x, packed, scale, min_, group_size, what=""):
    """y (bf16) against the reference in float32: one rounding to bf16 apart (2^-8 of the value),
    plus float32's rounding of the sums in another order, bounded by the magnitude of the terms
    summed. Those are the codes' part and the mins' part apart (scale dx sum(code xq) and
    min sum(x)), not w x: with an outlier in x the two cancel to a small y, and its rounding
    error is the size of the parts' (a bound from |w| failed 1 x in 140)."""
    expected = reference.int4_linear_q8(x.float(), packed, scale, min_, group_size)
    codes_part = reference.int4_weight(packed, scale, torch.zeros_like(min_), group_size)
    mins_part = reference.int4_weight(packed, torch.zeros_like(scale), min_, group_size)
    terms = x.float().abs() @ (codes_part.abs() + mins_part.abs()).T
    bound = 2.0**-8 * 1.01 * expected.abs() + 1e-5 * terms
    diff = (y.float() - expected).abs()
    assert (diff <= bound).all(), f"{what}: |y - expected| {diff.max():.4g}, worst relative {(diff / bound).max():.3g}"


def tiles_of(ops, w, group_size):
    tiles = ops.int4_tiles(*w, group_size)
    assert tiles.numel() > 0, f"no tiles at {ops.cpu_isa()}"
    # [ceil(n_out / F), n_in / 32, 20 F]: per output and block 16 bytes of codes and a float16 scale
    # and min, the 0.625 bytes a weight of the checkpoint's own layout
    (n_out, half_n_in), width = w[0].shape, tiles.shape[2] // 20
    assert width in (8, 16) and tuple(tiles.shape) == (-(-n_out // width), half_n_in // 16, 20 * width), tiles.shape
    return tiles


def weight_and_tiles(ops, isa, seed):
    """A [70, 320] int4 weight (G=32) and its tiles at this ISA; skips in portable C++ (no tiles)."""
    if isa == "scalar":
        pytest.skip("no tiles in portable C++")
    w = int4_weight(70, 320, 32, seed=seed)
    return w, tiles_of(ops, w, 32)


def test_every_row_count_on_every_cpu_path(ops, isa):
    if isa == "scalar":
        assert ops.int4_tiles(*int4_weight(16, 64, 32), 32).numel() == 0  # no integer path in portable C++
        return
    for n_out, n_in, group_size in SHAPES:
        w = int4_weight(n_out, n_in, group_size, seed=n_out)
        tiles = tiles_of(ops, w, group_size)
        x_all = torch.randn(max(ROWS), n_in, generator=torch.Generator().manual_seed(n_in)).bfloat16()
        for rows in ROWS:
            x = x_all[:rows]
            y = ops.int4_linear(x, *w, group_size, tiles)
            check_q8(y, x, *w, group_size, f"{isa} {rows} x {n_in} -> {n_out}, G={group_size}")


def test_a_row_gets_the_same_bits_alone_and_amid_others(ops, isa):
    # Each row's x is quantized by itself and its sums run the same instructions in a tile of 4 rows
    # as in a tail of 1..3 (one template), over threads split by outputs: so a decode row, a prompt
    # chunk's row and the same row amid 36 others give one result. The engine's replies owe their
    # independence of the batch to this (bench/reproducibility.py).
    w, tiles = weight_and_tiles(ops, isa, seed=6)
    x = torch.randn(37, 320, generator=torch.Generator().manual_seed(6)).bfloat16()
    together = ops.int4_linear(x, *w, 32, tiles)
    for start, rows in [(0, 1), (5, 1), (36, 1), (3, 2), (10, 3), (17, 4), (20, 16), (1, 36)]:
        alone = ops.int4_linear(x[start : start + rows], *w, 32, tiles)
        assert torch.equal(alone, together[start : start + rows]), f"{isa}: rows {start}..{start + rows - 1}"


def test_float32_x_and_batch_invariant_mode_leave_the_tiles_alone(ops, isa):
    w, tiles = weight_and_tiles(ops, isa, seed=3)
    x = torch.randn(40, 320)
    assert torch.equal(ops.int4_linear(x, *w, 32, tiles), ops.int4_linear(x, *w, 32))
    ops.set_batch_invariant(True)
    try:
        xb = x.bfloat16()
        assert torch.equal(ops.int4_linear(xb, *w, 32, tiles), ops.int4_linear(xb, *w, 32))
    finally:
        ops.set_batch_invariant(False)


def test_zero_blocks_outliers_and_extremes(ops, isa):
    # A block of zeros (scale 0: no division by it), one value far above its block (the others round
    # to few levels, as the reference's), values at +-max|x| (xq = +-127) and ties of rounding.
    w, tiles = weight_and_tiles(ops, isa, seed=4)
    x = torch.randn(20, 320)
    x[0, :32] = 0
    x[1, 40] = 1e4
    x[2, 64:96] = -3.0
    x[3, 96:128] = torch.arange(32) - 15.875  # k / 127 * max: halves land exactly on ties
    x[4] = 0
    x = x.bfloat16()
    y = ops.int4_linear(x, *w, 32, tiles)
    assert torch.isfinite(y).all()
    check_q8(y, x, *w, 32, f"{isa} edges")


def test_tiles_of_another_width_are_passed_over(ops):
    # Tiles are laid out for the ISA that made them (8 outputs wide for AVX2, 16 for VNNI); under
    # another, int4_linear takes the float path, with no wrong result and no error.
    if ops.best_cpu_isa() != "avx512_bf16":
        pytest.skip("needs a CPU with both tile widths (AVX512-BF16)")
    w = int4_weight(70, 320, 32, seed=5)
    wide = tiles_of(ops, w, 32)
    x = torch.randn(32, 320).bfloat16()
    ops.set_cpu_isa("avx2")
    try:
        narrow = tiles_of(ops, w, 32)
        assert narrow.shape[2] * 2 == wide.shape[2], (narrow.shape, wide.shape)
        assert torch.equal(ops.int4_linear(x, *w, 32, wide), ops.int4_linear(x, *w, 32))
    finally:
        ops.set_cpu_isa("avx512_bf16")


def test_tiles_that_are_not_the_weight_s_are_refused(ops):
    if ops.best_cpu_isa() == "scalar":
        pytest.skip("no tiles in portable C++")
    w = int4_weight(70, 320, 32)
    other = tiles_of(ops, int4_weight(70, 256, 32), 32)
    with pytest.raises(RuntimeError, match="are not int4_tiles of a"):
        ops.int4_linear(torch.randn(20, 320).bfloat16(), *w, 32, other)


def test_the_one_call_layer_s_linear_takes_the_tiles(ops):
    if ops.best_cpu_isa() == "scalar":
        pytest.skip("no tiles in portable C++")
    w = int4_weight(70, 320, 32, seed=6)
    tiles = tiles_of(ops, w, 32)
    linear = ops.Linear("int4", [*w, tiles], 32)
    x = torch.randn(24, 320).bfloat16()
    assert torch.equal(linear(x), ops.int4_linear(x, *w, 32, tiles))
    with pytest.raises(RuntimeError, match="takes 3 weight tensors"):
        ops.Linear("int4", [*w, tiles, tiles], 32)


def test_amx_tiles_give_vnni_s_bits_at_every_row_count(ops):
    # On a CPU with AMX-INT8 every 16 rows of x go to the tiles (codes widened to bytes, one tile
    # instruction a block), the rest to VNNI, with the VNNI tile's float steps after exact sums.
    skip_without_amx_int8(ops)  # before any tiles: a CPU without them has none at its level
    for n_out, n_in, group_size in SHAPES:
        w = int4_weight(n_out, n_in, group_size, seed=n_out + 1)
        tiles = tiles_of(ops, w, group_size)
        x_all = torch.randn(max(ROWS), n_in, generator=torch.Generator().manual_seed(n_in + 1)).bfloat16()

        def linear(r):
            return ops.int4_linear(x_all[:r], *w, group_size, tiles), x_all[:r]

        def check(y, x):
            check_q8(y, x, *w, group_size, f"AMX {x.shape[0]} x {n_in} -> {n_out}, G={group_size}")

        assert_amx_gives_vnni_s_bits(ops, linear, check, [r for r in ROWS if r >= 15])


def test_amx_tiles_give_the_same_bits_in_a_team_of_any_size(ops):
    # Each thread of a product configures its own tiles and keeps its own sums and widened codes;
    # the calling thread gathers x's factors for all of them. Teams of 1 to 3 threads (more than
    # this machine's cores too) split the tile rows differently and must not change a bit.
    skip_without_amx_int8(ops)
    w = int4_weight(200, 320, 32, seed=9)
    tiles = tiles_of(ops, w, 32)
    x = torch.randn(50, 320, generator=torch.Generator().manual_seed(9)).bfloat16()
    threads = torch.get_num_threads()
    try:
        ops.set_cpu_gemm_amx(False)
        vnni = ops.int4_linear(x, *w, 32, tiles)
        ops.set_cpu_gemm_amx(None)
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(ops.int4_linear(x, *w, 32, tiles), vnni), f"{n} threads"
    finally:
        torch.set_num_threads(threads)
        ops.set_cpu_gemm_amx(None)


# --- planted bugs: the CPU half compiled on its own (it is torch-free), with a bug put into a copy ---

SHIM = """
#include "cpu_kernels.h"
#include "q8_tiles.h"
using namespace kernels;
int planted_bug = -1;  // which bug of PLANTED is on: one build serves every test
extern "C" {
void set_bug(int b) { planted_bug = b; }
int set_isa(int level) { try { cpu::set_isa(cpu::Isa(level)); return 0; } catch (...) { return 1; } }
int width() { return cpu::q8_tile_width(); }
void tiles(uint8_t* t, const uint8_t* p, const uint16_t* s, const uint16_t* m, int n_in, int n_out, int g, int w) {
    cpu::int4_tiles(t, p, s, m, n_in, n_out, g, w); }
void gemm(void* y, const void* x, const uint8_t* t, int rows, int n_in, int n_out, int w) {
    auto& codes = cpu::q8::thread_buffers<cpu::q8::AmxWork>().codes;  // no codes widened by an earlier call
    std::fill(codes.begin(), codes.end(), 0xFF);
    cpu::int4_q8_gemm(y, x, t, rows, n_in, n_out, w, DType::bf16); }
int set_amx(int on) { try { cpu::set_amx(on); return 0; } catch (...) { return 1; } }
}
"""
# Each bug: (the correct text, the text with the bug, on while BUG), the call that shows it
# ((n_out, n_in), row counts) and the tile widths whose code it lives in.
PLANTED = {
    "x's scale is max|x| / 128": (("dx[b] = m / 127.f;", "dx[b] = m / (BUG ? 128.f : 127.f);"), (16, 64), [16], (8, 16)),
    "the tiles put a high nibble's inputs in the wrong order": (
        ("code(8 * j + 4 + k) << 4", "code(8 * j + 4 + (BUG ? k ^ 1 : k)) << 4"), (16, 64), [16], (8, 16)),
    "the mins' term is left out of a tile's last row": (
        ("acc[r] = S::fma(min, S::set1(a.xsum[rb]), acc[r]);",
         "if (!BUG || r + 1 < MR) acc[r] = S::fma(min, S::set1(a.xsum[rb]), acc[r]);"),
        (16, 64), [16], (8, 16)),
    "AVX2 counts one of each pair of 16-bit sums": (
        ("_mm256_madd_epi16(sum, _mm256_set1_epi16(1))",
         "_mm256_madd_epi16(sum, BUG ? _mm256_set1_epi32(1) : _mm256_set1_epi16(1))"), (16, 64), [16], (8,)),
    "VNNI drops the fourth of every four inputs of x": (
        ("_mm512_dpbusd_epi32(sum, codes, _mm512_set1_epi32(x))",
         "_mm512_dpbusd_epi32(sum, codes, _mm512_set1_epi32(BUG ? x & 0xFFFFFF : x))"), (16, 64), [16], (16,)),
    # in q8_tiles.h, the walk over the tiles both integer products share
    "a tail tile of rows stores one row too few": (
        ("q8_tiles.h", "store_outputs<F>(a, sums, r0, a.rows - r0, t * F);",
         "store_outputs<F>(a, sums, r0, a.rows - r0 - BUG, t * F);"), (16, 64), [17, 19], (8, 16)),
    "the outputs of a partial tile lose their last": (
        ("q8_tiles.h", "const int no = std::min(F, a.n_out - o0);",
         "const int no = std::min(F, a.n_out - o0) - (BUG && a.n_out - o0 < F);"), (70, 64), [16], (8, 16)),
}  # fmt: skip
# The same in the AMX path (on for these only: the bugs above live where 16 rows would go to it)
AMX_PLANTED = {
    "AMX widens a block's high nibbles into its low ones' rows": (
        ("_mm512_storeu_si512(codes + 128 * j, lo);", "_mm512_storeu_si512(codes + 128 * j, BUG ? hi : lo);"),
        (16, 64), [16, 33]),
    "AMX scales a block with the sums of the block before": (
        ("q8_tiles.h", "const int32_t* sums = work.sums[b % D];",
         "const int32_t* sums = work.sums[(b + BUG * (D - 1)) % D];"), (16, 256), [16]),
    "AMX's tile of x takes 16 rows a block apart": (
        ("q8_tiles.h", "const int64_t x_stride = a.n_in;", "const int64_t x_stride = BUG ? kBlock : a.n_in;"),
        (16, 64), [16]),
    "the rows after the tiles' last 16 are left out": (
        ("q8_tiles.h", "r0 = a.rows / kAmxRows * kAmxRows;", "r0 = (a.rows / kAmxRows + BUG) * kAmxRows;"),
        (16, 64), [17, 35]),
    "AMX's second 16 rows use codes that were never widened": (
        ("q8_tiles.h", "if (r0 == 0 && b < a.blocks)", "if (r0 == BUG * kAmxRows && b < a.blocks)"),
        (16, 64), [32]),
}  # fmt: skip


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The CPU half built once with every bug above in its copy of int4_q8_gemm.cpp, each behind a
    switch (set_bug), so that each bug is checked alone at every tile width; AMX off but for its own."""
    bugs = [change for change, *_ in [*PLANTED.values(), *AMX_PLANTED.values()]]
    changes = [(*change[:-1], change[-1].replace("BUG", f"(planted_bug == {i})")) for i, change in enumerate(bugs)]
    also = ("gemm.cpp", "quant_linear.cpp", "lora.cpp", "isa.cpp")  # lora.cpp: q8::run may add LoRA deltas
    lib = build_planted(tmp_path_factory.mktemp("planted_q8"), "int4_q8_gemm.cpp", changes, SHIM, also,
                        prologue="extern int planted_bug;\n")  # fmt: skip
    lib.set_amx(0)
    return lib


def planted_call(lib, x, w, n_out):
    packed, scale, min_ = w
    width = lib.width()
    n_in = x.shape[1]
    tiles = torch.zeros((n_out + width - 1) // width, n_in // 32, 20 * width, dtype=torch.uint8)
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    lib.tiles(ptr(tiles), ptr(packed), ptr(scale), ptr(min_), n_in, n_out, 32, width)
    y = torch.full((x.shape[0], n_out), float("nan"), dtype=x.dtype)
    lib.gemm(ptr(y), ptr(x), ptr(tiles), x.shape[0], n_in, n_out, width)
    return y, width


def checked_call(planted, n_out, n_in, seed, bug):
    """call(r) for the checks below: r rows of x through the planted copy of a [n_out, n_in] weight
    -> (the tiles' width, whether the result passes check_q8)."""
    w = int4_weight(n_out, n_in, 32, seed=seed)

    def call(r):
        x = torch.randn(r, n_in).bfloat16()
        y, width = planted_call(planted, x, w, n_out)
        try:
            check_q8(y, x, *w, 32, bug)
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
