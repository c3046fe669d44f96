"""The server's limits: request bodies, slow and idle connections, log floods, operator limits,
and answering errors before the status line. A random tiny model: only the plumbing matters."""

import asyncio
import contextlib
import io
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from common.tools.testing import SERVER_STACK, require

require(*SERVER_STACK)  # before the imports that need them: without them, this module skips

import httpx
from fastapi.testclient import TestClient

from common.tools.serving import connect_from, idle_flood
from common.tools.warm_python import run_python
from live_server import http, serve

REACHES = ["limits.py"]  # scripts run in a subprocess (common/tools/carried.py)

CHAPTER = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama3"
HI = [{"role": "user", "content": "hi"}]


LIMITS = [
    "--max-body-mb",
    "0.01",
    "--timeout-body",
    "1",
    "--timeout-headers",
    "2",
    "--limit-concurrency",
    "8",
    "--max-connections",
    "32",
    "--max-connections-per-client",
    "8",
    "--max-tokens-default",
    "7",
    "--max-model-len",
    "256",
]


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("limited"), MODEL, *LIMITS) as (url, proc, log):
        yield url, log


def error_of(r: httpx.Response) -> dict:
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


# --- operator limits ---------------------------------------------------------------------------


def test_max_tokens_default_applies_when_the_request_sets_none(limited):
    url, _ = limited
    r = http.post(
        url + "/v1/chat/completions", json={"messages": HI, "ignore_eos": True, "temperature": 0}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 7 and r.json()["choices"][0]["finish_reason"] == "length"


def test_max_model_len_caps_the_context(limited):
    url, _ = limited
    assert http.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 256
    r = http.post(url + "/v1/completions", json={"prompt": [5] * 300}, timeout=60)
    assert r.status_code == 400 and "context is 256 tokens" in error_of(r)["message"]


# --- bodies ------------------------------------------------------------------------------------


def test_a_body_over_the_limit_gets_413(limited):
    url, _ = limited
    body = b'{"prompt": "' + b"x" * 20_000 + b'"}'
    r = http.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    # without a Content-Length (chunked), the bytes are counted as they come
    r = http.post(
        url + "/v1/completions", content=iter([body[:8000], body[8000:]]), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and "10485 bytes" in error_of(r)["message"]


def test_a_body_that_does_not_arrive_in_time_gets_408(limited):
    url, _ = limited
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt"'
        )
        reply = b""
        while chunk := s.recv(4096):  # the server gives up after --timeout-body 1, answers, and closes
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 408") and '"code":"request_timeout"' in reply


@pytest.mark.parametrize(
    "method, path, content, status, fragment",
    [
        ("POST", "/v1/chat/completions", b"[" * 10_000, 400, "nested too deeply"),
        ("POST", "/v1/chat/completions", b'{"messages": "\xff\xfe"}', 400, "not valid UTF-8"),
        ("GET", "/v1/chat/completions", None, 405, "use POST"),
        ("GET", "/v1/nothing-here", None, 404, "Invalid URL (GET /v1/nothing-here)"),
    ],
)
def test_every_error_is_an_openai_error_object(limited, method, path, content, status, fragment):
    url, _ = limited
    r = http.request(method, url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status and fragment in error_of(r)["message"], r.text


def test_openapi_documents_400_with_the_error_object_and_no_422(limited):
    url, _ = limited
    schema = http.get(url + "/openapi.json").json()
    responses = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in responses and "HTTPValidationError" not in schema["components"]["schemas"]
    assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    error = schema["components"]["schemas"]["ErrorObject"]["properties"]
    assert set(error) == {"message", "type", "param", "code"}


# --- connections -------------------------------------------------------------------------------


def test_idle_connections_do_not_lock_out_other_clients(limited):
    url, log = limited
    port = int(url.rsplit(":", 1)[1])
    log_before = log.stat().st_size
    # more than --limit-concurrency 8, from four addresses (each under its cap of 8 connections)
    idle = [connect_from(f"127.0.0.{20 + i % 4}", port) for i in range(20)]
    try:
        t0 = time.time()
        r = http.get(url + "/health", timeout=10)
        assert r.status_code in (200, 503) and time.time() - t0 < 10  # an answer, not a hang
        # --timeout-headers 2 closes the sockets that never sent a request
        wait_until_healthy(url)
        for s in idle:
            s.settimeout(10)
            assert s.recv(1) == b""  # closed by the server
    finally:
        for s in idle:
            s.close()
    assert log.stat().st_size - log_before < 2000, log.read_text()[-2000:]


def test_a_flood_of_idle_connections_does_not_lock_out_other_clients(limited):
    # Five other addresses hold 40 idle connections (--max-connections 32), reopening each as the
    # server closes it; the clients on 127.0.0.1 must still be served, each the moment it asks.
    url, log = limited
    port = int(url.rsplit(":", 1)[1])
    with idle_flood(port, [f"127.0.0.{i}" for i in range(2, 7)]):
        time.sleep(1.0)  # the flood is on
        served = []
        for _ in range(10):
            r = http.post(
                url + "/v1/completions",
                json={"prompt": "hi", "max_tokens": 2},
                headers={"connection": "close"},
                timeout=10,
            )
            served.append(r.status_code)
        assert served == [200] * 10, served
        assert http.get(url + "/health", timeout=10).status_code == 200


def test_a_client_over_its_connection_cap_gets_a_503_error_object(limited):
    url, _log = limited
    port = int(url.rsplit(":", 1)[1])
    held = [connect_from("127.0.0.9", port) for _ in range(8)]  # --max-connections-per-client 8
    try:
        extra = connect_from("127.0.0.9", port)
        reply = extra.recv(4096)  # a response before any request, then the server closes
        extra.close()
        other = connect_from("127.0.0.10", port)  # another address is not held to this one's cap
        other.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert other.recv(4096).startswith(b"HTTP/1.1 200")
        other.close()
    finally:
        for c in held:
            c.close()
    head, body = reply.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 503") and b"application/json" in head, reply
    error = json.loads(body)["error"]
    assert error["code"] == "too_many_connections" and "8 connections open" in error["message"], error


def wait_until_healthy(url: str, within_s: float = 30) -> None:
    """Polls /health until it answers 200 (the server has recovered), then asserts it does."""
    deadline = time.time() + within_s
    while time.time() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if http.get(url + "/health", timeout=5).status_code == 200:
                break
        time.sleep(0.5)
    assert http.get(url + "/health", timeout=5).status_code == 200


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc and sets another process's limits (Linux)")
def test_running_out_of_file_descriptors_is_logged_once_not_a_million_times(tmp_path):
    import resource

    with serve(tmp_path, MODEL) as (url, proc, log):
        port = int(url.rsplit(":", 1)[1])
        in_use = len(os.listdir(f"/proc/{proc.pid}/fd"))
        soft, hard = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (in_use + 4, hard))
        sockets = []
        try:
            for _ in range(40):  # the server accepts a few, then every accept() fails with EMFILE
                sockets.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            time.sleep(1)  # CPython's accept loop logs up to its backlog (2048) failures per poll, many a second
        finally:
            for s in sockets:
                s.close()
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (soft, hard))
        wait_until_healthy(url)
        text = log.read_text()
    assert "out of system resource" in text  # it did happen, and was said
    assert len(text) < 20_000, f"{len(text)} bytes of log: {text[:1000]}"


def test_repeated_log_lines_are_held_back_and_counted():
    from limits import RepeatFilter

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RepeatFilter(window=60))
    logger = logging.getLogger("test_repeat_filter")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for i in range(10_000):
            logger.error("socket.accept() out of system resource\nsocket: %d", i)
        logger.error("something else")
    finally:
        logger.removeHandler(handler)
    lines = [line for line in out.getvalue().splitlines() if not line.startswith("socket:")]
    assert lines == ["socket.accept() out of system resource", "something else"]


def test_repeat_filter_reports_how_many_it_held_back():
    from limits import RepeatFilter

    f = RepeatFilter(window=0.2)
    records = [logging.LogRecord("x", logging.ERROR, __file__, 1, "boom %s", (i,), None) for i in range(6)]
    assert [f.filter(r) for r in records[:5]] == [True, False, False, False, False]
    time.sleep(0.3)
    assert f.filter(records[5]) and records[5].getMessage() == "boom 5 [4 more like this held back]"


def test_the_open_file_limit_is_raised_to_the_hard_limit():
    code = (
        "import resource, sys\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\n"
        "from limits import raise_open_file_limit\n"
        "raise_open_file_limit()\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard) or hard == resource.RLIM_INFINITY)\n"
    )
    pytest.importorskip("resource")
    r = run_python(["-c", code], cwd=CHAPTER, timeout=120)
    assert r.stdout.strip() == "True", r.stderr


# --- in process: the event loop and the status line --------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine():
    from engine import build_engine

    return build_engine(MODEL, "cpu", "float32", max_tokens_default=4)[0]


def on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def test_tokenizing_runs_off_the_event_loop(tiny_engine, monkeypatch):
    from server import create_app
    from worker import Worker

    calls = []
    for name in ("encode", "encode_chat"):
        real = getattr(tiny_engine.tokenizer, name)
        monkeypatch.setattr(
            tiny_engine.tokenizer, name, lambda *a, _real=real, **k: calls.append(on_event_loop()) or _real(*a, **k)
        )
    with TestClient(create_app(Worker(lambda: tiny_engine), MODEL)) as client:
        assert client.post("/v1/chat/completions", json={"messages": HI}).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
    assert calls and not any(calls)  # a 1 MB prompt takes a while: /health must not wait for it


def test_an_engine_failure_before_the_first_token_is_a_500_not_a_200_stream(tiny_engine, monkeypatch):
    from server import create_app
    from worker import Worker

    def fail(*args, **kwargs):
        raise MemoryError("no room for the KV cache")
        yield  # a generator, like the real stream

    monkeypatch.setattr(tiny_engine, "stream", fail)
    with TestClient(create_app(Worker(lambda: tiny_engine), MODEL), raise_server_exceptions=False) as client:
        for body in ({"prompt": "hi", "stream": True}, {"prompt": "hi"}):
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 500, r.text
            error = r.json()["error"]
            assert error["type"] == "server_error" and "no room for the KV cache" in error["message"]


def test_a_shutdown_ends_open_requests_with_an_error_before_its_deadline(tmp_path):
    # SIGTERM with a stream and a non-streaming request running, each long enough to outlast the
    # 3 s grace: both end before uvicorn's deadline, each with an error its client can read.
    import json
    import signal
    import threading

    long = {"prompt": "Once upon a time", "max_tokens": 60000, "ignore_eos": True, "temperature": 0}
    with serve(tmp_path, "tiny-llama3", "--timeout-graceful-shutdown", "3") as (url, proc, log):
        lines, reply = [], {}

        def stream():
            with http.stream("POST", f"{url}/v1/completions", json=long | {"stream": True}, timeout=60) as r:
                lines.extend(line for line in r.iter_lines() if line.startswith("data: "))

        def wait():
            r = http.post(f"{url}/v1/completions", json=long, timeout=60)
            reply.update(status=r.status_code, body=r.json())

        threads = [threading.Thread(target=stream), threading.Thread(target=wait)]
        threads[0].start()
        deadline = time.time() + 60
        while len(lines) < 3 and time.time() < deadline:  # the stream has begun
            time.sleep(0.05)
        threads[1].start()  # beside it, or queued behind it where the worker runs one at a time
        while time.time() < deadline:  # both in: running (from chapter 05), or one busy and one queued
            health = http.get(f"{url}/health", timeout=5).json()
            if health.get("running", int(health["busy"])) + health["queued"] >= 2:
                break
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        sent = time.time()
        for t in threads:
            t.join(timeout=30)
        # uvicorn ends by raising the signal it caught again, once it has shut down
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM) and time.time() - sent < 3 + 2
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutting_down" and "ended before it finished" in error["message"]
        assert reply["status"] == 503 and reply["body"]["error"]["code"] == "server_shutting_down", reply
        text = log.read_text()
        assert text.count("shutting down: 2 open request(s) get 2 s to finish") == 1, text
        assert "Traceback" not in text and "CancelledError" not in text, text


def test_health_says_stopping_with_a_503_once_a_shutdown_begins(tiny_engine):
    # A load balancer polls /health: once a shutdown (or, at tensor parallelism, the loss of a rank)
    # has begun, the server takes no new work, and /health says so instead of "ok".
    from server import create_app
    from worker import Worker

    with TestClient(create_app(Worker(lambda: tiny_engine), MODEL)) as client:
        assert client.get("/health").json()["status"] == "ok"
        client.app.state.server.stopping = True  # what a SIGTERM (GracefulServer) or a lost rank sets
        r = client.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "stopping", "model": MODEL}
        assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 503


# Flags that started a server refusing every request (a concurrency limit of 0: a 503 for each while
# /health said ok; a negative body limit: a 413 for each), or failed after the model loaded with a
# traceback (a port past 65535, a limit of nan): refused by argparse, before anything loads.
BAD_FLAGS = [
    ("--port", "99999", "must be a port number, 0 to 65535, got 99999"),
    ("--max-body-mb", "nan", "must be a finite number above 0, got nan"),
    ("--max-body-mb", "-1", "must be a finite number above 0, got -1"),
    ("--limit-concurrency", "0", "must be at least 1, got 0"),
    ("--max-connections", "0", "must be at least 1, got 0"),
    ("--timeout-body", "-1", "must be a finite number above 0, got -1"),
    ("--timeout-headers", "0", "must be a finite number above 0, got 0"),
    ("--memory-budget-gb", "inf", "must be a finite number above 0, got inf"),
]


@pytest.mark.parametrize("flag, value, message", BAD_FLAGS, ids=lambda x: str(x)[:20])
def test_a_limit_that_refuses_every_request_is_refused_at_startup(flag, value, message, capsys):
    from server import parse_args

    with pytest.raises(SystemExit) as refused:
        parse_args(["--model", MODEL, flag, value])
    assert refused.value.code == 2 and f"argument {flag}: {message}" in capsys.readouterr().err


def test_a_refused_flag_ends_the_server_program_in_one_line():
    # The program itself, once (the cases above ask its parser: a process each cost 0.5 s)
    flag, value, message = BAD_FLAGS[0]
    r = run_python(["server.py", "--model", MODEL, flag, value], cwd=CHAPTER, timeout=120)
    assert r.returncode == 2 and f"argument {flag}: {message}" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--served-model-name", "", "must not be empty"),  # was replaced by --model's name unseen
        ("--timeout-keep-alive", "-5", "must be at least 0, got -5"),  # were taken
        ("--timeout-graceful-shutdown", "-1", "must be at least 0, got -1"),
    ],
)
def test_a_name_or_timeout_that_means_nothing_is_refused(flag, value, message, capsys):
    from server import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--model", MODEL, flag, value])
    assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_a_port_in_use_is_one_line_before_the_model_loads(tmp_path):
    # uvicorn found the port taken only once the model had loaded and the server had said it was
    # serving there; the socket is bound first now (a missing model would be the error otherwise)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["server.py", "--model", str(tmp_path / "no-model"), "--host", "127.0.0.1", "--port", str(port)]
        r = run_python(argv, cwd=CHAPTER, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use", r.stderr
