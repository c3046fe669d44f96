"""The Llama forward pass in PyTorch, reading and writing a paged KV cache.

    x = embed[tokens]                                          # [tokens, hidden]
    for each layer:
        x = x + attention(rms_norm(x), cache)                  # writes K/V of the new tokens, reads all
        x = x + mlp(rms_norm(x))
    logits = rms_norm(x[last of each sequence]) @ lm_head.T    # [sequences, vocab]

One forward runs one engine step for many sequences at once. Their new tokens (a prompt chunk
for some, one decoded token for others) are laid end to end, [tokens, hidden], so every matmul
serves the whole batch; only attention needs to know which token belongs to which sequence, and
reads each one's K/V through its block table (batch.py, paged_attention.py).

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
from batch import StepBatch, Work, build_step
from paged_attention import paged_attention
from paged_cache import PagedKVCache
from qmatmul import DEFAULT_PATH, PerStepLinear, linear, prepare
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
    dense_copy_bytes: int = 0  # bytes of the dense copies kept beside quantized weights (matmul "auto")

    @property
    def device(self) -> torch.device:
        return self.norm.device  # norms are never quantized

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype


def load_model(
    model_dir: str | Path, device="cpu", dtype=torch.float32, quant: QuantSpec | None = None, matmul: str = DEFAULT_PATH
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
    norm = t("model.norm.weight")
    prepared = [lm_head] + [getattr(layer, f) for layer in layers for f in ("wqkv", "wo", "w_gate_up", "w_down")]
    dense_bytes = sum(p.dense.numel() * p.dense.element_size() for p in prepared if isinstance(p, PerStepLinear))
    return Model(
        config, embed, layers, norm, lm_head, inv_frequencies(config).to(device), quant, total_bytes, dense_bytes
    )


def embedding(embed, tokens: torch.Tensor, dtype) -> torch.Tensor:
    """The rows of `tokens`.  [tokens] -> [tokens, hidden]"""
    return embed[tokens] if isinstance(embed, torch.Tensor) else embed.rows(tokens, dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight: chapter 01's formula as one fused kernel (it
    accumulates in float32 for bf16/fp16 inputs). Eight small ops become one, 61 times per token."""
    return F.rms_norm(x, weight.shape, weight, eps)


def attention(
    x, layer: Layer, i: int, cos, sin, cache: PagedKVCache, step: StepBatch, config: LlamaConfig
) -> torch.Tensor:
    """Grouped-query self-attention through the block tables.  x: [tokens, hidden] -> [tokens, hidden]"""
    n = x.shape[0]
    nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    qkv = linear(x, layer.wqkv).view(n, nh + 2 * nkv, hd)
    # q and k heads are rotated together: they sit side by side in qkv.
    qk = apply_rope(qkv[:, : nh + nkv], cos, sin)  # [tokens, nh + nkv, hd]
    q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :]  # [tokens, heads, hd]
    cache.write(i, step.slots, k, v)
    out = paged_attention(q, cache.k[i], cache.v[i], step.groups)  # [tokens, nh, hd]
    return linear(out.reshape(n, nh * hd), layer.wo)


def mlp(x: torch.Tensor, layer: Layer) -> torch.Tensor:
    """SwiGLU: down( silu(gate(x)) * up(x) ).  [batch, new, hidden] -> [batch, new, hidden]"""
    gate, up = linear(x, layer.w_gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, layer.w_down)


def forward(model: Model, step: StepBatch, cache: PagedKVCache, capture: dict | None = None) -> torch.Tensor:
    """Runs one step: the new tokens of every sequence in `step` (batch.py), each at its own
    positions, writing their K/V into the pool and reading each sequence's earlier ones through
    its block table. -> logits [sequences, vocab] at each sequence's last new token, or
    [tokens, vocab] for every token when step.all_logits.

    `capture` receives the embedding and each layer's output for every token (see common.parity)."""
    config = model.config
    # Angles in float32, then cast: the same rounding as the reference, which also applies RoPE
    # in the activation dtype.
    cos, sin = cos_sin(model.inv_freq, step.positions)  # [tokens, hd]
    cos, sin = cos.to(model.dtype).unsqueeze(1), sin.to(model.dtype).unsqueeze(1)  # [tokens, 1, hd]

    x = embedding(model.embed, step.tokens, model.dtype)  # [tokens, hidden]: every sequence's, end to end
    if capture is not None:
        capture["embedding"] = x.float().cpu().numpy()
    for i, layer in enumerate(model.layers):
        x = x + attention(rms_norm(x, layer.attn_norm, config.rms_norm_eps), layer, i, cos, sin, cache, step, config)
        x = x + mlp(rms_norm(x, layer.mlp_norm, config.rms_norm_eps), layer)
        if capture is not None:
            capture[f"layer.{i}"] = x.float().cpu().numpy()
    if not step.all_logits:
        x = x[step.last]  # [sequences, hidden]: only these are sampled from
    # Logits in the model dtype, as HF transformers and vLLM compute them; samplers widen them to
    # float32. A float32 head makes a bf16 CPU decode step 1.2-2.5x slower and would not make bf16
    # greedy picks CPU-independent: the bf16 layers move near-tied logits more than bf16 rounds them.
    return linear(rms_norm(x, model.norm, config.rms_norm_eps), model.lm_head)


def forward_sequence(model: Model, ids: list[int], capture: dict | None = None) -> torch.Tensor:
    """Logits at every position of one fresh sequence, in a pool of its own: for parity checks,
    perplexity and tests.  -> [len(ids), vocab]"""
    block_size = 16
    n_blocks = -(-len(ids) // block_size)
    cache = PagedKVCache(model.config, n_blocks, block_size, model.device, model.dtype)
    step = build_step([Work(list(ids), 0, list(range(n_blocks)))], block_size, model.device, all_logits=True)
    return forward(model, step, cache, capture)
