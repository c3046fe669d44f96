"""Pieces of the torch engine against their HF transformers counterparts."""

import copy

import numpy as np
import pytest
import torch

from common.config import load_config
from common.hf_reference import load_hf_model
from common.models import resolve_model
from model import rms_norm
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(tiny, dtype):
    config, ref = tiny
    norm = ref.model.layers[0].input_layernorm
    x = torch.randn(5, config.hidden_size) * 3
    ours = rms_norm(x.to(dtype), norm.weight.detach().to(dtype), config.rms_norm_eps)
    theirs = copy.deepcopy(norm).to(dtype)(x.to(dtype)).detach()  # a copy: the cached reference stays fp32
    # fp32: the same maths; bf16: HF rounds the normalised x to bf16 before scaling, the fused kernel
    # rounds once at the end, so they may differ by one bf16 rounding step.
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0, "rtol": 2**-7}
    torch.testing.assert_close(ours, theirs, **tol)


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
