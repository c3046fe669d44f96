"""The CUDA LoRA kernels (csrc/cuda/lora.cu) through the operators on a GPU, against reference.py:
test_lora.py's cases (every row count from 1 to 70, the four slot patterns, ranks 1 to 64 with NaN
padding, base rows that must stay bit for bit) in float32, bf16 and fp16 activations with float32
and bf16 adapters, and SmolLM2's projection sizes at 16 rows with 16 adapters. Without a GPU every
case skips (the emulator runs the same kernels on the CPU: test_emulated_lora.py)."""

import pytest
import torch
from test_lora import PATTERNS, SHAPES, check, make_case

from kernels import reference

DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16)]


def run_on(ops, case, device):
    x, y, a, b_t, ranks, scale, starts, seg_slots = (t.to(device) for t in case)
    v = ops.lora_shrink(x, a, ranks, starts, seg_slots)
    ops.lora_expand_(y, v, b_t, ranks, scale, starts, seg_slots)
    return v.cpu(), y.cpu()


@pytest.mark.parametrize(("dtype", "w_dtype"), DTYPES, ids=["f32", "bf16", "f16-w_bf16"])
def test_every_row_count_and_pattern_on_cuda(ops, cuda, dtype, w_dtype):
    for n_in, n_out in SHAPES:
        for rows in range(1, 71):
            for pattern in PATTERNS if rows <= 5 or rows in (16, 17, 70) else [PATTERNS[rows % 4]]:
                case = make_case(rows, n_in, n_out, pattern, dtype, w_dtype, seed=rows)
                check(*run_on(ops, case, cuda), case, f"cuda {pattern} {rows} rows {n_in} -> {n_out}")


@pytest.mark.parametrize(("n_out", "n_in"), [(576, 576), (192, 576), (1536, 576), (576, 1536)])
def test_smollm2_projections_with_16_adapters_on_cuda(ops, cuda, n_out, n_in):
    case = make_case(16, n_in, n_out, "segments of 1", torch.bfloat16, torch.bfloat16, ranks=[16] * 16, r_max=16)
    x, y, a, b_t, ranks, scale, starts, seg_slots = case
    check(*run_on(ops, case, cuda), case, f"cuda {n_out} x {n_in}")
    # and the CPU kernel gives the same to bf16 rounding
    v = ops.lora_shrink(x, a, ranks, starts, seg_slots)
    torch.testing.assert_close(v, reference.lora_shrink(x, a, ranks, starts, seg_slots), rtol=2e-5, atol=2e-5)


def test_a_bad_table_reads_nothing_outside_the_weights_on_cuda(ops, cuda):
    # On CUDA the operators do not check slots and ranks (a copy to the host and a wait): the kernels
    # skip a slot outside the table and clamp a rank to r_max; the result is defined, and no read
    # leaves the weights (compute-sanitizer would say otherwise).
    case = make_case(6, 24, 40, "segments of 1", torch.float32, torch.float32, seed=2)
    x, y, a, b_t, ranks, scale, starts, seg_slots = (t.to(cuda) for t in case)
    seg_slots = torch.full_like(seg_slots, 9)
    v = ops.lora_shrink(x, a, ranks, starts, seg_slots)
    y_out = y.clone()
    ops.lora_expand_(y_out, v, b_t, ranks, scale, starts, seg_slots)
    torch.cuda.synchronize()
    assert torch.equal(v, torch.zeros_like(v)) and torch.equal(y_out, y)
