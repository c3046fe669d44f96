"""LoRA shrink and expand on the CPU (csrc/cpu/lora.cpp) against reference.py: every row count from 1
to 70 under four slot patterns (mixed segments with base-model rows, all rows on the base model, one
adapter for every row, every row a segment of its own), ranks 1, 7, 8, 16 and 64 in slots of 64, in
float32, bf16 and fp16 activations with float32 and bf16 adapters, on every instruction-set path
the CPU offers; inputs and outputs that are multiples of 8 but end inside every tile. The weights'
padding past each rank is NaN and the rows of the base model start as -0.0, so a read of the padding
or a write to such a row (even of y + 0) fails. Then the operators' checks, and bugs planted in a
torch-free copy of the source, each of which the same comparison must catch."""

import ctypes
import functools
import random

import pytest
import torch

from conftest import assert_close, build_planted
from kernels import reference

RANKS = [1, 8, 16, 64, 7]  # per slot; r_max 64
PATTERNS = ["mixed", "all base", "one adapter", "segments of 1"]
# (n_in, n_out): 200 = 12 * 16 + 8 and 328 = 256 + 64 + 8 end inside AVX512's 16 lanes, AVX2's
# tiles of 3 rows and 4 x 8 outputs, AVX512's 4 x 16 and an expand task's 256 outputs; 24 -> 40 is
# smaller than most of them.
SHAPES = [(200, 328), (24, 40)]


def row_slots(rows: int, pattern: str, slots: int, rng: random.Random) -> list[int]:
    if pattern == "all base":
        return [-1] * rows
    if pattern == "one adapter":
        return [rng.randrange(slots)] * rows
    if pattern == "segments of 1":  # decode rows: neighbours differ, so no two merge into a segment
        out = []
        for _ in range(rows):
            out.append(rng.choice([s for s in range(-1, slots) if not out or s != out[-1]]))
        return out
    out = []  # prompt chunks of 1..9 rows and decode rows, with the base model among them
    while len(out) < rows:
        out += [rng.randrange(-1, slots)] * rng.randint(1, 9)
    return out[:rows]


@functools.lru_cache(maxsize=None)
def adapters(n_in, n_out, w_dtype, ranks, r_max, seed):
    """The slot table's weights (cached: the sweeps reuse them), padding past each rank NaN."""
    g = torch.Generator().manual_seed(1000 + seed)
    a = torch.randn(len(ranks), r_max, n_in, generator=g) * n_in**-0.5
    b_t = torch.randn(len(ranks), r_max, n_out, generator=g) * 0.2
    for s, r in enumerate(ranks):
        a[s, r:], b_t[s, r:] = float("nan"), float("nan")
    scale = torch.rand(len(ranks), generator=g) * 1.5 + 0.5  # not 1: a scale applied twice shows
    return a.to(w_dtype), b_t.to(w_dtype), torch.tensor(ranks, dtype=torch.int32), scale


def make_case(rows, n_in, n_out, pattern, dtype, w_dtype, seed=0, ranks=RANKS, r_max=64):
    """-> (x, y, a, b_t, ranks, scale, seg_starts, seg_slots): padding past each rank NaN, rows of the
    base model in y -0.0."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    a, b_t, ranks_t, scale = adapters(n_in, n_out, w_dtype, tuple(ranks), r_max, seed % 2)
    x = torch.randn(rows, n_in, generator=g).to(dtype)
    starts, seg_slots = reference.lora_segments(row_slots(rows, pattern, len(ranks), rng))
    y = torch.randn(rows, n_out, generator=g).to(dtype)
    y[reference.lora_row_slots(starts, seg_slots) < 0] = -0.0
    return x, y, a, b_t, ranks_t, scale, starts, seg_slots


def check(v, y_out, case, what):
    x, y, a, b_t, ranks, scale, starts, seg_slots = case
    v_expected = reference.lora_shrink(x, a, ranks, starts, seg_slots)
    assert_close(v, v_expected, f"{what}: v")
    # zeros past each rank and on base rows, exactly (the expand may be handed v with another table)
    assert torch.equal(v[v_expected == 0], v_expected[v_expected == 0]), what
    assert_close(y_out, reference.lora_expand(y, v_expected, b_t, ranks, scale, starts, seg_slots), f"{what}: y")
    base = reference.lora_row_slots(starts, seg_slots) < 0
    assert torch.equal(y_out[base].view(torch.uint8), y[base].view(torch.uint8)), f"{what}: a base row was written"


def run(ops, case):
    x, y, a, b_t, ranks, scale, starts, seg_slots = case
    v = ops.lora_shrink(x, a, ranks, starts, seg_slots)
    y_out = y.clone()
    ops.lora_expand_(y_out, v, b_t, ranks, scale, starts, seg_slots)
    return v, y_out


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["w_f32", "w_bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_every_row_count_and_pattern_on_every_cpu_path(ops, isa, dtype, w_dtype):
    # every row count where x and the weights share a dtype; tile edges for the other pairs
    every = dtype == w_dtype
    for n_in, n_out in SHAPES:
        for rows in range(1, 71) if every else [1, 2, 3, 4, 5, 16, 17, 33, 70]:
            # every pattern at each of the first rows and at tile edges; one in turn elsewhere
            patterns = PATTERNS if rows <= 5 or rows in (16, 17, 33, 64, 70) else [PATTERNS[rows % 4]]
            for pattern in patterns:
                case = make_case(rows, n_in, n_out, pattern, dtype, w_dtype, seed=rows)
                check(*run(ops, case), case, f"{isa} {pattern} {rows} rows {n_in} -> {n_out}")


def test_segments_may_be_empty_and_strided_rows_work(ops, isa):
    # A table can hold empty segments (a request with nothing in this step); x, y and v may be views
    # with a row stride (a slice of a fused projection's output).
    case = make_case(9, 200, 328, "mixed", torch.bfloat16, torch.bfloat16, seed=3)
    x, y, a, b_t, ranks, scale, _, _ = case
    starts = torch.tensor([0, 0, 4, 4, 5, 9, 9], dtype=torch.int32)
    seg_slots = torch.tensor([2, 1, 0, -1, 3, 4], dtype=torch.int32)
    y[5:9] = -0.0
    wide_x = torch.randn(9, 300).bfloat16()
    wide_x[:, 40:240] = x
    wide_y = torch.randn(9, 400).bfloat16()
    wide_y[:, 8:336] = y
    v = ops.lora_shrink(wide_x[:, 40:240], a, ranks, starts, seg_slots)
    wide_v = torch.zeros(9, 80)
    wide_v[:, 16:] = v
    ops.lora_expand_(wide_y[:, 8:336], wide_v[:, 16:], b_t, ranks, scale, starts, seg_slots)
    check(v, wide_y[:, 8:336], (x, y, a, b_t, ranks, scale, starts, seg_slots), f"{isa} strided")


def test_a_segment_gives_the_rows_what_they_get_alone(ops, isa):
    # A prompt chunk (one segment of many rows: full row tiles) and the same rows as decode rows
    # (segments of one: matrix-vector products) compute each row in the same order: the same bits.
    case = make_case(37, 200, 328, "one adapter", torch.bfloat16, torch.bfloat16, seed=5)
    x, y, a, b_t, ranks, scale, starts, seg_slots = case
    v, y_out = run(ops, case)
    ones = torch.arange(38, dtype=torch.int32)
    each = torch.full((37,), int(seg_slots[0]), dtype=torch.int32)
    v1 = ops.lora_shrink(x, a, ranks, ones, each)
    y1 = y.clone()
    ops.lora_expand_(y1, v1, b_t, ranks, scale, ones, each)
    assert torch.equal(v, v1) and torch.equal(y_out, y1), isa


def test_lora_segments_merges_runs_of_a_slot():
    starts, slots = reference.lora_segments([3, 3, -1, 0, 0, 0, 3])
    assert starts.tolist() == [0, 2, 3, 6, 7] and slots.tolist() == [3, -1, 0, 3]
    assert reference.lora_row_slots(starts, slots).tolist() == [3, 3, -1, 0, 0, 0, 3]
    starts, slots = reference.lora_segments([])
    assert starts.tolist() == [0] and slots.tolist() == []


def test_the_operators_pass_opcheck_and_equal_the_module(ops):
    case = make_case(6, 24, 40, "mixed", torch.float32, torch.bfloat16, seed=1)
    x, y, a, b_t, ranks, scale, starts, seg_slots = case
    a, b_t = a.nan_to_num(), b_t.nan_to_num()  # opcheck compares runs of the op, NaN != NaN
    lk = torch.ops.llm_kernels
    torch.library.opcheck(lk.lora_shrink, (x, a, ranks, starts, seg_slots))
    v = lk.lora_shrink(x, a, ranks, starts, seg_slots)
    torch.library.opcheck(lk.lora_expand_, (y.clone(), v, b_t, ranks, scale, starts, seg_slots))
    assert torch.equal(v, ops.lora_shrink(x, a, ranks, starts, seg_slots))
    y1, y2 = y.clone(), y.clone()
    lk.lora_expand_(y1, v, b_t, ranks, scale, starts, seg_slots)
    ops.lora_expand_(y2, v, b_t, ranks, scale, starts, seg_slots)
    assert torch.equal(y1, y2)


def test_bad_calls_are_clear_errors(ops):
    x, y, a, b_t, ranks, scale, starts, seg_slots = make_case(5, 24, 40, "mixed", torch.float32, torch.float32)
    v = ops.lora_shrink(x, a, ranks, starts, seg_slots)
    shrink = lambda **kw: ops.lora_shrink(  # noqa: E731
        *[kw.get(k, d) for k, d in zip(["x", "a", "ranks", "starts", "slots"], [x, a, ranks, starts, seg_slots])]
    )

    def expand(**kw):
        args = dict(y=y.clone(), v=v, b_t=b_t, ranks=ranks, scale=scale, starts=starts, slots=seg_slots) | kw
        ops.lora_expand_(*args.values())

    bad_rank = ranks.clone()
    bad_rank[2] = 65
    with pytest.raises(RuntimeError, match=r"ranks\[2\] = 65 is outside 0..64"):
        shrink(ranks=bad_rank)
    with pytest.raises(RuntimeError, match=r"ranks\[2\] = 65 is outside 0..64"):
        expand(ranks=bad_rank)
    with pytest.raises(RuntimeError, match=r"seg_slots\[0\] = 5 is outside -1..4"):
        shrink(slots=torch.full_like(seg_slots, 5))
    with pytest.raises(RuntimeError, match=r"seg_slots\[0\] = -2 is outside -1..4"):
        expand(slots=torch.full_like(seg_slots, -2))
    with pytest.raises(RuntimeError, match="x has 24 inputs, the adapters' A \\(a\\) 32"):
        shrink(a=torch.zeros(5, 64, 32))
    with pytest.raises(RuntimeError, match="y has 40 outputs, the adapters' B"):
        expand(b_t=torch.zeros(5, 64, 48))
    with pytest.raises(RuntimeError, match="v: float32 \\[rows, r_max\\] = \\[5, 64\\]"):
        expand(v=v[:, :16])
    with pytest.raises(RuntimeError, match="float32 or bfloat16 adapter weights expected, got Half"):
        shrink(a=a.half())
    with pytest.raises(RuntimeError, match="x: float32, bfloat16 or float16 expected, got Int"):
        shrink(x=x.int())
    with pytest.raises(RuntimeError, match="ranks: contiguous int32"):
        shrink(ranks=ranks.long())
    with pytest.raises(RuntimeError, match="scale: contiguous float32 \\[slots\\] expected \\(5 slots\\)"):
        expand(scale=scale[:4])
    with pytest.raises(RuntimeError, match="seg_starts must run from 0 to the call's 5 rows"):
        shrink(starts=torch.tensor([0, 4], dtype=torch.int32), slots=torch.tensor([1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="seg_starts must not decrease"):
        shrink(starts=torch.tensor([0, 3, 2, 5], dtype=torch.int32), slots=torch.tensor([1, 2, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="seg_slots: contiguous int32 \\[n_seg\\] expected"):
        shrink(slots=seg_slots[:-1])


def test_the_decoder_layer_s_tables_are_checked_once_when_built(ops):
    """The one-call layer (csrc/decoder_layer.cpp) runs the kernels without the operators' checks, 14
    times a layer; its LoRA tables and a step's segments are checked when built instead."""
    x, y, a, b_t, ranks, scale, starts, seg_slots = make_case(5, 24, 40, "mixed", torch.float32, torch.float32)
    project = ops.LoraProjection(a, b_t, ranks)
    with pytest.raises(RuntimeError, match="LoraProjection: a is \\[5, 64, 24\\], b_t \\[5, 32, 40\\]"):
        ops.LoraProjection(a, b_t[:, :32].contiguous(), ranks)
    bad_rank = ranks.clone()
    bad_rank[1] = 65
    with pytest.raises(RuntimeError, match=r"ranks\[1\] = 65 is outside 0..64"):
        ops.LoraProjection(a, b_t, bad_rank)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 adapter weights expected, got Half"):
        ops.LoraProjection(a, b_t.half(), ranks)
    ops.LayerLora([project] * 3, [project], [project] * 2, [project], scale)
    with pytest.raises(RuntimeError, match="LayerLora: 3 \\(q, k, v\\), 1 \\(o\\), 2 \\(gate, up\\)"):
        ops.LayerLora([project] * 2, [project], [project] * 2, [project], scale)
    with pytest.raises(RuntimeError, match="LayerLora: scale must be contiguous float32 \\[slots\\] \\(5 slots\\)"):
        ops.LayerLora([project] * 3, [project], [project] * 2, [project], scale[:4])
    flags = [True] * 7
    ops.StepLora(starts, seg_slots, flags)
    with pytest.raises(RuntimeError, match="seg_starts must not decrease"):
        ops.StepLora(torch.tensor([0, 3, 2, 5], dtype=torch.int32), torch.tensor([1, 2, 3], dtype=torch.int32), flags)
    with pytest.raises(RuntimeError, match="seg_slots\\[0\\] = -2 is outside"):
        ops.StepLora(starts, torch.full_like(seg_slots, -2), flags)
    with pytest.raises(RuntimeError, match="StepLora: adapted has one flag per projection \\(7\\), got 6"):
        ops.StepLora(starts, seg_slots, flags[:6])


# --- a fused matmul's projections as one team of threads (cpu::lora_group, the one-call layer's form) --
# Three parts over one x, their outputs side by side in one y, as q, k and v sit in wqkv's output: the
# group must give every part what its own shrink and expand give it, bit for bit (the same tiles of
# the same sums), leave a part the step does not adapt as it was, and split its work over threads by
# ranks and outputs when rows are fewer than threads, by rows otherwise.
GROUP_OUTS = [328, 40, 200]


def group_case(rows, pattern, dtype, w_dtype, seed, slots: list[int] | None = None):
    """-> (x, y [rows, sum of GROUP_OUTS], parts [(a, b_t)], ranks, scale, starts, seg_slots): the parts
    share x, the segments, the ranks and the scales, as a layer's projections do. slots: each row's
    slot, in place of the pattern's."""
    cases = [make_case(rows, 200, n_out, pattern, dtype, w_dtype, seed=seed) for n_out in GROUP_OUTS]
    x, _, _, _, ranks, scale, starts, seg_slots = cases[0]
    assert all(torch.equal(c[0], x) and torch.equal(c[6], starts) and torch.equal(c[7], seg_slots) for c in cases)
    y = torch.cat([c[1] for c in cases], dim=1)
    if slots is not None:
        starts, seg_slots = reference.lora_segments(slots)
    # the parts' A would be alike (one n_in, one seed): scaled apart, so one part's v is not another's
    return x, y, [(c[2] * (1 + j), c[3]) for j, c in enumerate(cases)], ranks, scale, starts, seg_slots


def one_by_one(ops, case, adapted):
    x, y, parts, ranks, scale, starts, seg_slots = case
    y, col = y.clone(), 0
    for (a, b_t), on in zip(parts, adapted):
        if on:
            v = ops.lora_shrink(x, a, ranks, starts, seg_slots)
            ops.lora_expand_(y[:, col : col + b_t.shape[2]], v, b_t, ranks, scale, starts, seg_slots)
        col += b_t.shape[2]
    return y


def as_group(ops, case, adapted, first=0):
    """The parts as projections first.. of the seven (0: q, k, v; 4: gate, up, down), the step's
    flags of the others the opposite of the first part's: a group that reads another's flags errs."""
    x, y, parts, ranks, scale, starts, seg_slots = case
    y = y.clone()
    group = [ops.LoraProjection(a, b_t, ranks) for a, b_t in parts]
    flags = [not adapted[0]] * 7
    flags[first : first + len(adapted)] = adapted
    ops.lora_group_(y, x, group, scale, ops.StepLora(starts, seg_slots, flags), first)
    return y


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_group_gives_each_projection_what_it_gets_alone(ops, isa, threads):
    kept = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype, w_dtype in [
            (torch.bfloat16, torch.bfloat16),
            (torch.float32, torch.float32),
            (torch.float16, torch.bfloat16),
        ]:
            for rows in [1, 2, 3, 4, 5, 7, 12, 17, 40]:
                for pattern in PATTERNS:
                    case = group_case(rows, pattern, dtype, w_dtype, seed=rows)
                    for adapted, first in ([True, True, True], 0), ([False, True, True], 4), ([True, False, True], 0):
                        what = f"{isa} {threads} threads {dtype} {pattern} {rows} rows, parts {adapted} from {first}"
                        y_group = as_group(ops, case, adapted, first)
                        assert torch.equal(
                            y_group.view(torch.uint8), one_by_one(ops, case, adapted).view(torch.uint8)
                        ), what
                    # and against the reference, part by part (the last `adapted`: the middle part untouched)
                    x, y, parts, ranks, scale, starts, seg_slots = case
                    col = 0
                    for (a, b_t), on in zip(parts, adapted):
                        part = slice(col, col + b_t.shape[2])
                        v = reference.lora_shrink(x, a, ranks, starts, seg_slots)
                        expected = (
                            reference.lora_expand(y[:, part], v, b_t, ranks, scale, starts, seg_slots)
                            if on
                            else y[:, part]
                        )
                        assert_close(y_group[:, part], expected, f"{what}: part at {col}")
                        col += b_t.shape[2]
    finally:
        torch.set_num_threads(kept)


def test_a_group_s_bad_calls_are_clear_errors(ops):
    x, y, parts, ranks, scale, starts, seg_slots = group_case(5, "mixed", torch.float32, torch.float32, seed=1)
    group = [ops.LoraProjection(a, b_t, ranks) for a, b_t in parts]
    step = ops.StepLora(starts, seg_slots, [True] * 7)
    with pytest.raises(RuntimeError, match="do not fit a 200 -> 500 matmul"):
        ops.lora_group_(y[:, :500], x, group, scale, step)
    with pytest.raises(RuntimeError, match="one dtype expected"):
        ops.lora_group_(y.bfloat16(), x, group, scale, step)
    with pytest.raises(RuntimeError, match="seg_starts must run from 0 to the call's 4 rows"):
        ops.lora_group_(y[:4], x[:4], group, scale, step)
    with pytest.raises(RuntimeError, match="scale must be contiguous float32 \\[slots\\] \\(5 slots\\)"):
        ops.lora_group_(y, x, group, scale[:4], step)
    with pytest.raises(RuntimeError, match="of the seven expected, got first 0 and 0 projections"):
        ops.lora_group_(y, x, [], scale, step)
    with pytest.raises(RuntimeError, match="got first 5 and 3 projections"):
        ops.lora_group_(y, x, group, scale, step, 5)


# --- planted bugs: the CPU half compiled on its own (it is torch-free), with bugs put into a copy ----
# One copy holds every bug, each behind a switch (planted_bug == n) the test sets through ctypes: one
# compile instead of one per bug.

SHIM = """
#include "cpu_kernels.h"
using namespace kernels;
int planted_bug = 0;
extern "C" {
void plant(int bug) { planted_bug = bug; }
int set_isa(int level) { try { cpu::set_isa(cpu::Isa(level)); return 0; } catch (...) { return 1; } }
void shrink(float* v, const void* x, const void* a, const int32_t* ranks, const int32_t* starts, const int32_t* slots,
            int rows, int n_seg, int n_slots, int n_in, int r_max, int dtype, int w_dtype) {
    cpu::lora_shrink(v, r_max, x, n_in, a, ranks, starts, slots, rows, n_seg, n_slots, n_in, r_max, DType(dtype),
                     DType(w_dtype));
}
void expand(void* y, const float* v, const void* b, const int32_t* ranks, const float* scale, const int32_t* starts,
            const int32_t* slots, int rows, int n_seg, int n_slots, int n_out, int r_max, int dtype, int w_dtype) {
    cpu::lora_expand(y, n_out, v, r_max, b, ranks, scale, starts, slots, rows, n_seg, n_slots, n_out, r_max,
                     DType(dtype), DType(w_dtype));
}
void group(void* y, int64_t y_stride, const void* x, const void** a, const void** b, const int* n_outs, float* v,
           int n_parts, const int32_t* ranks, const float* scale, const int32_t* starts, const int32_t* slots, int rows,
           int n_seg, int n_slots, int n_in, int r_max, int dtype, int w_dtype) {
    cpu::LoraPart parts[8];
    int64_t col = 0;
    for (int j = 0; j < n_parts; ++j) {
        parts[j] = {a[j], b[j], ranks, v + int64_t(j) * rows * r_max, col, n_outs[j]};
        col += n_outs[j];
    }
    cpu::lora_group(y, y_stride, x, n_in, parts, n_parts, scale, starts, slots, rows, n_seg, n_slots, n_in, r_max,
                    DType(dtype), DType(w_dtype));
}
}
"""
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # kernels.h's DType
# bug -> (text of lora.cpp, the same with the bug behind `planted_bug == n`), n its place here + 1
PLANTED = {
    "the wrong slot's adapter (the previous segment's)": [
        ("return int(slots[i]);", "return int(slots[planted_bug == 1 && i > 0 ? i - 1 : i]);"),
    ],
    "the scale applied twice": [
        ("S::set1(p.scale[s]);", "S::set1(p.scale[s] * (planted_bug == 2 ? p.scale[s] : 1.f));"),
        ("+ p.scale[s] * sum", "+ p.scale[s] * (planted_bug == 2 ? p.scale[s] : 1.f) * sum"),
    ],
    "the rank padding read as if it held weights": [
        (
            "for (int k = 0; k < rk; ++k) {\n        ahead.step();",
            "for (int k = 0; k < (planted_bug == 3 ? p.r_max : rk); ++k) {\n        ahead.step();",
        ),
    ],
    "a run's tail rows (past the last whole row tile) skipped": [
        ("if (row < end) expand_rest<", "if (row < end && planted_bug != 4) expand_rest<"),
    ],
    "a one-row tile's last rank left out (the wide shrink tile)": [
        ("(p, r0, s, k0, NO_FIRST, ahead);", "(p, r0, s, k0, NO_FIRST - (planted_bug == 5), ahead);"),
    ],
    "a one-row tile stepping back over outputs it has added (the wide expand tile)": [
        (
            "expand_tile<S, DY, DW, MR, NO_FIRST>(p, r0, s, rk, o, ahead);",
            "expand_tile<S, DY, DW, MR, NO_FIRST>(p, r0, s, rk, o, ahead), planted_bug == 6 && (o -= W);",
        ),
    ],
}


# the same for lora_group, numbered on from PLANTED's
PLANTED_GROUP = {
    "a few-row group's first rank tile computed as its second": [
        (
            "return Task{j, rt * mr, std::min(g.rows, (rt + 1) * mr), kt * k_step,",
            "return Task{j, rt * mr, std::min(g.rows, (rt + 1) * mr), (kt + (planted_bug == 7 && !kt)) * k_step,",
        ),
    ],
    "every part expanded from the first part's v": [
        ("g.y_stride, part.v, g.r_max,", "g.y_stride, g.parts[planted_bug == 8 ? 0 : j].v, g.r_max,"),
    ],
    "a part's outputs written from column 0": [
        ("part.y_col * (g.dtype", "(planted_bug == 9 ? 0 : part.y_col) * (g.dtype"),
    ],
    "the zeros past a slot's rank left out of a rank tile": [
        (
            "std::fill(row + std::max(rk, k_lo), row + k_hi, 0.f);",
            "std::fill(row + std::max(rk, k_lo), row + k_hi - (planted_bug == 10), 0.f);",
        ),
    ],
    "a row tile's expand given its first row only (a tile of rows per task, no barrier)": [
        (
            "plan.expand(plan.expand_args(j), r0, r1, 0, g.parts[j].n_out);",
            "plan.expand(plan.expand_args(j), r0, planted_bug == 11 ? r0 + 1 : r1, 0, g.parts[j].n_out);",
        ),
    ],
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The CPU LoRA kernels built with every bug above in a copy of lora.cpp, as a plain shared library."""
    changes = [change for bugs in (PLANTED, PLANTED_GROUP) for changes in bugs.values() for change in changes]

    def declare(source):  # the switch the bugs read, defined by the shim
        return source.replace("namespace kernels::cpu {", "extern int planted_bug;\nnamespace kernels::cpu {", 1)

    return build_planted(tmp_path_factory.mktemp("planted"), "lora.cpp", changes, SHIM, ("isa.cpp",), declare)


def planted_run(lib, case):
    x, y, a, b_t, ranks, scale, starts, seg_slots = case
    rows, n_in, n_out, r_max = x.shape[0], x.shape[1], y.shape[1], a.shape[1]
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    v = torch.full((rows, r_max), float("nan"))
    n_seg, n_slots, dt, wdt = seg_slots.numel(), a.shape[0], DTYPE_CODES[x.dtype], DTYPE_CODES[a.dtype]
    tables = (ptr(ranks), ptr(starts), ptr(seg_slots))
    lib.shrink(ptr(v), ptr(x), ptr(a), *tables, rows, n_seg, n_slots, n_in, r_max, dt, wdt)
    y_out = y.clone()
    lib.expand(ptr(y_out), ptr(v), ptr(b_t), ptr(ranks), ptr(scale), *tables[1:], rows, n_seg, n_slots, n_out, r_max,
               dt, wdt)  # fmt: skip
    return v, y_out


@pytest.mark.parametrize("bug", PLANTED)
def test_a_planted_bug_fails_the_check(ops, planted, bug):
    levels = range(["scalar", "avx2", "avx512", "avx512_bf16"].index(ops.best_cpu_isa()) + 1)
    cases = [(17, "mixed"), (7, "one adapter"), (12, "segments of 1")]
    try:
        planted.plant(0)  # the copy is right without its bugs
        for seed, (rows, pattern) in enumerate(cases):
            case = make_case(rows, 200, 328, pattern, torch.bfloat16, torch.bfloat16, seed=seed)
            check(*planted_run(planted, case), case, f"{pattern}, no bug planted")
        planted.plant(list(PLANTED).index(bug) + 1)

        def check_case(seed, rows, pattern):
            case = make_case(rows, 200, 328, pattern, torch.bfloat16, torch.bfloat16, seed=seed)
            check(*planted_run(planted, case), case, bug)

        caught_at_every_level(planted, levels, [(check_case, seed, *c) for seed, c in enumerate(cases)], bug)
    finally:
        planted.plant(0)


def caught_at_every_level(planted, levels, calls, bug):
    """With a bug planted: at each ISA level, at least one of calls [(check, *args)] must fail."""
    for level in levels:
        assert planted.set_isa(level) == 0
        caught = []
        for check_call, *args in calls:
            try:
                check_call(*args)
            except AssertionError:
                caught.append(args)
        assert caught, f"{bug}: not caught at ISA level {level}"


def planted_group_run(lib, case):
    x, y, parts, ranks, scale, starts, seg_slots = case
    rows, n_in, r_max = x.shape[0], x.shape[1], parts[0][0].shape[1]
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    array = lambda ts: (ctypes.c_void_p * len(ts))(*[t.data_ptr() for t in ts])  # noqa: E731
    v = torch.full((len(parts), rows, r_max), float("nan"))
    n_outs = (ctypes.c_int * len(parts))(*[b_t.shape[2] for _, b_t in parts])
    y_out = y.clone()
    lib.group(ptr(y_out), ctypes.c_int64(y.shape[1]), ptr(x), array([a for a, _ in parts]),
              array([b for _, b in parts]), n_outs, ptr(v), len(parts), ptr(ranks), ptr(scale), ptr(starts),
              ptr(seg_slots), rows, seg_slots.numel(), parts[0][0].shape[0], n_in, r_max,
              DTYPE_CODES[x.dtype], DTYPE_CODES[parts[0][0].dtype])  # fmt: skip
    return v, y_out


def check_group(v_out, y_out, case, what):
    """Each part's v (zeros past the rank included) and its outputs against the reference."""
    x, y, parts, ranks, scale, starts, seg_slots = case
    col = 0
    for j, (a, b_t) in enumerate(parts):
        part = slice(col, col + b_t.shape[2])
        v = reference.lora_shrink(x, a, ranks, starts, seg_slots)
        assert_close(v_out[j], v, f"{what}: v of part {j}")
        assert_close(y_out[:, part], reference.lora_expand(y[:, part], v, b_t, ranks, scale, starts, seg_slots), what)
        col += b_t.shape[2]


@pytest.mark.parametrize("bug", PLANTED_GROUP)
def test_a_planted_bug_in_the_group_fails_the_check(ops, planted, bug):
    # Slots of rank 7 (a tile that ends past the rank), 16 and 64; 2 threads, so a decode row's group
    # splits its ranks and outputs over threads.
    levels = range(["scalar", "avx2", "avx512", "avx512_bf16"].index(ops.best_cpu_isa()) + 1)
    cases = [(1, [4]), (2, [2, 4]), (9, [3, 3, 3, -1, 4, 4, 2, 2, 2])]
    kept = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        planted.plant(0)
        for seed, (rows, slots) in enumerate(cases):
            case = group_case(rows, "mixed", torch.bfloat16, torch.bfloat16, seed, slots)
            check_group(*planted_group_run(planted, case), case, f"{slots}, no bug planted")
        planted.plant(len(PLANTED) + list(PLANTED_GROUP).index(bug) + 1)

        def check_case(seed, rows, slots):
            case = group_case(rows, "mixed", torch.bfloat16, torch.bfloat16, seed, slots)
            check_group(*planted_group_run(planted, case), case, bug)

        caught_at_every_level(planted, levels, [(check_case, seed, *c) for seed, c in enumerate(cases)], bug)
    finally:
        planted.plant(0)
        torch.set_num_threads(kept)
