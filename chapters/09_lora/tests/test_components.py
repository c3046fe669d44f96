"""Pieces of the torch engine against their HF transformers counterparts."""

import copy

import numpy as np
import pytest
import torch

from common.config import load_config
from common.hf_reference import load_hf_model
from common.models import resolve_model
from ops import TorchOps, resolve
from paged_cache import PagedKVCache
from rope import apply_rope, cos_sin_table, inv_frequencies


@pytest.fixture(scope="module")
def hf():
    """HF's Llama modeling module: seconds to import, so only when a test that compares with it runs."""
    from transformers.models.llama import modeling_llama

    return modeling_llama


@pytest.fixture(scope="module")
def tiny():
    d = resolve_model("tiny-llama3")
    return load_config(d), load_hf_model(str(d))


def both_ops():
    return [TorchOps(), resolve("on", torch.device("cpu"))]


@pytest.mark.parametrize("ops", both_ops(), ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm(tiny, ops, dtype):
    config, ref = tiny
    norm = ref.model.layers[0].input_layernorm
    x, delta = torch.randn(5, config.hidden_size) * 3, torch.randn(5, config.hidden_size)
    residual = x.to(dtype) + delta.to(dtype)
    stream = x.to(dtype)
    ours = ops.add_rms_norm(stream, delta.to(dtype), norm.weight.detach().to(dtype), config.rms_norm_eps)
    theirs = copy.deepcopy(norm).to(dtype)(residual).detach()  # a copy: the cached reference stays fp32
    torch.testing.assert_close(stream, residual)  # the residual stream, updated in place
    # fp32: the same maths; bf16: HF rounds the normalised x to bf16 before scaling, the fused kernel
    # rounds once at the end, so they may differ by one bf16 rounding step.
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0, "rtol": 2**-7}
    torch.testing.assert_close(ours, theirs, **tol)


@pytest.mark.parametrize("ops", both_ops(), ids=lambda o: type(o).__name__)
def test_rope_and_the_cache_write_match_hf(tiny, ops, hf):
    # HF rotates q and k (apply_rotary_pos_emb) and its cache stores k rotated and v as is; here q is
    # rotated in place in qkv, k and v go straight into the pool, at each token's slot.
    config, _ = tiny
    nkv, hd = config.num_key_value_heads, config.head_dim
    nh = config.num_attention_heads
    positions = torch.tensor([0, 3, 77, 9000])
    slots = torch.tensor([5, 0, 17, 9])  # any slots of the pool, in any order
    qkv = torch.randn(4, nh + 2 * nkv, hd)  # [tokens, heads, hd]
    cache = PagedKVCache(config, 3, 8, "cpu", torch.float32)
    cos, sin = ops.angles(inv_frequencies(config), positions, torch.float32)
    expected_cos, expected_sin = cos_sin_table(inv_frequencies(config), 9001)
    q, k, v = qkv[:, :nh].clone(), qkv[:, nh : nh + nkv].clone(), qkv[:, nh + nkv :].clone()
    q_hf, _ = hf.apply_rotary_pos_emb(
        q[None].transpose(1, 2), q[None].transpose(1, 2), expected_cos[positions][None], expected_sin[positions][None]
    )
    k_hf, _ = hf.apply_rotary_pos_emb(
        k[None].transpose(1, 2), k[None].transpose(1, 2), expected_cos[positions][None], expected_sin[positions][None]
    )
    ops.rope_cache_(qkv, cos, sin, cache, 0, slots)
    torch.testing.assert_close(qkv[:, :nh], q_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    k_pool, v_pool = cache.k[0].view(-1, nkv, hd), cache.v[0].view(-1, nkv, hd)
    torch.testing.assert_close(k_pool[slots], k_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert torch.equal(v_pool[slots], v)
    others = torch.ones(k_pool.shape[0], dtype=torch.bool)
    others[slots] = False
    assert not k_pool[others].any() and not v_pool[others].any()  # no other slot written
    assert not cache.k[1].any()  # nor another layer's pool


@pytest.mark.parametrize("ops", both_ops(), ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_hf_mlp(tiny, ops, dtype):
    # HF's LlamaMLP: down(act(gate(h)) * up(h)); ours multiplies the stacked gate_up projection's
    # two halves. bf16: against float32 maths on the same bf16 halves; torch rounds silu(gate)
    # before the product, the kernel rounds once, so one bf16 step apart at most.
    config, ref = tiny
    mlp = ref.model.layers[0].mlp
    h = torch.randn(6, config.hidden_size)
    gate_up = torch.cat([mlp.gate_proj(h), mlp.up_proj(h)], dim=-1).detach().to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    theirs = (mlp.act_fn(gate) * up).to(dtype)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-6, "rtol": 2**-7}
    torch.testing.assert_close(ops.silu_mul(gate_up), theirs, **tol)


def test_rope_tables_with_llama3_scaling_beyond_original_context(tiny):
    config, ref = tiny
    inv_freq = inv_frequencies(config)
    torch.testing.assert_close(inv_freq, ref.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    positions = torch.tensor([0, 1, 7, 100, 8191, 8192, 9000, 20000, 100000])
    cos, sin = cos_sin_table(inv_freq, 100001)
    hf_cos, hf_sin = ref.model.rotary_emb(torch.zeros(1), positions[None])
    torch.testing.assert_close(cos[positions], hf_cos[0], atol=2e-3, rtol=0)
    torch.testing.assert_close(sin[positions], hf_sin[0], atol=2e-3, rtol=0)


def test_apply_rope_matches_hf(tiny, hf):
    config, _ = tiny
    x = torch.randn(2, 6, 3, config.head_dim)  # [batch, seq, heads, hd]
    cos, sin = cos_sin_table(inv_frequencies(config), 6)
    ours = apply_rope(x, cos[None, :, None], sin[None, :, None])
    theirs, _ = hf.apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos[None], sin[None])
    torch.testing.assert_close(ours, theirs.transpose(1, 2))


def test_rope_matches_chapter_01():
    from common.tools.testing import load_neighbour

    ch01 = load_neighbour(1, "rope")
    config = load_config(resolve_model("tiny-llama3"))
    cos, sin = cos_sin_table(inv_frequencies(config), 50)
    np_cos, np_sin = ch01.rope.cos_sin(ch01.rope.inv_frequencies(config), np.arange(50))
    np.testing.assert_allclose(cos.numpy(), np_cos, atol=1e-6)
    np.testing.assert_allclose(sin.numpy(), np_sin, atol=1e-6)
