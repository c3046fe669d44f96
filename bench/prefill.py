"""Prompt processing and batched steps on a CPU: time to first token of a prompt against llama.cpp,
and a decode step of 16 sequences against a step of one, for the newest chapter with kernels (06 on;
--chapter for another).

    python bench/prefill.py                                  # int4 / Q4_1, prompts of 128 and 2000 tokens
    python bench/prefill.py --quant none                     # bf16 weights / the BF16 GGUF
    python bench/prefill.py --no-int8-activations            # int4 x bf16 in floats (not as int8)
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 PYTHONPATH=~/llama-cpp-avx2 python bench/prefill.py
                                                             # an AVX2-only CPU, reproduced on a wider one

TTFT: one request of --prompt-tokens random ids and max_tokens 1 through Engine.generate, against
llama.cpp evaluating the same ids in one batch (llama-cpp-python, the GGUF beside the weights), the
two interleaved --rounds times after a warm-up of each. Steps: the chapter's engine decoding 1, then
16 sequences (128-token prompts), the median of 24 steps. --clock cpu (default) times the process's
CPU time with --threads 1: on a shared machine a busy neighbour stretches wall time several-fold but
hardly the CPU time of one thread; --clock wall with --threads 2 is what a user waits. The last line
says which vector level each side ran (common.tools.bench.isa_report): a ratio counts where they are
the same. ATEN_CPU_CAPABILITY caps torch's and the library's kernels, ONEDNN_MAX_CPU_ISA torch's
GEMM (oneDNN), which uses bf16 instructions whatever ATEN_CPU_CAPABILITY says. Results: a table, JSON
at --out.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from common.tools.bench import int8_activations_error, RESULTS_DIR, add_int8_activations, isa_line, machine
from common.tools.chapters import chapter_number, load_chapter, newest_chapter
from common.tools.decoding import decoding_engine


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--chapter", type=chapter_number, default=newest_chapter(), help="06 on (default: the newest)")
    ap.add_argument("--model", default="smollm2-135m", help="llama.cpp runs beside smollm2-135m only (its GGUF)")
    ap.add_argument("--quant", choices=["int4", "none"], default="int4")
    ap.add_argument("--prompt-tokens", default="128,2000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--out", type=Path, default=None)
    add_int8_activations(ap)
    args = ap.parse_args()
    if args.chapter < 6:
        ap.error("--chapter: the kernels this bench times start in chapter 06")
    if why := int8_activations_error(args, args.quant):
        ap.error(why)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    ch = load_chapter(args.chapter, "engine", "loading", "sampling", "request", "peers", "ops")
    kernels = ch.ops.KernelFlags("on", False, args.int8_activations)
    spec = ch.loading.quant_spec(
        SimpleNamespace(
            quant=None if args.quant == "none" else args.quant, group_size=32, symmetric=False, lm_head="int8"
        )
    )
    blocks = max(lengths) // 16 + 8
    engine, _ = ch.engine.build_engine(
        args.model, "cpu", "bfloat16", spec, kernels=kernels, num_blocks=blocks, prefix_caching=False
    )
    ours_desc = engine.model.ops.describe()

    def ours(ids) -> float:
        params = ch.sampling.SamplingParams(temperature=0)
        start = clock()
        engine.generate([ch.request.Request(ids, params, max_tokens=1, ignore_eos=True)])
        return clock() - start

    theirs = llama_cpp_prefill(ch, args, max(lengths), clock) if args.model == "smollm2-135m" else None
    rng = random.Random(0)
    result = {"chapter": args.chapter, "model": args.model, "quant": args.quant, "clock": args.clock}
    # int8 activations meet int4 and int8 weights only: bf16 weights (--quant none) take x as it is
    int8_x = args.int8_activations and args.quant != "none"
    result |= {"threads": args.threads, "int8_activations": int8_x, "ttft": {}}
    for n in lengths:
        ids = [rng.randrange(100, engine.model.config.vocab_size) for _ in range(n)]
        ours(ids), theirs and theirs(ids)  # warm-up
        a, b = [], []
        for _ in range(args.rounds):
            a.append(ours(ids))
            if theirs:
                b.append(theirs(ids))
        row = {"ours_ms": [x * 1e3 for x in a], "llama_cpp_ms": [x * 1e3 for x in b]}
        if b:
            row["ratio"] = [x / y for x, y in zip(a, b)]
        result["ttft"][n] = row

    steps = {}
    for seqs in (1, 16):
        e = decoding_engine(
            args.chapter, args.model, args.quant, "bfloat16", "on", 128, 40, 4, seqs, args.int8_activations
        )
        times = []
        for _ in range(24):
            start = clock()
            e.step()
            times.append(clock() - start)
        steps[seqs] = statistics.median(times) * 1e3
    result["step_ms"] = steps
    result["machine"] = machine()

    print(f"\nchapter {args.chapter:02d}, {args.quant}, {args.clock} time, {args.threads} thread(s); {ours_desc}")
    for n, row in result["ttft"].items():
        line = f"TTFT, {n:>5}-token prompt: ours {statistics.median(row['ours_ms']):8.0f} ms"
        if "ratio" in row:
            r = row["ratio"]
            line += f", llama.cpp {statistics.median(row['llama_cpp_ms']):8.0f} ms, ours / llama.cpp "
            line += f"{statistics.median(r):.2f} [{min(r):.2f}-{max(r):.2f}]"
        print(line)
    print(f"decode step: 1 sequence {steps[1]:.1f} ms, 16 sequences {steps[16]:.1f} ms ({steps[16] / steps[1]:.2f}x)")
    isa = result["machine"]["isa"]
    print(isa_line(isa))
    out = args.out or RESULTS_DIR / f"prefill_ch{args.chapter:02d}_{args.quant}_{isa['ours']}{'_int8_x' * int8_x}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {out}")
    return 0


def llama_cpp_prefill(ch, args, longest: int, clock):
    """A function timing llama.cpp's evaluation of a prompt, or None (with the reason) where it is not
    installed."""
    why = ch.peers.llama_cpp_available()
    if why:
        print(f"[prefill] llama.cpp skipped: {why}", file=sys.stderr)
        return None
    import llama_cpp

    gguf = ch.peers.gguf_path("Q4_1" if args.quant == "int4" else "BF16")
    n = max(longest, 512)
    llm = llama_cpp.Llama(
        model_path=str(gguf), n_ctx=longest + 8, n_batch=n, n_ubatch=n, n_threads=args.threads,
        n_threads_batch=args.threads, flash_attn=True, verbose=False,
    )  # fmt: skip

    def theirs(ids) -> float:
        llm.reset()
        start = clock()
        llm.eval(ids)
        return clock() - start

    return theirs


if __name__ == "__main__":
    from common.cli import run_main

    run_main(main)
