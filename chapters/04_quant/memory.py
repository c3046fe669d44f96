"""What one request costs in memory, and a KV cache that grows as it is used instead of
being sized for tokens that may never come.

A request with `n` choices, a prompt of P tokens and room for M new ones holds, at its peak:

    KV cache      n x (P + M) x kv_bytes_per_token        the cache's final size (see `resize`)
    prefill       the prompt's one pass: attention scores [heads, P, P] and the MLP's activations
    sampling      per step, logits [n, vocab] and the sampler's float32 copies of them

The cache starts at P + CACHE_CHUNK slots and doubles when full (never past P + M), so a chat
that stops after 20 tokens never holds the 8192-token cache its max_tokens allowed. The
estimate counts the cache at its largest, so it holds whenever the request runs to M tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.config import LlamaConfig
from kv_cache import KVCache, available_memory

CACHE_CHUNK = 256  # slots past the prompt in a request's first cache; it doubles from there
# The default per-request budget: a quarter of what the device has free once the weights are
# loaded. One request runs at a time; the rest is the OS's, other processes', the allocator's
# slack and the estimate's error.
DEFAULT_BUDGET_SHARE = 0.25
GiB = 2**30


@dataclass
class MemoryEstimate:
    kv_cache: int  # bytes, the cache at its largest
    prefill: int  # bytes, the activations of the prompt's pass
    sampling: int  # bytes, one decode step's logits and sampler copies

    @property
    def total(self) -> int:
        return self.kv_cache + self.prefill + self.sampling

    def describe(self) -> str:
        return (
            f"{size(self.total)}: KV cache {size(self.kv_cache)}, "
            f"prompt pass {size(self.prefill)}, sampling {size(self.sampling)}"
        )


def size(nbytes: int) -> str:
    """GiB, or MiB below a tenth of one (a small request or budget read "0.00 GiB")."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB / 10 else f"{nbytes / 2**20:.1f} MiB"


def estimate(config: LlamaConfig, dtype: torch.dtype, n: int, n_prompt: int, max_tokens: int) -> MemoryEstimate:
    """An upper bound of what a request adds to the memory the weights already hold."""
    kv = config.kv_bytes_per_token(dtype.itemsize) * n * (n_prompt + max_tokens)
    # The prompt runs once, batch 1, whatever n (engine.py shares it). Attention arithmetic is
    # float32 on CPU (model.py widens bf16), and torch's CPU kernel holds two [heads, P, P]
    # float32 tensors with a mask; the MLP and the residual stream hold a few [P, width] ones.
    # Fitted to the peak RSS of smollm2-135m prefills on CPU (P = 1000: 145 MiB, 2000: 428 MiB;
    # this gives 145 and 427).
    prefill = 4 * (
        2 * config.num_attention_heads * n_prompt**2
        + n_prompt * (10 * config.intermediate_size + 8 * config.hidden_size)
    )
    # logits, their float32 copy, probabilities, the sorted copy, sort indices (int64) and masks
    sampling = 8 * 4 * n * config.vocab_size
    return MemoryEstimate(kv, prefill, sampling)


def default_budget(device: torch.device) -> int | None:
    """DEFAULT_BUDGET_SHARE of the memory free on `device` now; None when unknown (no budget)."""
    free = free_memory(torch.device(device))
    return None if free is None else int(free * DEFAULT_BUDGET_SHARE)


def free_memory(device: torch.device) -> int | None:
    """Bytes a process could still allocate on `device`. On Linux CPUs, MemAvailable: free pages
    plus the page cache the kernel gives back on demand (free pages alone can be a small part of
    it on a machine that has read many files); elsewhere kv_cache.available_memory."""
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024  # the file says kB and means KiB
        except OSError:
            pass
    return available_memory(device)


def first_capacity(n_prompt: int, n_total: int) -> int:
    """Slots of a request's first cache: the prompt and a chunk of output."""
    return min(n_prompt + CACHE_CHUNK, n_total)


def next_capacity(capacity: int, n_total: int) -> int:
    """Doubling keeps the copies cheap: each slot is copied about once on average."""
    return min(2 * capacity, n_total)


def resize(cache: KVCache, batch: int, max_seq: int) -> None:
    """Gives `cache` `batch` rows of `max_seq` slots, in place, keeping the filled slots; a
    batch-1 cache's row is copied into every row (the n choices share their prompt).

    Layer by layer: only one layer is ever held twice, where building a second KVCache and
    copying into it would hold the old and the new cache at once, up to twice the final size."""
    _, heads, _, dim = cache.shape
    shape = (batch, heads, max_seq, dim)
    filled = cache.length
    for tensors in (cache.k, cache.v):
        for i, old in enumerate(tensors):
            # empty, not zeros: a slot is always written before attention reads it
            new = old.new_empty(shape)
            new[:, :, :filled] = old[:, :, :filled]
            tensors[i] = new
    cache.shape = shape
