"""pytest setup for this chapter's tests.

The chapter's modules import each other by plain name (`import model`), as they do when one of
its scripts runs (Python puts a script's folder first on sys.path). The tests get the same view
from this file's presence alone: pytest (in its default "prepend" import mode) puts the folder of
a conftest.py that is not inside a package first on sys.path before importing it. `common` needs
nothing: it is an installed package (pyproject.toml).
"""

import os

import pytest
import torch

from common.tools.carried import pytest_collection_modifyitems  # noqa: F401  (carried tests skip where unchanged)
from common.tools.testing import (  # noqa: F401  (shared cores; seeded draws; devices used)
    pytest_configure,
    pytest_runtest_setup,
    pytest_terminal_summary,
)


def _available(device: str) -> str | None:
    """None when usable, else why not."""
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device (run on a GPU node: DEVICE=cuda make test-chapterN)"
    if device == "mps" and not torch.backends.mps.is_available():
        return "no MPS device (Apple silicon only)"
    return None


# DEVICE=cuda (or cpu, mps) runs the device-parametrised tests on that device only; unset, on every
# device present (the others skip with a reason).
DEVICES = [os.environ["DEVICE"]] if os.environ.get("DEVICE") else ["cpu", "cuda", "mps"]


@pytest.fixture(params=DEVICES)
def device(request):
    reason = _available(request.param)
    if reason:
        pytest.skip(reason)
    return torch.device(request.param)
