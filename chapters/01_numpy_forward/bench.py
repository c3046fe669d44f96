"""How the cost of one generated token grows without a KV cache.

Times one forward pass (last-position logits only, as greedy generation does) over sequences of
growing length, and saves the figures as JSON and a plot under bench/results/.

    python chapters/01_numpy_forward/bench.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from common.cli import positive_int, run_main
from common.models import resolve_model
from common.tools.bench import RESULTS_DIR, int_list
from model import forward, load_model


def time_forward(model, n_tokens: int, repeats: int) -> float:
    ids = list(np.random.default_rng(0).integers(3, model.config.vocab_size, n_tokens))
    forward(model, ids, last_only=True)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        forward(model, ids, last_only=True)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="16,64,128,256,512,1024")
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    model = load_model(model_dir)
    rows = []
    print(f"{'context':>8} {'ms / token':>11} {'tok/s':>8}")
    for n in int_list(args.lengths):
        seconds = time_forward(model, n, args.repeats)
        rows.append({"context_tokens": n, "ms_per_token": seconds * 1e3, "tokens_per_s": 1 / seconds})
        print(f"{n:>8} {seconds * 1e3:>11.1f} {1 / seconds:>8.1f}")
    result = {
        "what": "ch01 NumPy, no KV cache: time of one greedy step (full forward, last-position logits) vs context",
        "model": model_dir.name,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "numpy": np.__version__,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"ch01_cost_per_token_{model_dir.name}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([r["context_tokens"] for r in rows], [r["ms_per_token"] for r in rows], "o-")
        ax.set_xlabel("tokens already in the sequence")
        ax.set_ylabel("ms to generate the next token")
        ax.set_title(f"No KV cache: each token recomputes everything ({model_dir.name})")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png", dpi=120)
    except ImportError:
        pass
    print(f"saved {out / stem}.json/.png")
    return 0


if __name__ == "__main__":
    run_main(main)
