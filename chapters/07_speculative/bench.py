"""What speculative decoding buys on this machine: one stream with prompt lookup against plain
decoding (chapter 06's engine: --speculative off) and against llama.cpp's prompt lookup, and many
streams with speculation on and off, to find where it stops paying.

Usage, from this chapter's folder:

    python bench.py --peers llama.cpp        # every part: the README's figures
    python bench.py --parts one --ks 2,4,6,8 # one stream only, speedup against k

Parts (--parts, comma-separated; all three by default):

  one      one sequence at a time, greedy, each task's chat prompt to its natural end (at most
           --max-tokens): a code edit and a passage to correct (input-grounded: the reply copies
           its input) and two chat questions (it does not). Engines, interleaved --repeats times:
           speculation off, prompt lookup with at most k drafts for each k in --ks, and with
           --peers llama.cpp, llama.cpp on the Q4_1 GGUF without and with llama-cpp-python's
           LlamaPromptLookupDecoding (num_pred_tokens = the largest k). Reported: decode tok/s
           (tokens after the first / their time), the drafts' acceptance rate, tokens per verify,
           and whether the tokens equal speculation off's (in bf16 they may differ near ties: a
           verify row is a decode row, but the kernels are not batch-invariant by default).
  draft    one stream, the bf16 model with its own int4 copy drafting (--speculative draft) at
           k = 2 and 4, against the bf16 model alone and the int4 model alone, on the same tasks.
  batch    --batches sequences at once (the code-edit task, each prompt numbered so none is
           cached), with speculation off and on with no batch cut-off: output tok/s of the whole
           batch. Where "on" falls below "off" is where Engine's speculative_max_batch belongs.

Results: JSON at --out (default bench/results/chNN_bench.json, NN this chapter's) and a PNG beside it (speedup
against k per task; batch throughput on and off); tables on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from common.cli import run_main
from common.errors import UserError
from common.tools.bench import (
    RESULTS_DIR,
    add_int8_activations,
    check_out,
    command_line,
    fmt,
    int_list,
    machine,
    median,
    save_json,
    summarize,
)
from engine import Engine, Request, build_engine
from loading import quant_spec
from ops import KernelFlags
from peers import gguf_path, llama_cpp_available
from proposers import DraftModelProposer, NgramProposer
from quant import QuantSpec
from sampling import SamplingParams

CH = f"ch{Path(__file__).resolve().parent.name[:2]}"
PARTS = ("one", "batch", "draft")

CODE = """def moving_average(values, window):
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result


def normalise(values):
    lowest = min(values)
    highest = max(values)
    span = highest - lowest
    return [(value - lowest) / span for value in values]
"""
PASSAGE = (
    "The city of Lisbon sits on seven hills above the estuary of the Tagus river. For centuries it was a port "
    "from wich ships left for Africa, India and Brazil, and the wealth of that trade paid for the churches, "
    "palaces and monasteries that still stand in its old quarters. In 1755 a great earthquake, followed by a "
    "fire and a tsunami, destroyed much of the lower town. The Marquis of Pombal rebuilt it on a grid of "
    "straight streets, with buildings designed to resist the next earthquake, and the Baixa district that "
    "visitors walk through today is his work. Trams climb the steep streets of Alfama and Graca, where the "
    "houses are older and the lanes are narow. In the evenings, the sound of fado, the city's melancholy "
    "music, comes from small restaurants."
)
TASKS = {
    "code edit": "Rename the variable `values` to `samples` everywhere in this Python code and show the whole code:\n\n"
    + CODE,
    "fix typos": "Correct the spelling mistakes in this text and reply with the whole corrected text:\n\n" + PASSAGE,
    "chat: history": "Tell me about the history of Lisbon in a few sentences.",
    "chat: cooking": "Give me three tips for cooking rice.",
}


# --- engines -------------------------------------------------------------------------------------


def timing(t0: float, ids: list[int], times: list[float]) -> dict:
    """A run's tokens, decode tok/s (common.tools.bench.summarize's: the tokens after the first
    over their time; None when they all came at once) and TTFT. times: when each token was ready."""
    rate = summarize(t0, times, 0)["decode_tok_s"] if times[-1] > times[0] else None
    return {"tokens": len(ids), "decode_tok_s": rate, "ttft_ms": (times[0] - t0) * 1e3, "ids": ids}


def ours(engine: Engine, prompt: list[int], max_tokens: int) -> dict:
    """One greedy request to its end; decode tok/s = tokens after the first / their time."""
    spec0 = (engine.speculator.stats.drafted, engine.speculator.stats.accepted, engine.speculator.stats.verifies)
    ids, times = [], []
    t0 = time.perf_counter()
    for events in engine.stream(Request(list(prompt), SamplingParams(temperature=0), max_tokens=max_tokens)):
        now = time.perf_counter()
        for ev in events:
            ids += ev.token_ids
            times += [now] * len(ev.token_ids)
    drafted, accepted, verifies = (
        engine.speculator.stats.drafted - spec0[0],
        engine.speculator.stats.accepted - spec0[1],
        engine.speculator.stats.verifies - spec0[2],
    )
    return timing(t0, ids, times) | {
        "acceptance": accepted / drafted if drafted else None,
        "tokens_per_verify": 1 + accepted / verifies if verifies else None,
    }


def llama_cpp_run(llm, prompt: list[int], max_tokens: int, eos: set[int]) -> dict:
    """llama-cpp-python's own generate loop (greedy), with or without its draft model."""
    llm.reset()
    ids, times = [], []
    t0 = time.perf_counter()
    for token in llm.generate(prompt, temp=0.0, reset=True):
        times.append(time.perf_counter())
        ids.append(int(token))
        if token in eos or len(ids) >= max_tokens:
            break
    return timing(t0, ids, times)


def llama_cpp_engines(args, n_ctx: int) -> dict:
    """name -> a llama_cpp.Llama on the Q4_1 GGUF: plain, and with prompt-lookup drafts."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    common = dict(
        model_path=str(gguf_path("Q4_1")),
        n_ctx=n_ctx,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        flash_attn=True,
        verbose=False,
    )
    k = max(args.ks)
    return {
        "llama.cpp": llama_cpp.Llama(**common),
        f"llama.cpp lookup k={k}": llama_cpp.Llama(
            **common, draft_model=LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=k)
        ),
    }


def part_one(args, base: Engine) -> dict:
    engines = {"off": Engine(base.model, base.tokenizer, base.generation_config, max_num_seqs=1, prefix_caching=False)}
    for k in args.ks:
        engines[f"ngram k={k}"] = Engine(
            base.model,
            base.tokenizer,
            base.generation_config,
            max_num_seqs=1,
            prefix_caching=False,
            proposer=NgramProposer(),
            num_speculative_tokens=k,
        )
    prompts = {name: base.tokenizer.encode_chat([{"role": "user", "content": TASKS[name]}]) for name in args.tasks}
    peers = {}
    if args.peers == "llama.cpp":
        why = llama_cpp_available()
        if why:
            print(f"llama.cpp skipped: {why}", file=sys.stderr)
        else:
            peers = llama_cpp_engines(args, max(len(p) for p in prompts.values()) + args.max_tokens + 16)
    eos = set(base.eos_ids)
    runs: dict[str, dict[str, list[dict]]] = {task: {} for task in args.tasks}
    warm = next(iter(prompts.values()))[:32]  # a warm-up of every engine, untimed
    for engine in engines.values():
        ours(engine, warm, 4)
    for llm in peers.values():
        llama_cpp_run(llm, warm, 4, eos)
    for r in range(args.repeats):
        for task, prompt in prompts.items():
            for name, engine in engines.items():
                runs[task].setdefault(name, []).append(ours(engine, prompt, args.max_tokens))
            for name, llm in peers.items():
                runs[task].setdefault(name, []).append(llama_cpp_run(llm, prompt, args.max_tokens, eos))
            print(f"round {r + 1}/{args.repeats}: {task} done", file=sys.stderr, flush=True)
    for llm in peers.values():
        llm.close()

    def plain_of(name: str) -> str:
        return "llama.cpp" if name.startswith("llama.cpp") else "off"

    return {task: summarize_runs(by_engine, plain_of) for task, by_engine in runs.items()}


def summarize_runs(by_engine: dict[str, list[dict]], plain_of) -> dict:
    """Per engine: median decode tok/s and its range, and per round the speedup against the plain
    engine of the same round (plain_of(name) names it); whether its tokens are the plain engine's."""
    result = {}
    for name, rs in by_engine.items():
        plain = by_engine[plain_of(name)]
        rates = [x["decode_tok_s"] for x in rs if x["decode_tok_s"]]
        result[name] = {
            "decode_tok_s": median(rates),
            "decode_tok_s_range": [min(rates), max(rates)] if rates else None,
            "tokens": rs[0]["tokens"],
            "same_tokens_as_plain": rs[0]["ids"] == plain[0]["ids"],
            "acceptance": rs[0].get("acceptance"),
            "tokens_per_verify": rs[0].get("tokens_per_verify"),
            "ttft_ms": median([x["ttft_ms"] for x in rs]),
            "speedup_per_round": [
                round(x["decode_tok_s"] / p["decode_tok_s"], 3)
                for x, p in zip(rs, plain)
                if x["decode_tok_s"] and p["decode_tok_s"]
            ],
        }
    return result


def part_draft(args) -> dict:
    """bf16 target + int4 self-draft, against each alone (one stream, greedy)."""
    kernels = KernelFlags("auto", False, args.int8_activations)
    bf16, _ = build_engine(  # (--no-int8-activations is for the int4 draft: bf16 weights multiply in floats)
        args.model, args.device, args.dtype, None, kernels="auto", max_num_seqs=1, prefix_caching=False
    )
    int4, _ = build_engine(
        args.model, args.device, args.dtype, QuantSpec(4, 32), kernels=kernels, max_num_seqs=1, prefix_caching=False
    )
    engines = {"bf16": bf16, "int4": int4}
    for k in (2, 4):
        e = Engine(
            bf16.model,
            bf16.tokenizer,
            bf16.generation_config,
            max_num_seqs=1,
            prefix_caching=False,
            proposer=DraftModelProposer(int4.model, "int4 self"),
            num_speculative_tokens=k,
        )
        engines[f"bf16 + int4 draft k={k}"] = e
    prompts = {name: bf16.tokenizer.encode_chat([{"role": "user", "content": TASKS[name]}]) for name in args.tasks}
    for engine in engines.values():  # warm-up
        ours(engine, next(iter(prompts.values()))[:32], 4)
    runs: dict[str, dict[str, list[dict]]] = {task: {} for task in args.tasks}
    for r in range(args.repeats):
        for task, prompt in prompts.items():
            for name, engine in engines.items():
                runs[task].setdefault(name, []).append(ours(engine, prompt, args.max_tokens))
        print(f"draft round {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    return {task: summarize_runs(by_engine, lambda name: "bf16") for task, by_engine in runs.items()}


def part_batch(args, base: Engine) -> dict:
    """Output tok/s of a batch of sequences, speculation off and on (no cut-off)."""

    def engine(spec: bool, n: int) -> Engine:
        return Engine(
            base.model,
            base.tokenizer,
            base.generation_config,
            max_num_seqs=n,
            prefix_caching=False,
            proposer=NgramProposer() if spec else None,
            num_speculative_tokens=max(args.ks),
            speculative_max_batch=max(args.batches),
        )

    result = {}
    for n in args.batches:
        prompts = [
            base.tokenizer.encode_chat([{"role": "user", "content": f"({i}) " + TASKS["code edit"]}]) for i in range(n)
        ]
        rates = {"off": [], "on": []}
        for _ in range(args.repeats):
            for mode in ("off", "on"):
                e = engine(mode == "on", n)
                reqs = [Request(p, SamplingParams(temperature=0), max_tokens=args.batch_tokens) for p in prompts]
                t0 = time.perf_counter()
                outs = e.generate(reqs)
                dt = time.perf_counter() - t0
                rates[mode].append(sum(len(o[0].token_ids) for o in outs) / dt)
        result[str(n)] = {mode: {"tok_s": median(v), "tok_s_range": [min(v), max(v)]} for mode, v in rates.items()} | {
            "on_over_off": round(median(rates["on"]) / median(rates["off"]), 3)
        }
        print(f"batch {n}: {result[str(n)]}", file=sys.stderr, flush=True)
    return result


# --- report --------------------------------------------------------------------------------------


def print_rows(rows_by_task: dict) -> None:
    print(f"{'task':16} {'engine':22} {'tok/s':>7} {'speedup':>15} {'accept':>7} {'tok/verify':>10} {'tokens':>6} same")
    for task, rows in rows_by_task.items():
        for name, r in rows.items():
            sp = r["speedup_per_round"]
            speed = f"{statistics.median(sp):.2f} ({min(sp):.2f}-{max(sp):.2f})" if sp else "-"
            print(
                f"{task:16} {name:22} {fmt(r['decode_tok_s']):>7} {speed:>15} {fmt(r['acceptance'], '.2f'):>7} "
                f"{fmt(r['tokens_per_verify'], '.2f'):>10} {r['tokens']:>6} {'yes' if r['same_tokens_as_plain'] else 'no'}"
            )


def print_tables(result: dict) -> None:
    if "one" in result:
        print(
            f"\nOne stream, greedy, decode tok/s (median of {result['repeats']}; speedup per round against the plain engine)"
        )
        print_rows(result["one"])
    if "draft" in result:
        print("\nbf16 target with its int4 copy drafting, one stream, decode tok/s (speedup against bf16 alone)")
        print_rows(result["draft"])
    if "batch" in result:
        print("\nMany streams (code edit), output tok/s of the batch, speculation off / on (no cut-off)")
        for n, r in result["batch"].items():
            print(
                f"  {n:>3} sequences: off {fmt(r['off']['tok_s'])}, on {fmt(r['on']['tok_s'])}: {r['on_over_off']:.2f}x"
            )


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [p for p in ("one", "batch") if p in result]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, part in zip(axes[0], panels):
        if part == "one":
            for task, rows in result["one"].items():
                ks = [int(name.split("=")[1]) for name in rows if name.startswith("ngram")]
                speed = [statistics.median(rows[f"ngram k={k}"]["speedup_per_round"] or [float("nan")]) for k in ks]
                ax.plot(ks, speed, marker="o", label=task)
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xlabel("k: draft tokens at most per step")
            ax.set_ylabel("decode tok/s, prompt lookup / off")
            ax.set_title("One stream: speedup against k")
            ax.legend(fontsize=8)
        else:
            ns = [int(n) for n in result["batch"]]
            for mode in ("off", "on"):
                ax.plot(
                    ns, [result["batch"][str(n)][mode]["tok_s"] for n in ns], marker="o", label=f"speculation {mode}"
                )
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequences at once")
            ax.set_ylabel("output tok/s")
            ax.set_title("Many streams (code edit)")
            ax.legend(fontsize=8)
    fig.suptitle(f"{result['model']}, {result['quant']} weights, {result['threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)}")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(
        "--quant",
        choices=["int4", "int8", "none"],
        default=None,
        help="parts one and batch: the weights (default: int4); part draft has its bf16 target and int4 draft",
    )
    ap.add_argument("--dtype", default="bfloat16", help="activations and KV cache (default: %(default)s)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"parts one and draft: some of {', '.join(TASKS)}")
    ap.add_argument("--ks", default="2,4,6,8", help="part one: the largest k of each prompt-lookup engine")
    ap.add_argument("--max-tokens", type=int, default=256, help="part one: a reply's cap (default: %(default)s)")
    ap.add_argument("--batches", default="1,2,4,8,16", help="part batch: sequences at once")
    ap.add_argument("--batch-tokens", type=int, default=128, help="part batch: tokens per sequence at most")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median reported)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--peers", default="", help="llama.cpp: also llama.cpp, plain and with prompt lookup (part one)")
    add_int8_activations(ap)
    ap.add_argument(
        "--out", default=str(RESULTS_DIR / f"{CH}_bench.json"), help="the JSON (a .png beside it; default: %(default)s)"
    )
    args = ap.parse_args()
    args.ks, args.batches = int_list(args.ks), int_list(args.batches)
    check_out(Path(args.out))
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not args.tasks or any(t not in TASKS for t in args.tasks):
        raise UserError(f"--tasks takes some of {', '.join(TASKS)}, got {', '.join(args.tasks) or '(none)'}")
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise UserError(f"unknown part(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(PARTS)}")
    for name in ("max_tokens", "batch_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if args.quant is not None and parts == ["draft"]:  # it was recorded, and changed nothing
        raise UserError("--quant is for parts one and batch: part draft runs a bf16 target and its int4 draft")
    args.quant = args.quant or "int4"
    if args.peers not in ("", "llama.cpp"):
        raise UserError(f"--peers takes llama.cpp, got {args.peers!r}")
    torch.set_num_threads(args.threads)
    spec = quant_spec(
        argparse.Namespace(
            quant=None if args.quant == "none" else args.quant, group_size=32, symmetric=False, lm_head="int8"
        )
    )
    kernels = KernelFlags("auto", False, args.int8_activations)
    base, _ = build_engine(args.model, args.device, args.dtype, spec, kernels=kernels)
    most = base.scheduler.max_num_batched_tokens - 1  # the engine's cap on k: k drafts and one more fit a step
    if max(args.ks) > most:  # an engine asked for more drafts takes this many: its row would be mislabelled
        raise UserError(f"--ks: a prompt-lookup engine drafts at most {most} tokens a step, got {max(args.ks)}")
    result = {
        "model": args.model,
        "quant": "bf16" if args.quant == "none" else args.quant,
        "dtype": args.dtype,
        "device": args.device,
        "machine": machine(),
        "threads": args.threads,
        "command": command_line(__file__, sys.argv[1:]),
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "int8_activations": args.int8_activations,
        "kernels": base.model.ops.describe(),
    }
    t0 = time.perf_counter()
    if "one" in parts:
        result["one"] = part_one(args, base)
    if "batch" in parts:
        result["batch"] = part_batch(args, base)
    if "draft" in parts:
        result["draft"] = part_draft(args)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print_tables(result)
    out = Path(args.out)
    save_json(out, result)
    png = out.with_suffix(".png")
    saved = plot(result, png)
    print(f"saved {out}" + (f" and {png.name}" if saved else "") + f" ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    run_main(main)
