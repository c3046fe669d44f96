"""TTFT and inter-token latency of streamed requests, as a client of the HTTP server sees them.

Starts server.py on a free local port, sends streamed chat requests one after another with the
official openai client (greedy, fixed length), and times the arrival of each SSE chunk. Saves
JSON under bench/results/, and beside it a plot of the time each streamed token took, against its
position, for every request (the first token's time is the TTFT).

    python chapters/03_sampling_server/bench.py --model smollm2-135m --requests 5 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common.cli import run_main
from common.tools.bench import RESULTS_DIR, machine
from common.tools.serving import free_port

HERE = Path(__file__).resolve().parent

PROMPT = "Explain in a few sentences why the sky is blue."


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
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
                model=model,
                messages=[{"role": "user", "content": PROMPT}],
                max_tokens=args.max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
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
        "model": model,
        "machine": machine(),
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "ttft_ms_p50": float(np.percentile(ttft, 50)),
        "ttft_ms_max": float(max(ttft)),
        "itl_ms_p50": float(np.percentile(gaps, 50)),
        "itl_ms_p99": float(np.percentile(gaps, 99)),
        "stream_tok_s": float(1e3 / gaps.mean()),
        "runs": [
            {"ttft_ms": round(r["ttft_ms"], 3), "gaps_ms": [round(float(g), 3) for g in r["gaps_ms"]]} for r in runs
        ],
    }
    print(f"{model}: {args.requests} streamed requests x {args.max_tokens} tokens")
    print(
        f"TTFT p50 {result['ttft_ms_p50']:.0f} ms (max {result['ttft_ms_max']:.0f}), ITL p50 "
        f"{result['itl_ms_p50']:.1f} ms, p99 {result['itl_ms_p99']:.1f} ms, {result['stream_tok_s']:.1f} tok/s"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"ch03_server_stream_{model}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / f"{stem}.png")
    print(f"saved {out / stem}.json/.png")
    return 0


def plot(result: dict, path: Path) -> None:
    """Time per streamed token against its position, one line per request: token 1's time is the
    TTFT (marked), each later token's the gap since the one before (the ITL)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(result["runs"]):
        (line,) = ax.plot(range(2, len(r["gaps_ms"]) + 2), r["gaps_ms"], lw=1, label=f"request {i + 1}")
        ax.plot(1, r["ttft_ms"], "o", color=line.get_color(), ms=6, mfc="none")
    ax.plot([], [], "o", color="grey", mfc="none", label="TTFT (token 1)")
    ax.axhline(result["itl_ms_p50"], color="grey", ls="--", lw=1, label=f"ITL p50 {result['itl_ms_p50']:.1f} ms")
    ax.set_yscale("log")
    ax.set_xlabel("streamed token (position in the answer)")
    ax.set_ylabel("ms for this token (token 1: TTFT)")
    ax.set_title(
        f"ch03 server, {result['model']}: {result['requests']} streamed requests, greedy, "
        f"{result['stream_tok_s']:.1f} tok/s",
        fontsize=10,
    )
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    run_main(main)
