"""Run a Python script as `python script.py args` would, in a fork of an interpreter that has
already imported torch.

The chapters' tests start their scripts (generate.py, cli.py, quantize.py, server.py, ...) the way
a reader does, from the command line, a few hundred times per `make test`. Each new interpreter
spends about 2.5 s of CPU importing torch before the script's first line runs: a fifth of the
whole suite on a 2-core machine. So one helper process per test session imports torch once and
then forks a child per script; the child is a fresh `python script.py` in every way a test can
see (argv, sys.path[0], the working directory, the environment, stdin/stdout/stderr, the exit
code, a traceback on an uncaught exception, atexit and non-daemon threads at exit, signals), only
started 2.5 s later into its life.

The helper keeps the environment of its first run, and torch and OpenMP read theirs at import:
a run whose start-up variables (STARTUP_PREFIXES: OMP_NUM_THREADS, ATEN_CPU_CAPABILITY, ...)
differ is a real subprocess (restarting the helper would orphan the servers it runs). So is a run
with interpreter flags, or anything but `script.py ...`, `-m module ...` or `-c code ...`, and
every run with WARM_PYTHON=0. The helper never runs torch code itself, so no thread pool exists
when it forks.

    from common.tools.warm_python import run_python, start_python
    r = run_python(["generate.py", "--prompt", "hi"], cwd=CHAPTER, timeout=300)  # a CompletedProcess
    server = start_python(["server.py", "--port", "8000"], stderr=log_path)      # Popen's poll/wait/terminate
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_helper: subprocess.Popen | None = None
_helper_env: dict[str, str] | None = None
_POLL_S = 0.01
# Environment variables read while Python, the dynamic loader, torch or NumPy start (their
# OpenMP/BLAS/oneDNN thread pools and CPU kernels included).
STARTUP_PREFIXES = (
    "PYTHON", "LD_", "MALLOC_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "DNNL_", "ONEDNN_",
    "NPY_", "NUMPY_", "TORCH", "PYTORCH_", "ATEN_", "CUDA", "NVIDIA_",
)  # fmt: skip
# torch.compile's settings: read when torch._dynamo / torch._inductor load, which `import torch`
# does not do (and torch itself sets TORCHINDUCTOR_CACHE_DIR in a process that used them).
COMPILER_PREFIXES = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE_")


class WarmProcess:
    """A script started in a fork of the helper, with the part of subprocess.Popen's interface a
    test uses: pid, args, returncode, poll(), wait(timeout), send_signal(), terminate(), kill()."""

    def __init__(self, pid: int, args: list[str], status: Path, tmp: tempfile.TemporaryDirectory):
        self.pid, self.args, self.returncode = pid, args, None
        self._status, self._tmp = status, tmp  # the helper writes the exit code there

    def poll(self) -> int | None:
        if self.returncode is None and self._status.exists():
            self.returncode = int(self._status.read_text())
            self._tmp.cleanup()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(_POLL_S)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # ended, and its exit code not yet written
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_python(
    args: list[str],
    *,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    stdin: str | Path | None = None,
    stdout: str | Path | None = None,
    stderr: str | Path | None = None,
) -> WarmProcess | subprocess.Popen:
    """`subprocess.Popen([sys.executable, *args], ...)` with stdin read from a file and stdout/stderr
    written to files (None: /dev/null), in a fork of the warm helper where that is the same thing.
    The child leads a process group of its own: os.killpg(p.pid, sig) reaches what it started."""
    args, env = [str(a) for a in args], dict(os.environ if env is None else env)
    if not _warm_helper_for(args, env):
        files = [open(p or os.devnull, mode) for p, mode in ((stdin, "rb"), (stdout, "wb"), (stderr, "wb"))]
        try:
            return subprocess.Popen(
                [sys.executable, *args], cwd=cwd, env=env, stdin=files[0], stdout=files[1], stderr=files[2],
                start_new_session=True,
            )  # fmt: skip
        finally:
            for f in files:
                f.close()
    tmp = tempfile.TemporaryDirectory(prefix="warm-python-")
    status = Path(tmp.name) / "status"
    request = {
        "args": args,
        "cwd": str(Path(cwd or os.getcwd()).resolve()),
        "env": env,
        "stdin": str(stdin or os.devnull),
        "stdout": str(stdout or os.devnull),
        "stderr": str(stderr or os.devnull),
        "status": str(status),
    }
    _helper.stdin.write((json.dumps(request) + "\n").encode())
    _helper.stdin.flush()
    reply = _read_reply(_helper, timeout=60)
    if reply is None:
        _stop()
        raise RuntimeError(f"the warm Python helper stopped before it started {args}")
    return WarmProcess(reply["pid"], [sys.executable, *args], status, tmp)


def run_python(
    args: list[str],
    *,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    input: str | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)`, in a fork of
    the warm helper where that is the same thing. On a timeout the child's process group is killed."""
    with tempfile.TemporaryDirectory(prefix="warm-python-io-") as tmp:
        paths = {name: Path(tmp) / name for name in ("stdin", "stdout", "stderr")}
        paths["stdin"].write_text(input or "")
        proc = start_python(args, cwd=cwd, env=env, **paths)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out, err = (paths[name].read_text(errors="replace") for name in ("stdout", "stderr"))
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
        out, err = (paths[name].read_text(errors="replace") for name in ("stdout", "stderr"))
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _warm_helper_for(args: list[str], env: dict[str, str]) -> bool:
    """Whether `args` can run in a fork of the helper (started with `env` on first use)."""
    if os.environ.get("WARM_PYTHON", "1") == "0" or not args:
        return False
    if args[0] in ("-m", "-c") and len(args) < 2 or args[0].startswith("-") and args[0] not in ("-m", "-c"):
        return False
    if _helper_env is None:
        _start(env)
    return _helper is not None and _helper.poll() is None and _same(env, _helper_env)


def _same(env: dict[str, str], helper_env: dict[str, str]) -> bool:
    """Whether a process started with `env` would have imported torch as the helper did: the same
    values for every variable the interpreter, the loader, torch, NumPy and their thread pools
    read as they start. The rest (MODELS_DIR, PYTEST_CURRENT_TEST, ...) is read by the script,
    from the child's own environment, which is always `env`."""
    return _at_start(env) == _at_start(helper_env)


def _at_start(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) and not k.startswith(COMPILER_PREFIXES)}


def _start(env: dict[str, str]) -> None:
    """Starts the helper with this environment, once per session (a helper that cannot start means
    real subprocesses from then on)."""
    global _helper, _helper_env
    _helper_env = env
    try:
        _helper = subprocess.Popen(
            [sys.executable, "-c", "from common.tools.warm_python import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=Path(__file__).resolve().parents[2],  # `common` importable even from a copied chapter
        )
        ready = _read_reply(_helper, timeout=120)
    except (OSError, TimeoutError, ValueError):
        ready = None
    if ready != {"ready": True}:
        _stop()
    else:
        atexit.register(_close)


def _close() -> None:
    """At exit: the helper ends (its stdin closed) and this process waits for it, so the CPU time
    of the scripts it ran counts among this process's children, as a plain subprocess's would
    (`time make test`, /usr/bin/time pytest); left alone, it would end unwaited for, its time
    uncounted. A helper that does not end within 10 s is killed."""
    global _helper
    if _helper is not None and _helper.poll() is None:
        _helper.stdin.close()
        try:
            _helper.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _helper.kill()
            _helper.wait()
    _helper = None


def _stop() -> None:
    global _helper
    if _helper is not None and _helper.poll() is None:
        _helper.kill()
        _helper.wait()
    _helper = None


def _read_reply(proc: subprocess.Popen, timeout: float) -> dict | None:
    if not select.select([proc.stdout], [], [], timeout)[0]:
        raise TimeoutError
    line = proc.stdout.readline()
    return json.loads(line) if line else None


# --- the helper process


def serve() -> None:
    """The helper's loop: import torch, then fork a child per request line on stdin, and write each
    child's exit code (Popen's convention: -N for signal N) to its status file when it ends."""
    import torch  # noqa: F401  the 2.5 s every child skips (numpy comes with it)

    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    status_files: dict[int, str] = {}

    def reply(obj):
        replies.write((json.dumps(obj) + "\n").encode())
        replies.flush()

    def reap():
        while status_files:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            path = status_files.pop(pid)
            Path(path + ".tmp").write_text(str(os.waitstatus_to_exitcode(status)))
            os.rename(path + ".tmp", path)  # whole or absent for the reader

    reply({"ready": True})
    while True:
        if not select.select([requests], [], [], _POLL_S if status_files else None)[0]:
            reap()
            continue
        line = requests.readline()
        if not line:  # the test session ended; children still running are left as Popen leaves them
            return
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)  # never returns
        status_files[pid] = request["status"]
        reply({"pid": pid})
        reap()


def _child(request: dict) -> None:
    import atexit
    import io
    import random
    import runpy
    import threading
    import traceback

    code = 1
    try:
        os.setpgid(0, 0)
        write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        for fd, name, flags in ((0, "stdin", os.O_RDONLY), (1, "stdout", write), (2, "stderr", write)):
            opened = os.open(request[name], flags, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=unbuffered
        )
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
        )
        random.seed()  # a new interpreter seeds from the OS; a fork would repeat the helper's sequence
        sys.modules["numpy"].random.seed()
        args = request["args"]
        try:
            if args[0] == "-m":
                sys.argv = [args[1], *args[2:]]  # runpy puts the module's path in argv[0]
                sys.path[0] = os.getcwd()
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            elif args[0] == "-c":
                sys.argv = ["-c", *args[2:]]
                sys.path[0] = ""
                exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
            else:
                sys.argv = list(args)
                sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
                runpy.run_path(args[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        # What interpreter shutdown does before it exits: wait for non-daemon threads, run atexit.
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)
