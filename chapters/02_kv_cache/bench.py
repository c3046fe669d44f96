"""Decode speed with a KV cache, side by side with chapter 01 (no cache) and HF transformers.

Every engine gets the same prompt, dtype and thread count, generates greedily, and ignores EOS
so that all produce the same number of tokens. Each engine runs in its own process, so peak
memory is its own. Saves JSON and a plot of the time per decode step against position under
bench/results/.

    python chapters/02_kv_cache/bench.py --model smollm2-135m --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

from common.checkpoint import expected_shapes
from common.cli import positive_int, run_main
from common.config import load_config
from common.device import pick_device, pick_dtype, synchronize
from common.errors import RunError
from common.models import resolve_model
from common.tokenizer import Tokenizer
from common.tools.bench import RESULTS_DIR, machine, peak_memory_bytes, summarize
from common.tools.chapters import chapter_exists, load_chapter

TEXT = (
    "The history of computing is a story of abstractions stacked on abstractions. Early machines were "
    "programmed by rewiring panels; then came stored programs, assemblers, compilers and operating systems. "
)


def prompt_of_length(tokenizer: Tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(TEXT)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


@torch.inference_mode()
def run_ch02(model_dir, prompt, n_new, device, dtype) -> tuple[float, list[float]]:
    from kv_cache import KVCache
    from model import forward, load_model

    model = load_model(model_dir, device, dtype)

    def once(n):
        cache = KVCache(model.config, 1, len(prompt) + n, device, dtype)
        synchronize(device)
        t0, times = time.perf_counter(), []
        logits = forward(model, torch.tensor([prompt], device=device), cache, last_only=True)
        for i in range(n):
            next_id = logits[:, -1].argmax(-1)
            int(next_id)  # the token is known on the host: what a streaming server waits for
            times.append(time.perf_counter())
            if i + 1 < n:
                logits = forward(model, next_id[:, None], cache)
        return t0, times

    once(4)  # warm-up: kernel selection, allocator
    return once(n_new)


def run_ch01(model_dir, prompt, n_new, device, dtype) -> tuple[float, list[float]]:
    ch01 = load_chapter(1, "model")
    model = ch01.model.load_model(model_dir)
    ids = list(prompt)
    ch01.model.forward(model, ids[:8], last_only=True)  # warm-up
    t0, times = time.perf_counter(), []
    for _ in range(n_new):
        ids.append(int(ch01.model.forward(model, ids, last_only=True)[0].argmax()))
        times.append(time.perf_counter())
    return t0, times


@torch.inference_mode()
def run_hf(model_dir, prompt, n_new, device, dtype) -> tuple[float, list[float]]:
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    times: list[float] = []

    class Clock(BaseStreamer):
        def put(self, value):  # called with the prompt first, then each new token
            times.append(time.perf_counter())

        def end(self):
            pass

    def once(n):
        times.clear()
        ids = torch.tensor([prompt], device=device)
        synchronize(device)
        t0 = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            streamer=Clock(),
        )
        return t0, times[1:]

    once(4)
    return once(n_new)


ENGINES = {"ch02": run_ch02, "ch01": run_ch01, "hf": run_hf}


def child(args) -> None:
    """Runs one engine and prints its figures as one JSON line."""
    device = pick_device(args.device)
    dtype = torch.float32 if args.engine == "ch01" else pick_dtype(args.dtype, device)
    model_dir = resolve_model(args.model)
    prompt = prompt_of_length(Tokenizer(model_dir), args.prompt_tokens)
    n_new = args.ch01_new_tokens if args.engine == "ch01" else args.new_tokens
    t0, times = ENGINES[args.engine](model_dir, prompt, n_new, device, dtype)
    result = {"engine": args.engine, "dtype": str(dtype).removeprefix("torch."), **summarize(t0, times, len(prompt))}
    result["peak_memory_mib"] = peak_memory_bytes(device) / 2**20
    print(json.dumps(result))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default=None, help="default: $DEVICE, else auto")
    ap.add_argument("--dtype", default=None, help="default: $DTYPE, else auto (float32 on CPU)")
    ap.add_argument("--prompt-tokens", type=positive_int, default=128)
    ap.add_argument("--new-tokens", type=positive_int, default=128)
    ap.add_argument("--ch01-new-tokens", type=positive_int, default=16, help="chapter 01 is slow: time fewer steps")
    ap.add_argument("--engines", default="ch02,hf,ch01")
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # internal: run one engine in this process
    ap.add_argument("--out", default=str(RESULTS_DIR))
    args = ap.parse_args()
    unknown = sorted(set(args.engines.split(",")) - {"ch02", "hf", "ch01"})
    if unknown:
        ap.error(f"--engines: no engine {', '.join(map(repr, unknown))}; there are ch02, hf and ch01")
    if args.new_tokens < 2:
        ap.error("--new-tokens: at least 2 (decode is timed from the second token; the first ends the prompt)")
    if args.engine:
        child(args)
        return 0

    device = pick_device(args.device)
    dtype_name = str(pick_dtype(args.dtype, device)).removeprefix("torch.")
    model_dir = resolve_model(args.model)
    engines = args.engines.split(",")
    if "ch01" in engines and not chapter_exists(1):  # a copy of this chapter without its neighbour
        print("ch01 skipped: chapter 01 is not beside this chapter", file=sys.stderr)
        engines.remove("ch01")
    results = []
    for engine in engines:
        cmd = [
            sys.executable,
            __file__,
            "--engine",
            engine,
            "--model",
            str(model_dir),
            "--device",
            str(device),
            "--dtype",
            dtype_name,
            "--prompt-tokens",
            str(args.prompt_tokens),
            "--new-tokens",
            str(args.new_tokens),
            "--ch01-new-tokens",
            str(args.ch01_new_tokens),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:  # its own one-line error (exit 2), or a traceback: shown whole, then ours
            print(r.stderr.rstrip(), file=sys.stderr)
            lines = r.stderr.strip().splitlines() or [f"exit status {r.returncode}"]
            raise RunError(f"the {engine} engine failed: {lines[-1].removeprefix('error: ')}")
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))

    # Every weight is read once per decoded token (a tied LM head is the embedding, counted once).
    n_params = sum(math.prod(shape) for shape in expected_shapes(load_config(model_dir)).values())
    print(
        f"{model_dir.name}, {device}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens (ch01: {args.ch01_new_tokens})"
    )
    print(
        f"{'engine':<6} {'dtype':<9} {'prefill tok/s':>13} {'TTFT ms':>8} {'decode tok/s':>12} "
        f"{'ITL p50 ms':>10} {'ITL p99 ms':>10} {'GB/s':>6} {'peak MiB':>9}"
    )
    for r in results:
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[r["dtype"]]
        r["weight_gb_s"] = n_params * itemsize * r["decode_tok_s"] / 1e9
        print(
            f"{r['engine']:<6} {r['dtype']:<9} {r['prefill_tok_s']:>13.0f} {r['ttft_ms']:>8.1f} "
            f"{r['decode_tok_s']:>12.1f} {r['itl_p50_ms']:>10.2f} {r['itl_p99_ms']:>10.2f} "
            f"{r['weight_gb_s']:>6.1f} {r['peak_memory_mib']:>9.0f}"
        )
    by = {r["engine"]: r for r in results}
    if "ch02" in by and "hf" in by:
        print(f"ch02 decode / HF decode = {by['ch02']['decode_tok_s'] / by['hf']['decode_tok_s']:.2f}x")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"ch02_decode_{model_dir.name}_{dtype_name}"
    record = {
        "model": model_dir.name,
        "device": str(device),
        "machine": machine(),
        "weight_params": n_params,
        "command": " ".join(["python", "chapters/02_kv_cache/bench.py", *sys.argv[1:]]),
        "engines": results,
    }
    (out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    plot(results, out / f"{stem}.png", f"{model_dir.name}, {dtype_name}, prompt {args.prompt_tokens} tokens")
    print(f"saved {out / stem}.json/.png")
    return 0


def plot(results, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot(range(1, len(r["step_ms"]) + 1), r["step_ms"], label=f"{r['engine']} ({r['dtype']})", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("decode step (new tokens so far)")
    ax.set_ylabel("ms per token")
    ax.set_title(f"Time per decode step: {title}", fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    run_main(main)
