"""Are a chapter's greedy outputs independent of what else runs? Three counts, in one process,
through the engine (no HTTP), for a chapter from 05 on (not a test: a measurement of when
temperature 0 is reproducible, quoted in chapters 05 and 06's READMEs).

    python bench/reproducibility.py --chapter 6 [--dtype bfloat16|float32] [--quant int4|int8|none]
                                    [--requests 16] [--max-tokens 48] [--kv-cache-memory-gb 1]
                                    [--batch-invariant] [--int8-activations] [--out results.json]

1. batch: the requests all at once (one running batch) against each one alone.
2. n=2: each request asking for two greedy choices: are the two equal?
3. prefix cache: each request a second time, its prompt's blocks now cached, against its first run
   (1 and 2 run with the prefix cache off, so that only 3 sees it).

A greedy token can only change where the top two logits are close enough for the arithmetic to
tip them: the engine's compute path depends on the step's row count (which matmul and attention
kernel run, how torch blocks a GEMM), and in bfloat16 those paths round differently.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common.tools.bench import int8_activations_error, PROMPTS, add_int8_activations, machine
from common.tools.chapters import chapter_number, load_chapter, newest_chapter


def generate(
    engine, ch, prompts: list[list[int]], max_tokens: int, n: int = 1, tag: str = "r"
) -> list[list[list[int]]]:
    """All `prompts` added at once, stepped to the end. -> per prompt, per choice, the token ids."""
    out: dict[str, dict[int, list[int]]] = {}
    for i, ids in enumerate(prompts):
        params = ch.sampling.SamplingParams(temperature=0)
        engine.add(ch.engine.Request(ids, params, max_tokens=max_tokens, n=n, ignore_eos=True), f"{tag}{i}")
    while engine.has_work():
        for rid, events, _ in engine.step():
            if isinstance(events, Exception):  # a request that failed alone (chapter 05's engine.step)
                raise events
            for e in events:
                out.setdefault(rid, {}).setdefault(e.index, []).extend(e.token_ids)
    return [[out[f"{tag}{i}"][c] for c in range(n)] for i in range(len(prompts))]


def one_at_a_time(engine, ch, prompts: list[list[int]], max_tokens: int, tag: str) -> list[list[int]]:
    """Each prompt alone in the engine, one after the other. -> per prompt, its token ids."""
    return [generate(engine, ch, [p], max_tokens, tag=f"{tag}{i}-")[0][0] for i, p in enumerate(prompts)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chapter", type=chapter_number, default=newest_chapter(), help="05 on (default: the newest)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quant", default="int4", choices=["int4", "int8", "none"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    # The engine's default pool is a quarter of free memory: gigabytes to zero for a few requests.
    ap.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="each engine's KV pool")
    ap.add_argument("--batch-invariant", action="store_true", help="chapter 06 on: the engine's --batch-invariant")
    add_int8_activations(ap, "chapter 06 on: ")
    ap.add_argument("--out", type=Path, help="save the counts as JSON")
    args = ap.parse_args()
    if args.chapter < 5:
        ap.error("--chapter: the batching engine starts in chapter 05")
    if why := int8_activations_error(args, args.quant):
        ap.error(why)
    if args.batch_invariant and args.chapter < 6:
        ap.error("--batch-invariant: chapter 06 on (the kernels' batch-invariant form)")

    ch = load_chapter(args.chapter, "engine", "quant", "sampling", *(["ops"] if args.chapter >= 6 else []))
    spec = {"int4": ch.quant.QuantSpec(4, 32), "int8": ch.quant.QuantSpec(8), "none": None}[args.quant]
    pool = {"kv_cache_bytes": int(args.kv_cache_memory_gb * 2**30)}
    if args.chapter >= 6:
        pool["kernels"] = ch.ops.KernelFlags("auto", args.batch_invariant, args.int8_activations)
    t0 = time.perf_counter()
    # 1 and 2 without the prefix cache, so that a cached prompt cannot change what they count
    engine, name = ch.engine.build_engine(args.model, "cpu", args.dtype, spec, prefix_caching=False, **pool)
    # distinct prompts: a repeated one would be a prefix hit inside the batch
    questions = [f"{PROMPTS[i % len(PROMPTS)]} ({i + 1})" for i in range(args.requests)]
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    t1 = time.perf_counter()
    together = [c[0] for c in generate(engine, ch, prompts, args.max_tokens, tag="batch")]
    t2 = time.perf_counter()
    alone = one_at_a_time(engine, ch, prompts, args.max_tokens, "alone")
    t3 = time.perf_counter()
    pairs = generate(engine, ch, prompts, args.max_tokens, n=2, tag="pair")
    del engine
    # 3: each request twice, one at a time, the second finding its whole prompt's blocks cached
    engine, _ = ch.engine.build_engine(args.model, "cpu", args.dtype, spec, prefix_caching=True, **pool)
    first = one_at_a_time(engine, ch, prompts, args.max_tokens, "first")
    again = one_at_a_time(engine, ch, prompts, args.max_tokens, "again")

    n_tokens = args.requests * args.max_tokens
    result = {
        "chapter": args.chapter,
        "model": name,
        "dtype": args.dtype,
        "quant": args.quant,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "batch_equals_alone": sum(a == b for a, b in zip(together, alone)),
        "n2_choices_equal": sum(c[0] == c[1] for c in pairs),
        "cached_prefix_equals_first_run": sum(a == b for a, b in zip(again, first)),
        "batch_invariant": args.batch_invariant,
        "int8_activations": args.int8_activations and args.chapter >= 6,
        # what the mode costs: output tokens / second with all requests at once, and one at a time
        "tok_s_all_at_once": round(n_tokens / (t2 - t1), 1),
        "tok_s_one_at_a_time": round(n_tokens / (t3 - t2), 1),
        "seconds": round(time.perf_counter() - t0, 1),
        "machine": machine(),
    }
    n = args.requests
    weights = "unquantized weights" if args.quant == "none" else f"{args.quant} weights"
    print(
        f"chapter {args.chapter:02d}, {name}, {weights}, {args.dtype}, {n} requests x {args.max_tokens} greedy tokens:"
    )
    print(f"  all at once == each alone:          {result['batch_equals_alone']:3d} of {n}")
    print(f"  n=2: the two choices equal:         {result['n2_choices_equal']:3d} of {n}")
    print(f"  prefix cached == its first run:     {result['cached_prefix_equals_first_run']:3d} of {n}")
    print(f"  tok/s, all at once / one at a time: {result['tok_s_all_at_once']} / {result['tok_s_one_at_a_time']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    from common.cli import run_main

    run_main(main)
