"""Attention that reads K and V through block tables.

A sequence's keys are scattered over the pool, block by block, in the order of its block table.
The reference below does the obvious thing for one sequence: gather its blocks into one
contiguous [tokens, n_kv_heads, head_dim] tensor and run chapter 04's attention on it. The
batched path does the same for a whole group of sequences at once: indexing the pool with a
[B, blocks] table gathers [B, blocks, block_size, heads, dim] in one operation, which is
[B, keys, heads, dim] once the two block axes are merged, and one scaled_dot_product_attention
call with a mask serves every sequence. No Python loop over sequences, and the same kernels as
chapter 04.

The price is the gather: each step copies every sequence's whole context out of the pool,
layer by layer (a decode step of 16 sequences of 500 tokens copies 16 x 500 x 2 x 384 bytes = 6 MB
per layer in bf16). A paged attention kernel reads the blocks where they are instead: chapter 06
passes `decode`, kernels/' flash-decoding kernel, for the groups of one query per sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batch import AttentionGroup


def gather(pool: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """The keys (or values) of each sequence, in order.
    pool [num_blocks, block_size, heads, dim], block_tables [B, blocks] -> [B, heads, blocks * block_size, dim]"""
    return pool[block_tables].flatten(1, 2).transpose(1, 2)


def paged_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, groups: list[AttentionGroup], decode=None
) -> torch.Tensor:
    """q: [T, n_heads, head_dim], the step's queries (RoPE applied), K/V already written to the
    pools. decode(queries [B, n_heads, head_dim], k_pool, v_pool, group), if given, serves the
    groups of single queries. -> [T, n_heads, head_dim]"""
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_pool.shape[2]
    for g in groups:  # at most two: the decodes and the prefill chunks
        if decode is not None and g.decodes:
            if g.whole_step:
                return decode(q, k_pool, v_pool, g)
            rows = g.token_index[:, 0]
            out[rows] = decode(q[rows], k_pool, v_pool, g)
            continue
        B, Q = g.token_index.shape
        # A step of decodes only: the queries are already [B, 1] in order, no gather needed.
        queries = (q.view(B, Q, *q.shape[1:]) if g.whole_step else q[g.token_index]).transpose(
            1, 2
        )  # [B, n_heads, Q, dim]
        keys, values = gather(k_pool, g.block_tables), gather(v_pool, g.block_tables)  # [B, n_kv_heads, K, dim]
        if q.device.type == "cpu" and q.dtype != torch.float32:
            # As in chapter 04: torch's CPU attention is several times faster in float32 than in
            # bf16; the pool itself stays in the compact dtype.
            queries, keys, values = queries.float(), keys.float(), values.float()
        # enable_gqa: query head h reads KV head h // n_rep without copying K/V n_rep times.
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.bias(queries.dtype), enable_gqa=gqa)
        o = o.transpose(1, 2).to(q.dtype)  # [B, Q, n_heads, dim]
        if g.whole_step:
            return o.reshape(q.shape)
        if g.padded:
            out[g.token_index[g.valid]] = o[g.valid]
        else:
            out[g.token_index.flatten()] = o.flatten(0, 1)
    return out


def reference_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: list[int], start: int
) -> torch.Tensor:
    """One sequence, the plain way. q: [new, n_heads, head_dim] for positions start .. start+new-1.
    -> [new, n_heads, head_dim]"""
    new, n_heads, _ = q.shape
    block_size = k_pool.shape[1]
    n_keys = start + new
    blocks = torch.tensor(block_table[: -(-n_keys // block_size)], device=q.device)
    keys = k_pool[blocks].flatten(0, 1)[:n_keys]  # [keys, n_kv_heads, dim]: contiguous again
    values = v_pool[blocks].flatten(0, 1)[:n_keys]
    n_rep = n_heads // keys.shape[1]
    keys, values = keys.repeat_interleave(n_rep, dim=1), values.repeat_interleave(n_rep, dim=1)
    causal = torch.arange(n_keys, device=q.device)[None, :] <= torch.arange(start, n_keys, device=q.device)[:, None]
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys.float()) / q.shape[-1] ** 0.5  # [heads, new, keys]
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, values.float()).to(q.dtype)
