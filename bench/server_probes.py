"""A hostile but honest day for a chapter's server, replayed against a live one on localhost (not a
test): the probes of issue 21, each with the count or time that says whether the server held.

    python bench/server_probes.py --chapter 6 [--model smollm2-135m] [--out bench/results/server_probes_ch06.json]

1. big bodies: 100 clients at once, each a ~1 MB prompt (about 550k tokens, 67x SmolLM2's context):
   their statuses, the server's RSS before and after, and /health's slowest answer meanwhile.
2. a big reply: a non-streaming completion, n=4 x 1000 tokens with logprobs, built while /health is
   polled: /health's slowest answer.
3. a connection flood: five other loopback addresses hold 8 idle connections each and reopen them
   as they close; of 10 normal requests from 127.0.0.1, how many are served.
4. a 1M-character stop string: the status and how long the answer took.
5. SIGTERM with a stream running: how the stream ends and how long the server takes to exit.
6. a big logprobs reply (issue 38): n=16 x 400 tokens with the top 20 logprobs each, while /health
   is polled: /health's slowest answer (the reply is built and serialised off the event loop).
7. a long prompt beside a stream (issue 38; run it with --server-flags "--speculative draft"): one
   stream decodes while a ~5,000-token prompt arrives; the stream's longest gap between chunks
   while the long prompt is prefilled and drafted, and the long request's time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from common.tools.chapters import chapter_dir, chapter_number, newest_chapter
from common.tools.serving import free_port, idle_flood, wait_until_healthy


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# /health is polled every 50 ms by a process of its own: a thread here would share the GIL with the
# probe's hundred client threads and time them, not the server. One client, one kept-alive
# connection: httpx.get() builds a client (and its TLS context) per call, 40 ms here, more under load,
# which the figure would count as the server's.
_POLL = """
import json, statistics, sys, threading, time, httpx
url, times, done = sys.argv[1], [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
with httpx.Client(timeout=60) as client:
    while not done.is_set():
        t0 = time.perf_counter()
        try:
            client.get(url + "/health")
        except httpx.HTTPError:
            pass
        times.append(1000 * (time.perf_counter() - t0))
        time.sleep(0.05)
times.sort()
print(json.dumps({"slowest": times[-1], "median": statistics.median(times), "p99": times[int(0.99 * (len(times) - 1))], "polls": len(times)}))
"""


class HealthWatch:
    """Polls /health every 50 ms from another process; `slowest` is its longest answer, in ms,
    `answers` the slowest, median and 99th percentile with the number of polls."""

    def __init__(self, url: str):
        self.url, self.slowest, self.answers = url, float("nan"), {}

    def __enter__(self):
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _POLL, self.url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        time.sleep(1.0)  # its first answers, before the load
        return self

    def __exit__(self, *exc):
        out, _ = self._proc.communicate("", timeout=120)
        self.answers = json.loads(out) if out.strip() else {}
        self.slowest = self.answers.get("slowest", float("nan"))


# The hundred uploading clients, in a process of their own so that they can run at a lower
# priority (--client-nice): on a 2-core machine they otherwise take the cores from the server
# whose /health latency is being measured.
_SEND = """
import contextlib, json, sys, threading, httpx
url, n = sys.argv[1], int(sys.argv[2])
words = "the quick brown fox jumps over lazy dogs and cats " * 20000  # ~1,000,000 characters
statuses = []
def send():
    with contextlib.suppress(httpx.HTTPError):
        r = httpx.post(url + "/v1/completions", json={"prompt": words, "max_tokens": 1}, timeout=300)
        statuses.append(r.status_code)
clients = [threading.Thread(target=send) for _ in range(n)]
for c in clients:
    c.start()
for c in clients:
    c.join()
print(json.dumps(statuses))
"""


def big_bodies(url: str, pid: int, client_nice: int) -> dict:
    before = rss_mb(pid)
    with HealthWatch(url) as health:
        senders = subprocess.Popen(
            [sys.executable, "-c", _SEND, url, "100"],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=(lambda: os.nice(client_nice)) if client_nice else None,
        )
        statuses = json.loads(senders.communicate(timeout=900)[0])
    counts = {str(s): statuses.count(s) for s in sorted(set(statuses))}
    return {
        "statuses": counts,
        "rss_mb_before": before,
        "rss_mb_after": rss_mb(pid),
        "health_slowest_ms": health.slowest,
        "health_ms": health.answers,
        "client_nice": client_nice,
    }


def reply_under_watch(url: str, n: int, max_tokens: int, logprobs: int) -> dict:
    """One non-streaming completion of n choices with logprobs while /health is polled."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "n": n, "logprobs": logprobs, "ignore_eos": True}
    with HealthWatch(url) as health:
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json=body, timeout=1200)
        seconds = time.perf_counter() - t0
    return {"status": r.status_code, "seconds": seconds, "bytes": len(r.content), "health_slowest_ms": health.slowest, "health_ms": health.answers}


def big_reply(url: str) -> dict:
    return reply_under_watch(url, n=4, max_tokens=1000, logprobs=5)


def logprobs_reply(url: str) -> dict:
    return reply_under_watch(url, n=16, max_tokens=400, logprobs=20)


def long_prompt_beside_a_stream(url: str) -> dict:
    gaps, done = [], threading.Event()
    window: dict[str, float] = {}

    def stream():
        body = {"prompt": "Count slowly:", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=1200) as r:
            last = time.perf_counter()
            for line in r.iter_lines():
                now = time.perf_counter()
                if line.startswith("data: ") and line != "data: [DONE]":
                    gaps.append((now, now - last))
                    last = now
                if done.is_set():
                    break

    streamer = threading.Thread(target=stream)
    streamer.start()
    time.sleep(3.0)  # the stream is decoding
    words = "the quick brown fox jumps over the lazy dog " * 550  # ~5,000 tokens
    window["start"] = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"prompt": words, "max_tokens": 4}, timeout=1200)
    window["end"] = time.perf_counter()
    done.set()
    streamer.join(timeout=1200)
    during = [gap for at, gap in gaps if window["start"] <= at <= window["end"] + 1.0]
    return {
        "status": r.status_code,
        "long_request_seconds": window["end"] - window["start"],
        "stream_max_gap_ms": 1000 * max(during, default=float("nan")),
        "stream_chunks_during": len(during),
    }


def flood(url: str) -> dict:
    port = int(url.rsplit(":", 1)[1])
    statuses = []
    with idle_flood(port, [f"127.0.0.{i}" for i in range(2, 7)]):
        time.sleep(1.0)
        for _ in range(10):
            try:
                r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
                statuses.append(r.status_code)
            except httpx.HTTPError as e:
                statuses.append(type(e).__name__)
    return {"served": statuses.count(200), "of": len(statuses), "answers": statuses}


def long_stop(url: str) -> dict:
    # 100,000 characters: under the default body limit (a 1M-character one is refused by its size,
    # 413, before the stop string is read), far over the stop strings' limit (stopping.MAX_STOP_CHARS)
    t0 = time.perf_counter()
    r = httpx.post(
        url + "/v1/completions", json={"prompt": "hi", "max_tokens": 8, "stop": ["x" * 100_000]}, timeout=300
    )
    return {
        "status": r.status_code,
        "seconds": time.perf_counter() - t0,
        "message": r.json().get("error", {}).get("message"),
    }


def shutdown(url: str, proc: subprocess.Popen) -> dict:
    lines: list[str] = []
    body = {"prompt": "Once", "max_tokens": 4000, "ignore_eos": True, "stream": True}

    def stream():
        with contextlib.suppress(httpx.HTTPError):
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                lines.extend(line for line in r.iter_lines() if line.startswith("data: "))

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.time() + 60
    while len(lines) < 3 and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    sent = time.perf_counter()
    t.join(timeout=60)
    proc.wait(timeout=60)
    return {"exit_seconds": time.perf_counter() - sent, "last_events": lines[-2:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chapter", type=chapter_number, default=newest_chapter(), help="03 on (default: the newest)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default=None, help="JSON (default: bench/results/server_probes_chNN.json)")
    ap.add_argument("--timeout-graceful-shutdown", default="5")
    ap.add_argument(
        "--client-nice", type=int, default=0, help="big_bodies: run its 100 clients at this nice value (0-19)"
    )
    ap.add_argument(
        "--probes",
        default="big_bodies,big_reply,flood,long_stop,shutdown",
        help="comma-separated; also logprobs_reply, long_prompt (default: the first five)",
    )
    ap.add_argument("--server-flags", default="", help='more flags for server.py, e.g. "--speculative draft"')
    args = ap.parse_args()
    names = ["big_bodies", "big_reply", "flood", "long_stop", "logprobs_reply", "long_prompt", "shutdown"]
    unknown = [name for name in args.probes.split(",") if name not in names]
    if unknown:
        ap.error(f"--probes: no probe {', '.join(map(repr, unknown))}; there are {', '.join(names)}")
    out = Path(args.out or f"bench/results/server_probes_ch{args.chapter:02d}.json")
    earlier = json.loads(out.read_text()) if out.exists() else {}
    server = [str(chapter_dir(args.chapter) / "server.py"), "--model", args.model]
    server += ["--timeout-graceful-shutdown", args.timeout_graceful_shutdown, *args.server_flags.split()]
    port = free_port()
    cmd = [sys.executable, *server, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    # A run of some probes keeps the others' last figures; each says the server it ran against.
    result = earlier | {"chapter": args.chapter}
    recorded = " ".join(server).replace(f"{chapter_dir(args.chapter).parents[1]}/", "")  # paths from the repository
    try:
        try:
            wait_until_healthy(proc, url, f"the server ({' '.join(cmd)})")
        except RuntimeError as e:
            sys.exit(str(e))
        for name, probe in (
            ("big_bodies", lambda: big_bodies(url, proc.pid, args.client_nice)),
            ("big_reply", lambda: big_reply(url)),
            ("flood", lambda: flood(url)),
            ("long_stop", lambda: long_stop(url)),
            ("logprobs_reply", lambda: logprobs_reply(url)),
            ("long_prompt", lambda: long_prompt_beside_a_stream(url)),
            ("shutdown", lambda: shutdown(url, proc)),
        ):
            if name not in args.probes.split(","):
                continue
            result[name] = probe() | {"server": recorded}
            print(f"{name:>10}: {json.dumps(result[name])[:300]}", flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1))
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    from common.cli import run_main

    run_main(main)
