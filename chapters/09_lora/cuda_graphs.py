"""Decode steps replayed as CUDA graphs.

At batch 1 a decode step of a small model is a few hundred kernels of a few microseconds each,
and Python launches them one by one: a launch costs 5-20 us of CPU time, so the GPU spends most
of the step waiting for the next launch. A CUDA graph records a whole step's kernels once, with
their arguments, and replays them with one launch.

What a graph records is fixed: the kernels, their grid sizes and the addresses they read and
write. So everything that changes from step to step must live in tensors the graph reads, at
addresses that do not change (`static` below), and everything else must be the same each time:

    the batch size      captured once per bucket (1, 2, 4, 8, 16, 24, 32, ...); a step of 5
                        sequences runs the graph of 8, with 3 padding sequences that write their
                        K/V to a block no sequence owns and whose logits are dropped
    the block tables    [bucket, max_blocks]: as wide as the longest context, for every step;
                        the decode kernel reads only the blocks within context_lens
    the token budget    decode only: prefill steps (their shapes vary) run eagerly, as before

Nothing in the forward pass of a decode step may read a tensor's value on the host (no .item(),
no Python branch on a tensor), which is also why the decode kernel sizes its partitions from
the table's width and not from the longest context.

On a CPU there are no graphs; `capture=False` runs the same padded, static-buffer steps eagerly,
which is how this chapter's tests check everything here but the capture itself.
"""

from __future__ import annotations

import torch

from batch import DecodeGroup, StepBatch, Work
from model import Model, forward
from paged_cache import PagedKVCache

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(
        self, model: Model, cache: PagedKVCache, max_batch: int, max_blocks: int, pad_block: int, capture: bool
    ):
        """pad_block: a block of the pool the block manager never hands out (padding writes there)."""
        self.model, self.cache, self.capture = model, cache, capture
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.max_blocks, self.pad_block = max_blocks, pad_block
        device = model.device
        n = self.buckets[-1]
        # Everything a step varies, at fixed addresses: written before each replay.
        self.ids = torch.zeros(3, n, dtype=torch.long, device=device)  # tokens, positions, slots
        self.tables = torch.full((n, max_blocks), pad_block, dtype=torch.int32, device=device)
        self.lens = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, its logits)
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for every bucket

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def run(self, work: list[Work]) -> torch.Tensor:
        """A decode step (one new token per sequence) -> logits [len(work), vocab]."""
        n, bucket = len(work), self.bucket(len(work))
        bs = self.cache.block_size
        pad = bucket - n
        # Padding rows write slot 0 of the spare block and read it back (context 1).
        ids = torch.tensor(
            [
                [w.tokens[0] for w in work] + [0] * pad,
                [w.start for w in work] + [0] * pad,
                [w.block_table[w.start // bs] * bs + w.start % bs for w in work] + [self.pad_block * bs] * pad,
            ]
        )
        tables = [w.block_table[: w.start // bs + 1] for w in work]
        tables = torch.tensor(
            [t + [self.pad_block] * (self.max_blocks - len(t)) for t in tables]
            + [[self.pad_block] * self.max_blocks] * pad,
            dtype=torch.int32,
        )
        lens = torch.tensor([w.start + 1 for w in work] + [1] * pad, dtype=torch.int32)
        self.ids[:, :bucket].copy_(ids, non_blocking=True)
        self.tables[:bucket].copy_(tables, non_blocking=True)
        self.lens[:bucket].copy_(lens, non_blocking=True)
        if not self.capture:
            return self._forward(bucket)[:n]
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:n]

    def _forward(self, bucket: int) -> torch.Tensor:
        """The model on the static buffers' first `bucket` rows."""
        tokens, positions, slots = self.ids[:, :bucket]
        group = DecodeGroup(self.tables[:bucket], self.lens[:bucket])
        step = StepBatch(tokens, positions, slots, [group], last=torch.arange(bucket, device=tokens.device))
        return forward(self.model, step, self.cache)

    def _capture(self, bucket: int):
        # Warm up on a side stream first (as torch's docs prescribe): lazy initialisations, the
        # allocator's first blocks and cuBLAS workspaces must not happen inside the capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(bucket)
        return graph, logits
