"""A contiguous, preallocated KV cache: per layer one K and one V buffer for the whole batch.

Layout [batch, n_kv_heads, max_seq, head_dim]. The attention of one (sequence, KV head) reads
the rows 0..length of one [max_seq, head_dim] slab: contiguous memory, head_dim-long rows, the
layout `scaled_dot_product_attention` takes without a copy and the one a CUDA kernel wants
(one thread block per (batch, head) walks its slab). Chapter 05 cuts the max_seq axis into
fixed-size blocks; chapter 06 reads those blocks from a kernel.

Every sequence of a batch writes at the same slot index: prompts are left-padded so that they
all end at the same slot, and the padded slots are masked out of attention.
"""

from __future__ import annotations

import os

import torch

from common.config import LlamaConfig
from common.errors import UserError


def available_memory(device: torch.device) -> int | None:
    """Bytes free for a new allocation on `device` (None when unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None


class KVCache:
    def __init__(self, config: LlamaConfig, batch_size: int, max_seq: int, device, dtype: torch.dtype):
        if max_seq > config.max_position_embeddings:
            raise UserError(f"max_seq={max_seq} exceeds the model's context of {config.max_position_embeddings} tokens")
        self.shape = (batch_size, config.num_key_value_heads, max_seq, config.head_dim)
        device = torch.device(device)
        nbytes = config.kv_bytes_per_token(dtype.itemsize) * batch_size * max_seq
        free = available_memory(device)
        if free is not None and nbytes > free:
            raise MemoryError(
                f"a KV cache for batch {batch_size} x {max_seq} tokens needs {nbytes / 2**30:.2f} GiB; "
                f"{device} has {free / 2**30:.2f} GiB free: lower --max-seq or the batch size"
            )
        self.k = [torch.zeros(self.shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(self.shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.length = 0  # slots 0 .. length-1 are filled, for every sequence of the batch

    @property
    def max_seq(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores k, v ([batch, n_kv_heads, new, head_dim]) at slots length .. length+new-1 in
        place, and returns views of every filled slot including them ([batch, n_kv_heads, length+new, head_dim])."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_seq:
            raise ValueError(f"KV cache full: {end} tokens do not fit in max_seq={self.max_seq}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]
