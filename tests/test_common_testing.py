"""common.tools.testing's seeded draws: every test's random data comes from a seed of its own id."""

import random
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
