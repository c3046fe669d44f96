"""The Llama forward pass in NumPy: token ids in, next-token logits out.

    x = embed[ids]                                  # [seq, hidden]
    for each layer:
        x = x + attention(rms_norm(x))              # GQA self-attention with RoPE, causal
        x = x + mlp(rms_norm(x))                    # SwiGLU
    logits = rms_norm(x) @ lm_head.T                # [seq, vocab]

Everything runs in float32; bf16 checkpoints are widened exactly on load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.checkpoint import load_checkpoint
from common.config import LlamaConfig, load_config
from rope import apply_rope, cos_sin, inv_frequencies


@dataclass
class Layer:
    # Linear weights keep the checkpoint's [out_features, in_features] layout: y = x @ W.T
    attn_norm: np.ndarray  # [hidden]
    wq: np.ndarray  # [n_heads * head_dim, hidden]
    wk: np.ndarray  # [n_kv_heads * head_dim, hidden]
    wv: np.ndarray  # [n_kv_heads * head_dim, hidden]
    wo: np.ndarray  # [hidden, n_heads * head_dim]
    mlp_norm: np.ndarray  # [hidden]
    w_gate: np.ndarray  # [intermediate, hidden]
    w_up: np.ndarray  # [intermediate, hidden]
    w_down: np.ndarray  # [hidden, intermediate]


@dataclass
class Model:
    config: LlamaConfig
    embed: np.ndarray  # [vocab, hidden]
    layers: list[Layer]
    norm: np.ndarray  # [hidden]
    lm_head: np.ndarray  # [vocab, hidden]; the same array as `embed` when tied
    inv_freq: np.ndarray  # [head_dim / 2]


def load_model(model_dir: str | Path) -> Model:
    config = load_config(model_dir)
    w = load_checkpoint(model_dir, config, dtype=np.float32)
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        layers.append(
            Layer(
                attn_norm=w[p + "input_layernorm.weight"],
                wq=w[p + "self_attn.q_proj.weight"],
                wk=w[p + "self_attn.k_proj.weight"],
                wv=w[p + "self_attn.v_proj.weight"],
                wo=w[p + "self_attn.o_proj.weight"],
                mlp_norm=w[p + "post_attention_layernorm.weight"],
                w_gate=w[p + "mlp.gate_proj.weight"],
                w_up=w[p + "mlp.up_proj.weight"],
                w_down=w[p + "mlp.down_proj.weight"],
            )
        )
    embed = w["model.embed_tokens.weight"]
    # Tied embeddings: the output projection is the input embedding matrix itself (SmolLM2,
    # Llama 3.2 1B/3B). There is no lm_head.weight in such a checkpoint.
    lm_head = embed if config.tie_word_embeddings else w["lm_head.weight"]
    return Model(config, embed, layers, w["model.norm.weight"], lm_head, inv_frequencies(config))


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight. eps sits inside the square root, as in Llama."""
    x = x.astype(np.float32)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def softmax(scores: np.ndarray) -> np.ndarray:
    """Subtracting the row max changes nothing mathematically and keeps exp() from overflowing."""
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def causal_mask(seq: int) -> np.ndarray:
    """0 where query i may see key j (j <= i), -inf above the diagonal.  # [seq, seq]"""
    return np.triu(np.full((seq, seq), -np.inf, dtype=np.float32), k=1)


def attention_probs(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """softmax(q k^T / sqrt(head_dim) + causal mask).  q, k: [heads, seq, head_dim] -> [heads, seq, seq]"""
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    return softmax(scores + causal_mask(q.shape[1]))


def attention(x: np.ndarray, layer: Layer, cos: np.ndarray, sin: np.ndarray, config: LlamaConfig) -> np.ndarray:
    """Grouped-query self-attention.  x: [seq, hidden] -> [seq, hidden]"""
    seq, hd = x.shape[0], config.head_dim
    q = (x @ layer.wq.T).reshape(seq, config.num_attention_heads, hd).transpose(1, 0, 2)  # [n_heads, seq, hd]
    k = (x @ layer.wk.T).reshape(seq, config.num_key_value_heads, hd).transpose(1, 0, 2)  # [n_kv_heads, seq, hd]
    v = (x @ layer.wv.T).reshape(seq, config.num_key_value_heads, hd).transpose(1, 0, 2)  # [n_kv_heads, seq, hd]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # GQA: KV head j serves query heads j*n_rep ... j*n_rep + n_rep - 1 (consecutive, not strided).
    k = np.repeat(k, config.n_rep, axis=0)  # [n_heads, seq, hd]
    v = np.repeat(v, config.n_rep, axis=0)  # [n_heads, seq, hd]
    out = attention_probs(q, k) @ v  # [n_heads, seq, hd]
    return out.transpose(1, 0, 2).reshape(seq, -1) @ layer.wo.T


def mlp(x: np.ndarray, layer: Layer) -> np.ndarray:
    """SwiGLU: down( silu(gate(x)) * up(x) ).  [seq, hidden] -> [seq, hidden]"""
    return (silu(x @ layer.w_gate.T) * (x @ layer.w_up.T)) @ layer.w_down.T


def forward(model: Model, token_ids: list[int], capture: dict | None = None, last_only: bool = False) -> np.ndarray:
    """Logits for every position ([seq, vocab]), or only the last one ([1, vocab]) when
    `last_only` (all greedy generation needs). `capture`, if given, receives the embedding
    output and every layer's output under the names common.parity compares."""
    config = model.config
    positions = np.arange(len(token_ids))
    cos, sin = cos_sin(model.inv_freq, positions)  # [seq, head_dim] each

    x = model.embed[np.asarray(token_ids)]  # [seq, hidden]
    if capture is not None:
        capture["embedding"] = x
    for i, layer in enumerate(model.layers):
        x = x + attention(rms_norm(x, layer.attn_norm, config.rms_norm_eps), layer, cos, sin, config)
        x = x + mlp(rms_norm(x, layer.mlp_norm, config.rms_norm_eps), layer)
        if capture is not None:
            capture[f"layer.{i}"] = x
    if last_only:
        x = x[-1:]
    return rms_norm(x, model.norm, config.rms_norm_eps) @ model.lm_head.T
