"""The Llama forward pass in PyTorch, reading and writing a KV cache.

    x = embed[tokens]                                          # [batch, new, hidden]
    for each layer:
        x = x + attention(rms_norm(x), cache)                  # writes K/V of the new tokens, reads all
        x = x + mlp(rms_norm(x))
    logits = rms_norm(x) @ lm_head.T                           # [batch, new, vocab]

Prefill runs the whole prompt as `new` tokens; decode runs one token per step. Both call the
same forward: only the number of new tokens and the cache length differ.

A linear weight is either a tensor or a quantized weight prepared for its device (qmatmul.py),
and `linear` multiplies by either; a quantized tied embedding is looked up by dequantizing only
the rows of the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from common.config import LlamaConfig, load_config
from kv_cache import KVCache
from qmatmul import linear, prepare
from quant import QuantSpec, QuantWeight, cat_rows
from rope import apply_rope, cos_sin, inv_frequencies
from weights import read_weights, weight_bytes


@dataclass
class Layer:
    # Linear weights keep the checkpoint's [out_features, in_features] layout: linear(x, W) = x @ W.T.
    # Each is a tensor, or a quantized weight prepared for the matmul (qmatmul.prepare).
    attn_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(n_heads + 2 * n_kv_heads) * head_dim, hidden]: q, k, v stacked
    wo: torch.Tensor  # [hidden, n_heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate, up stacked
    w_down: torch.Tensor  # [hidden, intermediate]


@dataclass
class Model:
    config: LlamaConfig
    embed: torch.Tensor | QuantWeight  # [vocab, hidden]
    layers: list[Layer]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as `embed` when tied (or its prepared quantized form)
    inv_freq: torch.Tensor  # [head_dim / 2], float32: RoPE angles are computed per call from it
    quant: QuantSpec | None = None  # None: plain weights
    weight_bytes: int = 0  # bytes of all weights as loaded (codes, scales and floats)

    @property
    def device(self) -> torch.device:
        return self.norm.device  # norms are never quantized

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype


def load_model(
    model_dir: str | Path, device="cpu", dtype=torch.float32, quant: QuantSpec | None = None, matmul: str = "fast"
) -> Model:
    """Reads config.json and the weights, checked against each other (see common.checkpoint and
    weights.py), as `dtype` tensors on `device`. A quantized checkpoint loads its integers; a
    plain one is quantized on load when `quant` is given. matmul: "fast" (torch's packed kernels
    where they exist) or "reference" (dequantize and multiply), see qmatmul.py."""
    config = load_config(model_dir)
    w, quant = read_weights(Path(model_dir), config, dtype, quant)  # name -> tensor or quantized weight
    total_bytes = weight_bytes(w)
    device = torch.device(device)

    def t(*names: str):
        # Stacking q/k/v (and gate/up) makes one matmul read one weight: fewer, larger kernels,
        # which is most of what decode speed is about when a token is a matrix-vector product.
        # pop: each piece is freed once stacked, so memory peaks near one copy of the model.
        parts = [w.pop(n) for n in names]
        if isinstance(parts[0], torch.Tensor):
            return (torch.cat(parts) if len(parts) > 1 else parts[0]).to(device)
        return prepare(cat_rows(parts) if len(parts) > 1 else parts[0], device, dtype, matmul)

    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        layers.append(
            Layer(
                attn_norm=t(p + "input_layernorm.weight"),
                wqkv=t(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
                wo=t(p + "self_attn.o_proj.weight"),
                mlp_norm=t(p + "post_attention_layernorm.weight"),
                w_gate_up=t(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                w_down=t(p + "mlp.down_proj.weight"),
            )
        )
    embed = w.pop("model.embed_tokens.weight")
    if isinstance(embed, torch.Tensor):
        embed = embed.to(device)
        lm_head = embed if config.tie_word_embeddings else t("lm_head.weight")
    else:  # quantized and tied: the lookup reads our codes, the head multiplies by its prepared form
        lm_head = prepare(embed, device, dtype, matmul)
        embed = embed.to(device)
    return Model(
        config, embed, layers, t("model.norm.weight"), lm_head, inv_frequencies(config).to(device), quant, total_bytes
    )


def embedding(embed, tokens: torch.Tensor, dtype) -> torch.Tensor:
    """The rows of `tokens`.  [batch, new] -> [batch, new, hidden]"""
    return embed[tokens] if isinstance(embed, torch.Tensor) else embed.rows(tokens, dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight: chapter 01's formula as one fused kernel (it
    accumulates in float32 for bf16/fp16 inputs). Eight small ops become one, 61 times per token."""
    return F.rms_norm(x, weight.shape, weight, eps)


def attention_mask(cache_len: int, new: int, pad: torch.Tensor | None, device) -> torch.Tensor | None:
    """Which cached slots each new token may attend to: True = attend.  # [batch or 1, 1, new, cache_len + new]

    Causal: slot j is visible from slot i when j <= i. Left padding: slots below a sequence's
    pad count hold no token and are hidden. A padding query would then see nothing (a softmax
    over nothing is NaN), so it may see itself; its output is never used.
    None for a single new token without padding: it may see every filled slot.
    """
    if new == 1 and pad is None:
        return None
    q_slot = torch.arange(cache_len, cache_len + new, device=device)[:, None]  # [new, 1]
    k_slot = torch.arange(cache_len + new, device=device)[None, :]  # [1, cache_len + new]
    allowed = k_slot <= q_slot  # [new, cache_len + new]
    if pad is not None:
        allowed = (allowed & (k_slot >= pad[:, None, None])) | (k_slot == q_slot)  # [batch, new, cache_len + new]
    return allowed.unsqueeze(-3)


def attention(x, layer: Layer, i: int, cos, sin, cache: KVCache, mask, config: LlamaConfig) -> torch.Tensor:
    """Grouped-query self-attention over the cache.  x: [batch, new, hidden] -> [batch, new, hidden]"""
    batch, new, _ = x.shape
    nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    qkv = linear(x, layer.wqkv).view(batch, new, nh + 2 * nkv, hd)
    # q and k heads are rotated together: they sit side by side in qkv.
    qk = apply_rope(qkv[:, :, : nh + nkv], cos, sin)  # [batch, new, nh + nkv, hd]
    q = qk[:, :, :nh].transpose(1, 2)  # [batch, nh, new, hd]
    k = qk[:, :, nh:].transpose(1, 2)  # [batch, nkv, new, hd]
    v = qkv[:, :, nh + nkv :].transpose(1, 2)  # [batch, nkv, new, hd]
    k_all, v_all = cache.write(i, k, v)  # [batch, nkv, cache_len + new, hd]
    if x.device.type == "cpu" and x.dtype != torch.float32:
        # On CPU, torch's bf16 attention kernel was 3-7x slower than widening q/k/v to float32
        # and running the float32 kernel (measured on an AVX2 machine, contexts 64-1024); the
        # cache itself stays in the compact dtype. GPUs run attention in bf16 natively.
        q, k_all, v_all = q.float(), k_all.float(), v_all.float()
    # enable_gqa: query head h reads KV head h // n_rep, as chapter 01's np.repeat did, without
    # materialising the repeated K and V.
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=nkv != nh).to(x.dtype)
    return linear(out.transpose(1, 2).reshape(batch, new, nh * hd), layer.wo)


def mlp(x: torch.Tensor, layer: Layer) -> torch.Tensor:
    """SwiGLU: down( silu(gate(x)) * up(x) ).  [batch, new, hidden] -> [batch, new, hidden]"""
    gate, up = linear(x, layer.w_gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, layer.w_down)


def forward(
    model: Model,
    tokens: torch.Tensor,
    cache: KVCache,
    pad: torch.Tensor | None = None,
    capture: dict | None = None,
    last_only: bool = False,
) -> torch.Tensor:
    """Runs `tokens` ([batch, new]) at cache slots cache.length .. cache.length+new-1, fills
    those slots, and returns logits [batch, new, vocab] ([batch, 1, vocab] when `last_only`).

    `pad` ([batch]) is how many leading slots of each sequence are left padding. `capture`
    receives the embedding and each layer's output for batch row 0 (see common.parity)."""
    config = model.config
    batch, new = tokens.shape
    start = cache.length
    slots = torch.arange(start, start + new, device=tokens.device)[None, :]  # [1, new]
    positions = slots if pad is None else (slots - pad[:, None]).clamp(min=0)  # [batch or 1, new]
    # Angles in float32, then cast: the same rounding as the reference, which also applies RoPE
    # in the activation dtype.
    cos, sin = cos_sin(model.inv_freq, positions)  # [batch or 1, new, hd]
    cos, sin = cos.to(model.dtype).unsqueeze(2), sin.to(model.dtype).unsqueeze(2)  # [batch or 1, new, 1, hd]
    mask = attention_mask(start, new, pad, tokens.device)

    x = embedding(model.embed, tokens, model.dtype)  # [batch, new, hidden]
    if capture is not None:
        capture["embedding"] = x[0].float().cpu().numpy()
    for i, layer in enumerate(model.layers):
        x = x + attention(rms_norm(x, layer.attn_norm, config.rms_norm_eps), layer, i, cos, sin, cache, mask, config)
        x = x + mlp(rms_norm(x, layer.mlp_norm, config.rms_norm_eps), layer)
        if capture is not None:
            capture[f"layer.{i}"] = x[0].float().cpu().numpy()
    cache.length += new
    if last_only:
        x = x[:, -1:]
    # Logits in the model dtype, as HF transformers and vLLM compute them; samplers widen them to
    # float32. A float32 head makes a bf16 CPU decode step 1.2-2.5x slower and would not make bf16
    # greedy picks CPU-independent: the bf16 layers move near-tied logits more than bf16 rounds them.
    return linear(rms_norm(x, model.norm, config.rms_norm_eps), model.lm_head)
