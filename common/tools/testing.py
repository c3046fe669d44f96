"""Helpers for tests: comparing one chapter with another, and sharing the cores between workers."""

from __future__ import annotations

import os
import sys
import types

import pytest

from common.tools.chapters import ChapterNotFoundError, load_chapter


def load_neighbour(number: int, *module_names: str) -> types.SimpleNamespace:
    """load_chapter(), or a skip with the reason when chapter `number` is not there (a chapter
    copied out of the repository on its own): the comparison needs both chapters."""
    try:
        return load_chapter(number, *module_names)
    except ChapterNotFoundError as e:
        pytest.skip(f"compares with chapter {number:02d}, which is not here ({e})")


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


def pytest_configure(config):
    """Parallel workers share the cores: each worker's torch, and every server or script it starts
    (they inherit OMP_NUM_THREADS), gets its share of them. Two workers each running a two-thread
    OpenMP team on two cores would stall each other: a team waits for its slowest thread, and that
    thread is descheduled half the time. A conftest takes this hook by importing it."""
    threads = threads_per_worker()
    if threads is None:
        return
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # the chapter conftest imported it before this hook ran
        sys.modules["torch"].set_num_threads(threads)


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
