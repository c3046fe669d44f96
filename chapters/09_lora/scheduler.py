"""Which sequences run in the next step, and how many tokens each adds.

Two queues: `waiting` (arrived, or preempted, in order) and `running` (holding blocks, oldest
first). Each step is built under two limits: a token budget (max_num_batched_tokens: the
step's total new tokens, which bounds its time and activation memory) and a sequence cap
(max_num_seqs). Running sequences come first, so that streams already started keep their pace:

1. Every running sequence gets its next token (one while decoding, or the next chunk of its
   prompt; a decoding sequence with a draft adds the draft too, as far as budget and pool allow,
   since the guesses are only worth running if they displace nobody). If the pool has no block
   for it, the newest running sequence is preempted: its
   blocks go back to the pool and it rejoins the front of the waiting queue, to be computed
   again (its output so far is kept: nothing the client saw is lost). Newest first, because it
   has the least work to redo and the oldest are closest to finishing.
2. Then waiting sequences join, first come first served, while budget, seats and blocks last.
   A sequence first takes the cached blocks of its longest cached prefix (block_manager.py),
   then runs what is left: all of it, or with chunked prefill as much as the budget leaves (the
   rest next step). Without chunking, one long prompt would fill a whole step and stall every
   running stream for its duration.
3. A chunk's attention grows with the context it reads: n tokens at position p compare about
   n * (p + n) query-key pairs. While other sequences run, a prompt chunk is cut so that it
   compares no more pairs than a full chunk does at CHUNK_CONTEXT tokens (`chunk_limit`). On 2
   cores a 256-token chunk of SmolLM2 took 0.7 s at position 1,000 and 1.4 s at 4,000, and every
   other stream waited it out; with the limit a stream's longest gap beside a 5,000-token prompt
   fell from 1.0-1.3 s to 0.75 s, and the long prompt took 20-45 % longer (bench/server_probes.py).
   A sequence of a LoRA adapter also needs a slot for it (lora_slots.py); while every slot is busy
   with other adapters it stays at its place in the queue and the sequences behind it may start
   (the base model's, or another resident adapter's): a request waits for a slot, not for them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from block_manager import BlockManager, OutOfBlocks
from lora_slots import AdapterSlots
from sequence import Sequence, Status


CHUNK_CONTEXT = 1024  # full chunks up to this context; later ones compare as many pairs as they do


def chunk_limit(start: int, max_tokens: int) -> int:
    """The most tokens a prompt chunk from position `start` runs while other sequences run: n with
    n * (start + n) <= max_tokens * (CHUNK_CONTEXT + max_tokens), at least 16 and at most max_tokens."""
    pairs = max_tokens * (CHUNK_CONTEXT + max_tokens)
    n = int((math.sqrt(start * start + 4 * pairs) - start) / 2)
    return max(min(n, max_tokens), min(16, max_tokens))


@dataclass
class Scheduled:
    """One step's plan."""

    work: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens it adds)
    copies: list[tuple[int, int]] = field(default_factory=list)  # blocks to copy before the step (forks)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool = True,
        adapters: AdapterSlots | None = None,
    ):
        """adapters: the engine's LoRA slots (None: the base model only)."""
        self.blocks = blocks
        self.adapters = adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        # Blocks kept back when admitting a new sequence, so that the running ones can grow for a
        # few steps before anyone is preempted (admitting into a full pool thrashes).
        self.watermark = max(1, blocks.num_blocks // 100)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.n_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if seq.adapter is not None:
            seq.adapter_uid = self.adapters.enter(seq.adapter)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """A sequence is done (its last token, or its client left): its blocks go back at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)
        self._release_slot(seq)
        if seq.adapter is not None and seq.status is not Status.FINISHED:  # (an abort after a choice ended)
            self.adapters.leave(seq.adapter_uid)
        seq.status = Status.FINISHED

    def schedule(self) -> Scheduled:
        plan = Scheduled()
        budget = self.max_num_batched_tokens
        # 1. the running sequences, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.draft and not self.blocks.can_grow(seq.block_table, len(seq.tokens) + len(seq.draft)):
                seq.draft = []  # no room to verify guesses: decode one token rather than preempt for them
            n = min(seq.n_uncomputed + len(seq.draft), budget)
            if seq.n_uncomputed > 1 and len(self.running) > 1 and self.chunked_prefill:  # a prompt chunk beside others
                n = min(n, chunk_limit(seq.n_computed, self.max_num_batched_tokens))
            del seq.draft[max(0, n - seq.n_uncomputed) :]  # what the budget leaves of the draft
            while not self.blocks.can_grow(seq.block_table, seq.n_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # it preempted itself: every sequence after it is gone too
            self.blocks.grow(seq.block_table, seq.n_computed + n)
            plan.work.append((seq, n))
            budget -= n
            i += 1
        # 2. waiting sequences, in order, unless this step had to preempt (no room)
        no_slot: list[Sequence] = []  # sequences whose adapter has no slot this step: they keep their place
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not plan.preempted:
            seq = self.waiting[0]
            if not self._take_slot(seq):
                no_slot.append(self.waiting.popleft())
                continue
            n = self._admit(seq, budget, plan)
            if n == 0:
                self._release_slot(seq)
                break  # first come, first served: nobody overtakes the sequence at the front
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.work.append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(no_slot))
        return plan

    def _take_slot(self, seq: Sequence) -> bool:
        """The slot of the sequence's adapter (copied in if it is not resident). False: every slot
        is busy with other adapters; the wait is counted once per sequence."""
        if seq.adapter is None:
            return True
        slot = self.adapters.acquire(seq.adapter_uid)
        if slot is None:
            if not seq.waited_for_slot:
                seq.waited_for_slot = True
                self.adapters.count_wait()
            return False
        seq.lora_slot = slot
        return True

    def _release_slot(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.adapters.release(seq.lora_slot)
            seq.lora_slot = -1

    def _admit(self, seq: Sequence, budget: int, plan: Scheduled) -> int:
        """Gives the sequence at the front of the queue its first blocks, and returns how many
        tokens it runs this step (0: it cannot start yet, and holds nothing)."""
        parent = seq.parent
        lookup = False
        # A choice that has not started follows choice 0 (one that has output of its own was
        # preempted: it starts again like any sequence, from the prefix cache).
        if parent is not None and parent.status is not Status.FINISHED and not seq.output:
            if parent.status is Status.WAITING or parent.n_computed < len(seq.prompt) - 1:
                return 0  # its prompt is being computed by choice 0: start from its blocks after
            try:  # share choice 0's prompt blocks; compute only the prompt's last token (its logits)
                seq.block_table, copy = self.blocks.fork(parent.block_table, len(seq.prompt) - 1)
            except OutOfBlocks:
                return 0
            seq.n_computed = len(seq.prompt) - 1
            if copy:
                plan.copies.append(copy)
        else:
            seq.n_computed = self.blocks.take_prefix(seq.block_table, seq.tokens, seq.adapter_uid)
            lookup = not seq.n_preempted  # the hit rate counts prompts, not recomputations
        n = seq.n_uncomputed
        if self.running and self.chunked_prefill:  # a prompt chunk beside other streams
            n = min(n, chunk_limit(seq.n_computed, self.max_num_batched_tokens))
        if n > budget and self.chunked_prefill:
            n = budget
        keep = self.watermark if self.running else 0
        if (
            n > budget
            or self.blocks.blocks_for(seq.n_computed + n) - len(seq.block_table) > self.blocks.num_free - keep
        ):
            plan.copies = [c for c in plan.copies if c[1] not in seq.block_table]
            self.blocks.free(seq.block_table)  # not now: give back what it took
            seq.n_computed = 0
            return 0
        self.blocks.grow(seq.block_table, seq.n_computed + n)
        if lookup:
            self.blocks.count_lookup(len(seq.tokens), seq.n_computed)
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        self._release_slot(seq)
        seq.draft, seq.draft_probs = [], None
        # Its blocks are gone, and with them a draft model's K/V (kept at the same slots of its own
        # pool): the draft runs the sequence again from the start, as the target does.
        seq.n_computed = seq.draft_computed = 0
        seq.status = Status.WAITING
        seq.n_preempted += 1
        self.n_preemptions += 1
        self.waiting.appendleft(seq)
