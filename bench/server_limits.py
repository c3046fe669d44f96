"""Figures for chapter 03's server limits, measured against a live server on localhost (not a test).

Usage, from the repository's root:

    python bench/server_limits.py --model smollm2-135m

1. abandoned work: 5 clients send non-streaming requests (max_tokens 150) and give up after
   0.5 s; how long until the worker is idle, and how long the next user's request then takes.
2. the memory budget: n=16 with a ~5.8k-token chat prompt is refused up front; what it needed.
3. /health while a 50 MB body is refused (413), with and without a Content-Length; and while the
   largest prompt --max-body-mb 1 lets in is tokenized.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time

import httpx

from common.tools.chapters import chapter_dir
from common.tools.serving import servers


@contextlib.contextmanager
def server(model: str, *flags: str):
    """Chapter 03's server on a free port, stopped on the way out: -> its base url."""
    with servers({"ch03": (chapter_dir(3), ["--model", model, *flags])}) as urls:
        yield urls["ch03"]


def abandoned(url: str) -> None:
    body = {
        "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
        "max_tokens": 150,
        "ignore_eos": True,
        "temperature": 0,
    }

    def give_up():
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(url + "/v1/chat/completions", json=body, timeout=0.5)

    clients = [threading.Thread(target=give_up) for _ in range(5)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(timeout=30)
    gave_up = time.perf_counter()
    while time.perf_counter() - gave_up < 120:
        health = httpx.get(url + "/health", timeout=10).json()
        if not health["busy"] and health["queued"] == 0:
            break
        time.sleep(0.05)
    idle = time.perf_counter() - gave_up
    t0 = time.perf_counter()
    httpx.post(
        url + "/v1/chat/completions",
        timeout=120,
        json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 10,
            "temperature": 0,
        },
    )
    print(
        f"1. 5 abandoned requests (max_tokens 150, clients gone after 0.5 s): worker idle {idle:.2f} s after the "
        f"last client left; the next request (10 tokens) took {time.perf_counter() - t0:.2f} s"
    )


def over_budget(url: str) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 580  # ~5.8k tokens with the template
    body = {"messages": [{"role": "user", "content": text}], "n": 16, "temperature": 1}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    outcome = r.json()["error"]["message"] if r.status_code >= 400 else "accepted (within this model's budget)"
    print(f"2. n=16, long prompt, no max_tokens: HTTP {r.status_code} in {time.perf_counter() - t0:.2f} s: {outcome}")


def health_while(url: str, label: str, work) -> None:
    """Polls /health every 20 ms while `work` runs in a thread; prints the latencies."""
    latencies, done = [], threading.Event()
    outcome = {}

    def run():
        try:
            outcome["result"] = work()
        except httpx.HTTPError as e:  # the server closed the connection on a body it refused
            outcome["result"] = f"{type(e).__name__}"
        done.set()

    thread = threading.Thread(target=run)
    t0 = time.perf_counter()
    thread.start()
    with httpx.Client(timeout=60) as client:
        while not done.is_set() or len(latencies) < 5:
            t = time.perf_counter()
            client.get(url + "/health")
            latencies.append((time.perf_counter() - t) * 1e3)
            time.sleep(0.02)
    thread.join()
    print(
        f"3. {label}: {outcome['result']} after {time.perf_counter() - t0:.2f} s; /health during it: "
        f"{len(latencies)} calls, median {statistics.median(latencies):.1f} ms, max {max(latencies):.1f} ms"
    )


def post(url: str, content, timeout: float = 300):
    r = httpx.post(
        url + "/v1/completions", content=content, headers={"content-type": "application/json"}, timeout=timeout
    )
    return f"HTTP {r.status_code} {r.json()['error']['message'][:90]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    big = b'{"prompt": "' + b"hello " * (50 * 2**20 // 6) + b'"}'  # 50 MB
    with server(args.model, "--max-body-mb", "1") as url:  # probe 3 is about a 1 MB prompt
        abandoned(url)
        over_budget(url)
        health_while(url, "50 MB body with Content-Length", lambda: post(url, big))
        pieces = (big[i : i + 2**16] for i in range(0, len(big), 2**16))
        health_while(url, "50 MB body, chunked", lambda: post(url, pieces))
        one_mb = b'{"prompt": "' + b"hello " * (2**20 // 6 - 5) + b'"}'
        health_while(url, f"{len(one_mb)}-byte prompt tokenized", lambda: post(url, one_mb))
    return 0


if __name__ == "__main__":
    from common.cli import run_main

    run_main(main)
