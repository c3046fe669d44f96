"""One engine step as tensors: the new tokens of every scheduled sequence, laid end to end.

Continuous batching runs sequences at different points together: one adds a 256-token chunk
of its prompt, fifteen others add one decoded token each. The matmuls do not care whose token
is whose: they run on the flat list of the step's tokens, [tokens, hidden]. Only three things
are per sequence, and this file builds them once per step for all 30 layers:

    positions  [tokens]   where each token sits in its own sequence (RoPE)
    slots      [tokens]   where its K/V go in the block pool: table[pos // bs] * bs + pos % bs
    groups                how attention finds each token's sequence (paged_attention.py)
    lora                  which LoRA adapter slot each token's rows use (lora.py), or None

Attention runs in two batched calls: one for the sequences adding a single token (decode), one
for those adding several (prefill chunks), so that fifteen decodes are not padded to the length
of one prompt chunk. Within a group, the queries of each sequence are padded to the group's
longest and its block table to the group's widest, and a mask says what is real.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from lora import StepLora, step_lora


@dataclass
class Work:
    """What one sequence adds in a step."""

    tokens: list[int]  # the new tokens, at positions start .. start + len - 1
    start: int  # tokens of this sequence already in the cache
    block_table: list[int]  # must cover start + len(tokens) slots
    lora_slot: int = -1  # the slot of its LoRA adapter (lora_slots.py); -1: the base model


@dataclass
class AttentionGroup:
    """Sequences attended in one batched call.  B sequences, Q queries at most, K key slots."""

    token_index: torch.Tensor  # [B, Q] where each query sits in the step's flat token list (padding: 0)
    block_tables: torch.Tensor  # [B, K / block_size] int32, for the decode kernel (padding: block 0, masked out)
    mask: torch.Tensor  # [B, 1, Q, K] bool: query q of sequence b may read key slot k
    valid: torch.Tensor  # [B, Q] bool: which queries are real tokens
    padded: bool  # some queries are padding (not every sequence adds Q tokens)
    whole_step: bool  # the group is the step's every token, in order (a step of decodes only)
    # Chapter 06, what the paged decode kernel reads instead of the mask (with block_tables):
    context_lens: torch.Tensor  # [B] int32: keys each sequence's last query reads (its position + 1)
    decodes: bool = False  # one query per sequence
    _bias: dict = field(default_factory=dict, repr=False)
    _one_query_each: AttentionGroup | None = field(default=None, repr=False)  # one_query_each's, once per step

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as an additive bias (0 or -inf), made once per step for all layers: given a
        bool mask, attention would convert it in every layer."""
        if dtype not in self._bias:
            self._bias[dtype] = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(
                ~self.mask, float("-inf")
            )
        return self._bias[dtype]


@dataclass
class DecodeGroup:
    """Chapter 06: a step of decodes only as the paged decode kernel reads it, without the mask and
    the token index (one query per sequence, the step's every token in order). What a CUDA graph's
    step attends with (cuda_graphs.py), where the kernels always run."""

    block_tables: torch.Tensor  # [B, blocks] int32
    context_lens: torch.Tensor  # [B] int32
    decodes = True
    whole_step = True


@dataclass
class StepBatch:
    tokens: torch.Tensor  # [T] every new token of the step
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T]
    groups: list[AttentionGroup | DecodeGroup]
    last: torch.Tensor  # [S] index of each sequence's last new token: its logits are sampled
    all_logits: bool = False  # logits for every token (parity, perplexity), not just `last`
    lora: StepLora | None = None  # the rows' adapter slots; None: every row is the base model's


def build_step(work: list[Work], block_size: int, device, all_logits: bool = False) -> StepBatch:
    tokens, positions, slots, first, row_slots = [], [], [], [], []
    for w in work:
        if not w.tokens:
            raise ValueError("a sequence in a step must add at least one token")
        if len(w.block_table) * block_size < w.start + len(w.tokens):
            raise ValueError(
                f"a block table of {len(w.block_table)} blocks cannot hold {w.start + len(w.tokens)} tokens"
            )
        first.append(len(tokens))  # where this sequence's tokens start in the flat list
        tokens += w.tokens
        row_slots += [w.lora_slot] * len(w.tokens)
        for p in range(w.start, w.start + len(w.tokens)):
            positions.append(p)
            slots.append(w.block_table[p // block_size] * block_size + p % block_size)
    last = [f + len(w.tokens) - 1 for f, w in zip(first, work)]
    decode = [(f, w) for f, w in zip(first, work) if len(w.tokens) == 1]
    prefill = [(f, w) for f, w in zip(first, work) if len(w.tokens) > 1]
    groups = [_group(g, block_size, device, whole_step=len(g) == len(work)) for g in (decode, prefill) if g]
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return StepBatch(
        as_tensor(tokens),
        as_tensor(positions),
        as_tensor(slots),
        groups,
        as_tensor(last),
        all_logits,
        step_lora(row_slots, device),
    )


def _group(work: list[tuple[int, Work]], block_size: int, device, whole_step: bool) -> AttentionGroup:
    """work: (index of the sequence's first token in the flat list, its Work) per sequence."""
    n_queries = max(len(w.tokens) for _, w in work)
    n_blocks = max(-(-(w.start + len(w.tokens)) // block_size) for _, w in work)
    index = torch.zeros(len(work), n_queries, dtype=torch.long)
    tables = torch.zeros(len(work), n_blocks, dtype=torch.int32)
    query_pos = torch.full((len(work), n_queries), -1)  # -1: a padding query
    for b, (first, w) in enumerate(work):
        q = len(w.tokens)
        index[b, :q] = torch.arange(first, first + q)
        used = -(-(w.start + q) // block_size)
        tables[b, :used] = torch.tensor(w.block_table[:used])
        query_pos[b, :q] = torch.arange(w.start, w.start + q)
    key_pos = torch.arange(n_blocks * block_size)
    valid = query_pos >= 0  # [B, Q]
    # Causal within the sequence: a query at position p reads keys 0..p. That also hides the
    # slots past the sequence's end and the padding blocks. A padding query reads slot 0 only, so
    # its softmax is over something (over nothing it is NaN); its output is dropped.
    mask = key_pos[None, None, :] <= query_pos.clamp(min=0)[:, :, None]  # [B, Q, K]
    padded = not bool(valid.all())
    lens = torch.tensor([w.start + len(w.tokens) for _, w in work], dtype=torch.int32)
    return AttentionGroup(
        index.to(device),
        tables.to(device),
        mask[:, None].to(device),
        valid.to(device),
        padded,
        whole_step and not padded,
        lens.to(device),
        decodes=n_queries == 1,
    )


def one_query_each(g: AttentionGroup) -> AttentionGroup:
    """A group of prompt chunks as a group of decodes: each real query a row of its own, with its
    sequence's block table and the keys up to its own position, which is how the paged decode
    kernel would attend it in a decode step (ops.KernelOps, batch-invariant). Made once per step and
    kept on the group: every layer attends the same way."""
    if g._one_query_each is None:
        n_valid = g.valid.sum(dim=1)  # [B] queries of each sequence
        first = g.context_lens - n_valid + 1  # [B] keys the first query of each chunk reads
        lens = first[:, None] + torch.arange(g.valid.shape[1], device=first.device)[None, :]  # [B, Q]
        g._one_query_each = replace(
            g,
            token_index=g.token_index[g.valid][:, None],  # [T, 1]
            block_tables=g.block_tables.repeat_interleave(n_valid, dim=0),  # [T, blocks]
            context_lens=lens[g.valid].to(torch.int32),  # [T]
            decodes=True,
            _bias={},
        )
    return g._one_query_each
