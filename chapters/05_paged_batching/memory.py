"""How much memory the KV block pool takes.

Chapter 04 gave each request a cache of its own and refused a request whose estimate exceeded
a per-request budget. Here the pool is allocated once, when the engine starts, and every
request lives inside it: blocks are taken as sequences grow and given back as they finish, and
when the pool runs dry the scheduler preempts. What a step holds beyond the pool is bounded by
the scheduler's limits, not by any one request: at most max_num_batched_tokens new tokens (the
activations of a prefill chunk) and max_num_seqs rows of logits.
"""

from __future__ import annotations

import os

import torch

# The default pool: a quarter of what the device has free once the weights are loaded (vLLM
# takes 90% of a GPU it owns; a CPU is shared with the OS, the tokenizer and the HTTP server).
DEFAULT_KV_SHARE = 0.25
GiB = 2**30


def default_kv_bytes(device: torch.device) -> int | None:
    """DEFAULT_KV_SHARE of the memory free on `device` now; None when unknown."""
    free = free_memory(torch.device(device))
    return None if free is None else int(free * DEFAULT_KV_SHARE)


def check_fits(nbytes: int, device: torch.device) -> None:
    """A MemoryError that says so when a pool of `nbytes` is more than `device` has free. A CPU pool
    takes its pages as blocks fill (paged_cache.zeros): one too large would fail mid-run, not here."""
    free = free_memory(torch.device(device))
    if free is not None and nbytes > free:
        raise MemoryError(
            f"a KV cache of {nbytes / GiB:.2f} GiB is more than the {free / GiB:.2f} GiB free on {device}: "
            "lower --kv-cache-memory-gb"
        )


def free_memory(device: torch.device) -> int | None:
    """Bytes a process could still allocate on `device`. On Linux CPUs, MemAvailable: free pages
    plus the page cache the kernel gives back on demand (free pages alone can be a small part of
    it on a machine that has read many files)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024  # the file says kB and means KiB
        except OSError:
            pass
        if hasattr(os, "sysconf"):
            try:
                return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError):
                return None
    return None
