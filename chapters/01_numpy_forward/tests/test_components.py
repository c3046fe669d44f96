"""Each piece of the forward pass against its HF transformers counterpart."""

import numpy as np
import pytest
import torch
from transformers.models.llama import modeling_llama as hf

from common.config import load_config
from common.hf_reference import load_hf_model
from common.models import resolve_model
from model import Layer, attention, attention_probs, causal_mask, mlp, rms_norm, softmax
from rope import apply_rope, cos_sin, inv_frequencies


@pytest.fixture(scope="module")
def tiny():
    d = resolve_model("tiny-llama3")
    return load_config(d), load_hf_model(str(d))


def t(x):
    return torch.from_numpy(np.ascontiguousarray(x))


def test_rms_norm(tiny):
    config, ref = tiny
    norm = ref.model.layers[0].input_layernorm
    x = np.random.default_rng(0).standard_normal((5, config.hidden_size)).astype(np.float32) * 3
    ours = rms_norm(x, norm.weight.detach().numpy(), config.rms_norm_eps)
    np.testing.assert_allclose(ours, norm(t(x)).detach().numpy(), atol=1e-6, rtol=1e-6)


def test_rope_tables_with_llama3_scaling_beyond_original_context(tiny):
    config, ref = tiny
    assert config.rope_scaling is not None
    positions = np.array([0, 1, 7, 100, 8191, 8192, 9000, 20000, 100000])
    assert positions.max() > config.rope_scaling.original_max_position_embeddings
    inv_freq = inv_frequencies(config)
    np.testing.assert_allclose(inv_freq, ref.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)
    cos, sin = cos_sin(inv_freq, positions)
    x = torch.zeros(1, len(positions), config.hidden_size)
    hf_cos, hf_sin = ref.model.rotary_emb(x, t(positions)[None])
    # float32 angles near 1e5 carry ~1e-2 absolute rounding on both sides; the scaling itself is exact.
    np.testing.assert_allclose(cos, hf_cos[0].numpy(), atol=2e-3)
    np.testing.assert_allclose(sin, hf_sin[0].numpy(), atol=2e-3)
    np.testing.assert_allclose(cos[:5], hf_cos[0, :5].numpy(), atol=1e-6)


def test_llama3_scaling_changes_only_low_frequencies(tiny):
    config, _ = tiny
    from dataclasses import replace

    scaled, plain = inv_frequencies(config), inv_frequencies(replace(config, rope_scaling=None))
    wavelength = 2 * np.pi / plain
    s = config.rope_scaling
    high = wavelength < s.original_max_position_embeddings / s.high_freq_factor
    low = wavelength > s.original_max_position_embeddings / s.low_freq_factor
    assert high.any() and low.any()
    np.testing.assert_array_equal(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / s.factor, rtol=1e-6)
    mid = ~high & ~low
    assert np.all((scaled[mid] < plain[mid]) & (scaled[mid] > plain[mid] / s.factor))


def test_apply_rope_matches_hf_rotate_half(tiny):
    config, _ = tiny
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 6, config.head_dim)).astype(np.float32)
    cos, sin = cos_sin(inv_frequencies(config), np.arange(6))
    hf_q, _ = hf.apply_rotary_pos_emb(t(q)[None], t(q)[None], t(cos)[None], t(sin)[None])
    np.testing.assert_allclose(apply_rope(q, cos, sin), hf_q[0].numpy(), atol=1e-6)
    # A rotation preserves length
    np.testing.assert_allclose(np.linalg.norm(apply_rope(q, cos, sin), axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-5)


def layer_weights(hf_layer) -> Layer:
    a, m = hf_layer.self_attn, hf_layer.mlp
    n = lambda p: p.weight.detach().numpy()  # noqa: E731
    return Layer(
        n(hf_layer.input_layernorm),
        n(a.q_proj),
        n(a.k_proj),
        n(a.v_proj),
        n(a.o_proj),
        n(hf_layer.post_attention_layernorm),
        n(m.gate_proj),
        n(m.up_proj),
        n(m.down_proj),
    )


def test_gqa_attention_matches_hf(tiny):
    config, ref = tiny
    assert config.n_rep == 4
    hf_layer = ref.model.layers[1]
    seq = 9
    x = np.random.default_rng(2).standard_normal((seq, config.hidden_size)).astype(np.float32)
    cos, sin = cos_sin(inv_frequencies(config), np.arange(seq))
    ours = attention(x, layer_weights(hf_layer), cos, sin, config)
    mask = t(causal_mask(seq))[None, None]
    with torch.no_grad():
        theirs, _ = hf_layer.self_attn(t(x)[None], (t(cos)[None], t(sin)[None]), attention_mask=mask)
    np.testing.assert_allclose(ours, theirs[0].numpy(), atol=1e-5)


def test_attention_is_causal_and_normalised():
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((2, 2, 5, 8)).astype(np.float32)
    p = attention_probs(q, k)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
    assert np.all(np.triu(p[0], k=1) == 0)
    assert p[0, 0, 0] == 1.0  # the first token can only attend to itself


def test_softmax_is_stable_for_huge_logits():
    p = softmax(np.array([[1000.0, 1000.0, -np.inf]], dtype=np.float32))
    np.testing.assert_allclose(p, [[0.5, 0.5, 0.0]])


def test_swiglu_mlp_matches_hf(tiny):
    config, ref = tiny
    hf_layer = ref.model.layers[0]
    x = np.random.default_rng(4).standard_normal((4, config.hidden_size)).astype(np.float32)
    with torch.no_grad():
        theirs = hf_layer.mlp(t(x)).numpy()
    np.testing.assert_allclose(mlp(x, layer_weights(hf_layer)), theirs, atol=1e-5)
