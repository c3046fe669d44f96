"""The CUDA LoRA kernels (csrc/cuda/lora.cu: lora_shrink, lora_expand) run on the CPU by the
emulator (kernels/emulator.py) against reference.py, with test_lora.py's cases: row counts that
leave a tail of the expand's 4-row tiles, 264 inputs (a split-K pass of 256 threads and 8 more) and
72 outputs (a block of 64 and 8 more), ranks 1 to 64 (one to four rank tiles of 16), every slot
pattern, in float32, bf16 and fp16 activations with bf16 and float32 adapters. The padding past
each rank is NaN and the base rows start as -0.0, so a read of the padding or a write to a base row
fails. Then bugs planted in a copy of lora.cu, each of which the same check must catch, and one run
under the address and undefined-behaviour sanitizers."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_lora import PATTERNS, check, make_case

from kernels import emulator

ROWS = [1, 2, 3, 4, 5, 7, 16, 17, 33, 70]
N_IN, N_OUT = 264, 72
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16)]
DTYPE_IDS = ["f32-w_f32", "bf16-w_bf16", "f16-w_bf16"]


def run(emu, case):
    x, y, a, b_t, ranks, scale, starts, seg_slots = case
    v = emu.lora_shrink(x, a, ranks, starts, seg_slots)
    y_out = y.clone()
    emu.lora_expand_(y_out, v, b_t, ranks, scale, starts, seg_slots)
    return v, y_out


@pytest.mark.parametrize(("dtype", "w_dtype"), DTYPES, ids=DTYPE_IDS)
def test_every_tile_tail_and_pattern(emu, dtype, w_dtype):
    for rows in ROWS:
        for pattern in PATTERNS if rows in (1, 5, 17) else [PATTERNS[rows % 4]]:
            case = make_case(rows, N_IN, N_OUT, pattern, dtype, w_dtype, seed=rows)
            check(*run(emu, case), case, f"emulated {pattern} {rows} rows {N_IN} -> {N_OUT}")


def test_strided_rows_and_empty_segments(emu):
    x, y, a, b_t, ranks, scale, _, _ = make_case(9, N_IN, N_OUT, "mixed", torch.bfloat16, torch.bfloat16, seed=3)
    starts = torch.tensor([0, 0, 4, 4, 5, 9, 9], dtype=torch.int32)
    seg_slots = torch.tensor([2, 1, 0, -1, 3, 4], dtype=torch.int32)
    y[5:9] = -0.0
    wide_x = torch.randn(9, 300).bfloat16()
    wide_x[:, 8:272] = x
    wide_y = torch.randn(9, 100).bfloat16()
    wide_y[:, 16:88] = y
    v = emu.lora_shrink(wide_x[:, 8:272], a, ranks, starts, seg_slots)
    emu.lora_expand_(wide_y[:, 16:88], v, b_t, ranks, scale, starts, seg_slots)
    check(v, wide_y[:, 16:88], (x, y, a, b_t, ranks, scale, starts, seg_slots), "emulated strided")


def test_a_bad_table_reads_nothing_outside_the_weights(emu):
    # The CUDA operators cannot check slots and ranks without a wait (ops.cpp): the kernels count a
    # slot outside the table as the base model's and clamp a rank to r_max instead.
    x, y, a, b_t, ranks, scale, starts, seg_slots = make_case(6, N_IN, N_OUT, "segments of 1", torch.float32,
                                                               torch.float32, seed=2)  # fmt: skip
    seg_slots = torch.full_like(seg_slots, 9)  # 5 slots
    v = emu.lora_shrink(x, a, ranks, starts, seg_slots)
    assert torch.equal(v, torch.zeros_like(v))
    y_out = y.clone()
    emu.lora_expand_(y_out, v, b_t, ranks, scale, starts, seg_slots)
    assert torch.equal(y_out, y)


# --- planted bugs: each fails the check above ------------------------------------------------------------
PLANTED = {
    # threads read the staged v before the other threads have written it (NaN shared memory)
    "missing __syncthreads after staging v": ("    __syncthreads();  // v is staged\n", ""),
    # the split-K sum leaves out warp 0's partial sums
    "a warp's partial sums dropped": (
        "for (int w = 0; w < kWarps; ++w) s += partial[w][threadIdx.x];",
        "for (int w = 1; w < kWarps; ++w) s += partial[w][threadIdx.x];",
    ),
    # the first row of each segment takes the previous segment's slot
    "the wrong slot (segment search off by one)": (
        "if (starts[mid] <= row) lo = mid;",
        "if (starts[mid] < row) lo = mid;",
    ),
    # the last, partial block of outputs is never launched
    "the tail of the outputs skipped": (
        "const dim3 grid((n_out + kExpandOut - 1) / kExpandOut,",
        "const dim3 grid(n_out / kExpandOut,",
    ),
    # the expand sums over all r_max rows of b_t, past the adapter's rank, into the padding (the
    # shrink's reads of it are harmless by design: it stores only the sums of ranks < nk)
    "the rank padding read": (
        "for (int k = 0; k < rank; ++k) acc = fmaf(",
        "for (int k = 0; k < r_max; ++k) acc = fmaf(",
    ),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_a_planted_bug_fails_the_lora_check(emu, bug):
    broken = emulator.load(plant=[("lora.cu", *PLANTED[bug])])
    cases = [make_case(17, N_IN, N_OUT, "mixed", torch.float32, torch.float32, seed=7)]
    cases.append(make_case(6, N_IN, N_OUT, "segments of 1", torch.float32, torch.float32, seed=8))
    for case in cases:
        check(*run(emu, case), case, "the unbroken kernel")
    caught = []
    for case in cases:
        try:
            check(*run(broken, case), case, bug)
        except AssertionError:
            caught.append(case)
    assert caught, f"{bug}: not caught"


SANITIZED = textwrap.dedent(
    """
    import sys, torch
    sys.path[:0] = [{tests!r}]
    from kernels import emulator
    from test_lora import check, make_case
    emu = emulator.load(sanitize=True)
    for rows, pattern, dtype in ((17, "mixed", torch.bfloat16), (5, "segments of 1", torch.float32)):
        case = make_case(rows, 264, 72, pattern, dtype, dtype, seed=rows)
        x, y, a, b_t, ranks, scale, starts, slots = case
        v = emu.lora_shrink(x, a, ranks, starts, slots)
        y_out = y.clone()
        emu.lora_expand_(y_out, v, b_t, ranks, scale, starts, slots)
        check(v, y_out, case, "sanitized")
    print("sanitized run: clean")
    """
)


def test_the_lora_kernels_are_clean_under_the_sanitizers():
    # Every tensor is its own heap allocation: a read or write past a table, a row of x or y, v or
    # the weights would be a heap-buffer-overflow here.
    code = SANITIZED.format(tests=str(Path(__file__).parent))
    r = subprocess.run(
        [sys.executable, "-c", code], env=emulator.sanitizer_env(), capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0 and "sanitized run: clean" in r.stdout, r.stderr[-3000:]
