"""Every CUDA kernel of csrc/cuda/, run on the CPU by the emulator (kernels/emulator.py), against
reference.py: the launch layout, the indexing, the barriers and the shuffles execute here, on a
machine without a GPU, on the shape set the CPU twins are tested with."""

import math

import pytest
import torch
from conftest import assert_close
from test_paged_attention import make_case
from test_quant_linear import assert_int8_close, int4_weight

from kernels import emulator, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]


# --- paged decode attention ------------------------------------------------------------------------

SHAPES = [  # n_heads, n_kv_heads: GQA groups of 1, 3, 4, 8 and 16 (two blocks of 8 heads); every head_dim
    (4, 4, 64),
    (9, 3, 96),
    (8, 2, 32),
    (16, 2, 128),
    (32, 2, 64),
    (4, 1, 256),
]
LENGTHS = [[1], [17], [1, 300, 64, 513], [1000]]  # one token, odd lengths, partitions that do not divide


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("lens", LENGTHS, ids=lambda l: "lens" + "-".join(map(str, l)))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paged_attention(emu, n_heads, n_kv_heads, head_dim, lens, dtype):
    case = make_case(len(lens), n_heads, n_kv_heads, head_dim, 16, lens, dtype, "cpu")
    scale = 1 / math.sqrt(head_dim)
    expected = reference.paged_decode_attention(*case, scale)
    for partition in (16, 256):
        assert_close(emu.paged_decode_attention(*case, scale, partition), expected, f"partition {partition}")


@pytest.mark.parametrize("block_size", [1, 2, 8, 32])
def test_paged_attention_block_sizes(emu, block_size):
    lens = [1, block_size, 3 * block_size + 5, 97]
    for dtype in (torch.float32, torch.bfloat16):
        case = make_case(len(lens), 12, 4, 64, block_size, lens, dtype, "cpu", seed=block_size)
        expected = reference.paged_decode_attention(*case, 0.125)
        for partition in (block_size * 2, 128):
            assert_close(emu.paged_decode_attention(*case, 0.125, partition), expected, f"bs {block_size}")


def test_paged_attention_the_largest_partition_beside_the_largest_merge(emu):
    # Blocks of 4096 keys (the most ops.py lets through) are partitions of 4096 pool rows, 16 KB,
    # beside the merge of 8 heads of 256 values, 33 KB: past the 48 KB a block gets without opting in.
    case = make_case(2, 8, 1, 256, 4096, [5, 4100], torch.bfloat16, "cpu")
    expected = reference.paged_decode_attention(*case, 1 / 16)
    assert_close(emu.paged_decode_attention(*case, 1 / 16, 4096), expected)


def test_paged_attention_wide_tables(emu):
    # A table far wider than every context (as CUDA graphs pad them): most partitions are empty.
    case = make_case(3, 8, 2, 64, 16, [5, 40, 200], torch.bfloat16, "cpu", width=64)
    expected = reference.paged_decode_attention(*case, 0.125)
    assert_close(emu.paged_decode_attention(*case, 0.125, 64), expected)


def test_splits_past_a_sequence_write_nothing(emu):
    # Tables 1024 keys wide, partitions of 64: 16 partitions, and (132 SMs, 6 KV-head blocks) 16
    # splits. Sequences of 5 and 40 keys have one partition: kernel 1 writes their output and no
    # workspace entry; the 200-key one has 4, written by splits 0-3. The rest keeps its sentinel.
    emu.set_sm_count(132)
    q, k, v, tables, lens = make_case(3, 8, 2, 64, 16, [5, 40, 200], torch.float32, "cpu", width=64)
    n_splits, head_dim = 16, 64
    workspace = torch.full((3 * 8 * 16 * (head_dim + 2),), 1234.5)
    out = emu.paged_decode_attention(q, k, v, tables, lens, 0.125, 64, workspace=workspace)
    assert_close(out, reference.paged_decode_attention(q, k, v, tables, lens, 0.125))
    part_out = workspace[: 3 * 8 * n_splits * head_dim].view(3, 8, n_splits, head_dim)
    part_max = workspace[3 * 8 * n_splits * head_dim :][: 3 * 8 * n_splits].view(3, 8, n_splits)
    written = part_max != 1234.5
    assert not written[:2].any() and not (part_out[:2] != 1234.5).any()  # one partition: no entry at all
    assert written[2, :, :4].all() and not written[2, :, 4:].any()
    assert not (part_out[2, :, 4:] != 1234.5).any()


@pytest.mark.parametrize("sms", [1, 3, 132])
def test_the_grid_is_bounded_and_blocks_loop_over_partitions(emu, sms):
    # The grid: splits x KV-head blocks x sequences, the splits from the SM count (4 blocks per SM),
    # at most one per partition; then the merge, one block per (head, sequence).
    emu.set_sm_count(sms)
    lens = [700, 1, 1000]
    case = make_case(3, 8, 2, 64, 16, lens, torch.bfloat16, "cpu", width=64)  # 1024 keys: 16 partitions of 64
    before = emu.blocks_run
    out = emu.paged_decode_attention(*case, 0.125, 64)
    n_splits = min(16, max(1, -(-4 * sms // (3 * 2))))
    assert emu.blocks_run - before == n_splits * 2 * 3 + 8 * 3
    assert_close(out, reference.paged_decode_attention(*case, 0.125))
    emu.set_sm_count(132)


def launched_blocks(emu, batch, sms=132):
    """Blocks one decode-attention call launches for a Llama-3.2-1B layer (32 query heads, 8 KV
    heads, head_dim 64) whose block table is as wide as its longest context, 131,072 keys (blocks
    of 16, partitions of 256): what CUDA graphs capture."""
    emu.set_sm_count(sms)
    q = torch.randn(batch, 32, 64, dtype=torch.bfloat16)
    k = torch.randn(batch + 1, 16, 8, 64, dtype=torch.bfloat16)
    tables = torch.zeros(batch, 131072 // 16, dtype=torch.int32)
    tables[:, 0] = torch.arange(batch, dtype=torch.int32)
    lens = torch.full((batch,), 9, dtype=torch.int32)
    before = emu.blocks_run
    emu.paged_decode_attention(q, k, k, tables, lens, 0.125, 256)
    emu.set_sm_count(132)
    return emu.blocks_run - before


def test_llama_3_2_1b_blocks_per_layer(emu):
    # Before the bounded grid: one block per (partition, KV head, sequence), 512 x 8 x batch, and
    # the merge's 32 x batch. Now: 4 x 132 SMs' worth, and the merge.
    assert launched_blocks(emu, 1) == 66 * 8 + 32  # was 4,128
    assert launched_blocks(emu, 32) == 3 * 8 * 32 + 32 * 32  # was 132,096


def test_paged_attention_refuses_what_it_cannot_run(emu):
    case = make_case(1, 4, 2, 80, 16, [20], torch.float32, "cpu")  # head_dim 80: not instantiated
    with pytest.raises(emulator.EmulatorError, match="cudaError 1"):
        emu.paged_decode_attention(*case, 0.1, 64)


# --- RMSNorm and RoPE ---------------------------------------------------------------------------


@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 64), (17, 100), (5, 2048), (2, 16384)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_add_rms_norm(emu, rows, hidden, dtype):
    g = torch.Generator().manual_seed(rows * hidden)
    for with_delta in (True, False):
        x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
        delta = torch.randn(rows, hidden, generator=g).to(dtype) if with_delta else None
        weight = torch.randn(hidden, generator=g).to(dtype)
        new_x, expected = reference.add_rms_norm(x.clone(), delta, weight, 1e-5)
        assert_close(emu.add_rms_norm(x, delta, weight, 1e-5), expected, "normalised")
        assert_close(x, new_x, "residual stream, updated in place")


def test_add_rms_norm_unaligned(emu):
    # Rows that start off a 16-byte boundary take the one-element path.
    buf = torch.randn(3 * 64 + 1)
    x = buf[1:].view(3, 64)
    weight = torch.rand(64)
    new_x, expected = reference.add_rms_norm(x.clone(), None, weight, 1e-6)
    assert_close(emu.add_rms_norm(x, None, weight, 1e-6), expected)


@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 12, 64), (7, 5, 128), (3, 2, 6), (300, 3, 32)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rope_on_a_strided_view(emu, tokens, heads, head_dim, dtype):
    qkv = torch.randn(tokens, heads + 3, head_dim).to(dtype)
    before = qkv.clone()
    positions = torch.randint(0, 5000, (tokens,)).float()
    angles = positions[:, None] / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = angles.cos(), angles.sin()
    emu.rope_(qkv[:, :heads], cos, sin)
    assert_close(qkv[:, :heads], reference.rope(before[:, :heads], cos, sin))
    assert torch.equal(qkv[:, heads:], before[:, heads:])  # the v heads beside them: untouched


@pytest.mark.parametrize("tokens,n_heads,n_kv_heads,head_dim", [(1, 9, 3, 64), (5, 4, 4, 6), (40, 6, 2, 128)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rope_cache(emu, tokens, n_heads, n_kv_heads, head_dim, dtype):
    from test_norm_rope import rope_cache_case

    case = rope_cache_case(tokens, n_heads, n_kv_heads, head_dim, dtype, "cpu", num_blocks=12, seed=tokens)
    qkv, k_pool, v_pool = reference.rope_cache(*case)
    emu.rope_cache_(*case)
    assert_close(case[0][:, :n_heads], qkv[:, :n_heads])
    assert torch.equal(case[0][:, n_heads:], qkv[:, n_heads:])  # k and v heads of qkv: as they were
    assert_close(case[3], k_pool)
    assert torch.equal(case[4], v_pool)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (3, 8), (4, 100)])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_mul(emu, rows, inter, dtype):
    from test_norm_rope import gate_up

    x = gate_up(rows, inter, dtype, seed=rows)
    assert_close(emu.silu_mul(x), reference.silu_mul(x))


# --- quantized linear layers ------------------------------------------------------------------------
# Rows 1..16 in one launch, 17 in two; n_in 2048 at 8 rows is two tiles of x under 48 KB of shared
# memory, at 16 rows one tile over it (cudaFuncSetAttribute first); odd row counts of W.
LINEAR = [(13, 64, 1), (40, 576, 3), (96, 2048, 8), (48, 2048, 16), (24, 320, 17)]


@pytest.mark.parametrize("n_out,n_in,rows", LINEAR, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_int4_linear(emu, n_out, n_in, rows, dtype):
    for group_size in (32, 64):
        packed, scale, min_ = int4_weight(n_out, n_in, group_size, seed=n_out + rows)
        x = torch.randn(rows, n_in).to(dtype)
        expected = reference.int4_linear(x, packed, scale, min_, group_size)
        assert_close(emu.int4_linear(x, packed, scale, min_, group_size), expected, f"G={group_size}")


@pytest.mark.parametrize("n_out,n_in,rows", LINEAR + [(21, 100, 2)], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_int8_linear(emu, n_out, n_in, rows, dtype):
    g = torch.Generator().manual_seed(n_in + rows)
    q = torch.randint(-127, 128, (n_out, n_in), generator=g, dtype=torch.int8)
    scale = torch.rand(n_out, generator=g) * 0.01
    x = torch.randn(rows, n_in, generator=g).to(dtype)
    assert_int8_close(emu.int8_linear(x, q, scale), x, q, scale)


@pytest.mark.parametrize("n_out,n_in,rows", LINEAR + [(21, 100, 2), (5, 13, 3)], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bf16_linear(emu, n_out, n_in, rows, dtype):
    g = torch.Generator().manual_seed(n_in + rows)
    w = (torch.randn(n_out, n_in, generator=g) * 0.05).bfloat16()  # a model's scale: sums near 1
    x = torch.randn(rows, n_in, generator=g).to(dtype)
    assert_close(emu.bf16_linear(x, w), reference.bf16_linear(x, w))


def test_quantized_linear_unaligned(emu):
    # x and W at odd addresses: the byte-by-byte loads.
    packed, scale, min_ = int4_weight(20, 256, 32)
    x = torch.randn(2 * 256 + 1)[1:].view(2, 256)
    w = torch.empty(20 * 128 + 1, dtype=torch.uint8)[1:].view(20, 128)
    w.copy_(packed)
    assert_close(emu.int4_linear(x, w, scale, min_, 32), reference.int4_linear(x, packed, scale, min_, 32))
    q = torch.randint(-127, 128, (20, 256), dtype=torch.int8)
    q_odd = torch.empty(20 * 256 + 1, dtype=torch.int8)[1:].view(20, 256)
    q_odd.copy_(q)
    s = scale[:, 0].float().contiguous()
    assert_int8_close(emu.int8_linear(x, q_odd, s), x, q, s)
    wb = (torch.randn(20, 256) * 0.05).bfloat16()
    wb_odd = torch.empty(20 * 256 + 1, dtype=torch.bfloat16)[1:].view(20, 256)  # 2 bytes past 16-byte alignment
    wb_odd.copy_(wb)
    assert_close(emu.bf16_linear(x, wb_odd), reference.bf16_linear(x, wb))


# --- the emulator finds kernel bugs: each planted bug fails the check above it -----------------------------
ATTENTION = "paged_attention.cu"
PLANTED = {
    # the barrier between filling key_rows and reading it: threads read rows others have not written
    "missing __syncthreads": (
        ATTENTION,
        "            key_rows[k] = table[t / p.block_size] * p.block_size + t % p.block_size;\n        }\n        __syncthreads();",
        "            key_rows[k] = table[t / p.block_size] * p.block_size + t % p.block_size;\n        }",
    ),
    # one key past the context attended to
    "off-by-one in the context mask": (
        ATTENTION,
        "const int n_keys = min(p.partition_size, context - key_begin);",
        "const int n_keys = min(p.partition_size, context - key_begin + 1);",
    ),
    # the last lane of each warp skips the butterfly that sums a score over its lane group
    "a lane left out of a shuffle": (
        ATTENTION,
        "for (int offset = LANES / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);",
        "for (int offset = LANES / 2; offset > 0; offset /= 2)\n"
        "        if (threadIdx.x % 32 != 31) v += __shfl_xor_sync(0xffffffffu, v, offset);",
    ),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_a_planted_bug_fails_the_attention_check(bug):
    broken = emulator.load(plant=[PLANTED[bug]])
    case = make_case(3, 8, 2, 64, 16, [1, 77, 300], torch.float32, "cpu", width=24)
    expected = reference.paged_decode_attention(*case, 0.125)
    with pytest.raises((AssertionError, emulator.EmulatorError)) as caught:
        assert_close(broken.paged_decode_attention(*case, 0.125, 128), expected, bug)
    if bug == "a lane left out of a shuffle":  # the emulator stops the launch and says where lanes wait
        message = str(caught.value)
        assert (
            caught.type is emulator.EmulatorError and "the lanes of one mask are at different warp exchanges" in message
        )
        assert "lanes 0-30 __shfl_xor_sync at kernels/csrc/cuda/paged_attention.cu:" in message, message
        assert "lane 31 __shfl_xor_sync at kernels/csrc/cuda/paged_attention.cu:" in message, message
    else:  # the kernel runs to the end with a wrong result
        assert caught.type is AssertionError


def test_a_barrier_not_every_thread_reaches_is_reported(emu):
    broken = emulator.load(
        plant=[
            (
                "norm_rope.cu",
                "    v = warp_sum(v);\n    if (lane == 0)",
                "    if (warp == 1) return 0.f;\n    v = warp_sum(v);\n    if (lane == 0)",
            )
        ]
    )
    with pytest.raises(emulator.EmulatorError, match=r"__syncthreads reached by 96 of 128 threads"):
        broken.add_rms_norm(torch.randn(1, 128 * 4), None, torch.ones(128 * 4), 1e-5)


def test_a_printf_inside_a_block_reaches_the_caller():
    # What chapter 06's README and notebook show: one line added to a kernel, printed per block.
    debug = emulator.load(
        plant=[
            (
                "norm_rope.cu",
                "    const float inv_rms = rsqrtf(block_sum(sum_sq) / hidden + eps);\n",
                "    const float inv_rms = rsqrtf(block_sum(sum_sq) / hidden + eps);\n"
                '    if (threadIdx.x == 0) printf("block %u of %u: 1/rms = %.4f\\n", blockIdx.x, gridDim.x, inv_rms);\n',
            )
        ]
    )
    x = torch.randn(3, 576) * torch.tensor([[1.0], [2.0], [4.0]])
    with emulator.printed() as out:
        debug.add_rms_norm(x, None, torch.ones(576), 1e-5)
    inv_rms = x.pow(2).mean(-1).add(1e-5).rsqrt()
    assert out.text.splitlines() == [f"block {b} of 3: 1/rms = {float(inv_rms[b]):.4f}" for b in range(3)]
