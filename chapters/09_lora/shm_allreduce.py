"""An all-reduce between the ranks of one host through shared memory: vLLM's CPU backend's idea.

gloo sends a decode step's all-reduce (a few KB) through TCP sockets on the loopback: a few
hundred microseconds here, most of it system calls and wake-ups, and a decoder layer makes two.
Ranks on one host can instead share a buffer:

    each rank r: copy its partial sum into slot[r]; publish flag[r] = call number
    wait until every flag has reached it (spinning, yielding the core between looks)
    every rank adds slot[0] + slot[1] + ... in that order: the same sum, bit for bit, on every rank

Two sets of slots alternate between calls: a rank can only start call n + 2 once every rank has
published call n + 1, i.e. has finished reading call n's slots, so a slot is never overwritten
while someone still reads it. x86 keeps stores in order (a flag is seen only after the data written
before it). The file lives in /dev/shm and is unlinked once every rank has mapped it: nothing is
left behind whatever way the ranks end.
"""

from __future__ import annotations

import os
import time

import torch

SLOT_BYTES = 1 << 20  # bigger tensors (long prompt chunks) go through the process group
CHECK_S = 0.1


class ShmAllReduce:
    @staticmethod
    def size(world: int) -> tuple[int, int]:
        """(bytes of the flags: one cache line per rank, bytes of the whole file)."""
        flags = 64 * world
        return flags, flags + 2 * world * SLOT_BYTES

    @classmethod
    def create(cls, path: str, world: int) -> None:
        """Rank 0, before the others look for it: the file, zeros (every flag at call 0)."""
        with open(path, "wb") as f:
            f.truncate(cls.size(world)[1])

    def __init__(self, path: str, rank: int, world: int, timeout_s: float, check=None):
        """check: called every CHECK_S while waiting; raises if a rank is known to be gone (rank 0
        watches its children), so a dead rank fails the step at once, not after `timeout_s`."""
        self.rank, self.world, self.timeout_s, self.check = rank, world, timeout_s, check
        flags, size = self.size(world)
        self.mem = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        self.flags = self.mem[:flags].view(torch.int64).view(world, 8)[:, 0]  # [world]
        self.slots = self.mem[flags:].view(2, world, SLOT_BYTES)
        self.calls = 0

    def fits(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.numel() * t.element_size() <= SLOT_BYTES and t.is_contiguous()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        n = t.numel() * t.element_size()
        slots = self.slots[self.calls % 2]  # [world, SLOT_BYTES]
        slots[self.rank, :n].copy_(t.view(-1).view(torch.uint8))
        self.flags[self.rank] = self.calls
        deadline = look = None
        while bool((self.flags < self.calls).any()):
            now = time.monotonic()
            if deadline is None:
                deadline, look = now + self.timeout_s, now + CHECK_S
            elif now > deadline:
                raise TimeoutError(f"shared-memory all-reduce: a rank did not arrive in {self.timeout_s:g} s")
            elif now > look and self.check is not None:
                self.check()
                look = now + CHECK_S
            os.sched_yield()
        parts = [slots[r, :n].view(t.dtype).view(t.shape) for r in range(self.world)]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return t.copy_(total)
