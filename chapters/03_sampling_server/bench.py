"""TTFT and inter-token latency of streamed requests, as a client of the HTTP server sees them.

Starts server.py on a free local port, sends streamed chat requests one after another with the
official openai client (greedy, fixed length), and times the arrival of each SSE chunk. Saves
JSON under bench/results/.

    python chapters/03_sampling_server/bench.py --model smollm2-135m --requests 5 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common.bench import RESULTS_DIR, machine
from common.cli import run_main

HERE = Path(__file__).resolve().parent

PROMPT = "Explain in a few sentences why the sky is blue."


def start_server(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, str(HERE / "server.py"), "--model", args.model, "--port", str(port)]
    for flag in ("device", "dtype"):
        if getattr(args, flag):
            cmd += [f"--{flag}", getattr(args, flag)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    import httpx

    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args()
    import openai

    proc, url = start_server(args)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        runs = []
        for i in range(args.requests + 1):  # the first request warms up and is not counted
            t0 = time.perf_counter()
            stamps = []
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=args.max_tokens,
                temperature=0, stream=True, extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(time.perf_counter())
            if i:
                runs.append({"ttft_ms": (stamps[0] - t0) * 1e3, "gaps_ms": list(np.diff(stamps) * 1e3)})
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    ttft = [r["ttft_ms"] for r in runs]
    gaps = np.concatenate([r["gaps_ms"] for r in runs])
    result = {
        "what": "streamed chat requests through the ch03 HTTP server, one at a time, timed at the client",
        "command": " ".join(["python", "chapters/03_sampling_server/bench.py", *sys.argv[1:]]),
        "model": model, "machine": machine(), "requests": args.requests, "max_tokens": args.max_tokens,
        "ttft_ms_p50": float(np.percentile(ttft, 50)), "ttft_ms_max": float(max(ttft)),
        "itl_ms_p50": float(np.percentile(gaps, 50)), "itl_ms_p99": float(np.percentile(gaps, 99)),
        "stream_tok_s": float(1e3 / gaps.mean()),
    }
    print(f"{model}: {args.requests} streamed requests x {args.max_tokens} tokens")
    print(f"TTFT p50 {result['ttft_ms_p50']:.0f} ms (max {result['ttft_ms_max']:.0f}), ITL p50 "
          f"{result['itl_ms_p50']:.1f} ms, p99 {result['itl_ms_p99']:.1f} ms, {result['stream_tok_s']:.1f} tok/s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"ch03_server_stream_{model}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out / f'ch03_server_stream_{model}.json'}")
    return 0


if __name__ == "__main__":
    run_main(main)
