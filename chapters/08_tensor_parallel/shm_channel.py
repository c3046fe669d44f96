"""The ranks of one host talk through shared memory: vLLM's CPU backend's idea, for every message of
a step (the plan rank 0 sends, the two all-reduces per layer, the logits' gather).

gloo sends each of them through TCP sockets on the loopback: a few hundred microseconds here, most
of it system calls and wake-ups, and a step makes 2 per layer and 3 more. Ranks on one host can
instead share a file in /dev/shm that each maps: one cache line of flags per rank, then two sets of
one slot per rank. Every rank makes the same calls in the same order, and call n goes like this:

    wait until every flag has reached n - 1   (everyone is done with call n - 2, which used this set)
    write my part into my slot of set n % 2; publish my flag = n
    wait until the flags of the ranks I read have reached n, then read their slots

    all_reduce   every rank writes its partial sum, reads every slot, and adds them in rank order:
                 the same sum, bit for bit, on every rank
    gather       every rank writes its slice of the logits; rank 0 reads them all, in rank order
    send / recv  rank 0 writes a pickled message (the step's plan); the others read it, then publish

Waiting spins (the other ranks arrive within microseconds in a step), yielding the core between
looks; a worker waiting for the next plan (an idle server, for hours) backs off to sleeping.
x86 keeps stores in order, so a flag is seen only after the data written before it (an ARM host
would need a fence before each flag). The file is unlinked once every rank has mapped it: nothing
is left behind whatever way the ranks end. Until then rank 0 holds a lock on it (flock), which the
kernel lets go when rank 0 dies however it dies: a file nobody holds (its rank 0 killed while the
ranks loaded: SIGKILL, the out-of-memory killer) is removed by the next group that starts. A lock,
not a pid: a container sharing /dev/shm with another (docker --ipc=host) sees none of its pids.
Its space is reserved when it is made: a /dev/shm too small for it (Docker's default 64 MB, at 8
ranks) is an error at start, not a SIGBUS in the middle of a long prompt.

The hot path is NumPy on the flags and one or two torch operators on cached views of the slots:
each torch operator costs a few microseconds, and ten of them per call took ~90 µs where the wait
itself takes one. Even so a call costs ~10 µs of Python, so where the kernel library is loaded its
C++ twin of the all-reduce and the gather (kernels/csrc/shm_channel.h: the same file, flags and
sums) takes them over (`attach_library`, then `native`), and the library's one-call decoder layer
calls it without coming back to Python. A rank's flag is the number of its last call, whichever
side made it: the two take turns on one file.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import pickle
import time

import numpy as np
import torch

from common.errors import UserError

PREFIX = "llm-tp-"  # the files: PREFIX + rank 0's pid + "-" + a timestamp, in /dev/shm
_held: dict[str, int] = {}  # path -> the descriptor whose lock says its rank 0 runs (ShmChannel.remove)
SLOT_BYTES = 4 << 20  # a bigger tensor or plan (a long prompt chunk) goes through the process group
CHECK_S = 0.1  # while waiting, look this often whether a rank is gone
SPIN_S = 0.05  # a worker waiting for a plan spins this long, then sleeps between looks (idle)
TOO_BIG_LENGTH = -1  # a plan's length that says: this one comes through the process group
TOO_BIG = object()  # what recv returns then


def remove_orphans(folder: str) -> None:
    """Unlinks the channel files whose rank 0 no longer holds their lock (another user's files
    cannot be opened or unlinked here: left alone)."""
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: its rank 0 runs
            os.unlink(path)
        except OSError:
            pass
        finally:
            os.close(fd)


class ShmChannel:
    @staticmethod
    def size(world: int) -> tuple[int, int]:
        """(bytes of the flags: one cache line per rank, bytes of the whole file)."""
        flags = 64 * world
        return flags, flags + 2 * world * SLOT_BYTES

    @classmethod
    def create(cls, folder: str, world: int) -> str:
        """Rank 0, before it starts the others: the file, zeros (every flag at call 0), its space
        reserved. -> its path."""
        remove_orphans(folder)
        name = f"{os.getpid()}-{time.monotonic_ns()}"
        making, path = os.path.join(folder, f".{PREFIX}{name}"), os.path.join(folder, f"{PREFIX}{name}")
        size = cls.size(world)[1]
        try:
            fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise UserError(
                f"cannot make the ranks' shared-memory file in {folder} ({e.strerror}): "
                "TP_TRANSPORT=gloo runs the ranks without it"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # before its name is one a sweep looks at (the rename)
            os.posix_fallocate(fd, 0, size)  # a sparse file would fail later, page by page, with SIGBUS
            os.rename(making, path)
        except OSError as e:
            os.close(fd)
            os.unlink(making)
            raise UserError(
                f"{folder} has no room for the ranks' shared memory ({size / 2**20:.0f} MiB for {world} ranks: "
                f"{e.strerror}): free some, give the machine more (docker run --shm-size), or TP_TRANSPORT=gloo"
            ) from None
        _held[path] = fd
        return path

    @staticmethod
    def remove(path: str) -> None:
        """Rank 0, once every rank has mapped the file (or the group failed): its name and its lock."""
        if os.path.exists(path):
            os.unlink(path)
        fd = _held.pop(path, None)
        if fd is not None:
            os.close(fd)

    def __init__(self, path: str, rank: int, world: int, timeout_s: float, check=None):
        """check: called every CHECK_S while waiting; raises if a rank is known to be gone (rank 0
        watches its children), so a dead rank fails the step at once, not after `timeout_s`."""
        self.rank, self.world, self.timeout_s, self.check = rank, world, timeout_s, check
        flags, size = self.size(world)
        with open(path, "r+b") as f:
            self.mem = mmap.mmap(f.fileno(), size)
        self.flags = np.frombuffer(self.mem, dtype=np.int64, count=8 * world)[::8]  # [world], a line each
        self.bytes = np.frombuffer(self.mem, dtype=np.uint8, offset=flags).reshape(2, world, SLOT_BYTES)
        self.slots = torch.frombuffer(self.mem, dtype=torch.uint8, offset=flags).view(2, world, SLOT_BYTES)
        self.views: dict = {}  # (set, dtype, shape) -> the slots of that set as [world, *shape] tensors
        self.file = torch.frombuffer(self.mem, dtype=torch.uint8)  # the whole file, for `native`
        self.native = None  # the kernel library's ShmChannel on this file: all_reduce and gather_last_dim

    @property
    def calls(self) -> int:
        """The number of this rank's last call: its flag."""
        return int(self.flags[self.rank])

    def attach_library(self, ops) -> None:
        """Where the kernels run on this CPU (ops: an ops.KernelOps), the all-reduce and the gather go
        through the library's C++ twin from now on (`native`). With ops.py, the one file here that
        loads the library: chapters before this one have no use for its ShmChannel."""
        from ops import KernelOps

        if isinstance(ops, KernelOps) and ops.device.type == "cpu":
            import kernels

            lib = kernels.load()
            self.native = lib.ShmChannel(self.file, self.rank, self.world, SLOT_BYTES, self.timeout_s, self.check)

    def fits(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.numel() * t.element_size() <= SLOT_BYTES

    # --- the three messages -----------------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.native is not None and self.native.fits(t):
            return self.native.all_reduce(t)
        slots = self._write(t)
        self._wait(self.calls, self.flags)
        return torch.sum(slots, dim=0, out=t)  # slot 0 + slot 1 + ..., the same order everywhere

    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """[rows, V/N] on each rank -> [rows, V] on rank 0 (its own slice elsewhere)."""
        if self.native is not None and self.native.fits(t):
            return self.native.gather_last_dim(t)
        slots = self._write(t)
        if self.rank != 0:
            return t
        self._wait(self.calls, self.flags)
        return torch.cat(slots.unbind(0), dim=-1)

    def send(self, message) -> bool:
        """Rank 0: the message to every other rank. -> False when it is too big for a slot: then
        the caller sends it through the process group, where the others will look for it."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        n = self._begin()
        fits = len(data) + 8 <= SLOT_BYTES
        slot = self.bytes[n % 2, 0]
        slot[:8].view(np.int64)[0] = len(data) if fits else TOO_BIG_LENGTH
        if fits:
            slot[8 : 8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.flags[0] = n
        return fits

    def recv(self):
        """The others: rank 0's next message, or TOO_BIG (it comes through the process group)."""
        n = self.calls + 1
        self._wait(n, self.flags[:1], idle=True)
        slot = self.bytes[n % 2, 0]
        length = int(slot[:8].view(np.int64)[0])
        message = TOO_BIG if length == TOO_BIG_LENGTH else pickle.loads(slot[8 : 8 + length].tobytes())
        self.flags[self.rank] = n  # read: rank 0 may reuse this set at call n + 2
        return message

    # --- the protocol ---------------------------------------------------------------------------

    def _begin(self) -> int:
        """A call that writes: its number, once every rank is done with the set it will write."""
        n = self.calls + 1
        self._wait(n - 1, self.flags)
        return n

    def _write(self, t: torch.Tensor) -> torch.Tensor:
        """t into this rank's slot, the flag published. -> every rank's slot of this call as t's."""
        n = self._begin()
        key = (n % 2, t.dtype, t.shape)
        slots = self.views.get(key)
        if slots is None:
            nbytes = t.numel() * t.element_size()
            slots = self.slots[n % 2, :, :nbytes].view(t.dtype).view(self.world, *t.shape)
            self.views[key] = slots
        slots[self.rank].copy_(t)
        self.flags[self.rank] = n
        return slots

    def _wait(self, n: int, watched: np.ndarray, idle: bool = False) -> None:
        """Until every flag in `watched` (a view of self.flags) reaches call n. idle: no deadline (a
        worker waiting for work), and after SPIN_S it sleeps between looks."""
        if watched.min() >= n:
            return
        start = look = time.monotonic()
        while watched.min() < n:
            now = time.monotonic()
            if not idle and now - start > self.timeout_s:
                raise TimeoutError(f"shared memory: a rank did not arrive in {self.timeout_s:g} s")
            if now - look > CHECK_S and self.check is not None:
                self.check()
                look = now
            if idle and now - start > SPIN_S:
                time.sleep(min(0.01, (now - start) / 100))
            else:
                os.sched_yield()
