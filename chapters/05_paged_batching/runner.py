"""The model runner: the model and its KV pool, and one forward pass over a step's work.

    logits = runner.run(work)     # one Work per row: a sequence's new tokens, where they start,
                                  # its block table -> [rows, vocab], each row's last position

Everything that touches the weights or the K/V pool lives here, and nothing else does: the engine
(engine.py) decides who runs and what a logits row means, the runner computes it. That split is
what lets a later chapter put one runner on every device of a tensor-parallel group while one
engine schedules for all of them.
"""

from __future__ import annotations

import torch

from batch import Work, build_step
from common.errors import UserError
from memory import check_fits, default_kv_bytes
from model import Model, forward
from paged_cache import PagedKVCache


def pool_size(model: Model, block_size: int, most: int, kv_cache_bytes: int | None) -> int:
    """How many KV blocks to allocate: what `kv_cache_bytes` buy (default: memory.default_kv_bytes
    of the model's device), never more than `most`, the blocks that could ever be used at once."""
    budget = kv_cache_bytes if kv_cache_bytes is not None else default_kv_bytes(model.device)
    if budget is None:  # free memory unknown (MPS)
        return most
    blocks = min(most, PagedKVCache.blocks_in(budget, model.config, block_size, model.dtype))
    if kv_cache_bytes is not None:  # the default is a share of what is free
        check_fits(blocks * block_size * model.config.kv_bytes_per_token(model.dtype.itemsize), model.device)
    return blocks


class ModelRunner:
    def __init__(self, model: Model, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise UserError(f"the KV cache budget holds no block of {block_size} tokens: raise --kv-cache-memory-gb")
        self.model = model
        self.block_size = block_size
        self.cache = PagedKVCache(model.config, num_blocks, block_size, model.device, model.dtype)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: a block shared by several sequences, about to be written by one of them."""
        for src, dst in copies:
            self.cache.copy_block(src, dst)

    @torch.inference_mode()
    def run(self, work: list[Work]) -> torch.Tensor:
        """One forward pass: every row's tokens through the model, their K/V into the pool.
        -> [rows, vocab], the logits at each row's last token."""
        return forward(self.model, build_step(work, self.block_size, self.model.device), self.cache)
