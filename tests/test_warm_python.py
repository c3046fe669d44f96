"""common.tools.warm_python: a script run in a fork of the warm helper behaves as `python script.py` does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.tools.warm_python import WarmProcess, run_python, start_python

SCRIPT = """\
import atexit, os, random, sys, threading, time
print("argv", sys.argv)
print("path0", sys.path[0])
print("cwd", os.getcwd())
print("env", os.environ.get("WARM_TEST_VALUE"))
print("stdin", sys.stdin.read().strip())
print("name", __name__)
print("random", random.random())
print("to stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
if "--fail" in sys.argv:
    raise ValueError("a bad input")
sys.exit(int(sys.argv[-1]))
"""


def started_warm(r: subprocess.CompletedProcess) -> bool:
    return "warm: True" in r.stdout


@pytest.fixture
def script(tmp_path):
    folder = tmp_path / "chapter"
    folder.mkdir()
    (folder / "script.py").write_text('import sys\nprint("warm:", "torch" in sys.modules)\n' + SCRIPT)
    return folder / "script.py"


def run_both(args, **kw):
    """The same command in a fork of the helper and in a new interpreter."""
    real = subprocess.run([sys.executable, *args], capture_output=True, text=True, **kw)
    return run_python(args, **kw), real


def test_a_script_sees_what_a_new_interpreter_would(script, tmp_path, monkeypatch):
    monkeypatch.setenv("WARM_TEST_VALUE", "42")
    warm, real = run_both([str(script), "x y", "3"], cwd=tmp_path, input="hello\n")
    assert started_warm(warm) and not started_warm(real)  # the fork started with torch imported
    same = [line for line in real.stdout.splitlines() if not line.startswith(("warm:", "random"))]
    assert [line for line in warm.stdout.splitlines() if not line.startswith(("warm:", "random"))] == same
    assert f"argv ['{script}', 'x y', '3']" in same and f"path0 {script.parent}" in same
    assert f"cwd {tmp_path}" in same and "env 42" in same and "stdin hello" in same and "name __main__" in same
    assert "thread joined" in same and same[-1] == "atexit ran"  # threads, then atexit, as at shutdown
    assert warm.stderr == real.stderr == "to stderr\n"
    assert warm.returncode == real.returncode == 3


def test_an_uncaught_exception_is_a_traceback_and_exit_1(script, tmp_path):
    warm, real = run_both([str(script), "--fail", "0"], cwd=tmp_path)
    assert started_warm(warm)
    assert warm.returncode == real.returncode == 1
    for r in (warm, real):
        assert r.stderr.startswith("to stderr\nTraceback (most recent call last):")
        assert r.stderr.endswith("ValueError: a bad input\n")


def test_each_fork_draws_its_own_random_numbers(script, tmp_path):
    draws = {
        next(line for line in run_python([str(script), "0"], cwd=tmp_path).stdout.splitlines() if "random" in line)
        for _ in range(3)
    }
    assert len(draws) == 3


def test_module_and_code_runs(tmp_path):
    r = run_python(["-c", "import sys; print(sys.argv, repr(sys.path[0])); sys.exit('bye')", "a"], cwd=tmp_path)
    assert (r.returncode, r.stdout, r.stderr) == (1, "['-c', 'a'] ''\n", "bye\n")
    (tmp_path / "mod.py").write_text("import sys\nprint(__name__, sys.argv)\n")
    r = run_python(["-m", "mod", "b"], cwd=tmp_path)
    assert r.returncode == 0 and r.stdout == f"__main__ ['{tmp_path / 'mod.py'}', 'b']\n", r.stderr


def test_another_environment_or_interpreter_flags_start_a_new_interpreter(script, tmp_path):
    assert "warm: True" in run_python([str(script), "0"], cwd=tmp_path).stdout
    r = run_python([str(script), "0"], cwd=tmp_path, env=os.environ | {"OMP_NUM_THREADS": "7"})
    assert r.returncode == 0 and "warm: False" in r.stdout  # torch would have read 7 at import
    r = run_python(["-X", "utf8", str(script), "0"], cwd=tmp_path)
    assert r.returncode == 0 and "warm: False" in r.stdout


def test_a_run_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    marker = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(marker)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", code], cwd=tmp_path, timeout=3)
    assert time.monotonic() - t0 < 30
    grandchild = Path(f"/proc/{marker.read_text()}/status")
    time.sleep(0.5)  # gone with its process group (or a zombie, where nothing reaps orphans)
    assert not grandchild.exists() or "\nState:\tZ" in grandchild.read_text()
    assert run_python(["-c", "print('still serving')"]).stdout == "still serving\n"


def test_a_started_script_runs_until_it_is_signalled(tmp_path):
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (print('stopping', file=sys.stderr), sys.exit(0)))\n"
        "print('up', file=sys.stderr, flush=True)\n"
        "time.sleep(60)\n"
    )
    log = tmp_path / "log"
    proc = start_python(["-c", code], stderr=log)
    assert isinstance(proc, WarmProcess)
    for _ in range(500):
        if log.exists() and "up" in log.read_text():
            break
        time.sleep(0.01)
    assert proc.poll() is None and proc.returncode is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.terminate()
    assert proc.wait(timeout=30) == 0 and log.read_text() == "up\nstopping\n"
    # killed by a signal: Popen's -N
    proc = start_python(["-c", "import time; time.sleep(60)"])
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_every_test_of_a_session_shares_the_helper(script, tmp_path, monkeypatch):
    # pytest names the running test in PYTEST_CURRENT_TEST, tests set what their scripts read: a
    # variable no interpreter, torch or NumPy reads as it starts does not make a run cold
    assert "warm: True" in run_python([str(script), "0"], cwd=tmp_path).stdout
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_other.py::test_other (call)")
    monkeypatch.setenv("MODELS_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # torch sets it in a process that compiled
    assert "warm: True" in run_python([str(script), "0"], cwd=tmp_path).stdout
