"""Prompt-chunk attention (causal, over the paged cache) against gather + SDPA, on every CPU path:
chunks that start at a block's start, inside a block, of one query, at position 0; block sizes 1,
16, 32; GQA groups 1 to 16; every head size; contexts up to 4k. A row's result is the same bits
whatever chunks its prompt was cut into. And bugs planted in a torch-free copy of the source,
each of which the same check must catch."""

import ctypes
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close, build_planted, each_form
from kernels import reference


def make_chunks(chunks, n_heads, n_kv_heads, head_dim, block_size, dtype, device="cpu", seed=0, extra_rows=0):
    """chunks: (start, new) per sequence: `new` queries at positions start .. start + new - 1.
    Random q (the sequences' rows end to end, after `extra_rows` rows no chunk names, as a decode
    row of a mixed step) and pools; block tables scatter each sequence over a shuffled pool, padded
    with a spare block full of keys (a kernel reading past a context would use it).
    -> (q, k_pool, v_pool, block_tables, query_start, query_lens, context_lens)"""
    g = torch.Generator().manual_seed(seed)
    lens = [start + new for start, new in chunks]
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(chunks), max(need)), int(perm[-1]), dtype=torch.int32)
    used = 0
    for b, k in enumerate(need):
        tables[b, :k] = perm[used : used + k].to(torch.int32)
        used += k
    starts, row = [], extra_rows
    for _, new in chunks:
        starts.append(row)
        row += new
    q = torch.randn(row, n_heads, head_dim, generator=g).to(dtype)
    k_pool = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=g).to(dtype)
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    case = (q, k_pool, v_pool, tables, as_int(starts), as_int([n for _, n in chunks]), as_int(lens))
    return [t.to(device) for t in case]


def sdpa(q, k_pool, v_pool, block_tables, query_start, query_lens, context_lens, scale):
    """What chapter 05 computes: gather each sequence's keys, then SDPA with a causal mask, float32."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b in range(block_tables.shape[0]):
        n, new, first = int(context_lens[b]), int(query_lens[b]), int(query_start[b])
        keys = k_pool[block_tables[b].long()].flatten(0, 1)[:n].transpose(0, 1).float()  # [n_kv_heads, n, D]
        values = v_pool[block_tables[b].long()].flatten(0, 1)[:n].transpose(0, 1).float()
        queries = q[first : first + new].transpose(0, 1).float()  # [n_heads, new, D]
        mask = torch.arange(n)[None, :] <= torch.arange(n - new, n)[:, None]
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[first : first + new] = o.transpose(0, 1)
    return out.to(q.dtype)


def check(ops, isa, case, what):
    """The kernel against SDPA; bf16 at AVX512-BF16 in both forms of the scores (bf16 pairs, floats)."""
    scale = 1 / math.sqrt(case[0].shape[-1])
    expected = sdpa(*case, scale)
    for form in each_form(ops, isa) if case[0].dtype == torch.bfloat16 else ["floats"]:
        assert_close(ops.chunk_attention(*case, scale), expected, f"{what} ({form})")


def test_the_reference_equals_sdpa():
    case = make_chunks([(0, 20), (13, 9), (16, 1), (40, 33)], 8, 2, 32, 16, torch.float32)
    assert_close(reference.chunk_attention(*case, 0.2), sdpa(*case, 0.2))


BLOCK_START, MID_BLOCK = (32, 40), (21, 27)  # chunks of a sequence whose earlier keys are cached
CHUNKS = {  # (start, new) per sequence: where a chunk starts relative to the blocks, and how long it is
    "prompt": [(0, 45)],
    "block-start": [BLOCK_START],
    "mid-block": [MID_BLOCK],
    "one-query": [(37, 1)],
    "mixed": [(0, 3), MID_BLOCK, (5, 1), BLOCK_START, (64, 17)],
}
GQA = [(4, 4), (6, 3), (9, 3), (8, 2), (10, 2), (14, 2), (16, 2), (16, 1)]  # groups 1, 2, 3, 4, 5, 7, 8, 16


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_chunks_on_every_cpu_path(ops, isa, block_size, chunks, dtype):
    for n_heads, n_kv_heads in GQA[:: 3 if chunks != "mixed" else 1]:
        case = make_chunks(CHUNKS[chunks], n_heads, n_kv_heads, 64, block_size, dtype, seed=block_size, extra_rows=2)
        check(ops, isa, case, f"{isa} {chunks} bs {block_size} gqa {n_heads}/{n_kv_heads}")


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_every_head_size_and_dtype(ops, isa, head_dim, dtype):
    case = make_chunks(CHUNKS["mixed"], 8, 2, head_dim, 16, dtype, seed=head_dim)
    check(ops, isa, case, f"{isa} head_dim {head_dim}")


@pytest.mark.parametrize(
    "chunks",
    [[(0, 2000)], [(3800, 296)], [(1000, 1), (2047, 300), (0, 700)]],
    ids=["prompt-2000", "chunk-after-3800", "three"],
)
def test_long_contexts(ops, isa, chunks):
    if isa == "scalar" and chunks[0][1] == 2000:
        pytest.skip("2000 x 2000 on the portable path: long; the other cases cover its code")
    for dtype in (torch.float32, torch.bfloat16):
        case = make_chunks(chunks, 4, 1, 64, 16, dtype, seed=len(chunks))
        check(ops, isa, case, f"{isa} {chunks}")


def test_a_row_is_the_same_bits_whatever_chunks_its_prompt_was_cut_into(ops, isa):
    # What --batch-invariant would need of it: each query row sums over fixed key tiles from 0, in
    # the same order, whichever chunk (and query tile within it) it sits in.
    n = 150
    for dtype in (torch.float32, torch.bfloat16):
        whole = make_chunks([(0, n)], 9, 3, 64, 16, dtype, seed=5)
        q, k_pool, v_pool, tables = whole[:4]
        for form in each_form(ops, isa) if dtype == torch.bfloat16 else ["floats"]:
            expected = ops.chunk_attention(*whole, 0.125)
            for cuts in ([1, 149], [17, 16, 100, 17], [33] * 4 + [18], [1] * 5 + [145]):
                rows, start = [], 0
                for new in cuts:
                    one = [torch.tensor([x], dtype=torch.int32) for x in (start, new, start + new)]
                    rows.append(ops.chunk_attention(q, k_pool, v_pool, tables, *one, 0.125)[start : start + new])
                    start += new
                assert torch.equal(torch.cat(rows), expected), (dtype, form, cuts)


def test_rows_no_chunk_names_are_zero_and_q_may_be_a_strided_view(ops):
    # The engine passes q as a slice of the qkv projection: [tokens, nh + 2 nkv, hd][:, :nh].
    case = make_chunks([(5, 7), (0, 4)], 8, 2, 64, 16, torch.float32, extra_rows=3)
    q = case[0]
    qkv = torch.randn(q.shape[0], 12, 64)
    qkv[:, :8] = q
    out = ops.chunk_attention(qkv[:, :8], *case[1:], 0.125)
    assert torch.equal(out[:3], torch.zeros(3, 8, 64))
    assert_close(out, sdpa(*case, 0.125))


def test_bad_arguments_are_clear_errors(ops):
    q, k_pool, v_pool, tables, starts, lens, ctx = make_chunks([(5, 7)], 4, 2, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="block_tables: contiguous int32"):
        ops.chunk_attention(q, k_pool, v_pool, tables.long(), starts, lens, ctx, 0.125)
    with pytest.raises(RuntimeError, match="query_lens 7 and context_lens 6 must satisfy"):
        ops.chunk_attention(q, k_pool, v_pool, tables, starts, lens, ctx - 6, 0.125)
    with pytest.raises(RuntimeError, match="outside q's 7 tokens"):
        ops.chunk_attention(q, k_pool, v_pool, tables, starts + 1, lens, ctx, 0.125)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.chunk_attention(q.bfloat16(), k_pool, v_pool, tables, starts, lens, ctx, 0.125)
    with pytest.raises(RuntimeError, match="not a multiple of n_kv_heads"):
        ops.chunk_attention(q[:, :3], k_pool, v_pool, tables, starts, lens, ctx, 0.125)
    with pytest.raises(RuntimeError, match=r"is outside the pool's 0\.\."):
        ops.chunk_attention(q, k_pool, v_pool, tables + 100, starts, lens, ctx, 0.125)
    bad = make_chunks([(5, 7)], 4, 2, 48, 16, torch.float32)
    with pytest.raises(RuntimeError, match="head_dim 48 is not one the kernels are built for"):
        ops.chunk_attention(*bad, 0.125)


# --- planted bugs: the CPU half compiled on its own (it is torch-free), with bugs put into a copy ---

SHIM = """
#include "cpu_kernels.h"
using namespace kernels;
extern "C" {
int planted_bug = 0;
int set_isa(int level) { try { cpu::set_isa(cpu::Isa(level)); return 0; } catch (...) { return 1; } }
void chunk(void* out, const void* q, const void* k, const void* v, const int32_t* tables, const int32_t* starts,
           const int32_t* lens, const int32_t* ctx, int batch, int n_heads, int n_kv_heads, int head_dim,
           int block_size, int max_blocks, float scale, int bf16, int bug) {
    planted_bug = bug;
    cpu::set_gemm_bf16_pairs(bf16);  // bf16 at AVX512-BF16: the scores in bf16 pairs
    cpu::chunk_attention(out, q, int64_t(n_heads) * head_dim, k, v, tables, starts, lens, ctx, 0, batch, n_heads,
                         n_kv_heads, head_dim, block_size, max_blocks, scale, bf16 ? DType::bf16 : DType::f32);
}
}
"""
# Each bug is an expression of the copy switched on by planted_bug == its number, so one build
# holds them all.
PLANTED = {
    "the causal bound lets a query read the key after it": (
        "return std::min(n, pos0 + first + r / group - k0 + 1); };",
        "return std::min(n, pos0 + first + r / group - k0 + 1 + (planted_bug == 1)); };",
    ),
    "the accumulator is not rescaled when the max rises": (
        "    return alpha;\n}",
        "    return planted_bug == 2 ? 1.f : alpha;\n}",
    ),
    "a key is read through the block-table entry of its 64-key span's first block": (
        "int64_t(table[pos / bs])",
        "int64_t(table[(planted_bug == 3 ? pos - pos % 64 : pos) / bs])",
    ),
    "the chunk's queries are placed one position early": (
        "const int pos0 = a.context_lens[b] - n_q;",
        "const int pos0 = a.context_lens[b] - n_q - (planted_bug == 4 && a.context_lens[b] > n_q);",
    ),
    "the scores in bf16 pairs are not scaled": (
        "_mm512_mul_ps(acc[r][v], sv)",
        "(planted_bug == 5 ? acc[r][v] : _mm512_mul_ps(acc[r][v], sv))",
    ),
}
PAIRS_ONLY = {"the scores in bf16 pairs are not scaled"}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return build_planted(
        tmp_path_factory.mktemp("planted_chunk"), "chunk_attention.cpp", PLANTED.values(), SHIM, ("isa.cpp",),
        'extern "C" int planted_bug;\n',
    )


def planted_call(lib, case, bug):
    q, k_pool, v_pool, tables, starts, lens, ctx = case
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    n_heads, head_dim = q.shape[1:]
    lib.chunk(
        *[ptr(t) for t in (out, q, k_pool, v_pool, tables, starts, lens, ctx)],
        tables.shape[0], n_heads, k_pool.shape[2], head_dim, k_pool.shape[1], tables.shape[1],
        ctypes.c_float(1 / math.sqrt(head_dim)), int(q.dtype == torch.bfloat16), bug,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_bug_fails_the_check(ops, planted, bug):
    number = list(PLANTED).index(bug) + 1
    level = ["scalar", "avx2", "avx512", "avx512_bf16"].index(ops.best_cpu_isa())
    # float32 on every level up to AVX512 (AVX512-BF16 runs its code for float32), and bf16 in
    # pairs where the CPU has them
    configs = [(isa, torch.float32) for isa in range(0, min(level, 2) + 1)]
    configs += [(3, torch.bfloat16)] if level == 3 else []
    expected_caught = [c for c in configs if bug not in PAIRS_ONLY or c[1] == torch.bfloat16]
    if not expected_caught:
        pytest.skip("a bug of the bf16 pairs' scores: this CPU (or ATEN_CPU_CAPABILITY) has no AVX512-BF16")
    caught = []
    for isa, dtype in configs:
        case = make_chunks([(0, 40), MID_BLOCK, (70, 1)], 8, 2, 64, 16, dtype, seed=3)
        expected = sdpa(*case, 1 / 8)
        assert planted.set_isa(isa) == 0
        assert_close(planted_call(planted, case, 0), expected, f"the copy without the bug, ISA level {isa}")
        try:
            assert_close(planted_call(planted, case, number), expected, bug)
        except AssertionError:
            caught.append((isa, dtype))
    assert caught == expected_caught, f"{bug}: caught in {caught} only"
