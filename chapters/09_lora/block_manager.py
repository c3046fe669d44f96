"""Which KV-cache blocks each sequence owns: a free list, reference counts and a prefix cache.

The cache is a pool of `num_blocks` blocks of `block_size` token slots (paged_cache.py holds
the tensors; this file only hands out block numbers). A sequence's block table lists its blocks
in order: token t of the sequence lives in block table[t // block_size], slot t % block_size.
Memory is taken a block at a time as a sequence grows, and given back the moment it finishes,
so no sequence holds room for tokens it may never produce (the contiguous cache of chapter 04
reserved prompt + max_tokens slots up front).

Prefix caching: a full block is named by a hash of its tokens chained with the previous
block's hash, so the name stands for the whole prefix up to the block's end. When a new
sequence starts with the same tokens (a shared system prompt, the earlier turns of a chat), its
table takes the cached blocks instead of computing them again. A hit is served only if the
block's stored tokens equal the sequence's and the block was computed after the very block the
sequence has just taken (its number, and which use of that number: a block is reused for other
data after eviction). Each block's K/V then provably follow the sequence's own prefix, so a hash
collision costs a miss, never a wrong answer. With LoRA adapters (lora_slots.py) the same tokens
through another adapter are other K/V: a block's name and its check include the adapter that
computed it, so a prefix cached by one adapter serves only that adapter. A block can be in use
by several sequences at once (its reference count); when the count drops to zero a cached block
is not wiped but parked, least recently used first, and reused for new data only when the free
list is empty.

Invariant, after any sequence of calls: used + free == num_blocks, where "free" counts the
uncached free blocks and the parked cached ones (both can be handed out now).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


def block_hash(previous: int | None, tokens: tuple[int, ...]) -> int:
    """The name of a full block: its tokens and, through `previous`, every token before them.
    Python's hash of a tuple of ints is deterministic (no PYTHONHASHSEED for ints)."""
    return hash((previous, tokens))


def chain_start(adapter: int | None) -> int | None:
    """The `previous` of a sequence's first block: None for the base model, else a seed of the LoRA
    adapter (lora_slots.py's uid), so that every block name of its prefixes is its own."""
    return None if adapter is None else hash(("lora", adapter))


@dataclass
class CachedBlock:
    """What a registered block holds, to check a hit against."""

    hash: int
    tokens: tuple[int, ...]
    parent: tuple[int, int] | None  # (block, its use count) computed just before; None: a sequence's first block
    adapter: int | None = None  # the LoRA adapter's uid that computed it (None: the base model)


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of one slot, got {num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref_count = [0] * num_blocks
        self.uses = [0] * num_blocks  # how often each block was handed out: names one filling of it
        self._free = list(range(num_blocks - 1, -1, -1))  # uncached free blocks, a stack: block 0 goes first
        self._parked: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced blocks, least recent first
        self._cached: dict[int, CachedBlock] = {}  # block -> what it holds, for registered (full) blocks
        self._by_hash: dict[int, int] = {}  # hash -> block
        self.queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # ... and found there

    # --- counts ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: free, or cached and unreferenced."""
        return len(self._free) + len(self._parked)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks that hold a registered prefix (in use or parked)."""
        return len(self._cached)

    @property
    def parked(self) -> list[int]:
        """Cached blocks nobody uses, least recently used first: evicted in this order."""
        return list(self._parked)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    # --- a sequence's table ---------------------------------------------------------------------

    def take_prefix(self, table: list[int], tokens: list[int], adapter: int | None = None) -> int:
        """Starts an empty `table` with the cached blocks of `tokens`' longest cached prefix
        computed with `adapter` (a LoRA uid; None: the base model), and returns how many tokens
        they hold. At least the last token is left out, so the caller always computes one (its
        logits are what the next token is sampled from)."""
        assert not table, "a prefix is only taken by a sequence that holds no blocks"
        if not self.prefix_caching:
            return 0
        full = (len(tokens) - 1) // self.block_size
        previous = chain_start(adapter)
        for i in range(full):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(previous, chunk)
            block = self._by_hash.get(h)
            entry = self._cached.get(block) if block is not None else None
            if (
                entry is None
                or entry.tokens != chunk
                or entry.parent != self._parent_of(table, i)
                or entry.adapter != adapter
            ):
                break  # a miss, or a collision: the blocks from here on are computed again
            self._ref(block)
            table.append(block)
            previous = h
        return len(table) * self.block_size

    def count_lookup(self, n_tokens: int, n_hit: int) -> None:
        """Statistics: a sequence of `n_tokens` started with `n_hit` of them found in the cache
        (the scheduler counts the sequences it admits, not every look that had to wait)."""
        self.queried_tokens += n_tokens
        self.hit_tokens += n_hit

    def can_grow(self, table: list[int], n_tokens: int) -> bool:
        return self.blocks_for(n_tokens) - len(table) <= self.num_free

    def grow(self, table: list[int], n_tokens: int) -> None:
        """Appends blocks to `table` until it holds `n_tokens` slots. Raises OutOfBlocks (taking
        nothing) when the pool cannot."""
        need = self.blocks_for(n_tokens) - len(table)
        if need > self.num_free:
            raise OutOfBlocks(f"{need} more blocks needed, {self.num_free} free")
        for _ in range(need):
            table.append(self._take_free())

    def register(self, table: list[int], tokens: list[int], n_computed: int, adapter: int | None = None) -> None:
        """Names the full blocks among the first `n_computed` tokens (their K/V are in the cache,
        computed with `adapter`), so that later sequences of the same adapter can share them. A
        block already named stays as it is."""
        if not self.prefix_caching:
            return
        previous = chain_start(adapter)
        for i in range(n_computed // self.block_size):
            block = table[i]
            entry = self._cached.get(block)
            if entry is None:
                chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
                h = block_hash(previous, chunk)
                if h in self._by_hash:
                    # The same prefix computed twice (two sequences started together), or a
                    # collision: the first copy stays the one that is shared, and this table's
                    # later blocks, computed after a block nobody can find, are not named.
                    return
                entry = self._cached[block] = CachedBlock(h, chunk, self._parent_of(table, i), adapter)
                self._by_hash[h] = block
            previous = entry.hash

    def fork(self, parent: list[int], n_tokens: int) -> tuple[list[int], tuple[int, int] | None]:
        """A table for a new sequence whose first `n_tokens` tokens are the parent's: the full
        blocks are shared, a partly filled last block is copied. -> the table, and the
        (source, destination) block to copy, if any. Raises OutOfBlocks when no block is free for
        the copy."""
        full, partial = divmod(n_tokens, self.block_size)
        copy = None
        if partial:
            if not self.num_free:
                raise OutOfBlocks("no free block to copy a partly filled block into")
            copy = (parent[full], self._take_free())
        table = parent[:full]
        for block in table:
            self._ref(block)
        if copy:
            table.append(copy[1])
        return table, copy

    def truncate(self, table: list[int], n_tokens: int) -> None:
        """Gives back the blocks of `table` past its first `n_tokens` slots: a speculating sequence
        grew its table for drafts that were rejected. Such blocks were never registered (only blocks
        of computed, kept tokens are), so nothing can find the rejected tokens' K/V; the slots of
        rejected drafts inside a kept block are overwritten when their position runs again."""
        keep = self.blocks_for(n_tokens)
        self.free(table[keep:])
        del table[keep:]

    def free(self, table: list[int]) -> None:
        """Gives back a sequence's blocks (last first, so the end of a prefix is evicted before its
        start) and empties the table."""
        for block in reversed(table):
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, f"block {block} freed more often than taken"
            if self.ref_count[block] == 0:
                if block in self._cached:
                    self._parked[block] = None
                else:
                    self._free.append(block)
        table.clear()

    # --- internals ------------------------------------------------------------------------------

    def _parent_of(self, table: list[int], i: int) -> tuple[int, int] | None:
        """Which filling of which block comes before block i of `table`."""
        return (table[i - 1], self.uses[table[i - 1]]) if i else None

    def _ref(self, block: int) -> None:
        if self.ref_count[block] == 0:
            self._parked.pop(block, None)
        self.ref_count[block] += 1

    def _take_free(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # evict the least recently used cached block
            block, _ = self._parked.popitem(last=False)
            entry = self._cached.pop(block)
            del self._by_hash[entry.hash]
        self.ref_count[block] = 1
        self.uses[block] += 1
        return block
