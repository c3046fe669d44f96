"""Prompt-chunk attention on a CPU: the library's chunk kernel (kernels/csrc/cpu/chunk_attention.cpp)
against chapter 05's gather + SDPA, alone and inside a prompt's time to first token.

    python bench/chunk_attention.py                      # both parts, one thread, CPU time
    python bench/chunk_attention.py --parts attention    # the attention alone
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/chunk_attention.py   # an AVX2-only CPU

attention: one layer of SmolLM2-135M's attention (9 query heads over 3 kv heads of 64 values, bf16
pool of 16-token blocks scattered at random) for a prompt of --prompt-tokens tokens in the engine's
chunks of 256 (each chunk after the earlier ones' cached keys), the chunk kernel vs gather + SDPA
(float32, as chapter 05 runs it on a CPU), interleaved --rounds times; the median.
profile: the newest chapter's engine (int4 weights, bf16 activations, kernels on) prefilling a
--profile-tokens prompt, its time split into the linear layers (the library's int4/int8 matmuls),
attention, and the rest (norms, RoPE, SwiGLU, Python), once with each attention path.
--clock cpu (default) times the process's CPU time with one thread (a shared machine stretches wall
time, hardly one thread's CPU time). JSON at --out and a plot beside it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from common.tools.bench import RESULTS_DIR, machine
from common.tools.chapters import chapter_number, load_chapter, newest_chapter


def attention_case(n_tokens: int, dtype=torch.bfloat16, block_size: int = 16, seed: int = 0):
    """A prompt's K/V in a pool of scattered blocks, and its q: SmolLM2-135M's attention shapes."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-n_tokens // block_size)
    pool = lambda: torch.randn(blocks + 4, block_size, 3, 64, generator=g).to(dtype)  # noqa: E731
    k_pool, v_pool = pool(), pool()
    table = torch.randperm(blocks + 4, generator=g)[:blocks].to(torch.int32)[None]
    q = torch.randn(n_tokens, 9, 64, generator=g).to(dtype)
    return q, k_pool, v_pool, table


def chunked_attention_paths(ch, ext, q, k_pool, v_pool, table, chunk: int):
    """Two functions attending the whole prompt in chunks of `chunk` as the engine would: the chunk
    kernel, and gather + SDPA (chapter 05's paged_attention on the same step groups)."""
    block_size, n = k_pool.shape[1], q.shape[0]
    steps = []
    for start in range(0, n, chunk):
        new = min(chunk, n - start)
        work = ch.batch.Work([0] * new, start, table[0, : -(-(start + new) // block_size)].tolist())
        steps.append((start, new, ch.batch.build_step([work], block_size, "cpu")))

    def kernel():
        for start, new, step in steps:
            g = step.groups[0]
            lens = torch.tensor([new], dtype=torch.int32)
            ext.chunk_attention(
                q[start : start + new], k_pool, v_pool, g.block_tables, torch.zeros(1, dtype=torch.int32), lens,
                g.context_lens, 0.125,
            )  # fmt: skip

    def sdpa():
        for start, new, step in steps:
            ch.paged_attention.paged_attention(q[start : start + new], k_pool, v_pool, step.groups)

    return kernel, sdpa


def bench_attention(ch, ext, lengths, rounds, clock) -> dict:
    out = {}
    for n in lengths:
        kernel, sdpa = chunked_attention_paths(ch, ext, *attention_case(n), chunk=256)
        kernel(), sdpa()  # warm-up
        a, b = [], []
        for _ in range(rounds):
            for fn, times in ((kernel, a), (sdpa, b)):
                start = clock()
                fn()
                times.append((clock() - start) * 1e3)
        out[n] = {"kernel_ms": a, "gather_sdpa_ms": b, "speedup": statistics.median(b) / statistics.median(a)}
        print(
            f"attention, {n:>5} tokens (one layer, chunks of 256): kernel {statistics.median(a):8.2f} ms, "
            f"gather + SDPA {statistics.median(b):8.2f} ms: {out[n]['speedup']:.2f}x"
        )
    return out


def profile_prefill(ch, n_tokens: int, rounds: int, clock) -> dict:
    """The engine prefilling one prompt, timed by parts: the linears, attention, the rest."""
    spec = ch.loading.quant_spec(argparse.Namespace(quant="int4", group_size=32, symmetric=False, lm_head="int8"))
    engine, _ = ch.engine.build_engine("smollm2-135m", "cpu", "bfloat16", spec, num_blocks=n_tokens // 16 + 8,
                                       prefix_caching=False)  # fmt: skip
    ops = engine.model.ops
    spent = defaultdict(float)

    def timed(part, fn):
        def call(*a, **k):
            start = clock()
            try:
                return fn(*a, **k)
            finally:
                spent[part] += clock() - start

        return call

    for kind in (ch.ops.KernelInt4Linear, ch.ops.KernelInt8Linear, ch.ops.KernelBf16Linear):
        kind.__call__ = timed("linear", kind.__call__)
    ops.attention = timed("attention", ops.attention)
    ids = [random.Random(0).randrange(100, engine.model.config.vocab_size) for _ in range(n_tokens)]
    serves = ops._chunk_kernel_serves
    result = {}
    for path in ("kernel", "gather_sdpa"):
        ops._chunk_kernel_serves = serves if path == "kernel" else (lambda *a: False)
        request = lambda: ch.request.Request(ids, ch.sampling.SamplingParams(temperature=0), max_tokens=1)  # noqa: E731
        engine.generate([request()])  # warm-up
        totals = []
        parts = defaultdict(list)
        for _ in range(rounds):
            spent.clear()
            start = clock()
            engine.generate([request()])
            total = clock() - start
            totals.append(total * 1e3)
            for part in ("linear", "attention"):
                parts[part].append(spent[part] * 1e3)
            parts["rest"].append((total - spent["linear"] - spent["attention"]) * 1e3)
        row = {"ttft_ms": statistics.median(totals)} | {p: statistics.median(v) for p, v in parts.items()}
        result[path] = row
        share = {p: f"{row[p]:6.0f} ms ({row[p] / row['ttft_ms']:4.0%})" for p in ("linear", "attention", "rest")}
        print(
            f"prefill, {n_tokens} tokens, attention by {path:>11}: TTFT {row['ttft_ms']:7.0f} ms = linears "
            f"{share['linear']} + attention {share['attention']} + rest {share['rest']}"
        )
    return result


def plot(result: dict, path: Path) -> bool:
    """The attention part's figure at `path`. -> whether there was one to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.get("attention", {})
    if not rows:
        return False
    lengths = list(rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    x = range(len(lengths))
    ax.bar([i - 0.2 for i in x], [statistics.median(rows[n]["gather_sdpa_ms"]) for n in lengths], 0.4,
           label="gather + SDPA (float32)")  # fmt: skip
    ax.bar([i + 0.2 for i in x], [statistics.median(rows[n]["kernel_ms"]) for n in lengths], 0.4, label="chunk kernel")
    ax.set_xticks(list(x), [f"{n} tokens" for n in lengths])
    ax.set_yscale("log")
    ax.set_ylabel(f"ms per layer ({result['clock']} time, 1 thread)")
    ax.set_title(f"Prompt attention, one SmolLM2-135M layer, bf16 pool\n({result['isa']})", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--chapter", type=chapter_number, default=newest_chapter(), help="06 on (default: the newest)")
    ap.add_argument("--parts", default="attention,profile")
    ap.add_argument("--prompt-tokens", default="128,512,2000")
    ap.add_argument("--profile-tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.chapter < 6:
        ap.error("--chapter: the chunk attention kernel starts in chapter 06")
    torch.set_num_threads(1)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    ch = load_chapter(args.chapter, "engine", "loading", "sampling", "request", "batch", "paged_attention", "ops")
    import kernels

    ext = kernels.load()
    result = {"chapter": args.chapter, "clock": args.clock, "threads": 1, "isa": ext.cpu_isa()}
    parts = args.parts.split(",")
    if "attention" in parts:
        lengths = [int(n) for n in args.prompt_tokens.split(",")]
        result["attention"] = bench_attention(ch, ext, lengths, args.rounds, clock)
    if "profile" in parts:
        result["profile"] = profile_prefill(ch, args.profile_tokens, args.rounds, clock)
    result["machine"] = machine()
    out = args.out or RESULTS_DIR / f"chunk_attention_{result['isa']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    drawn = plot(result, out.with_suffix(".png"))
    print(f"saved {out}" + (f" and {out.with_suffix('.png').name}" if drawn else " (the plot is the attention part's)"))
    return 0


if __name__ == "__main__":
    from common.cli import run_main

    run_main(main)
