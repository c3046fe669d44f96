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

from pathlib import Path

import torch

from batch import Work, build_step
from common.errors import UserError
from cuda_graphs import DecodeGraphs
from lora import Adapter, LoraWeights, read_adapter
from memory import GiB, check_fits, default_kv_bytes, free_memory
from model import Model, forward
from paged_cache import PagedKVCache
from sharding import shard_adapter


def pool_size(model: Model, block_size: int, most: int, kv_cache_bytes: int | None, reserved: int = 0) -> int:
    """How many KV blocks to allocate: what `kv_cache_bytes` buy (default: memory.default_kv_bytes
    of the model's device, less the `reserved` bytes that something else will take there: the LoRA
    slot table), never more than `most`, the blocks that could ever be used at once."""
    budget = kv_cache_bytes if kv_cache_bytes is not None else default_kv_bytes(model.device)
    if budget is None:  # free memory unknown (MPS)
        return most
    if kv_cache_bytes is None:
        budget = max(0, budget - reserved)
    blocks = min(most, PagedKVCache.blocks_in(budget, model.config, block_size, model.dtype))
    if kv_cache_bytes is not None:  # the default is a share of what is free
        check_fits(blocks * block_size * model.config.kv_bytes_per_token(model.dtype.itemsize), model.device)
    return blocks


def lora_table_bytes(model: Model, n_slots: int, max_rank: int) -> int:
    """The bytes of the LoRA slot table (taken at the first load); UserError where they are more
    than the device has free: each load would fail, and with it a step of other requests."""
    table = LoraWeights.table_bytes(model.config, n_slots, max_rank, model.dtype)
    free = free_memory(model.device)
    if free is not None and table > free:
        raise UserError(
            f"a LoRA slot table of {n_slots} slots of rank up to {max_rank} takes {table / GiB:.2f} GiB, more "
            f"than the {free / GiB:.2f} GiB free on {model.device}: fewer slots or a lower rank (a server's "
            "--max-loras, --max-lora-rank; the CLI's one slot is as wide as its adapter's rank)"
        )
    return table


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
        # Tensor parallelism (parallel.py): (the whole model's config, this rank's sharding.ShardPlan);
        # adapters are checked against the whole model and cut to the rank's slices.
        self.shard = None

    def enable_lora(self, n_slots: int, max_rank: int) -> None:
        """A slot table for `n_slots` adapters of rank up to `max_rank` (its memory is taken on the
        first load)."""
        if max_rank < 1:
            raise UserError(f"--max-lora-rank must be at least 1, got {max_rank}")
        m = self.model
        m.lora = LoraWeights(m.config, n_slots, max_rank, m.dtype, m.device)

    def read_lora(self, path: Path) -> Adapter:
        """A PEFT directory, checked against this model (UserError for a bad one)."""
        config = self.model.config if self.shard is None else self.shard[0]
        return read_adapter(path, config, self.model.lora.max_rank, self.model.dtype)

    def forget_lora(self, adapter: Adapter) -> None:
        """A host copy read_lora gave is dropped: one process keeps nothing else (a tensor-parallel
        runner's other ranks drop theirs: parallel.py)."""

    def write_lora(self, slot: int, adapter: Adapter | None) -> None:
        """Fills `slot` of the model's table with `adapter` (this rank's part of it), or empties it (None)."""
        if adapter is None:
            self.model.lora.free(slot)
        else:
            if self.shard is not None:
                adapter = shard_adapter(adapter, *self.shard)
            self.model.lora.load(slot, adapter)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: a block shared by several sequences, about to be written by one of them."""
        for src, dst in copies:
            self.cache.copy_block(src, dst)

    @torch.inference_mode()
    def run(self, work: list[Work]) -> torch.Tensor:
        """One forward pass: every row's tokens through the model, their K/V into the pool.
        -> [rows, vocab], the logits at each row's last token."""
        # A captured graph holds no LoRA segment table: steps with adapter rows run eagerly.
        graphable = all(len(w.tokens) == 1 and w.lora_slot < 0 for w in work)
        if self.graphs is not None and graphable and self.graphs.bucket(len(work)):
            return self.graphs.run(work)  # a decode step: one replay
        return forward(self.model, build_step(work, self.block_size, self.model.device), self.cache)
