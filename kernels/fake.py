"""Fake implementations of the library's operators (torch.ops.llm_kernels.*, csrc/bindings.cpp).

torch.compile and torch.export trace a program with fake tensors: shapes, dtypes and devices, no
data. An operator of ours is opaque to them, so each says here what it returns, from its inputs'
metadata alone; the arguments an operator writes are in its schema, not here. Registered once,
when kernels.load() first loads the library.
"""

from __future__ import annotations

import torch

NAMESPACE = "llm_kernels"
_registered = False


def register() -> None:
    """Once per process (torch refuses a second fake implementation of an operator)."""
    global _registered
    if _registered:
        return
    _registered = True
    lib = f"{NAMESPACE}::"

    @torch.library.register_fake(lib + "paged_decode_attention")
    def _(q, k_pool, v_pool, block_tables, context_lens, scale, partition_size):
        return q.new_empty(q.shape)  # [batch, n_heads, head_dim], contiguous

    @torch.library.register_fake(lib + "chunk_attention")
    def _(q, k_pool, v_pool, block_tables, query_start, query_lens, context_lens, scale):
        return q.new_empty(q.shape)  # [tokens, n_heads, head_dim], contiguous

    @torch.library.register_fake(lib + "add_rms_norm")
    def _(x, delta, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "rope_")
    def _(qk, cos, sin):
        return None

    @torch.library.register_fake(lib + "rope_cache_")
    def _(qkv, cos, sin, k_pool, v_pool, slots):
        return None

    @torch.library.register_fake(lib + "silu_mul")
    def _(gate_up):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @torch.library.register_fake(lib + "int4_linear")
    def _(x, packed, scale, min, group_size, tiles=None):
        return x.new_empty(x.shape[0], packed.shape[0])

    @torch.library.register_fake(lib + "int8_linear")
    def _(x, q, scale, tiles=None):
        return x.new_empty(x.shape[0], q.shape[0])

    @torch.library.register_fake(lib + "bf16_linear")
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake(lib + "lora_shrink")
    def _(x, a, ranks, seg_starts, seg_slots):
        return x.new_empty(x.shape[0], a.shape[1], dtype=torch.float32)

    @torch.library.register_fake(lib + "lora_expand_")
    def _(y, v, b_t, ranks, scale, seg_starts, seg_slots):
        return None
