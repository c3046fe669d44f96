"""Which slice of which weight each rank holds, reading only that slice, and the three layers that
turn slices back into the whole (Megatron-LM's tensor parallelism, as vLLM and SGLang ship it).

A rank of N holds, of every decoder layer (checkpoint layout [out, in]):

    q_proj, k_proj, v_proj   rows of its query heads and their KV heads    column-parallel: no talk
    gate_proj, up_proj       rows [r*I/N, (r+1)*I/N) of the MLP             column-parallel: no talk
    o_proj, down_proj        the matching columns (its heads' / MLP's)      row-parallel: a partial sum,
                                                                            then one all-reduce each
    embed_tokens, lm_head    rows [r*V/N, (r+1)*V/N) of the vocabulary      vocab-parallel
    norms                    all of it (a few KB)

so attention runs on each rank's heads alone (a head never needs another head), and the MLP on its
slice of the intermediate features (silu(gate) * up is per feature). Only the two row-parallel
matmuls end in partial sums of the whole hidden vector: `RowParallelLinear` adds them up across the
ranks. The embedding lookup finds a token's row on one rank only: the others contribute zeros to
one all-reduce. The LM head leaves each rank the logits of its slice of the vocabulary: they are
gathered on rank 0, the sampler's rank (see VocabParallelHead for why a gather).

The model is the chapter's model.py, untouched: each rank builds it from a config whose head
counts and intermediate size are its own (vocab_size stays whole: rank 0 sees whole logits) and
from its slices, the row-parallel weights wrapped so that the model's `linear` runs them like any
prepared weight. GQA: where the KV heads are fewer than the ranks, each KV head is replicated on
the ranks whose query heads use it (vLLM's rule), so N must divide or be a multiple of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from common.checkpoint import CheckpointError, checkpoint_files, plan_checkpoint
from common.config import LlamaConfig, load_config
from common.errors import UserError
from model import Layer, Model
from ops import Ops
from qmatmul import PerStepLinear, linear
from quant import Int4Weight, Int8Weight, QuantSpec, QuantWeight, cat_rows, group_size_for, nbytes
from rope import inv_frequencies
from weights import bits_of, read_weights, spec_of


@dataclass(frozen=True)
class ShardPlan:
    """The slices rank `rank` of `world` holds (all ranges are [start, stop))."""

    rank: int
    world: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    mlp: tuple[int, int]  # intermediate features
    vocab: tuple[int, int]

    @staticmethod
    def check(config: LlamaConfig, world: int, quant: QuantSpec | None = None) -> None:
        """Refuses a size that does not split the model evenly, naming the numbers and the sizes that do."""
        if world < 1:
            raise UserError(f"--tensor-parallel-size must be at least 1, got {world}")
        problems = ShardPlan.problems(config, world, quant)
        if problems:
            nh = config.num_attention_heads
            sizes = [n for n in range(1, nh + 1) if not ShardPlan.problems(config, n, quant)]
            raise UserError(
                f"--tensor-parallel-size {world} does not fit this model: {'; '.join(problems)} "
                f"(sizes that split it: {', '.join(map(str, sizes))})"
            )

    @staticmethod
    def problems(config: LlamaConfig, world: int, quant: QuantSpec | None = None) -> list[str]:
        """Why `world` ranks do not split the model evenly; [] where they do."""
        nh, nkv, inter, vocab = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.intermediate_size,
            config.vocab_size,
        )
        problems = []
        if nh % world:
            problems.append(f"{nh} query heads do not split into {world} equal parts")
        if nkv >= world and nkv % world:
            problems.append(f"{nkv} KV heads do not split into {world} equal parts")
        if nkv < world and world % nkv:
            problems.append(f"{world} ranks are not a multiple of the {nkv} KV heads (each KV head is replicated)")
        if inter % world:
            problems.append(f"the MLP's {inter} features do not split into {world} equal parts")
        if vocab % world:
            problems.append(f"the vocabulary of {vocab} does not split into {world} equal parts")
        if quant is not None and quant.bits == 4 and not problems:
            # Row-parallel weights split their inputs: whole int4 groups only, so that quantizing a
            # slice gives the very codes of slicing the quantized whole.
            for what, n_in in (("o_proj", nh * config.head_dim), ("down_proj", inter)):
                g = group_size_for(n_in, quant.group_size)
                if (n_in // world) % g:
                    problems.append(f"{what}'s {n_in // world} inputs per rank are not whole int4 groups of {g}")
        return problems

    @classmethod
    def of(cls, config: LlamaConfig, rank: int, world: int) -> ShardPlan:
        cls.check(config, world)
        nh, nkv = config.num_attention_heads, config.num_key_value_heads
        per_q = nh // world
        if nkv >= world:
            per_kv = nkv // world
            kv = (rank * per_kv, (rank + 1) * per_kv)
        else:  # replicated: the one KV head this rank's query heads read
            first = rank * nkv // world
            kv = (first, first + 1)
        inter, vocab = config.intermediate_size // world, config.vocab_size // world
        return cls(
            rank,
            world,
            (rank * per_q, (rank + 1) * per_q),
            kv,
            (rank * inter, (rank + 1) * inter),
            (rank * vocab, (rank + 1) * vocab),
        )

    def local_config(self, config: LlamaConfig) -> LlamaConfig:
        """The config this rank's model runs with: its heads and MLP slice; the whole vocabulary
        (rank 0's logits are whole once gathered, and the engine checks token ids against it)."""
        return dataclasses.replace(
            config,
            num_attention_heads=self.q_heads[1] - self.q_heads[0],
            num_key_value_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.mlp[1] - self.mlp[0],
        )

    def slice_of(self, name: str, config: LlamaConfig) -> tuple[slice, slice] | None:
        """(rows, columns) this rank reads of checkpoint tensor `name`; None: all of it."""
        hd, every = config.head_dim, slice(None)
        heads = lambda r: slice(r[0] * hd, r[1] * hd)  # noqa: E731
        if name.endswith("self_attn.q_proj.weight"):
            return heads(self.q_heads), every
        if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            return heads(self.kv_heads), every
        if name.endswith("self_attn.o_proj.weight"):
            return every, heads(self.q_heads)
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            return slice(*self.mlp), every
        if name.endswith("mlp.down_proj.weight"):
            return every, slice(*self.mlp)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return slice(*self.vocab), every
        return None  # a norm


def read_shard(model_dir: Path, config: LlamaConfig, plan: ShardPlan) -> tuple[dict[str, torch.Tensor], int]:
    """This rank's slice of every tensor, in the stored dtype, read through safetensors' lazy
    slices (only those bytes leave the file). -> ({name: tensor}, bytes read)."""
    from safetensors import SafetensorError, safe_open

    out, read = {}, 0
    for path, names in plan_checkpoint(model_dir, config).items():
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in names:
                    where = plan.slice_of(name, config)
                    t = f.get_slice(name)[where] if where is not None else f.get_tensor(name)
                    read += t.numel() * t.element_size()
                    if t.is_floating_point() and not torch.isfinite(t).all():
                        raise CheckpointError(f"{path}: tensor {name} holds NaN or infinity")
                    out[name] = t.contiguous()
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: the safetensors library cannot read it: {e}") from None
    return out, read


def slice_weight(w, where: tuple[slice, slice]):
    """(rows, columns) of a weight loaded whole: a tensor's, or a quantized weight's codes with their
    scales (and mins). Every row keeps its own scales; a column cut falls on whole int4 groups
    (ShardPlan.check), so the slice holds exactly the codes TP=1 multiplies by."""
    rows, cols = where
    if isinstance(w, torch.Tensor):
        return w[rows, cols].contiguous()
    if isinstance(w, Int8Weight):  # one scale per whole row: a row's slice keeps it
        return Int8Weight(w.q[rows, cols].contiguous(), w.scale[rows].contiguous())
    start, stop, _ = cols.indices(w.shape[1])
    g = w.group_size
    assert start % g == 0 and stop % g == 0, f"a cut through an int4 group of {g}: columns {start}..{stop}"
    groups = slice(start // g, stop // g)
    return Int4Weight(
        w.packed[rows, start // 2 : stop // 2].contiguous(),  # two codes a byte, along the inputs
        w.scale[rows, groups].contiguous(),
        w.min[rows, groups].contiguous(),
        g,
        w.symmetric,
    )


class RowParallelLinear:
    """o_proj or down_proj of one rank: its slice of the inputs times its columns of the weight is
    a partial sum of the whole output; the all-reduce adds the ranks' partial sums. One call per
    layer each: the two collectives of a decoder layer."""

    def __init__(self, prepared, comm):
        self.prepared, self.comm = prepared, comm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(linear(x, self.prepared))


class VocabParallelEmbedding:
    """The embedding rows [start, start + n) of the vocabulary. A token's row lives on one rank:
    the others look up zeros, and one all-reduce (a sum with zeros: exact) gives every rank the row."""

    def __init__(self, rows: torch.Tensor | QuantWeight, start: int, comm):
        self.local, self.start, self.comm = rows, start, comm
        self.n = rows.shape[0]

    def rows(self, tokens: torch.Tensor, dtype) -> torch.Tensor:
        index = tokens - self.start
        mine = (index >= 0) & (index < self.n)
        index = torch.where(mine, index, torch.zeros_like(index))
        x = self.local[index] if isinstance(self.local, torch.Tensor) else self.local.rows(index, dtype)
        x = x.to(dtype) * mine[:, None].to(dtype)  # [tokens, hidden]: zeros for other ranks' tokens
        return self.comm.all_reduce(x)


class VocabParallelHead:
    """The LM head rows of this rank's vocabulary slice: [rows, V/N] logits per rank, gathered on
    rank 0 into [rows, V]. A gather, not a (max, index) reduce: a reduce would serve greedy argmax
    only, while the sampler needs the whole distribution (temperature, top-p/top-k, min_tokens'
    masks, penalties, logprobs, speculative verification). On other ranks it returns their slice."""

    def __init__(self, prepared, comm):
        self.prepared, self.comm = prepared, comm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.gather_last_dim(linear(x, self.prepared))


def load_shard(
    model_dir: str | Path,
    rank: int,
    world: int,
    comm,
    device,
    dtype,
    quant: QuantSpec | None,
    matmul: str,
    ops: Ops,
) -> tuple[Model, int]:
    """Rank `rank`'s model: model.load_model's assembly on this rank's slices. -> (model, bytes
    read from the checkpoint). comm: all_reduce(t) and gather_last_dim(t) (parallel.py)."""
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    stored_spec = spec_of(model_dir)
    ShardPlan.check(config, world, stored_spec or quant)
    plan = ShardPlan.of(config, rank, world)
    local = plan.local_config(config)
    device = torch.device(device)
    if stored_spec is not None:
        # Quantized already (quantize.py, a converted .gguf): its codes cannot be read by slices
        # of the file's rows, so every rank reads it whole, checked as at TP=1, and keeps its slices.
        whole, quant = read_weights(model_dir, config, dtype, quant)
        w = {name: slice_weight(t, where) if (where := plan.slice_of(name, config)) else t for name, t in whole.items()}
        read = sum(f.stat().st_size for f in checkpoint_files(model_dir))
    else:
        stored, read = read_shard(model_dir, config, plan)
        w = {}
        for name, t in stored.items():
            bits = bits_of(name, config, quant) if quant is not None else None
            # Quantized from the stored floats, as weights.read_weights does, so the codes are TP=1's.
            w[name] = quant.quantize(t, bits) if bits else t.to(dtype)
    total_bytes = sum(nbytes(v) for v in w.values())

    def t(*names: str):
        parts = [w.pop(n) for n in names]
        if isinstance(parts[0], torch.Tensor):
            tensor = (torch.cat(parts) if len(parts) > 1 else parts[0]).to(device)
            return ops.dense_linear(tensor) if tensor.dim() == 2 else tensor
        return ops.quant_linear(cat_rows(parts) if len(parts) > 1 else parts[0], device, dtype, matmul)

    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = Layer(
            attn_norm=t(p + "input_layernorm.weight"),
            wqkv=t(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
            wo=RowParallelLinear(t(p + "self_attn.o_proj.weight"), comm),
            mlp_norm=t(p + "post_attention_layernorm.weight"),
            w_gate_up=t(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
            w_down=RowParallelLinear(t(p + "mlp.down_proj.weight"), comm),
        )
        # The kernels' one-call layer (decode steps in one C++ call) multiplies by this rank's slices
        # of o and down and calls the all-reduce back after each: the Python loop's order.
        layer.one_call = ops.build_one_call_layer(
            dataclasses.replace(layer, wo=layer.wo.prepared, w_down=layer.w_down.prepared), local
        )
        if layer.one_call is not None:
            layer.one_call.all_reduce = comm.all_reduce
        layers.append(layer)
    embed = w.pop("model.embed_tokens.weight")
    if isinstance(embed, torch.Tensor):
        embed = embed.to(device)
        head = ops.dense_linear(embed) if config.tie_word_embeddings else t("lm_head.weight")
    else:
        head = ops.quant_linear(embed, device, dtype, matmul)
        embed = embed.to(device)
    norm = t("model.norm.weight")
    inner = [head] + [getattr(lay, f) for lay in layers for f in ("wqkv", "w_gate_up")]
    inner += [lay.wo.prepared for lay in layers] + [lay.w_down.prepared for lay in layers]
    dense_bytes = sum(p.copy_bytes for p in inner if isinstance(p, PerStepLinear))
    model = Model(
        local,
        VocabParallelEmbedding(embed, plan.vocab[0], comm),
        layers,
        norm,
        VocabParallelHead(head, comm),
        inv_frequencies(config).to(device),
        quant,
        total_bytes,
        dense_bytes,
        ops,
    )
    return model, read
