"""The model runner: the model and its KV pool, and one forward pass over a step's work.

    logits = runner.run(work)     # one Work per row: a sequence's new tokens, where they start,
                                  # its block table -> [rows, vocab], each row's last position

Everything that touches the weights or the K/V pool lives here, and nothing else does: the engine
(engine.py) decides who runs and what a logits row means, the runner computes it. That split is
what lets a later chapter put one runner on every device of a tensor-parallel group while one
engine schedules for all of them. With the kernels on CUDA, a decode step (one token per row)
replays a captured CUDA graph instead of launching its kernels one by one (cuda_graphs.py).
"""

from __future__ import annotations

import torch

from batch import Work, build_step
from common.errors import UserError
from cuda_graphs import DecodeGraphs
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
    def __init__(
        self, model: Model, num_blocks: int, block_size: int, max_rows: int, max_blocks: int, cuda_graphs: bool = True
    ):
        """max_rows: the most rows a decode step has, max_blocks: the longest block table (both size
        the graphs' static buffers). cuda_graphs: replay decode steps where the model's ops can (on
        CUDA, with the kernels); False: every step eagerly."""
        if num_blocks < 1:
            raise UserError(f"the KV cache budget holds no block of {block_size} tokens: raise --kv-cache-memory-gb")
        model.ops.check_block_size(block_size)
        self.model = model
        self.block_size = block_size
        graphs = cuda_graphs and model.ops.can_capture_graphs
        # With graphs, one block more than the block manager knows: padding sequences write there.
        self.cache = PagedKVCache(
            model.config, num_blocks + 1 if graphs else num_blocks, block_size, model.device, model.dtype
        )
        self.graphs = DecodeGraphs(model, self.cache, max_rows, max_blocks, num_blocks, capture=True) if graphs else None

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: a block shared by several sequences, about to be written by one of them."""
        for src, dst in copies:
            self.cache.copy_block(src, dst)

    @torch.inference_mode()
    def run(self, work: list[Work]) -> torch.Tensor:
        """One forward pass: every row's tokens through the model, their K/V into the pool.
        -> [rows, vocab], the logits at each row's last token."""
        if self.graphs is not None and all(len(w.tokens) == 1 for w in work) and self.graphs.bucket(len(work)):
            return self.graphs.run(work)  # a decode step: one replay
        return forward(self.model, build_step(work, self.block_size, self.model.device), self.cache)
