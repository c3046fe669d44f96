"""The standard offline throughput workload, on every engine at hand, on the same requests.

N requests whose prompt and output lengths are drawn uniformly from [--min-len, --max-len] (seed 0),
prompts of random token ids, EOS ignored (every request yields exactly its output length), all
submitted at once; throughput = output tokens / wall time. nano-vllm and mini-sglang report this
with N=256 and lengths in [100, 1024] on a GPU; the default here is sized for a 2-core CPU:

    python bench/workload.py                              # N=64, lengths 32..256, int4 weights
    python bench/workload.py --quant none                 # bf16 weights (llama.cpp: the BF16 GGUF)
    python bench/workload.py --requests 256 --min-len 100 --max-len 1024 --device cuda   # full size

Engines (--engines, comma-separated; by default the newest chapter's, ch05's and the two peers):
  chNN        chapter NN's engine (05 on, the first that batches): every request added at once and
              stepped to the end, its scheduler batching them continuously (--max-num-seqs,
              --max-num-batched-tokens); ch05 is the PyTorch path the later chapters started from
  llama.cpp   the GGUF our weights come from (Q4_1 beside int4, BF16 beside bf16), through its C
              API, batched continuously by hand as llama-server does with --max-num-seqs slots: a
              free slot takes the next request (its whole prompt in one llama_decode with the other
              admitted ones), and one llama_decode per step carries every running sequence's token
  hf          transformers' generate on static batches of --hf-batch requests (left-padded; a batch
              runs until its longest output is done, and only the requested tokens are counted)
An engine that cannot run here (llama.cpp not installed, or a model it has no GGUF for) is
skipped with the reason. Results: JSON at --out and a PNG beside it; a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from common.tools.bench import int8_activations_error, add_int8_activations, fmt, isa_line, machine
from common.cli import positive_int
from common.tools.chapters import chapter_exists, load_chapter, newest_chapter

REPO = Path(__file__).resolve().parents[1]
BASELINE = 5  # the first chapter that batches: its engine is the PyTorch path the later ones speed up
PEERS = ("llama.cpp", "hf")


def default_engines() -> list[str]:
    """The newest chapter's engine (whatever chapter that is), chapter 05's, then the peers."""
    return [*dict.fromkeys([f"ch{newest_chapter():02d}", f"ch{BASELINE:02d}"]), *PEERS]


def our_chapter(engine: str) -> int | None:
    """ch07 -> 7, for a chapter here that batches; None for a peer or a name that is neither."""
    if len(engine) == 4 and engine.startswith("ch") and engine[2:].isdigit():
        number = int(engine[2:])
        return number if number >= BASELINE and chapter_exists(number) else None
    return None


def make_requests(n: int, low: int, high: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """-> n (prompt token ids, output length) pairs, lengths uniform in [low, high]."""
    rng = random.Random(seed)
    top = min(vocab, 10000) - 1  # ordinary tokens, clear of a large vocabulary's rare tail
    return [([rng.randint(0, top) for _ in range(rng.randint(low, high))], rng.randint(low, high)) for _ in range(n)]


def run_ours(chapter: int, args, requests) -> dict:
    ch = load_chapter(chapter, "engine", "loading", "sampling", *(["ops"] if chapter >= 6 else []))
    spec = ch.loading.quant_spec(SimpleNamespace(quant=args.quant, group_size=32, symmetric=False, lm_head="int8"))
    # chapter 06 on: --[no-]int8-activations (ops.py's flags, of this same load)
    flags = {"kernels": ch.ops.KernelFlags("auto", False, args.int8_activations)} if chapter >= 6 else {}
    engine, _ = ch.engine.build_engine(
        args.model,
        args.device,
        args.dtype,
        spec,
        kv_cache_bytes=int(args.kv_cache_memory_gb * 2**30),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_caching=False,  # random prompts share nothing; no hit would be real
        **flags,
    )
    greedy = ch.sampling.SamplingParams(temperature=0)

    def submit(batch, tag):
        for i, (prompt, n_out) in enumerate(batch):
            engine.add(ch.engine.Request(list(prompt), greedy, max_tokens=n_out, ignore_eos=True), f"{tag}{i}")

    submit(requests[:2], "warm")  # first calls: page the weights in, start the thread pools
    while engine.has_work():
        engine.step()
    ids: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    submit(requests, "r")
    while engine.has_work():
        for rid, events, _ in engine.step():
            if isinstance(events, Exception):  # a request that failed alone (chapter 05's engine.step)
                raise events
            ids.setdefault(rid, []).extend(t for e in events for t in e.token_ids)
    if args.device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    # chapter 06 on: the kernels' line (their path, and int8 activations where on); chapter 05 has none
    ops = engine.model.ops.describe() if hasattr(engine.model, "ops") else "torch"
    return {"wall_s": wall, "ids": [ids.get(f"r{i}", []) for i in range(len(requests))], "ops": ops}


def run_llama_cpp(args, requests) -> dict:
    """Continuous batching over llama.cpp's C API (peers.BatchedLlamaCpp's context and batch)."""
    peers = load_chapter(newest_chapter(), "peers").peers
    longest = max(len(p) for p, _ in requests)
    slots = min(args.max_num_seqs, len(requests))
    path = peers.gguf_path({"int4": "Q4_1", None: "BF16"}[args.quant])
    with peers.BatchedLlamaCpp(
        path,
        slots=slots,
        ctx_per_seq=longest + max(n for _, n in requests),
        max_batch_tokens=max(args.max_num_batched_tokens, longest + slots),
        threads=args.threads,
    ) as ctx:
        ctx.generate([requests[0][0]], 2)  # warm-up, untimed
        lib = ctx.lib
        lib.llama_memory_clear(ctx.mem, True)
        waiting = list(range(len(requests)))
        free = list(range(slots))
        running: dict[int, int] = {}  # slot -> request index
        out: list[list[int]] = [[] for _ in requests]
        t0 = time.perf_counter()

        def decode(entries, rows):
            ctx._fill(entries)
            for r, token in zip(rows, ctx._decode_greedy(len(rows))):
                out[r].append(token)

        while waiting or running:
            # Whole prompts of the requests that free slots take, in one llama_decode of their own:
            # with a KV stream per sequence, llama.cpp splits a batch into equal shares per
            # sequence, so a prompt mixed into a decode step would run in one-token pieces.
            entries, rows = [], []
            while waiting and free and len(entries) + len(requests[waiting[0]][0]) <= ctx.n_batch:
                r, s = waiting.pop(0), free.pop(0)
                prompt = requests[r][0]
                entries += [(t, j, s, j == len(prompt) - 1) for j, t in enumerate(prompt)]
                running[s] = r
                rows.append(r)
            if entries:
                decode(entries, rows)
            # then the next token of every running sequence
            live = {s: r for s, r in running.items() if len(out[r]) < requests[r][1]}
            if live:
                decode(
                    [(out[r][-1], len(requests[r][0]) + len(out[r]) - 1, s, True) for s, r in live.items()],
                    list(live.values()),
                )
            for s, r in list(running.items()):
                if len(out[r]) == requests[r][1]:  # done: its slot's cells are freed for the next
                    lib.llama_memory_seq_rm(ctx.mem, s, -1, -1)
                    del running[s]
                    free.append(s)
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "ids": out, "file": path.name, "slots": slots}


def run_hf(args, requests) -> dict:
    from transformers import AutoModelForCausalLM

    from common.models import resolve_model

    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=dtype).to(args.device).eval()
    model.generation_config.eos_token_id = None  # EOS ignored: every batch runs its max_new_tokens
    pad = 0

    def generate(batch) -> list[list[int]]:
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=args.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=args.device)
        new = max(n for _, n in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                pad_token_id=pad,
            )  # fmt: skip
        return [out[i, width : width + n].tolist() for i, (_, n) in enumerate(batch)]

    generate(requests[:1])  # warm-up, untimed
    ids: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(requests), args.hf_batch):
        ids += generate(requests[i : i + args.hf_batch])
    if args.device == "cuda":
        torch.cuda.synchronize()
    return {"wall_s": time.perf_counter() - t0, "ids": ids, "batch": args.hf_batch}


def why_not(engine: str, args) -> str | None:
    if engine == "llama.cpp":
        if Path(args.model).name != "smollm2-135m":
            return f"its GGUFs are smollm2-135m's, not {args.model}'s"
        if args.quant not in ("int4", None):
            return f"no GGUF beside {args.quant} weights (Q4_1 is int4's, BF16 unquantized)"
        if args.device != "cpu":
            return "it runs on the CPU here"
        return load_chapter(newest_chapter(), "peers").peers.llama_cpp_available()
    if engine == "hf" and args.quant is not None and Path(args.model).name != "smollm2-135m":
        return "HF runs the checkpoint unquantized; only the bundled model's weights are its int4 values exactly"
    return None


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = result["runs"]
    names = list(runs)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh(names, [runs[n]["tok_s"] for n in names], color="#4c72b0")
    for y, n in enumerate(names):
        ax.text(runs[n]["tok_s"], y, f" {runs[n]['tok_s']:.0f}", va="center")
    w = result["workload"]
    ax.set_xlabel("output tokens / s (higher is better)")
    ax.set_title(
        f"{w['requests']} requests, lengths {w['min_len']}-{w['max_len']}, {result['weights']}, {result['device']}",
        fontsize=10,
    )
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--engines",
        default=",".join(default_engines()),
        help=f"comma-separated, of: ch{BASELINE:02d}..ch{newest_chapter():02d} (our engines), {', '.join(PEERS)}",
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quant", default="int4", choices=["int4", "none"])
    ap.add_argument("--dtype", default="bfloat16", help="activations and KV cache (float32 for exact comparisons)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=positive_int, default=64)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=positive_int, default=32, help="our engines' batch, and llama.cpp's slots")
    add_int8_activations(ap, "chapters 06 on: ")
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=512)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    ap.add_argument("--hf-batch", type=positive_int, default=16, help="requests per static batch of HF generate")
    ap.add_argument("--threads", type=positive_int, default=torch.get_num_threads(), help="llama.cpp's threads")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "workload.json")
    args = ap.parse_args()
    if why := int8_activations_error(args, args.quant):
        ap.error(why)
    args.quant = None if args.quant == "none" else args.quant
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(e for e in engines if e not in PEERS and our_chapter(e) is None)
    if unknown or not 1 <= args.min_len <= args.max_len or args.requests < 1:
        ap.error(f"unknown engines {unknown}" if unknown else "need 1 <= --min-len <= --max-len and --requests >= 1")

    from common.models import resolve_model
    from common.tokenizer import Tokenizer

    vocab = Tokenizer(resolve_model(args.model)).vocab_size
    requests = make_requests(args.requests, args.min_len, args.max_len, vocab, args.seed)
    expected = sum(n for _, n in requests)
    runners = {"llama.cpp": lambda: run_llama_cpp(args, requests), "hf": lambda: run_hf(args, requests)}
    runs, skipped = {}, {}
    for name in engines:
        reason = why_not(name, args)
        if reason:
            skipped[name] = reason
            print(f"[workload] {name}: skipped ({reason})", file=sys.stderr)
            continue
        print(f"[workload] {name} ...", file=sys.stderr, flush=True)
        r = runners[name]() if name in PEERS else run_ours(our_chapter(name), args, requests)
        got = [len(ids) for ids in r["ids"]]
        if got != [n for _, n in requests]:
            raise SystemExit(f"{name} returned {sum(got)} output tokens, {expected} asked: {got}")
        r["output_tokens"], r["tok_s"] = expected, expected / r["wall_s"]
        runs[name] = r
        print(f"[workload] {name}: {r['tok_s']:.1f} tok/s ({r['wall_s']:.1f} s)", file=sys.stderr, flush=True)
    if not runs:  # nothing to save: an earlier result at --out stays as it was
        print(f"error: no engine ran ({'; '.join(f'{k}: {v}' for k, v in skipped.items())})", file=sys.stderr)
        return 1

    weights = "int4 G=32 (llama.cpp: Q4_1)" if args.quant else "bf16 weights (llama.cpp: BF16)"
    result = {
        "workload": {
            "requests": args.requests, "min_len": args.min_len, "max_len": args.max_len, "seed": args.seed,
            "prompt_tokens": sum(len(p) for p, _ in requests), "output_tokens": expected,
        },
        "model": args.model, "weights": weights, "dtype": args.dtype, "device": args.device,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "int8_activations": args.int8_activations,
        "runs": {k: {f: v for f, v in r.items() if f != "ids"} for k, r in runs.items()},
        "skipped": skipped,
        "machine": machine(),
    }  # fmt: skip
    base, ours = f"ch{BASELINE:02d}", [name for name in runs if name not in PEERS]
    for name in ours:  # greedy: equal tokens where the arithmetic is (float32)
        if name != base and base in runs:
            same = sum(a == b for a, b in zip(runs[base]["ids"], runs[name]["ids"]))
            result[f"{name}_tokens_equal_{base}"] = same

    w = result["workload"]
    print(
        f"\n{w['requests']} requests, prompt and output lengths uniform in [{w['min_len']}, {w['max_len']}] (seed "
        f"{w['seed']}): {w['prompt_tokens']} prompt tokens, {w['output_tokens']} output tokens, EOS ignored; "
        f"{args.model}, {weights}, {args.dtype}, {args.device}"
    )
    print(f"{'engine':<12}{'output tok/s':>14}{'wall s':>9}")
    for name, r in runs.items():
        print(f"{name:<12}{r['tok_s']:>14.1f}{r['wall_s']:>9.1f}")
    best_ours = max((runs[n]["tok_s"] for n in ours), default=None)
    isa = result["machine"]["isa"]
    for peer in ("llama.cpp", "hf"):
        if best_ours and peer in runs:
            print(f"ours (best chapter) / {peer}: {fmt(best_ours / runs[peer]['tok_s'], '.2f')}x")
    if "llama.cpp" in runs:
        print(isa_line(isa))
    for name in ours:
        if f"{name}_tokens_equal_{base}" in result:
            same = result[f"{name}_tokens_equal_{base}"]
            print(f"{name} tokens = {base} tokens for {same} of {w['requests']} requests")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    png = args.out.with_suffix(".png")
    print(f"saved {args.out}" + (f" and {png.name}" if plot(result, png) else ""))
    return 0


if __name__ == "__main__":
    from common.cli import run_main

    run_main(main)
