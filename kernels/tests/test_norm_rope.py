"""Fused residual-add + RMSNorm, in-place RoPE, RoPE fused with the KV cache write, and SwiGLU's silu(gate) * up, against their references."""

import pytest
import torch

from kernels import reference
from conftest import assert_close


@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 64), (17, 100), (5, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("with_delta", [True, False], ids=["add", "plain"])
def test_add_rms_norm(ops, device, rows, hidden, dtype, with_delta):
    g = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype).to(device)
    delta = torch.randn(rows, hidden, generator=g).to(dtype).to(device) if with_delta else None
    weight = torch.randn(hidden, generator=g).to(dtype).to(device)
    new_x, expected = reference.add_rms_norm(x.clone(), delta, weight, 1e-5)
    out = ops.add_rms_norm(x, delta, weight, 1e-5)
    assert_close(out, expected, "normalised")
    assert_close(x, new_x, "residual stream, updated in place")


def test_add_rms_norm_every_cpu_path(ops, isa):
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(7, 200).to(dtype)
        delta, weight = torch.randn(7, 200).to(dtype), torch.rand(200).to(dtype)
        new_x, expected = reference.add_rms_norm(x.clone(), delta, weight, 1e-6)
        assert_close(ops.add_rms_norm(x, delta, weight, 1e-6), expected, isa)
        assert_close(x, new_x, isa)


def angles(tokens, head_dim, device):
    positions = torch.randint(0, 5000, (tokens,)).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    a = positions[:, None] * inv_freq
    return a.cos().to(device), a.sin().to(device)


@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 12, 64), (7, 5, 128), (3, 2, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rope_in_place_on_a_strided_view(ops, device, tokens, heads, head_dim, dtype):
    # As the engine calls it: q and k heads, a slice of qkv whose v heads must stay untouched.
    qkv = torch.randn(tokens, heads + 3, head_dim).to(dtype).to(device)
    before = qkv.clone()
    cos, sin = angles(tokens, head_dim, device)
    ops.rope_(qkv[:, :heads], cos, sin)
    assert_close(qkv[:, :heads], reference.rope(before[:, :heads], cos, sin))
    assert torch.equal(qkv[:, heads:], before[:, heads:])


def test_rope_every_cpu_path(ops, isa):
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(9, 4, 64).to(dtype)
        cos, sin = angles(9, 64, "cpu")
        expected = reference.rope(x, cos, sin)
        ops.rope_(x, cos, sin)
        assert_close(x, expected, isa)


def rope_cache_case(tokens, n_heads, n_kv_heads, head_dim, dtype, device, num_blocks=6, block_size=4, seed=0):
    """qkv, cos, sin, k_pool, v_pool, slots as a layer hands them: the pools hold earlier tokens'
    K/V (random), the step's tokens go to distinct slots scattered over the blocks."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, n_heads + 2 * n_kv_heads, head_dim, generator=g).to(dtype)
    pools = [torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=g).to(dtype) for _ in range(2)]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    cos, sin = angles(tokens, head_dim, "cpu")
    return [t.to(device) for t in (qkv, cos, sin, *pools, slots)]


@pytest.mark.parametrize("tokens,n_heads,n_kv_heads,head_dim", [(1, 9, 3, 64), (5, 4, 4, 32), (17, 6, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rope_cache(ops, device, tokens, n_heads, n_kv_heads, head_dim, dtype):
    case = rope_cache_case(tokens, n_heads, n_kv_heads, head_dim, dtype, device, seed=tokens)
    qkv, k_pool, v_pool = reference.rope_cache(*[t.cpu() for t in case])
    v_before = case[0][:, n_heads:].clone()
    ops.rope_cache_(*case)
    assert_close(case[0][:, :n_heads], qkv[:, :n_heads], "q heads, rotated in place")
    assert torch.equal(case[0][:, n_heads:], v_before), "k and v heads of qkv are left as they were"
    assert_close(case[3], k_pool, "k pool: rotated k at the slots, the rest untouched")
    assert torch.equal(case[4].cpu(), v_pool), "v pool: v copied bit for bit at the slots, the rest untouched"


def test_rope_cache_every_cpu_path(ops, isa):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        case = rope_cache_case(7, 9, 3, 64, dtype, "cpu", seed=3)
        qkv, k_pool, v_pool = reference.rope_cache(*case)
        ops.rope_cache_(*case)
        assert_close(case[0], qkv, f"{isa} {dtype}")
        assert_close(case[3], k_pool, f"{isa} {dtype}")
        assert torch.equal(case[4], v_pool), f"{isa} {dtype}"


def test_rope_cache_equals_rope_then_the_indexed_copies(ops):
    # What the fused call replaces in the engine (chapter 05's cache.write after rope_), bit for bit
    # in bf16: the same rotation arithmetic, and copies are copies.
    qkv, cos, sin, k_pool, v_pool, slots = rope_cache_case(6, 9, 3, 64, torch.bfloat16, "cpu", seed=1)
    qkv2, k2, v2 = qkv.clone(), k_pool.clone(), v_pool.clone()
    ops.rope_cache_(qkv, cos, sin, k_pool, v_pool, slots)
    ops.rope_(qkv2[:, :12], cos, sin)
    k2.view(-1, 3, 64).index_copy_(0, slots, qkv2[:, 9:12])
    v2.view(-1, 3, 64).index_copy_(0, slots, qkv2[:, 12:])
    assert torch.equal(qkv[:, :9], qkv2[:, :9]) and torch.equal(k_pool, k2) and torch.equal(v_pool, v2)


def gate_up(rows, inter, dtype, seed=0):
    # gates from -100 to 100 as well as around 0: silu's two tails (0 and the identity), and past
    # the point where e^-g overflows a float
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(rows, 2 * inter, generator=g) * 4
    gu[0, : min(inter, 8)] = torch.tensor([-100.0, -88.5, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0])[: min(inter, 8)]
    return gu.to(dtype)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (3, 8), (4, 100), (17, 8192)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_silu_mul(ops, device, rows, inter, dtype):
    x = gate_up(rows, inter, dtype, seed=rows)
    out = ops.silu_mul(x.to(device))
    assert out.shape == (rows, inter) and torch.isfinite(out.float()).all()
    assert_close(out, reference.silu_mul(x), f"{rows} x {inter}")


def test_silu_mul_every_cpu_path(ops, isa):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = gate_up(5, 77, dtype)  # 77: whole vectors and a tail on every path
        assert_close(ops.silu_mul(x), reference.silu_mul(x), f"{isa} {dtype}")


def test_bad_arguments_are_clear_errors(ops):
    with pytest.raises(RuntimeError, match=r"gate_up: contiguous \[rows, 2 \* inter\]"):
        ops.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="weight: contiguous"):
        ops.add_rms_norm(torch.randn(2, 8), None, torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.add_rms_norm(torch.randn(2, 8).double(), None, torch.randn(8).double(), 1e-5)
    with pytest.raises(RuntimeError, match=r"cos, sin: contiguous float32 \[tokens, head_dim / 2\]"):
        ops.rope_(torch.randn(2, 3, 8), torch.randn(2, 8), torch.randn(2, 8))
    qkv, cos, sin, k_pool, v_pool, slots = rope_cache_case(3, 4, 2, 32, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"slots\[1\] = 24 is outside the pool's 0..23"):
        ops.rope_cache_(qkv, cos, sin, k_pool, v_pool, torch.tensor([0, 24, 1]))
    with pytest.raises(RuntimeError, match="slots: contiguous int64"):
        ops.rope_cache_(qkv, cos, sin, k_pool, v_pool, slots.int())
    with pytest.raises(RuntimeError, match=r"qkv: contiguous \[tokens, n_heads \+ 2 \* n_kv_heads"):
        ops.rope_cache_(qkv[:, :4], cos, sin, k_pool, v_pool, slots)
    with pytest.raises(RuntimeError, match="must share a dtype"):
        ops.rope_cache_(qkv, cos, sin, k_pool.bfloat16(), v_pool.bfloat16(), slots)
