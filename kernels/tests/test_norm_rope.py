"""Fused residual-add + RMSNorm, in-place RoPE, and SwiGLU's silu(gate) * up, against their references."""

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
