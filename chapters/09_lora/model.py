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

The residual add, the norms, RoPE with the KV cache write, decode attention and SwiGLU's
silu(gate) * up run through `model.ops` (ops.py): kernels/' CUDA or C++ kernels, or PyTorch. The
residual stream x is updated in place, and each add is fused with the norm that follows it:

    h = norm(x)
    for each layer:
        h = norm(x += attention(h))      # one kernel: add, then normalise
        h = norm(x += mlp(h))            # with the next layer's norm (the final norm after the last)

A linear weight is a tensor or a quantized weight, made ready for its device by the same ops when
the model is loaded (`dense_linear`, `quant_linear`: a kernel of the library, torch's packed ops of
qmatmul.py, or per step the faster of one and a dense GEMM), and `linear` multiplies by any of them.
A quantized tied embedding is looked up by dequantizing only the rows of the tokens.

LoRA (lora.py): with adapters resident (`model.lora`) and a step whose rows use them, each of the
four matmuls adds its projections' deltas for those rows right after it runs:

    qkv = linear(h, wqkv);  qkv += lora deltas of q_proj, k_proj, v_proj   (one row's adapter each)

A row-parallel weight (o_proj, down_proj under tensor parallelism, sharding.py) takes its delta
before its all-reduce: the delta of a shard's inputs is a partial sum like the product's.

A step of decodes only, with the kernels on a CPU, runs each layer's two lines as one C++ call
(Layer.one_call, built by ops.KernelOps.build_one_call_layer): the same kernels in the same order,
bit for bit the same result, without the Python between them. Prompt chunks, `--kernels off` and
CUDA (where CUDA graphs replay the whole step) run the loop as written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.config import LlamaConfig, load_config
from batch import StepBatch, Work, build_step
from lora import LoraWeights
from ops import Ops, TorchOps, resolve
from paged_cache import PagedKVCache
from qmatmul import DEFAULT_PATH, PerStepLinear, linear
from quant import QuantSpec, QuantWeight, cat_rows
from rope import inv_frequencies
from weights import read_weights, weight_bytes


@dataclass
class Layer:
    # Linear weights keep the checkpoint's [out_features, in_features] layout: linear(x, W) = x @ W.T.
    # Each is a tensor, or a weight made ready for the matmul by the model's ops (ops.py).
    attn_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(n_heads + 2 * n_kv_heads) * head_dim, hidden]: q, k, v stacked
    wo: torch.Tensor  # [hidden, n_heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate, up stacked
    w_down: torch.Tensor  # [hidden, intermediate]
    one_call: object | None = None  # ops.build_one_call_layer: the layer's decode steps in one C++ call, or None


@dataclass
class Model:
    config: LlamaConfig
    embed: torch.Tensor | QuantWeight  # [vocab, hidden]
    layers: list[Layer]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as `embed` when tied (or its prepared form)
    inv_freq: torch.Tensor  # [head_dim / 2], float32: RoPE angles are computed per call from it
    quant: QuantSpec | None = None  # None: plain weights
    weight_bytes: int = 0  # bytes of all weights as loaded (codes, scales and floats)
    dense_copy_bytes: int = 0  # bytes of the dense copies kept beside quantized weights (matmul "auto")
    ops: Ops = field(default_factory=TorchOps)  # ops.KernelOps or ops.TorchOps
    lora: LoraWeights | None = None  # the resident LoRA adapters' slot table, when the engine serves any

    @property
    def device(self) -> torch.device:
        return self.norm.device  # norms are never quantized

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype


def load_model(
    model_dir: str | Path,
    device="cpu",
    dtype=torch.float32,
    quant: QuantSpec | None = None,
    matmul: str = DEFAULT_PATH,
    ops: Ops | None = None,
) -> Model:
    """Reads config.json and the weights, checked against each other (see common.checkpoint and
    weights.py), as `dtype` tensors on `device`. A quantized checkpoint loads its integers; a
    plain one is quantized on load when `quant` is given. matmul: "auto", "fast" (packed kernels
    where they exist) or "reference" (dequantize and multiply), see qmatmul.py. ops: the hot
    operations, resolved for `device` (ops.py); default: the kernels where they run."""
    config = load_config(model_dir)
    device = torch.device(device)
    ops = ops if ops is not None else resolve("auto", device, config.head_dim)
    w, quant = read_weights(Path(model_dir), config, dtype, quant)  # name -> tensor or quantized weight
    total_bytes = weight_bytes(w)

    def t(*names: str):
        # Stacking q/k/v (and gate/up) makes one matmul read one weight: fewer, larger kernels,
        # which is most of what decode speed is about when a token is a matrix-vector product.
        # pop: each piece is freed once stacked, so memory peaks near one copy of the model.
        parts = [w.pop(n) for n in names]
        if isinstance(parts[0], torch.Tensor):
            tensor = (torch.cat(parts) if len(parts) > 1 else parts[0]).to(device)
            return ops.dense_linear(tensor) if tensor.dim() == 2 else tensor  # a matrix, or a norm's vector
        return ops.quant_linear(cat_rows(parts) if len(parts) > 1 else parts[0], device, dtype, matmul)

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
    for layer in layers:
        layer.one_call = ops.build_one_call_layer(layer, config)
    embed = w.pop("model.embed_tokens.weight")
    if isinstance(embed, torch.Tensor):
        embed = embed.to(device)
        lm_head = ops.dense_linear(embed) if config.tie_word_embeddings else t("lm_head.weight")
    else:  # quantized and tied: the lookup reads our codes, the head multiplies by its prepared form
        lm_head = ops.quant_linear(embed, device, dtype, matmul)
        embed = embed.to(device)
    norm = t("model.norm.weight")
    prepared = [lm_head] + [getattr(layer, f) for layer in layers for f in ("wqkv", "wo", "w_gate_up", "w_down")]
    dense_bytes = sum(p.copy_bytes for p in prepared if isinstance(p, PerStepLinear))
    return Model(
        config, embed, layers, norm, lm_head, inv_frequencies(config).to(device), quant, total_bytes, dense_bytes, ops
    )


def embedding(embed, tokens: torch.Tensor, dtype) -> torch.Tensor:
    """The rows of `tokens`.  [tokens] -> [tokens, hidden]"""
    return embed[tokens] if isinstance(embed, torch.Tensor) else embed.rows(tokens, dtype)


def attention(h, layer: Layer, i: int, cos, sin, cache: PagedKVCache, step: StepBatch, model: Model) -> torch.Tensor:
    """Grouped-query self-attention through the block tables.  h: [tokens, hidden] -> [tokens, hidden]"""
    config, ops = model.config, model.ops
    n = h.shape[0]
    nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    qkv = linear_lora(h, layer.wqkv, model, i, "qkv", step).view(n, nh + 2 * nkv, hd)
    ops.rope_cache_(qkv, cos, sin, cache, i, step.slots)  # q rotated in place; k rotated and v stored in the pool
    q = qkv[:, :nh]  # [tokens, nh, hd]
    out = ops.attention(q, cache.k[i], cache.v[i], step.groups)  # [tokens, nh, hd]
    return linear_lora(out.reshape(n, nh * hd), layer.wo, model, i, "o", step)


def mlp(h: torch.Tensor, layer: Layer, i: int, step: StepBatch, model: Model) -> torch.Tensor:
    """SwiGLU: down( silu(gate(h)) * up(h) ).  [tokens, hidden] -> [tokens, hidden]"""
    gate_up = linear_lora(h, layer.w_gate_up, model, i, "gate_up", step)  # [tokens, 2 * inter]: gate, then up
    return linear_lora(model.ops.silu_mul(gate_up), layer.w_down, model, i, "down", step)


def linear_lora(x: torch.Tensor, w, model: Model, i: int, group: str, step: StepBatch) -> torch.Tensor:
    """linear(x, w), plus the LoRA deltas of the projections in `group` (lora.GROUPS) for the rows
    of the step that use an adapter. A row-parallel weight (sharding.RowParallelLinear) adds them
    to its partial sum, before the all-reduce."""
    if step.lora is None:
        return linear(x, w)
    row_parallel = hasattr(w, "reduce")
    y = w.partial(x) if row_parallel else linear(x, w)
    model.ops.lora_group_(y, x, model.lora, i, group, step.lora)
    return w.reduce(y) if row_parallel else y


def decodes_only(step: StepBatch) -> bool:
    """One query per sequence, every sequence of the step in one group."""
    return len(step.groups) == 1 and step.groups[0].decodes


def forward(model: Model, step: StepBatch, cache: PagedKVCache, capture: dict | None = None) -> torch.Tensor:
    """Runs one step: the new tokens of every sequence in `step` (batch.py), each at its own
    positions, writing their K/V into the pool and reading each sequence's earlier ones through
    its block table. -> logits [sequences, vocab] at each sequence's last new token, or
    [tokens, vocab] for every token when step.all_logits.

    `capture` receives the embedding and each layer's output for every token (see common.parity)."""
    config, ops, layers = model.config, model.ops, model.layers
    eps = config.rms_norm_eps
    cos, sin = ops.angles(model.inv_freq, step.positions, model.dtype)  # once per step, for every layer

    x = embedding(model.embed, step.tokens, model.dtype)  # [tokens, hidden]: every sequence's, end to end
    if capture is not None:
        capture["embedding"] = x.float().cpu().numpy().copy()  # a copy: x is updated in place
    h = ops.add_rms_norm(x, None, layers[0].attn_norm, eps)
    # The C++ layer adds LoRA deltas through the library's shrink and expand, which read float32 and
    # bfloat16 tables; with float16 ones a step with adapter rows runs each layer as Python.
    lora_served = step.lora is None or model.lora.dtype in (torch.float32, torch.bfloat16)
    one_call = capture is None and layers[0].one_call is not None and decodes_only(step) and lora_served
    for i, layer in enumerate(layers):
        next_norm = layers[i + 1].attn_norm if i + 1 < len(layers) else model.norm
        if one_call:  # the two lines below, in C++ (kernels/csrc/decoder_layer.cpp, DecoderLayer::decode)
            h = ops.run_one_call_layer(layer, i, x, h, cos, sin, cache, step, next_norm, model.lora)
            continue
        h = ops.add_rms_norm(x, attention(h, layer, i, cos, sin, cache, step, model), layer.mlp_norm, eps)
        h = ops.add_rms_norm(x, mlp(h, layer, i, step, model), next_norm, eps)
        if capture is not None:
            capture[f"layer.{i}"] = x.float().cpu().numpy().copy()
    if not step.all_logits:
        h = h[step.last]  # [sequences, hidden]: only these are sampled from
    # Logits in the model dtype, as HF transformers and vLLM compute them; samplers widen them to
    # float32. A float32 head makes a bf16 CPU decode step 1.2-2.5x slower and would not make bf16
    # greedy picks CPU-independent: the bf16 layers move near-tied logits more than bf16 rounds them.
    return linear(h, model.lm_head)


def forward_sequence(model: Model, ids: list[int], capture: dict | None = None, lora_slot: int = -1) -> torch.Tensor:
    """Logits at every position of one fresh sequence, in a pool of its own, through the adapter
    in `lora_slot` (-1: the base model): for parity checks, perplexity and tests.  -> [len(ids), vocab]"""
    block_size = 16
    n_blocks = -(-len(ids) // block_size)
    cache = PagedKVCache(model.config, n_blocks, block_size, model.device, model.dtype)
    step = build_step([Work(list(ids), 0, list(range(n_blocks)), lora_slot)], block_size, model.device, all_logits=True)
    return forward(model, step, cache, capture)
