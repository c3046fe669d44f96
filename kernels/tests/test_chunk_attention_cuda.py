"""Prompt-chunk attention's CUDA kernel through the operator, on a GPU, against gather + SDPA: the
shapes of the CPU tests (chunks at a block's start, inside one, of one query; block sizes 1/16/32;
GQA 1-16; every head size; contexts up to 4k), and the same rows as the CPU twin to the tolerance of
float32 sums. Without a GPU every case skips (the emulator runs the same kernel on the CPU:
test_emulated_chunk_attention.py)."""

import math

import pytest
import torch
from conftest import assert_close
from test_chunk_attention import CHUNKS, GQA, make_chunks, sdpa


def check(ops, case, what):
    scale = 1 / math.sqrt(case[0].shape[-1])
    out = ops.chunk_attention(*case, scale)
    cpu = [t.cpu() for t in case]
    assert_close(out.cpu(), sdpa(*cpu, scale), what)
    assert_close(out.cpu(), ops.chunk_attention(*cpu, scale), f"{what}: against the CPU twin")


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_chunks_on_cuda(ops, cuda, block_size, chunks, dtype):
    for n_heads, n_kv_heads in GQA:
        case = make_chunks(CHUNKS[chunks], n_heads, n_kv_heads, 64, block_size, dtype, cuda, extra_rows=2)
        check(ops, case, f"{chunks} bs {block_size} gqa {n_heads}/{n_kv_heads}")


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_every_head_size_on_cuda(ops, cuda, head_dim):
    for dtype in (torch.float32, torch.bfloat16):
        case = make_chunks(CHUNKS["mixed"], 8, 2, head_dim, 16, dtype, cuda, seed=head_dim)
        check(ops, case, f"head_dim {head_dim}")


@pytest.mark.parametrize("chunks", [[(0, 2000)], [(3800, 296)], [(1000, 1), (2047, 300), (0, 700)]])
def test_long_contexts_on_cuda(ops, cuda, chunks):
    case = make_chunks(chunks, 8, 2, 128, 16, torch.bfloat16, cuda, seed=len(chunks))
    check(ops, case, str(chunks))
