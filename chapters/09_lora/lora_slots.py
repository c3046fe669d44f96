"""Which adapter is in which slot: the engine's bookkeeping of its LoRA adapters.

Adapters are registered by name (`register`, from --lora-modules or a load request) and kept on the
host; `max_loras` of them can be resident at once, in the model's slot table (lora.py); with none,
the engine serves the base model only. A sequence of adapter X can only run while X has a slot, so
the scheduler asks for one when it admits the sequence (`acquire`) and gives it back when the
sequence leaves the running queue (`release`: finished, aborted or preempted). A slot whose adapter
no running sequence uses is idle: it keeps its adapter (the next request of X needs no copy) until
another adapter needs the slot, the least recently used idle slot first. With every slot busy, a
sequence of a new adapter waits, counted in `n_waits`: more adapters than slots are served by
swapping, never refused.

Unloading (`unregister`) stops new requests at once; sequences already added keep their adapter,
which is dropped with the last of them (`users` counts them, waiting or running). Loading a name in
place (`register(..., replace=True)`, vLLM's `load_inplace`) is the same: new requests get the new
weights at once, running ones finish with the weights they started with. So the bookkeeping is by
registration (its uid), and a name is only what new requests ask for (`current`): while the old
weights drain, the name is free to load again.

With `max_cpu` (--max-cpu-loras), at most that many registered adapters keep their weights on the
host while no sequence uses them: the least recently used beyond it drop theirs, and are read again
from their folder when a request names them (vLLM's CPU LoRA cache). An adapter whose bytes changed
since it was registered is refused then, not served: its uid would otherwise stand for other weights.

Each registration gets a new `uid`: the prefix cache keys blocks by it (block_manager.py), so K/V
computed with one adapter never serve another, nor the same name loaded again from new files.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from common.errors import UserError
from lora import Adapter


class AdapterNameError(UserError):
    """The name given to an adapter cannot be used (the HTTP route says which field is wrong)."""


class UnknownAdapter(UserError):
    """A request names an adapter the engine does not serve (never loaded, or unloaded since): for
    the HTTP server a model it does not serve, a 404 whichever check catches it."""

    status, param, code = 404, "model", "model_not_found"


class NoAdapterSlots(UserError):
    """The engine has no slots (max_loras 0): no adapter can be loaded into it."""


# A name goes back in every 404 that lists the loaded ones, and in /v1/models: not a 100,000-character one.
MAX_NAME_CHARS = 256

@dataclass
class Registration:
    """One load of an adapter: what a sequence that names it when it is added keeps to its end."""

    name: str
    path: Path
    digest: str  # of the files' bytes when it was read (a later read must find the same)
    adapter: Adapter | None  # None: its host copy was dropped (read again when a request needs it)
    users: int = 0  # sequences added and not finished, waiting or running
    retired: bool = False  # unloaded or replaced: dropped once no sequence uses it


class AdapterSlots:
    def __init__(
        self,
        n_slots: int,
        read: Callable[[Path], Adapter],
        write: Callable[[int, Adapter | None], None],
        max_cpu: int | None = None,
        forget: Callable[[Adapter], None] = lambda adapter: None,
    ):
        """read(path) -> the checked Adapter (lora.read_adapter for the model); write(slot, adapter)
        fills a slot of the model's table, or empties it (None): the runner's, on every rank;
        forget(adapter): a host copy that read() gave is dropped (the other ranks drop theirs).
        max_cpu: host copies kept of adapters no sequence uses (None: every one)."""
        if n_slots < 0:
            raise UserError(f"--max-loras must be at least 0 (0: no adapters), got {n_slots}")
        if max_cpu is not None and max_cpu < max(n_slots, 1):
            raise UserError(f"--max-cpu-loras must be at least --max-loras ({max(n_slots, 1)}), got {max_cpu}")
        self.n_slots, self._read, self._write, self._forget, self.max_cpu = n_slots, read, write, forget, max_cpu
        self.current: dict[str, int] = {}  # name -> the uid a new request of it gets
        self.loads: dict[int, Registration] = {}  # uid -> its registration, current or draining
        self.on_host: OrderedDict[int, None] = OrderedDict()  # uids with a host copy, least recent first
        self.n_reads = 0  # host copies read again from their folder
        self.slot_of: dict[int, int] = {}  # resident registrations
        self.holder: list[int | None] = [None] * n_slots  # slot -> its registration's uid
        self.running: list[int] = [0] * n_slots  # slot -> running sequences using it
        self.idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(n_slots))  # least recent first
        self._uids = itertools.count(1)
        self.n_loads = 0  # adapters copied into a slot
        self.n_waits = 0  # sequences that had to wait for a slot (at least once each)

    # --- names ----------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """The adapters a request may name."""
        return list(self.current)

    def register(self, name: str, path: str | Path, replace: bool = False) -> None:
        """Reads and checks the adapter (UserError for a bad one). A name already loaded is refused,
        or with `replace` given the new weights: its running sequences finish with the old ones."""
        if not self.n_slots:
            raise NoAdapterSlots("this engine serves no LoRA adapters: start it with --max-loras (max_loras) of 1 or more")
        if not isinstance(name, str) or not name.strip() or not name.isprintable() or len(name) > MAX_NAME_CHARS:
            shown = repr(name) if len(repr(name)) <= 80 else f"{repr(name)[:60]}... ({len(name)} characters)"
            raise AdapterNameError(
                f"a LoRA adapter needs a name of 1 to {MAX_NAME_CHARS} printable characters, got {shown}"
            )
        if name in self.current and not replace:
            raise AdapterNameError(f"LoRA adapter {name!r} is already loaded; unload it first, or load it in place")
        adapter = self._read(Path(path))  # a bad adapter is refused here, the loaded one untouched
        if name in self.current:
            self._retire(self.current[name])
        uid = next(self._uids)
        self.loads[uid] = Registration(name, Path(path), adapter.digest, adapter)
        self.current[name] = uid
        self._keep_on_host(uid)

    def unregister(self, name: str) -> None:
        """No new request may use `name`; its weights are dropped now, or when its last sequence ends."""
        if name not in self.current:
            loaded = ", ".join(self.names()) or "none"
            raise UserError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")
        self._retire(self.current.pop(name))

    def check(self, name: str | None) -> None:
        """A request's adapter: None (the base model) or a loaded name, else UserError. Reads only:
        a server's threads call it too."""
        if name is not None and not self.n_slots:
            raise UnknownAdapter(f"LoRA adapter {name!r}: this engine serves no adapters (max_loras is 0)")
        if name is not None and name not in self.current:
            loaded = ", ".join(self.names()) or "none"
            raise UnknownAdapter(f"unknown LoRA adapter {name!r} (loaded: {loaded})")

    # --- sequences: by the uid `enter` gave them -------------------------------------------------

    def enter(self, name: str | None) -> int | None:
        """A sequence of `name` is being added (on the engine's thread): its host copy is read again
        if it was dropped (UserError if its files changed, before anything is counted). -> the
        registration's uid: what the sequence gives `acquire` and `leave`, and its prefix-cache
        identity (K/V computed with one registration never serve another)."""
        if name is None:
            return None
        self.check(name)
        uid = self.current[name]
        load = self.loads[uid]
        if load.adapter is None:
            load.adapter = self._read_again(load)
        load.users += 1
        self._keep_on_host(uid)
        return uid

    def leave(self, uid: int | None) -> None:
        """A sequence of registration `uid` is finished (it released any slot first)."""
        if uid is not None:
            self.loads[uid].users -= 1
            self._drop_if_unused(uid)
            self._trim_host()

    def acquire(self, uid: int | None) -> int | None:
        """A slot for a sequence about to run: -1 for the base model (None), the registration's slot
        (copied in now if it was not resident, into a free or the least recently used idle slot),
        or None when every slot is busy with other adapters: the sequence waits."""
        if uid is None:
            return -1
        slot = self.slot_of.get(uid)
        if slot is None:
            if not self.idle:
                return None
            slot, _ = self.idle.popitem(last=False)
            evicted = self.holder[slot]
            if evicted is not None:
                del self.slot_of[evicted]
                self.holder[slot] = None
            try:
                self._write(slot, self.loads[uid].adapter)
            except BaseException:  # the slot stays free (first in line), not lost to every later request
                self.idle[slot] = None
                self.idle.move_to_end(slot, last=False)
                raise
            self.holder[slot], self.slot_of[uid] = uid, slot
            self.n_loads += 1
        else:
            self.idle.pop(slot, None)
        self.running[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        """A sequence stops running (finished, aborted, preempted) and gives its slot back."""
        if slot < 0:
            return
        self.running[slot] -= 1
        assert self.running[slot] >= 0, f"slot {slot} released more often than acquired"
        if self.running[slot] == 0:
            self.idle[slot] = None  # most recently used: evicted last

    def count_wait(self) -> None:
        self.n_waits += 1

    def _retire(self, uid: int) -> None:
        self.loads[uid].retired = True
        self._drop_if_unused(uid)

    def _drop_if_unused(self, uid: int) -> None:
        load = self.loads[uid]
        if load.retired and load.users == 0:
            slot = self.slot_of.pop(uid, None)
            if slot is not None:
                self.holder[slot] = None
                self._write(slot, None)
                self.idle.pop(slot, None)
                self.idle[slot] = None
                self.idle.move_to_end(slot, last=False)  # an empty slot is the first to fill
            del self.loads[uid]
            self.on_host.pop(uid, None)
            if load.adapter is not None:
                self._forget(load.adapter)

    # --- host copies ------------------------------------------------------------------------------

    def _keep_on_host(self, uid: int) -> None:
        self.on_host.pop(uid, None)
        self.on_host[uid] = None  # most recently used
        self._trim_host(keep=uid)

    def _trim_host(self, keep: int | None = None) -> None:
        """Drops the least recently used host copies beyond max_cpu, of registrations no sequence
        uses (a slot that holds one keeps its weights there), never `keep`'s, just asked for."""
        if self.max_cpu is None:
            return
        for uid in list(self.on_host):
            if len(self.on_host) <= self.max_cpu:
                return
            if self.loads[uid].users == 0 and uid != keep:
                del self.on_host[uid]
                self._forget(self.loads[uid].adapter)
                self.loads[uid].adapter = None

    def _read_again(self, load: Registration) -> Adapter:
        """The registration's adapter from its folder again, if the folder still holds the same bytes
        (a size and a time would miss a retrained adapter copied with its times: `cp -p`, rsync)."""
        try:
            adapter = self._read(load.path)
        except UserError as e:
            raise UserError(f"LoRA adapter {load.name!r} cannot be read again ({e}); unload it and load it again") from None
        if adapter.digest != load.digest:
            self._forget(adapter)  # (a tensor-parallel engine's other ranks read it too)
            raise UserError(
                f"LoRA adapter {load.name!r}: its files in {load.path} changed since it was loaded; "
                "unload it and load it again"
            )
        self.n_reads += 1
        return adapter

    def stats(self) -> dict:
        if not self.n_slots:
            return {}
        return {
            "lora_adapters": len(self.current),
            "lora_slots": self.n_slots,
            "lora_resident": len(self.slot_of),
            "lora_loads": self.n_loads,
            "lora_waits": self.n_waits,
            "lora_host_copies": len(self.on_host),
            "lora_reads": self.n_reads,
        }
