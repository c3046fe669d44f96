"""A real server.py process on a free localhost port, for the tests that talk HTTP to it."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from common.tools.serving import free_port
from common.tools.warm_python import start_python

REACHES = ["server.py"]  # scripts run in a subprocess (common/tools/carried.py)

CHAPTER = Path(__file__).resolve().parents[1]
# One client for the tests' requests: httpx.get() and its kin build a client per call, and with it an
# SSL context that reads certifi's CA bundle, 30 ms of CPU each (4-7 s of a chapter's suite), even
# for http://. Like them it keeps no connection between requests: the server tests count connections.
http = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))

# The KV block pool of a test server, unless its flags size it: the server's default is a quarter
# of the free memory, gigabytes for tiny-llama3's 131072-token context.
KV_CACHE_GB = "0.25"


@contextlib.contextmanager
def serve(log_dir: Path, model: str, *flags: str):
    """server.py for `model` on cpu/float32 with these flags (and a KV cache of KV_CACHE_GB unless
    they set --kv-cache-memory-gb), once /health answers; -> (base url, its process, the path of
    its stderr). Stopped on exit."""
    if "--kv-cache-memory-gb" not in flags:
        flags = (*flags, "--kv-cache-memory-gb", KV_CACHE_GB)
    port = free_port()
    log = log_dir / f"server-{port}.log"
    proc = start_python(
        [
            str(CHAPTER / "server.py"),
            "--model",
            model,
            "--port",
            str(port),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            *flags,
        ],
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"server exited: {log.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if http.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.05)  # a poll costs the server a millisecond; a late one, a core idle
        else:
            pytest.fail("server did not come up in 180 s")
        yield url, proc, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
