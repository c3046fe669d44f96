"""Helpers for tests: comparing one chapter with another, sharing loaded models, sharing the cores
between workers, and running a test on each instruction-set level of the kernel library."""

from __future__ import annotations

import ctypes
import gc
import os
import random
import sys
import types
import zlib
from typing import Callable, TypeVar

import pytest

from common.tools.chapters import ChapterNotFoundError, load_chapter


T = TypeVar("T")
_SHARED: dict = {}


def shared(make: Callable[..., T], *args, **kwargs) -> T:
    """make(*args, **kwargs), made once in this test process: every test that asks for the same
    function with the same arguments gets the same object. For what tests only read: a loaded
    model's weights, a tokenizer. Never an engine, a KV cache, or anything a test changes (build
    those fresh around a shared model; a test that changes a shared object puts it back, as
    monkeypatch does). The arguments are the key: names, paths, dtypes, QuantSpecs; an `ops`
    object is a key by its identity. A suite asked for SmolLM2 some 80 times, at 1-2 s of CPU
    each (quantized, more), and for a tokenizer some 60 times, at 0.1 s each."""
    key = (make, args, tuple(sorted(kwargs.items())))
    if key not in _SHARED:
        _SHARED[key] = make(*args, **kwargs)
    return _SHARED[key]


def dequantized_once(model):
    """`model` with each of its dequantize-and-multiply weights (qmatmul's ReferenceLinear, what
    matmul="reference" prepares) replaced by the tensor it dequantizes to: the same products bit
    for bit (the reference dequantizes to the activations' dtype, the model's, at every call)
    without dequantizing every weight of the model again at every forward pass, which took most of
    a reference decode step on SmolLM2. -> the model, changed in place."""
    for holder in (model, *model.layers):
        for name, value in list(vars(holder).items()):
            if type(value).__name__ == "ReferenceLinear":
                setattr(holder, name, value.weight.dequantize(model.dtype))
    return model


def load_neighbour(number: int, *module_names: str) -> types.SimpleNamespace:
    """load_chapter(), or a skip with the reason when chapter `number` is not there (a chapter
    copied out of the repository on its own): the comparison needs both chapters."""
    try:
        return load_chapter(number, *module_names)
    except ChapterNotFoundError as e:
        pytest.skip(f"compares with chapter {number:02d}, which is not here ({e})")


# The instruction-set levels of the kernel library's CPU half (kernels/), lowest first.
CPU_ISAS = ["scalar", "avx2", "avx512", "avx512_bf16"]


@pytest.fixture(params=CPU_ISAS)
def cpu_isa(request):
    """Runs a test once per instruction-set level of kernels/' CPU half that this CPU offers, the
    library switched to it (its set_cpu_isa: the level is read at every call, so a model loaded
    before serves every level), and puts back the level it found; a level the CPU lacks skips,
    naming the best it has. ATEN_CPU_CAPABILITY=avx2 (=default) caps the best as it caps torch's
    own kernels, so that such a run takes the paths of an AVX2-only (a non-x86) CPU. A test picks
    its levels with @pytest.mark.parametrize("cpu_isa", [...], indirect=True); None there is the
    level in use, unchanged (the best, unless capped). A test module takes the fixture by importing
    it. -> the level's name."""
    import kernels

    try:
        ext = kernels.load()
    except kernels.KernelBuildError as e:
        pytest.skip(f"kernels/ is not built here: {e}")
    found = ext.cpu_isa()
    if request.param is None:
        yield found
        return
    best = ext.best_cpu_isa()
    if CPU_ISAS.index(request.param) > CPU_ISAS.index(best):
        cap = os.environ.get("ATEN_CPU_CAPABILITY")
        pytest.skip(f"kernels/ runs {best} at most here" + (f" (ATEN_CPU_CAPABILITY={cap})" if cap else ""))
    ext.set_cpu_isa(request.param)
    try:
        yield request.param
    finally:
        ext.set_cpu_isa(found)


# What the server tests need beyond torch: the server (fastapi, uvicorn, pydantic) and its clients.
SERVER_STACK = ("fastapi", "uvicorn", "pydantic", "openai", "httpx")


def require(*packages: str) -> None:
    """Skips the calling test module (or test) where a package it needs is missing, naming it. A GPU
    node may have torch and pytest and none of the server stack: it runs what it can, and one
    failed import does not abort the whole pytest run."""
    for name in packages:
        pytest.importorskip(name, reason=f"needs {name}, which is not installed here (requirements.txt has it)")


def threads_per_worker() -> int | None:
    """Under pytest-xdist, this run's cores divided among the workers; None in a plain run. The run's
    cores: OMP_NUM_THREADS where it is set (`make test` runs suites side by side, each with its
    share of the machine), else every core this process may use."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    cores = int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
    return max(1, cores // workers) if workers > 1 else None


# glibc's mallopt parameters, and the variables that set them in a new process.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_FREED_BYTES = 2**31 - 1
_MMAP_FROM_BYTES = 32 * 2**20  # the most mallopt takes: glibc's own ceiling for its moving threshold


def keep_freed_memory() -> None:
    """Memory a test frees stays with this process (and with every process it starts) for the next
    test, instead of going back to the OS. glibc trims the top of its heap once 128 KB there are
    free, and maps a large block anew at each allocation; the next test's model, of the same size,
    then faults each 4 KB page in again: a chapter's suite took 10.9 million page faults and 21 s of
    system time in 180 s of CPU (kept: 7.7 million, 18 s). Where the C library is not glibc,
    nothing changes."""
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(_KEEP_FREED_BYTES))
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(_MMAP_FROM_BYTES))
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    mallopt(_M_MMAP_THRESHOLD, _MMAP_FROM_BYTES)
    mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED_BYTES)


def pytest_configure(config):
    """Parallel workers share the cores: each worker's torch, and every server or script it starts
    (they inherit OMP_NUM_THREADS), gets its share of them. Two workers each running a two-thread
    OpenMP team on two cores would stall each other: a team waits for its slowest thread, and that
    thread is descheduled half the time. Freed memory stays for the next test (keep_freed_memory).
    It also registers the `reaches` mark of carried.py. A conftest takes this hook by importing it."""
    config.addinivalue_line("markers", "reaches(*files): chapter files the test runs in a subprocess (carried.py)")
    keep_freed_memory()
    threads = threads_per_worker()
    if threads is None:
        return
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # the chapter conftest imported it before this hook ran
        sys.modules["torch"].set_num_threads(threads)


_imports_frozen = False


def pytest_runtest_setup(item):
    """Each test draws the same random data at every run: Python's, NumPy's and torch's generators
    are seeded from the test's id before it starts. A test that fails on some draw fails again on a
    rerun (an unseeded one failed CI once in ~300 runs, and passed every rerun), and one that
    passes does not fail on the next draw. Before the first test, what the imports made (torch's
    and transformers' million objects) leaves the garbage collector's view (gc.freeze): each full
    collection walked all of it again, 3 % of a suite's CPU. A conftest takes this hook by importing it."""
    global _imports_frozen
    if not _imports_frozen:
        gc.collect()
        gc.freeze()
        _imports_frozen = True
    seed = zlib.crc32(item.nodeid.encode())
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)


def pytest_terminal_summary(terminalreporter):
    """The devices this suite ran on, printed at its end (also under -q): on a GPU node a reader sees
    whether the [cuda] cases ran or skipped, and why. A conftest takes this hook by importing it."""
    torch = sys.modules.get("torch")
    if torch is None:  # chapters 00 and 01 run without torch
        return
    if torch.cuda.is_available():
        cuda = f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}: the [cuda] cases ran"
    elif torch.version.cuda:
        cuda = f"none visible (torch is a CUDA {torch.version.cuda} build): the [cuda] cases skipped"
    else:
        cuda = "none (a CPU build of torch; TORCH_INDEX_URL= at make setup installs a CUDA one)"
    only = (
        f"; DEVICE={os.environ['DEVICE']} (device-parametrised tests ran there only)"
        if os.environ.get("DEVICE")
        else ""
    )
    terminalreporter.write_line(f"devices: torch {torch.__version__}, cpu; cuda: {cuda}{only}")
