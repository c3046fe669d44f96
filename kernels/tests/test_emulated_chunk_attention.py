"""Prompt-chunk attention's CUDA kernel (csrc/cuda/chunk_attention.cu), run on the CPU by the
emulator (kernels/emulator.py), against gather + SDPA: row tiles that end inside a block's 16
rows, key tiles that end inside a tile (32 keys, 16 for heads of 256), chunks after cached keys
that start at a block's start and inside one, chunks of one query, GQA groups 1 to 16, every head
size, three dtypes; and planted bugs, each of which the same check catches."""

import math

import pytest
import torch
from conftest import assert_close
from test_chunk_attention import CHUNKS, make_chunks, sdpa

from kernels import emulator

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def check(emu, case, what):
    scale = 1 / math.sqrt(case[0].shape[-1])
    out = emu.chunk_attention(*case, scale)
    rows = torch.cat([torch.arange(int(s), int(s) + int(n)) for s, n in zip(case[4], case[5])])
    assert_close(out[rows], sdpa(*case, scale)[rows], what)  # rows no chunk names are the caller's (NaN here)


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_chunks_and_block_sizes(emu, chunks, block_size):
    for n_heads, n_kv_heads in ((4, 4), (9, 3), (16, 1)):  # groups 1, 3, 16: 16 rows a block are 16, 5.3, 1 queries
        case = make_chunks(CHUNKS[chunks], n_heads, n_kv_heads, 64, block_size, torch.float32, extra_rows=1)
        check(emu, case, f"{chunks} bs {block_size} gqa {n_heads}/{n_kv_heads}")


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
def test_every_head_size_and_dtype(emu, head_dim, dtype):
    for n_heads, n_kv_heads in ((8, 2), (10, 2), (14, 2)):  # groups 4, 5, 7
        case = make_chunks([(0, 19), (21, 27), (3, 1)], n_heads, n_kv_heads, head_dim, 16, dtype, seed=head_dim)
        check(emu, case, f"head_dim {head_dim} gqa {n_heads}/{n_kv_heads}")


def test_a_long_chunk_after_a_long_context(emu):
    case = make_chunks([(900, 70)], 4, 2, 64, 16, torch.bfloat16)
    check(emu, case, "900 cached + 70")


CHUNK = "chunk_attention.cu"
PLANTED = {
    # the barrier after staging a tile: warps read K/V rows others have not written yet
    "missing __syncthreads after the tile is staged": (
        CHUNK,
        "        __syncthreads();  // the tile is staged\n",
        "",
    ),
    # a query attends to the key after its own
    "the causal bound one key too far": (
        CHUNK,
        "const int own = min(n, pos[rr] - k0 + 1);",
        "const int own = min(n, pos[rr] - k0 + 2);",
    ),
    # the accumulator kept at its old scale when a tile raises the max
    "the accumulator not rescaled": (CHUNK, "for (int i = 0; i < E; ++i) acc[rr][i] *= alpha;", ""),
    # a key read through its tile's first block-table entry instead of its own
    "a wrong block-table index": (CHUNK, "table[key / p.block_size]", "table[k0 / p.block_size]"),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_a_planted_bug_fails_the_check(bug):
    broken = emulator.load(plant=[PLANTED[bug]])
    case = make_chunks([(0, 40), (21, 27), (70, 1)], 8, 2, 64, 16, torch.float32, seed=3)
    with pytest.raises(AssertionError):
        check(broken, case, bug)
