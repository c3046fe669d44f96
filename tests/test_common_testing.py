"""common.tools.testing's hooks: every test's random data comes from a seed of its own id; the
imports stay out of the garbage collector's walks; freed memory stays for the next test."""

import gc
import os
import random
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_a_test_draws_from_the_seed_of_its_id(request):
    drawn = torch.randn(4), np.random.rand(4), random.random()
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    assert torch.equal(drawn[0], torch.randn(4))
    assert np.array_equal(drawn[1], np.random.rand(4))
    assert drawn[2] == random.random()


def test_every_suite_takes_the_hook():
    conftests = [*ROOT.glob("chapters/*/conftest.py"), ROOT / "tests/conftest.py", ROOT / "kernels/tests/conftest.py"]
    assert len(conftests) >= 12
    missing = [str(p.relative_to(ROOT)) for p in conftests if "pytest_runtest_setup" not in p.read_text()]
    assert not missing, f"these suites draw unseeded data: {missing}"


def test_what_the_imports_made_is_frozen_before_the_first_test():
    # torch's modules were imported before any test: frozen, a full collection no longer walks them
    assert gc.get_freeze_count() > 100_000


def test_freed_memory_stays_in_this_process_and_in_the_ones_it_starts():
    assert int(os.environ["MALLOC_TRIM_THRESHOLD_"]) >= 2**30
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ['MALLOC_TRIM_THRESHOLD_'])"],
                           capture_output=True, text=True, check=True)
    assert int(child.stdout) >= 2**30
