"""The KV cache as a pool of fixed-size blocks, shared by every sequence the engine runs.

Per layer one K and one V tensor:  # [num_blocks, block_size, n_kv_heads, head_dim]

A token's K (or V) is one contiguous [n_kv_heads, head_dim] row at its slot, slot = block *
block_size + offset, so viewing the pool as [num_blocks * block_size, n_kv_heads, head_dim]
writes a whole step's tokens, whatever sequences they belong to, with one indexed copy. A block
is block_size such rows in a row, so gathering a block table reads whole blocks
(paged_attention.py), and a kernel can walk them (chapter 06). Which block belongs to which
sequence is block_manager.py's business: this file never looks at a sequence.
"""

from __future__ import annotations

import math
import mmap

import torch

from common.config import LlamaConfig


class PagedKVCache:
    def __init__(self, config: LlamaConfig, num_blocks: int, block_size: int, device, dtype: torch.dtype):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        device = torch.device(device)
        # zeros, not empty: a gathered block table may read slots no token has written yet
        # (masked out of attention, but a NaN from garbage memory would survive 0 * NaN).
        self.k = [zeros(self.shape, device, dtype) for _ in range(config.num_hidden_layers)]
        self.v = [zeros(self.shape, device, dtype) for _ in range(config.num_hidden_layers)]

    @staticmethod
    def blocks_in(nbytes: int, config: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
        """How many blocks `nbytes` of memory hold (K and V, every layer)."""
        return nbytes // (config.kv_bytes_per_token(dtype.itemsize) * block_size)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores k and v ([tokens, n_kv_heads, head_dim]) at `slots` ([tokens])."""
        _, _, heads, dim = self.shape
        self.k[layer].view(-1, heads, dim).index_copy_(0, slots, k)
        self.v[layer].view(-1, heads, dim).index_copy_(0, slots, v)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write for a forked sequence's partly filled last block (block_manager.fork)."""
        for tensors in (self.k, self.v):
            for t in tensors:
                t[dst] = t[src]


def zeros(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of zeros that, on a CPU, takes memory only as its pages are first written.

    The pool is sized for the worst case, and torch.zeros would write every byte of it at start-up
    (a 5 GiB pool: 1.1 s on two Xeon cores, and all 5 GiB resident before the first request). An
    anonymous mapping reads as zeros by definition (POSIX mmap), and the kernel backs a page only
    when it is first written: the pool costs the blocks that sequences fill. On a GPU zeroing is
    a fast memset."""
    n = math.prod(shape)
    if device.type != "cpu" or n == 0:
        return torch.zeros(shape, device=device, dtype=dtype)
    pages = mmap.mmap(-1, n * dtype.itemsize)  # unmapped when the tensor is freed
    return torch.frombuffer(pages, dtype=dtype, count=n).view(shape)
