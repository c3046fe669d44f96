"""One model over N processes: the ranks, their start, the step plan rank 0 sends, and their end.

    rank 0                                     ranks 1 .. N-1 (this file run as a script, or torchrun)
    scheduler, sampler, server                 -
    plan = scheduler.schedule()                -
    send(("run", runner_id, work)) -------->  work = recv()
    runner.run(work) on its shard              runner.run(work) on its shard
        ... all-reduce after o_proj and down_proj, every layer, every rank ...
        logits gathered on rank 0  <--------   its slice of the vocabulary's logits
    sample                                     recv() the next plan

Only rank 0 decides anything: it owns the block manager, so the block tables it sends are the
same on every rank, and each rank's KV pool holds its own KV heads at the same slots. The model
runner (runner.py) is the seam: rank 0's engine gets a `ParallelRunner`, which has ModelRunner's
interface and first sends the plan; the engine (engine.py) does not know about ranks.

Two process groups, both torch.distributed: the default one (gloo) carries the plans, with no
useful timeout (an idle server sends none for hours; a worker whose rank 0 dies is killed by the
kernel, PR_SET_PDEATHSIG); the compute group (gloo on CPU, NCCL on CUDA) carries the all-reduces
and the gather, with `--tensor-parallel-timeout` seconds on each: a rank that died fails the next
step instead of hanging it. Rank 0 also watches its children: a worker that exits is reported at
once (`RankLost`), and the server then answers 503 and exits with one line. CPU ranks of one host
send all three (plans, all-reduces, the gather) through shared memory instead (shm_channel.py):
gloo's loopback sockets cost ~0.5 ms a message, the shared file ~20 µs.

Launch: `--tensor-parallel-size N` on generate.py, cli.py and server.py spawns N-1 copies of
this file with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (MASTER_PORT: free, picked by
binding port 0, unless set). Under torchrun (RANK and WORLD_SIZE already set) rank 0 runs the
command and every other rank becomes a worker at the top of `main` (`become_worker_if_torchrun`).
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from common.config import load_config
from common.device import pick_device, pick_dtype
from common.cli import USER_ERRORS, positive_int
from common.errors import RunError, UserError
from memory import GiB, default_kv_bytes, free_memory
from ops import KernelFlags
from proposers import DRAFT_DEFAULT
from qmatmul import DEFAULT_PATH
from quant import QuantSpec
from runner import ModelRunner
from sharding import ShardPlan, load_shard
from shm_channel import TOO_BIG, ShmChannel
from weights import spec_of

DEFAULT_TIMEOUT_S = 60.0  # a collective that takes longer: a rank is gone
RENDEZVOUS_S = 120.0  # the ranks' meeting at start (python and torch to import): whatever the step timeout
NO_TIMEOUT = timedelta(days=20)  # the plan broadcast: workers wait as long as rank 0 idles (gloo takes
# milliseconds in 32 bits: a year hung its connect)


class Refused(UserError):
    """A rank's load refused (a flag, the checkpoint), as every rank knows after the gather: rank 0
    says it once, as at size 1 (the same words on every rank), and the workers leave without a word."""

    def __init__(self, by_rank: dict[int, str], world: int):
        alike = len(by_rank) == world and len(set(by_rank.values())) == 1
        super().__init__(by_rank[0] if alike else "; ".join(f"rank {r}: {m}" for r, m in by_rank.items()))


class RankLost(RunError):
    """A rank died or a collective failed: the group cannot compute any more."""


def seconds(text: str) -> float:
    """--tensor-parallel-timeout: at least a second (a step of a long prompt chunk, or making the
    compute group, takes longer than a millisecond without any rank being gone), and at most
    NO_TIMEOUT (gloo counts milliseconds in 32 bits)."""
    value = float(text)
    if not 1 <= value <= NO_TIMEOUT.total_seconds():  # NaN too
        raise argparse.ArgumentTypeError(f"must be at least 1 and at most {NO_TIMEOUT.total_seconds():.0f} seconds, got {text}")
    return value


def add_arguments(ap) -> None:
    g = ap.add_argument_group("tensor parallelism")
    g.add_argument(
        "--tensor-parallel-size",
        type=positive_int,  # 0 would read as "not given": size 1, unseen
        default=None,
        help="split every layer across N processes (default: 1, or WORLD_SIZE under torchrun)",
    )
    g.add_argument(
        "--tensor-parallel-timeout",
        type=seconds,
        default=None,  # None: not given, so that size_from can refuse it at size 1
        help="seconds a step's collective may wait for the other ranks before the group is declared lost "
        f"(default: {DEFAULT_TIMEOUT_S:g})",
    )


def env_int(key: str) -> int:
    """RANK or WORLD_SIZE, as torchrun sets them (a ValueError's traceback for anything else)."""
    value = os.environ[key]
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{key}={value!r} is not a whole number (torchrun sets it)") from None


def size_from(args) -> int:
    """--tensor-parallel-size, or torchrun's WORLD_SIZE; a mismatch between them is refused."""
    launched = env_int("WORLD_SIZE") if under_torchrun() else None
    size = args.tensor_parallel_size if args.tensor_parallel_size is not None else launched or 1
    if launched is not None and size != launched:
        raise UserError(f"--tensor-parallel-size {size} under torchrun with WORLD_SIZE {launched}: make them equal")
    if size < 1:
        raise UserError(f"--tensor-parallel-size must be at least 1, got {size}")
    if size == 1 and getattr(args, "tensor_parallel_timeout", None) is not None:  # it changed nothing there
        raise UserError("--tensor-parallel-timeout goes with --tensor-parallel-size 2 or more: one rank waits for none")
    return size


def transport() -> str:
    """TP_TRANSPORT: "shm" (the default: CPU ranks of one host talk through /dev/shm) or "gloo"."""
    value = os.environ.get("TP_TRANSPORT", "shm")
    if value not in ("shm", "gloo"):
        raise UserError(f"TP_TRANSPORT={value!r}: shm (the default) or gloo")
    return value


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "TP_SPAWNED" not in os.environ


def become_worker_if_torchrun() -> None:
    """At the top of an entry point's main: under torchrun, every rank but 0 serves rank 0 and exits."""
    if not under_torchrun():
        return
    rank, world = env_int("RANK"), env_int("WORLD_SIZE")
    if not 0 <= rank < world:  # a rank that no group has: it waited for ever, silent
        raise UserError(f"RANK={rank} with WORLD_SIZE={world}: a rank is 0 to WORLD_SIZE - 1 (torchrun sets both)")
    missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
    if missing:
        raise UserError(
            f"RANK and WORLD_SIZE are set but {missing[0]} is not: start the ranks with torchrun, or unset "
            "RANK and WORLD_SIZE and give --tensor-parallel-size"
        )
    if os.environ.get("MASTER_PORT") == "0":  # every rank would wait forever for a store on port 0
        raise UserError(
            "torchrun passed MASTER_PORT=0 (--master-port 0): the ranks cannot meet on it; "
            "run `torchrun --standalone` (it picks a free port) or give --master-port a free port"
        )
    if rank > 0:
        if any(a == "-h" or (len(a) >= 3 and "--help".startswith(a)) for a in sys.argv[1:]):  # argparse's
            sys.exit(0)  # abbreviations too: rank 0 prints the help and exits 0, never calling the ranks
        sys.exit(worker_main())


# --- the group ------------------------------------------------------------------------------


@dataclass
class LoadArgs:
    """What every rank needs to load its shard: rank 0 sends it as the first plan."""

    model_dir: str
    device: str
    dtype: torch.dtype
    quant: QuantSpec | None
    matmul: str
    kernels: KernelFlags
    timeout_s: float
    shm_path: str | None = None  # the shared-memory channel's file, when the ranks share a host


def threads_per_rank(world: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // world)


class Group:
    """This process's place in the tensor-parallel group, and on rank 0 its children."""

    def __init__(self, rank: int, world: int, children: list[subprocess.Popen] | None = None):
        self.rank, self.world = rank, world
        self.children = children or []
        self.compute = None  # the compute process group, made once the device is known
        self.shm = None  # shm_channel.ShmChannel: CPU ranks of one host (TP_TRANSPORT=gloo: off)
        self.lost_reason: str | None = None
        self.on_lost: list = []  # callbacks(reason), e.g. the server's shutdown
        self.closed = False
        self._ids = itertools.count()
        self._lock = threading.Lock()

    # -- collectives (every rank) --

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.shm is not None and self.shm.fits(t):
            return self.shm.all_reduce(t)
        dist.all_reduce(t, group=self.compute)
        return t

    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """[rows, V/N] on each rank -> [rows, V] on rank 0 (its own slice elsewhere)."""
        t = t.contiguous()
        if self.shm is not None and self.shm.fits(t):
            return self.shm.gather_last_dim(t)
        parts = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(t, parts, dst=0, group=self.compute)
        return torch.cat(parts, dim=-1) if self.rank == 0 else t

    def send(self, message) -> None:
        """Rank 0: one pickled message to every worker (the step's plan)."""
        if self.shm is None or not self._guard(self.shm.send, message):
            self._guard(dist.broadcast_object_list, [message], 0)

    def recv(self):
        if self.shm is not None and (message := self.shm.recv()) is not TOO_BIG:
            return message
        box = [None]
        dist.broadcast_object_list(box, 0)
        return box[0]

    # -- faults (rank 0) --

    def error(self) -> Exception:
        """The exception a lost group raises: RankLost, or what the host chose (the server: a 503)."""
        return self.make_error(self.lost_reason)

    make_error = RankLost

    def raise_if_lost(self) -> None:
        self._poll_children()
        if self.lost_reason is not None:
            raise self.error()

    def _poll_children(self) -> None:
        for rank, child in enumerate(self.children, start=1):
            if child.poll() is not None:
                self.lost(f"rank {rank} (pid {child.pid}) exited with status {child.returncode}")
                return

    def _guard(self, fn, *args):
        """fn(*args), a collective or a step; any failure loses the group (a peer is gone or late)."""
        if self.shm is None:  # (shared memory's waits look at the children every 0.1 s themselves)
            self._poll_children()
        if self.lost_reason is not None:
            raise self.error()
        try:
            return fn(*args)
        except KeyboardInterrupt:  # mid-step the workers wait inside a collective: stop them now
            self.lost("interrupted")
            raise
        except Exception as e:
            self._poll_children()  # a dead child names itself; else the collective's error does
            if isinstance(e, USER_ERRORS):  # rank 0's own (a bad checkpoint, a flag): said as at size 1
                self.lost(f"{type(e).__name__}: {e}", quiet=True)
                raise
            first = str(e).splitlines()[0] if str(e) else ""
            self.lost(f"a collective failed ({type(e).__name__}: {first})")
            raise self.error() from None

    def lost(self, reason: str, quiet: bool = False) -> None:
        with self._lock:
            if self.lost_reason is not None or self.closed:
                return
            self.lost_reason = reason
        if not quiet:
            print(f"tensor parallel: {reason}; stopping every rank", file=sys.stderr, flush=True)
        for callback in self.on_lost:
            callback(reason)
        self._kill_children()

    def watch(self, interval: float = 0.2) -> None:
        """Rank 0: a thread that notices a child's exit while no step runs (an idle server)."""

        def loop():
            while not self.closed and self.lost_reason is None:
                for rank, child in enumerate(self.children, start=1):
                    if child.poll() is not None and not self.closed:
                        self.lost(f"rank {rank} (pid {child.pid}) exited with status {child.returncode}")
                        return
                time.sleep(interval)

        if self.children:
            threading.Thread(target=loop, name="tp-watch", daemon=True).start()

    def _kill_children(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
        for child in self.children:
            child.wait()

    def close(self) -> None:
        """Rank 0: every worker told to stop, waited for (killed after 10 s); idempotent."""
        if self.closed:
            return
        if not dist.is_initialized():  # ended before the group existed (Ctrl-C at start): nothing to tell
            self._kill_children()
        elif self.lost_reason is None and self.rank == 0:
            try:
                self.send(("stop",))
            except Exception:  # noqa: BLE001  (lost on the way: the children are killed below)
                pass
        self.closed = True
        deadline = time.monotonic() + 10
        for child in self.children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001  (a lost group may not shut down cleanly; the process goes on)
                pass

    def runner(self, model, num_blocks: int, block_size: int, *_, **__) -> ParallelRunner:
        """A ModelRunner factory (generate.py): rank 0's runner, and one on every worker."""
        return ParallelRunner(self, ModelRunner(model, num_blocks, block_size, 1, 1, cuda_graphs=False))


class ParallelRunner:
    """ModelRunner's interface on rank 0: each call first sends the plan, then runs rank 0's shard."""

    def __init__(self, group: Group, inner: ModelRunner):
        self.group, self.inner, self.id = group, inner, next(group._ids)
        self.model, self.cache, self.graphs = inner.model, inner.cache, None
        group.send(("runner", self.id, inner.cache.num_blocks, inner.block_size))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            self.group.send(("copy", self.id, copies))
            self.inner.copy_blocks(copies)

    def run(self, work):
        self.group.send(("run", self.id, work))
        return self.group._guard(self.inner.run, work)


# --- start ----------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """A worker ends when rank 0 does, however rank 0 ends (SIGKILL included): Linux's
    PR_SET_PDEATHSIG, and where it is missing a thread that polls the parent's pid."""
    parent = int(os.environ.get("TP_PARENT_PID", "0"))
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent:
        if os.getppid() != parent:  # it died before prctl ran
            os._exit(1)

        def poll():
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=poll, name="tp-parent", daemon=True).start()


def _store(world: int, timeout: timedelta):
    """Rank 0's rendezvous store on MASTER_ADDR:MASTER_PORT (default: 127.0.0.1, a free port)."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("MASTER_PORT", "0")
    if not (port.isdigit() and int(port) < 65536):
        raise UserError(f"MASTER_PORT={port!r} is not a port number (0-65535; 0 or unset: a free one)")
    port = int(port)
    _check_local(addr)
    try:
        return addr, dist.TCPStore(addr, port, world, is_master=True, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"cannot listen on {addr}:{port} for the ranks' rendezvous ({first}): "
            "the port is in use? set MASTER_PORT to a free one, or unset it to pick one"
        ) from None


def _check_local(addr: str) -> None:
    """The ranks this file spawns all run on this machine, so MASTER_ADDR must be one of its own
    addresses: TCPStore would otherwise retry an unknown or unreachable host for minutes."""
    try:
        found = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(
            f"MASTER_ADDR={addr!r}: no such host ({e}): unset it (127.0.0.1) or give this machine's address"
        ) from None
    for family, kind, proto, _, sockaddr in found:
        with socket.socket(family, kind, proto) as s:
            try:
                s.bind((sockaddr[0], 0))  # binding succeeds only on an address this machine has
                return
            except OSError:
                continue
    raise UserError(
        f"MASTER_ADDR={addr!r} is not an address of this machine: the ranks --tensor-parallel-size "
        "starts all run here (unset it for 127.0.0.1; torchrun starts ranks on several hosts)"
    )


def start(world: int, timeout_s: float) -> Group:
    """Rank 0: the group of `world` ranks, spawning the workers unless torchrun started them."""
    timeout = timedelta(seconds=timeout_s)
    if under_torchrun():
        # torchrun starts the others: said, so that a rank that never comes is no silent wait
        print(f"[tp] rank 0 of {world}: waiting for the other ranks at {os.environ['MASTER_ADDR']}:"
              f"{os.environ['MASTER_PORT']}", file=sys.stderr, flush=True)  # fmt: skip
        dist.init_process_group("gloo", init_method="env://", timeout=NO_TIMEOUT)
        group = Group(0, world)
        atexit.register(group.close)  # the workers' "stop"; torchrun reaps the processes
        return group
    # The rendezvous is no step: a tiny --tensor-parallel-timeout would fail it as a busy port.
    addr, store = _store(world, max(timeout, timedelta(seconds=RENDEZVOUS_S)))
    env = dict(os.environ, MASTER_ADDR=addr, MASTER_PORT=str(store.port), WORLD_SIZE=str(world))
    env |= {"TP_SPAWNED": "1", "TP_PARENT_PID": str(os.getpid())}
    children = []
    for rank in range(1, world):
        env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        children.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve())], env=env_r))
    group = Group(0, world, children)
    atexit.register(group.close)
    try:
        _wait_for_workers(store, children)
        dist.init_process_group("gloo", store=store, rank=0, world_size=world, timeout=NO_TIMEOUT)
    except BaseException:  # Ctrl-C included
        group._kill_children()
        raise
    return group


def _wait_for_workers(store, children: list[subprocess.Popen]) -> None:
    """Until every spawned worker has reached the store: a worker that dies first (killed, out of
    memory, an import that fails) would leave init_process_group waiting for it for NO_TIMEOUT."""
    for rank, child in enumerate(children, start=1):
        while not store.check([f"tp-alive-{rank}"]):  # (store.wait with a timeout logs each one it hits)
            if child.poll() is not None:
                raise RankLost(f"rank {rank} (pid {child.pid}) exited with status {child.returncode} before it joined")
            time.sleep(0.02)


def _join(world: int, rank: int) -> Group:
    """A worker: into the group rank 0 made: its store when rank 0 spawned us (rank 0 passed its
    store object to init_process_group, which then adds no key prefix: env:// would), else torchrun's."""
    if "TP_SPAWNED" in os.environ:
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(addr, port, world, is_master=False, timeout=timedelta(seconds=RENDEZVOUS_S))
        store.set(f"tp-alive-{rank}", "1")  # rank 0 waits for this, watching that we still run
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=NO_TIMEOUT)
    else:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=NO_TIMEOUT)
    return Group(rank, world)


def _load(group: Group, a: LoadArgs):
    """Every rank: the compute group, then its shard. -> (model, every rank's (bytes held, bytes read))."""
    device = torch.device(a.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", group.rank)))
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    group.compute = dist.new_group(backend=backend, timeout=timedelta(seconds=a.timeout_s))
    if not os.environ.get("OMP_NUM_THREADS", "").strip().split(",")[0].isdigit():  # unset, or not a count
        # the ranks that share this host's cores: torchrun's LOCAL_WORLD_SIZE over several nodes
        torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", group.world))))
    if a.shm_path is not None:
        group.shm = ShmChannel(a.shm_path, group.rank, group.world, a.timeout_s, group.raise_if_lost)
        dist.barrier()  # every rank has it mapped: rank 0 unlinks the file below
        if group.rank == 0:
            ShmChannel.remove(a.shm_path)
    try:  # a refusal (a flag, the checkpoint) on any rank: every rank learns it below
        ops = a.kernels.ops(device, load_config(a.model_dir).head_dim)
        model, read = load_shard(a.model_dir, group.rank, group.world, group, device, a.dtype, a.quant, a.matmul, ops)
        outcome = (model.weight_bytes, read)
    except USER_ERRORS as e:
        model, outcome = None, str(e)
    sizes = [None] * group.world
    dist.all_gather_object(sizes, outcome, group=None)
    refused = {rank: o for rank, o in enumerate(sizes) if isinstance(o, str)}
    if refused:
        raise Refused(refused, group.world)
    if group.shm is not None:
        group.shm.attach_library(ops)
        for layer in model.layers:  # the one-call layers sum o's and down's partial sums without Python
            if layer.one_call is not None:
                layer.one_call.shm = group.shm.native
    return model, sizes


def load(
    name_or_path: str | None,
    device: str | None,
    dtype: str | None,
    spec: QuantSpec | None,
    matmul: str = DEFAULT_PATH,
    kernel_flags: KernelFlags | str = KernelFlags(),
    world: int = 2,
    timeout_s: float | None = None,
    check_quant_flags: bool = True,
):
    """Rank 0's loading.load at tensor-parallel size `world`: checks the sizes, starts the ranks,
    each loads its shard (timeout_s None: DEFAULT_TIMEOUT_S). -> (rank 0's Model, its directory, the Group)."""
    from loading import refuse_idle_quant_flags, resolve  # (loading imports model loading; here only its checks)

    if spec is not None and Path(str(name_or_path or "")).suffix.lower() == ".gguf":  # as loading.load, before conversion
        raise UserError(f"{name_or_path}: --quant applies to a plain checkpoint; a GGUF file runs as its own Q4_1 codes")
    model_dir = resolve(name_or_path)
    config = load_config(model_dir)
    stored = spec_of(model_dir)  # a quantized directory, or a converted .gguf
    if stored is not None and spec is not None and spec != stored:
        raise UserError(f"{model_dir} is already quantized ({stored.name}); --quant applies to a plain checkpoint")
    ShardPlan.check(config, world, spec or stored)  # refused before any process starts
    dev = pick_device(device)
    auto = (dtype or os.environ.get("DTYPE") or "auto") == "auto"
    quantized = spec is not None or stored is not None
    dt = torch.bfloat16 if quantized and auto and dev.type in ("cpu", "cuda") else pick_dtype(dtype, dev)
    flags = KernelFlags(kernel_flags) if isinstance(kernel_flags, str) else kernel_flags
    if check_quant_flags or quantized:  # as loading.load's, before any rank starts (each resolves its ops so)
        refuse_idle_quant_flags(matmul, flags, quantized, dt, flags.ops(dev, config.head_dim, note=False), model_dir)
    one_host = not under_torchrun() or os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")
    shm = dev.type == "cpu" and one_host and transport() == "shm"  # (checked where it is read)
    shm_path = ShmChannel.create("/dev/shm", world) if shm else None  # before any rank starts
    group = None
    try:
        timeout_s = timeout_s or DEFAULT_TIMEOUT_S
        group = start(world, timeout_s)
        args = LoadArgs(str(model_dir), dev.type, dt, spec, matmul, flags, timeout_s, shm_path)
        group.send(("load", args))
        model, sizes = group._guard(_load, group, args)
    except BaseException:
        if group is not None:
            group.lost("a rank failed to load its shard")
        if shm_path is not None:
            ShmChannel.remove(shm_path)
        raise
    group.watch()
    per_rank = ", ".join(f"{held / 1e6:.1f}" for held, _ in sizes)
    print(
        f"tensor parallel: {world} ranks ({'NCCL' if dev.type == 'cuda' else 'gloo'}"
        f"{', plans, all-reduces and the gather in shared memory' if group.shm else ''}), {torch.get_num_threads()} "
        f"threads each; weights per rank {per_rank} MB (read from the checkpoint: "
        f"{', '.join(f'{r / 1e6:.1f}' for _, r in sizes)} MB)",
        file=sys.stderr,
        flush=True,
    )
    group.sizes = sizes
    return model, model_dir, group


def worker_main() -> int:
    """A worker's life: join, load its shard, run every plan rank 0 sends until "stop"."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "TP_SPAWNED" in os.environ:
        _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    group = _join(world, rank)
    kind, args = group.recv()
    assert kind == "load", kind
    try:
        model, _ = _load(group, args)
    except Refused:  # rank 0 says it
        return 1
    except Exception as e:  # noqa: BLE001  (one line, then rank 0 notices the exit)
        print(f"tensor parallel: rank {rank} could not load its shard: {e}", file=sys.stderr, flush=True)
        return 1
    runners: dict[int, ModelRunner] = {}
    with torch.inference_mode():
        while True:
            message = group.recv()
            kind = message[0]
            if kind == "run":
                runners[message[1]].run(message[2])
            elif kind == "copy":
                runners[message[1]].copy_blocks(message[2])
            elif kind == "runner":
                _, rid, num_blocks, block_size = message
                runners[rid] = ModelRunner(model, num_blocks, block_size, 1, 1, cuda_graphs=False)
            elif kind == "drop":
                runners.pop(message[1], None)
            elif kind == "stop":
                break
    dist.destroy_process_group()
    return 0


def build_engine(
    model: str | None,
    device: str = "auto",
    dtype: str = "auto",
    quant: QuantSpec | None = None,
    matmul: str = DEFAULT_PATH,
    kernels: KernelFlags | str = KernelFlags(),
    speculative: str = "off",
    draft_model: str | None = None,
    draft_quant: QuantSpec | str | None = DRAFT_DEFAULT,
    tensor_parallel_size: int = 1,
    tensor_parallel_timeout: float | None = None,
    **limits,
):
    """engine.build_engine at tensor-parallel size N: size 1 is chapter 07's exactly. Otherwise the
    ranks start, rank 0's engine gets a ParallelRunner, and the engine's `tensor_parallel` is the
    Group. A draft model (--speculative draft) runs whole on rank 0 alone: it is small, and its
    steps would otherwise cost two all-reduces per layer for a model that fits one device."""
    import engine as engine_module
    from common.tokenizer import Tokenizer
    from proposers import check_proposer_name, load_draft, make_proposer

    if tensor_parallel_size == 1:
        return engine_module.build_engine(
            model, device, dtype, quant, matmul, kernels, speculative, draft_model, draft_quant, **limits
        )
    check_proposer_name(speculative)
    loaded, model_dir, group = load(  # an int4 draft of an unquantized target: --matmul and the like are for the draft
        model, device, dtype, quant, matmul, kernels, tensor_parallel_size, tensor_parallel_timeout,
        check_quant_flags=speculative != "draft",
    )
    try:
        tokenizer, draft = Tokenizer(model_dir), None
        if speculative == "draft":
            draft = load_draft(draft_model or model, loaded, tokenizer, device, dtype, draft_quant, matmul, kernels)
        explicit = limits.get("kv_cache_bytes") is not None  # --kv-cache-memory-gb
        if limits.get("num_blocks") is None and not explicit and loaded.device.type == "cpu":
            # N ranks on one host share its memory: each takes its part of the default budget.
            budget = default_kv_bytes(loaded.device)
            limits["kv_cache_bytes"] = None if budget is None else budget // tensor_parallel_size
        if draft is not None and limits.get("num_blocks") is None:
            limits["kv_cache_bytes"] = draft.target_share(limits.get("kv_cache_bytes"), loaded)
        limits["cuda_graphs"] = False  # a captured step would hold collectives: not yet (see README)
        engine = engine_module.Engine(
            loaded, tokenizer, engine_module.Engine.read_generation_config(model_dir), proposer=make_proposer(speculative, draft), **limits
        )
        if explicit and loaded.device.type == "cpu":
            # --kv-cache-memory-gb is each rank's pool (as on GPUs, each its own memory), capped as at
            # size 1 at what its sequences could ever use; here the ranks share one host's memory:
            # all N pools must fit, which rank 0's own check would not see.
            total = engine.runner.cache.nbytes * tensor_parallel_size
            free = free_memory(loaded.device)
            if free is not None and total > free:
                raise UserError(
                    f"--kv-cache-memory-gb is each rank's: {tensor_parallel_size} ranks on this host take "
                    f"{total / GiB:.2f} GiB, more than the {free / GiB:.2f} GiB free; lower it"
                )
        engine.runner = ParallelRunner(group, engine.runner)
        engine.tensor_parallel = group
    except BaseException:
        group.close()
        raise
    named = model not in (None, "") and not Path(model).exists()
    return engine, model if named else Path(model or model_dir).name


if __name__ == "__main__":
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        sys.exit(worker_main())
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001  (a collective failed: rank 0 is gone or stopping)
        print(f"tensor parallel: rank {os.environ.get('RANK')} stops: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
