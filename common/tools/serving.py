"""The serving benches' harness (chapter 05 on): a chapter's `server.py` started on a free port and
stopped whatever happens (`servers`), a streaming OpenAI-API client timed at each SSE chunk
(`stream`), /health watched while it runs, and rounds of N concurrent clients (`concurrent_round`,
`throughput_rounds`). It knows HTTP and processes, never an engine: what a chapter measures stays
in its bench.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common.tools.bench import PROMPTS, command_line, median, pct

# --- servers ------------------------------------------------------------------------------------


def ephemeral_ports() -> range:
    """The ports the kernel hands out to sockets that do not choose one (Linux's
    /proc/sys/net/ipv4/ip_local_port_range; IANA's 49152-65535 elsewhere)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(49152, 65536)


def free_port() -> int:
    """A localhost port that nothing listens on, for a server about to start: taken below the
    ephemeral range. A port from bind(0) comes from that range, the one every outgoing connection
    draws from (a server at --tensor-parallel-size 2 opens its ranks' gloo connections before it
    listens; other tests' clients run beside it): one of them can take the port first (`address
    already in use`, seen in make test)."""
    first_ephemeral = ephemeral_ports().start
    below = range(max(1024, first_ephemeral - 16384), first_ephemeral)
    for port in random.Random(os.urandom(8)).sample(below, 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free localhost port in {below.start}-{below.stop - 1} (64 tried)")


def connect_from(address: str, port: int) -> socket.socket:
    """A connection to a server on 127.0.0.1 from `address`, one of the loopback addresses
    (127.0.0.0/8 all reach this host), so that one machine can play several clients."""
    s = socket.socket()
    s.settimeout(10)
    s.bind((address, 0))
    s.connect(("127.0.0.1", port))
    return s


@contextlib.contextmanager
def idle_flood(port: int, addresses: list[str], per_address: int = 8):
    """While the block runs, each address holds `per_address` idle connections to the server on
    `port` (sending nothing) and reopens each one the server closes: the connection flood of a
    hostile client. A thread per address."""
    import threading

    stop = threading.Event()

    def hold(address: str) -> None:
        held: list[socket.socket] = []
        while not stop.is_set():
            with contextlib.suppress(OSError):
                while len(held) < per_address:
                    held.append(connect_from(address, port))
            time.sleep(0.02)
            for c in list(held):  # a connection the server closed reads b"" (or fails) at once: reopen it
                try:
                    c.setblocking(False)
                    closed = c.recv(1) == b""
                    c.setblocking(True)
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if closed:
                    c.close()
                    held.remove(c)
        for c in held:
            c.close()

    threads = [threading.Thread(target=hold, args=(a,)) for a in addresses]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()


def _die_with_parent() -> None:
    """In the server's process, before exec: SIGTERM it when the bench dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def wait_until_healthy(proc: subprocess.Popen, url: str, what: str, timeout: float = 600.0, log=None) -> None:
    """Returns once `url`/health answers 200; a RuntimeError (with the end of `log`, the server's
    stderr file, if given) when the process exits first or `timeout` seconds pass."""
    import httpx

    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            tail = ""
            if log is not None:
                log.seek(0)
                tail = ":\n" + log.read()[-3000:]
            raise RuntimeError(f"{what} exited with status {proc.returncode}{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        if time.time() > deadline:
            raise RuntimeError(f"{what} did not answer /health in {timeout:.0f} s")
        time.sleep(0.2)


@contextlib.contextmanager
def servers(
    specs: dict[str, tuple[Path, list[str]]],
    record: dict | None = None,
    threads: int | None = None,
    timeout: float = 600.0,
):
    """Starts every server of `specs` ({label: (a chapter's folder, its server.py's arguments)}) at
    once, each on a free port (--port is added), waits for their /health, and yields {label: base
    url}. Every process is terminated on the way out, whatever happened. Each one's command and its
    start-up line ("serving ...") go into `record`. `threads` sets their OMP_NUM_THREADS."""

    env = dict(os.environ) | ({"OMP_NUM_THREADS": str(threads)} if threads else {})
    procs = {}
    try:
        for label, (folder, args) in specs.items():
            port = free_port()
            cmd = [sys.executable, str(Path(folder) / "server.py"), *args, "--port", str(port)]
            log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty server never blocks on it
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=env,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
            procs[label] = (proc, f"http://127.0.0.1:{port}", log, cmd)
        for label, (proc, url, log, cmd) in procs.items():
            wait_until_healthy(proc, url, f"{label} server", timeout, log)
            log.seek(0)
            banner = next((line.strip() for line in log if line.startswith("serving")), "")
            if record is not None:
                record[label] = {"command": command_line(cmd[1], cmd[2:]), "banner": banner}
            print(f"[server] {label}: {banner or url}", file=sys.stderr, flush=True)
        yield {label: url for label, (_, url, _, _) in procs.items()}
    finally:
        for proc, *_ in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc, _, log, _ in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


# --- a streaming client -------------------------------------------------------------------------


def new_client(n: int):
    """An async HTTP client for n requests at once (and a few spare connections)."""
    import httpx

    return httpx.AsyncClient(
        timeout=httpx.Timeout(600.0, connect=30.0),
        limits=httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8),
    )


def chat_body(question: str, max_tokens: int, system: str | None = None) -> dict:
    """A streamed, greedy chat request that yields exactly max_tokens tokens (ignore_eos)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return {
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream(
    client, url: str, path: str, body: dict, progress: list | None = None, stop: asyncio.Event | None = None
) -> dict:
    """One streamed request. -> t_send, the arrival time of every chunk that carries tokens (text,
    or the finish), usage (prompt and completion tokens) and the finish reason. `progress`, if
    given, is a one-element list kept at the number of chunks so far; the stream hangs up early
    (the server then aborts the request) when `stop` is set."""
    times, usage, finish = [], None, None
    t_send = time.perf_counter()
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"POST {path}: HTTP {r.status_code}: {(await r.aread()).decode()[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"POST {path}: error in the stream: {chunk['error']}")
            now = time.perf_counter()
            usage = chunk.get("usage") or usage
            carries = False
            for c in chunk.get("choices") or []:
                text = c["text"] if "text" in c else (c.get("delta") or {}).get("content")
                carries |= bool(text) or c.get("finish_reason") is not None
                finish = c.get("finish_reason") or finish
            if carries:
                times.append(now)
                if progress is not None:
                    progress[0] = len(times)
                if stop is not None and stop.is_set():
                    break
    return {"t_send": t_send, "times": times, "usage": usage, "finish": finish}


async def watch_health(client, url: str, stop: asyncio.Event, interval: float = 0.05) -> dict:
    """Polls /health until `stop`: the peaks of KV blocks used, running and waiting, and the last reply."""
    peak, last = {}, {}
    while True:
        with contextlib.suppress(Exception):
            last = (await client.get(url + "/health", timeout=5)).json()
            for key in ("kv_blocks_used", "running", "waiting"):
                if key in last:
                    peak[key] = max(peak.get(key, 0), last[key])
        if stop.is_set():
            return {"peak": peak, "last": last}
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)


# --- rounds of concurrent clients ---------------------------------------------------------------


async def concurrent_round(url: str, n: int, max_tokens: int, watch: float | None) -> dict:
    """n clients at once, one chat request each (prompts 0..n-1 of PROMPTS, cycled); /health polled
    every `watch` seconds (None: not at all)."""
    async with new_client(n) as client, new_client(1) as health_client:
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch_health(health_client, url, stop, watch)) if watch else None
        t0 = time.perf_counter()
        try:
            results = await asyncio.gather(
                *[
                    stream(client, url, "/v1/chat/completions", chat_body(PROMPTS[i % len(PROMPTS)], max_tokens))
                    for i in range(n)
                ]
            )
        finally:
            wall = time.perf_counter() - t0
            stop.set()
            health = await watcher if watcher else {"peak": {}, "last": {}}
    ttft = [(r["times"][0] - r["t_send"]) * 1e3 for r in results if r["times"]]
    itl = [g * 1e3 for r in results for g in np.diff(r["times"])]
    tokens = sum(r["usage"]["completion_tokens"] if r["usage"] else len(r["times"]) for r in results)
    return {
        "concurrency": n,
        "requests": n,
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "itl_ms_p50": pct(itl, 50),
        "itl_ms_p99": pct(itl, 99),
        "chunks": sum(len(r["times"]) for r in results),
        "prompt_tokens": [r["usage"]["prompt_tokens"] if r["usage"] else None for r in results],
        "finish": sorted({r["finish"] for r in results}, key=str),
        "peak_kv_blocks_used": health["peak"].get("kv_blocks_used"),
        "peak_running": health["peak"].get("running"),
        "peak_waiting": health["peak"].get("waiting"),
        "kv_blocks_total": health["last"].get("kv_blocks_total"),
        "preemptions": health["last"].get("preemptions"),
    }


def combine_rounds(runs: list[dict]) -> dict:
    """Rounds of one configuration -> medians, the peaks' maximum, and every round's tok/s."""
    out = {
        "concurrency": runs[0]["concurrency"],
        "requests": runs[0]["requests"],
        "tokens": runs[0]["tokens"],
        "tokens_per_round": [r["tokens"] for r in runs],
        "prompt_tokens": runs[0]["prompt_tokens"],
        "finish": runs[0]["finish"],
        "tok_s_runs": [r["tok_s"] for r in runs],
    }
    for key in ("tok_s", "wall_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99"):
        out[key] = median([r[key] for r in runs])
    for key in ("peak_kv_blocks_used", "peak_running", "peak_waiting"):
        out[key] = max((r[key] for r in runs if r[key] is not None), default=None)
    out["kv_blocks_total"] = runs[0]["kv_blocks_total"]
    out["preemptions"] = runs[-1]["preemptions"]
    return out


def throughput_rounds(
    urls: dict[str, str], plan: list[tuple[str, int]], repeats: int, max_tokens: int, health_interval: float
) -> dict[tuple[str, int], list[dict]]:
    """A few untimed requests to each server (a fresh one's first are slow), then `repeats` rounds of
    `plan`, its (server label, concurrency) pairs in order, so the servers interleave and share the
    machine's drift. -> {(label, concurrency): every round's concurrent_round}."""
    runs: dict[tuple[str, int], list[dict]] = {}

    async def go():
        for url in urls.values():
            await concurrent_round(url, 2, 4, watch=None)
        for r in range(repeats):
            for label, n in plan:
                run = await concurrent_round(urls[label], n, max_tokens, watch=health_interval)
                runs.setdefault((label, n), []).append(run)
                print(
                    f"[throughput] round {r + 1}/{repeats} {label} N={n:<3} {run['tok_s']:8.1f} tok/s  "
                    f"TTFT p50 {run['ttft_ms_p50']:7.1f} ms  ITL p50 {run['itl_ms_p50']:6.1f} ms  "
                    f"peak KV blocks {run['peak_kv_blocks_used']}",
                    file=sys.stderr,
                    flush=True,
                )

    asyncio.run(go())
    return runs
