"""Paged decode attention (flash-decoding) against the plain softmax, on CPU paths and CUDA."""

import itertools
import math

import pytest
import torch

from kernels import reference
from conftest import assert_close


def make_case(batch, n_heads, n_kv_heads, head_dim, block_size, context_lens, dtype, device, seed=0, width=None):
    """Random q and pools, and block tables that scatter each sequence over a shuffled pool."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in context_lens]
    max_blocks = width or max(need)
    num_blocks = sum(need) + 3  # spare blocks: tables must not read them
    perm = torch.randperm(num_blocks, generator=g)
    # Padding entries name a spare block full of keys: a kernel reading past a context would use them.
    tables = torch.full((batch, max_blocks), int(perm[-1]), dtype=torch.int32)
    used = 0
    for b, k in enumerate(need):
        tables[b, :k] = perm[used : used + k].to(torch.int32)
        used += k
    q = torch.randn(batch, n_heads, head_dim, generator=g).to(dtype)
    k_pool = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=g).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return [t.to(device) for t in (q, k_pool, v_pool, tables, lens)]


def test_flash_decoding_reference_equals_plain_softmax():
    # The algorithm itself, before any kernel: partitions + online softmax + merge == softmax.
    for partition in (4, 8, 32):
        case = make_case(2, 6, 2, 16, 4, [1, 29], torch.float32, "cpu")
        scale = 1 / math.sqrt(16)
        plain = reference.paged_decode_attention(*case, scale)
        flash = reference.flash_decoding(*case, scale, partition)
        assert_close(flash, plain, f"partition {partition}")


SHAPES = [  # n_heads, n_kv_heads (GQA ratio 1, 3, 4, 8), head_dim (every size the kernels serve)
    (8, 2, 32),
    (4, 4, 64),
    (9, 3, 64),
    (6, 2, 96),
    (8, 2, 128),
    (32, 4, 64),
    (4, 1, 256),
]
LENGTHS = [  # per sequence: one token, a block exactly, one past, partitions that do not divide
    [1],
    [16],
    [17],
    [1, 300, 64, 513],
    [1000],
]


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("lens", LENGTHS, ids=lambda l: "lens" + "-".join(map(str, l)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_kernel_equals_reference(ops, device, n_heads, n_kv_heads, head_dim, lens, dtype):
    case = make_case(len(lens), n_heads, n_kv_heads, head_dim, 16, lens, dtype, device)
    scale = 1 / math.sqrt(head_dim)
    expected = reference.paged_decode_attention(*case, scale)
    for partition in (16, 64, 256):
        assert_close(ops.paged_decode_attention(*case, scale, partition), expected, f"partition {partition}")


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_every_cpu_path_and_block_size(ops, isa, block_size):
    lens = [1, block_size, 3 * block_size + 5, 97]
    # GQA groups of 3 and 5: the value sums take a group's heads 2 (AVX2) or 4 (AVX512) at a time,
    # so both end on a pass of fewer heads; and of 18, more heads than a vector has lanes (the
    # softmax's rescale takes a group's heads 8 or 16 at a time). Blocks of 1 and 8 keys fill part
    # of a vector of scores, blocks of 32 two (AVX512) or four (AVX2).
    groups = [(12, 4), (10, 2), (18, 1)]
    for (n_heads, n_kv_heads), dtype in itertools.product(groups, (torch.float32, torch.bfloat16)):
        case = make_case(len(lens), n_heads, n_kv_heads, 64, block_size, lens, dtype, "cpu", seed=block_size)
        expected = reference.paged_decode_attention(*case, 0.125)
        for partition in (block_size * 2, 128):
            what = f"{isa} bs {block_size}, {n_heads} / {n_kv_heads} heads"
            assert_close(ops.paged_decode_attention(*case, 0.125, partition), expected, what)


def test_full_tables_and_wide_tables(ops, device):
    # Every slot of the table used; and a table wider than any context (CUDA graphs pad tables to
    # a fixed width): the extra entries are never read.
    for width in (None, 40):
        case = make_case(3, 8, 2, 64, 16, [64, 48, 5], torch.float32, device, width=width)
        assert_close(ops.paged_decode_attention(*case, 0.125, 32), reference.paged_decode_attention(*case, 0.125))


def test_queries_may_be_a_strided_view(ops, device):
    # The engine passes q as a slice of the qkv projection: [tokens, nh + 2 nkv, hd][:, :nh].
    q, k_pool, v_pool, tables, lens = make_case(2, 8, 2, 64, 16, [20, 7], torch.float32, device)
    qkv = torch.randn(2, 12, 64, device=device)
    qkv[:, :8] = q
    out = ops.paged_decode_attention(qkv[:, :8], k_pool, v_pool, tables, lens, 0.125)
    assert_close(out, reference.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.125))


def test_bad_arguments_are_clear_errors(ops):
    q, k_pool, v_pool, tables, lens = make_case(1, 4, 2, 64, 16, [20], torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="block_tables: contiguous int32"):
        ops.paged_decode_attention(q, k_pool, v_pool, tables.long(), lens, 0.125)
    with pytest.raises(RuntimeError, match=r"context_lens\[0\] = 33 is outside 1..32"):
        ops.paged_decode_attention(q, k_pool, v_pool, tables, torch.tensor([33], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="multiple of block_size"):
        ops.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.125, 24)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.paged_decode_attention(q.bfloat16(), k_pool, v_pool, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="not a multiple of n_kv_heads"):
        ops.paged_decode_attention(q[:, :3], k_pool, v_pool, tables, lens, 0.125)


@pytest.mark.parametrize("head_dim", [16, 48, 80, 192])
def test_a_head_size_the_kernels_are_not_built_for_is_refused_naming_the_sizes(ops, device, head_dim):
    # The same contract on CPU and CUDA: the CUDA kernel is instantiated for these sizes only.
    assert list(ops.head_dims()) == [32, 64, 96, 128, 256]
    case = make_case(1, 4, 2, head_dim, 16, [20], torch.float32, device)
    with pytest.raises(
        RuntimeError, match=rf"head_dim {head_dim} is not one the kernels are built for \(32, 64, 96, 128, 256:"
    ):
        ops.paged_decode_attention(*case, 0.125)
