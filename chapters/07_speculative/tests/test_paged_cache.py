"""The KV block pool's memory: on a CPU it is taken as blocks are first written, not when the pool is
made, and a budget for a pool larger than the free memory is refused with a clear error."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import memory
from common.config import load_config
from common.models import resolve_model
from paged_cache import PagedKVCache
from runner import pool_size

STATM = Path("/proc/self/statm")
MiB = 2**20


def resident_bytes() -> int:
    return int(STATM.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not STATM.exists(), reason="needs Linux's /proc/self/statm to read the resident memory")
def test_a_cpu_pool_takes_memory_as_its_blocks_are_written():
    config = load_config(resolve_model("smollm2-135m"))
    block_size = 16
    n_blocks = 2**30 // (config.kv_bytes_per_token(4) * block_size)  # 1 GiB of float32 K and V
    before = resident_bytes()
    cache = PagedKVCache(config, n_blocks, block_size, "cpu", torch.float32)
    made = resident_bytes()
    assert cache.nbytes > 1000 * MiB
    assert made - before < 64 * MiB, f"making the pool took {(made - before) / MiB:.0f} MiB"
    # unwritten slots read as zeros (a gathered block table reads them, masked)
    assert not cache.k[0][::97].any() and not cache.v[-1][::89].any()
    # a block written costs about its own pages in every layer, and reads back what was written
    slots = torch.arange(5 * block_size, 6 * block_size)
    heads, dim = config.num_key_value_heads, config.head_dim
    for layer in range(config.num_hidden_layers):
        k, v = torch.randn(block_size, heads, dim), torch.randn(block_size, heads, dim)
        cache.write(layer, slots, k, v)
        assert torch.equal(cache.k[layer][5], k) and torch.equal(cache.v[layer][5], v)
    assert resident_bytes() - made < 64 * MiB
    assert not cache.k[0][4].any() and not cache.k[0][6].any()  # its neighbours untouched
    # every dtype a pool takes, and a pool of no block (mmap refuses a mapping of 0 bytes)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert PagedKVCache(config, 0, block_size, "cpu", dtype).k[0].shape == (0, block_size, heads, dim)
        small = PagedKVCache(config, 3, block_size, "cpu", dtype)
        assert small.k[2].dtype == dtype and not small.v[1].any()


def test_a_pool_budget_over_the_free_memory_is_a_clear_error(monkeypatch):
    config = load_config(resolve_model("tiny-llama3"))
    model = SimpleNamespace(config=config, device=torch.device("cpu"), dtype=torch.float32)
    block = config.kv_bytes_per_token(4) * 16
    monkeypatch.setattr(memory, "free_memory", lambda device: 40 * block)
    with pytest.raises(MemoryError, match=r"GiB is more than the 0\.\d\d GiB free on cpu: lower --kv-cache-memory-gb"):
        pool_size(model, 16, most=1000, kv_cache_bytes=41 * block)
    assert pool_size(model, 16, most=1000, kv_cache_bytes=40 * block) == 40
    assert pool_size(model, 16, most=30, kv_cache_bytes=100 * block) == 30  # what is used is what counts
    assert pool_size(model, 16, most=1000, kv_cache_bytes=None) == 10  # the default: a quarter of it
