"""A machine with torch and pytest but without the server stack or gguf (a lent GPU node, a Slurm
node with a bare environment) collects every chapter's suite, and skips what it cannot run with the
package named: one failed import must not abort a whole pytest run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ABSENT = ("pydantic", "pydantic_core", "fastapi", "starlette", "uvicorn", "openai", "gguf")
SUITES = [d for d in sorted(REPO.glob("chapters/*/tests")) if (d.parent / "server.py").exists()]


@pytest.mark.parametrize("suite", SUITES, ids=lambda d: d.parent.name)
def test_a_suite_collects_without_the_server_stack_and_names_what_it_skips(suite, hiding):
    env = os.environ | {"PYTHONPATH": hiding(*ABSENT), "RUN_CARRIED_TESTS": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-rs", "-p", "no:cacheprovider", str(suite)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "error" not in out.splitlines()[-1], out[-3000:]
    assert "needs fastapi, which is not installed here" in out and "needs pydantic" in out, out[-3000:]
