"""What serving LoRA adapters costs: generation with adapters against the base model, in one engine,
and batch 1 against llama.cpp with the same adapter.

    python lora_bench.py                      # JSON + plot: bench/results/ch09_lora.json, .png
    python lora_bench.py --repeats 5 --tokens 64
    python lora_bench.py --no-int8-activations --out float_x   # float_x.json and float_x.png here

Rows (SmolLM2, the Q4_1 GGUF run directly: llama.cpp's weights, bit for bit, as int4 G=32):
- 16 sequences of the base model, against 16 sequences with 16 different rank-16 adapters on all
  seven projections (16 slots, every adapter resident: the cost of the deltas, not of swapping);
- 1 sequence of the base model, against 1 with an adapter, and against the base reading as many
  bytes as one adapter's tables each step (one sum: the bytes without the deltas' arithmetic, so
  what the adapter's bytes alone cost; see `reading`);
- llama.cpp (llama-cpp-python, where installed) at batch 1, its base and the same adapter written as
  a GGUF LoRA file (`lora_path`). Its greedy tokens are compared with ours, which checks the file.
Each figure is generated tokens per second of a whole run (16-token prompts, --tokens new tokens
each, the prefix cache off so every run computes its prompts). The runs interleave (base, adapters,
base, ...) and repeat: the table shows medians and [min-max] ranges.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from common.cli import positive_int
from common.prepare_models import find_gguf
from common.tools.bench import RESULTS_DIR, add_int8_activations, check_out, command_line, isa_line, machine, save_json
from engine import Request, build_engine
from lora import PROJECTIONS, LoraWeights, projection_shapes
from ops import KernelFlags
from sampling import SamplingParams

OUT = RESULTS_DIR / "ch09_lora"
RANK, ALPHA = 16, 32
# llama.cpp's names of the seven projections inside `blk.N.`
GGUF_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}


def random_adapter(config, seed: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, projection) -> (A [r, n_in], B [n_out, r]), float32, small enough that the tuned
    model still speaks (greedy tokens change, text stays text)."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config.num_hidden_layers):
        for p, (n_out, n_in) in projection_shapes(config).items():
            a = torch.randn(RANK, n_in, generator=g) / n_in**0.5
            b = torch.randn(n_out, RANK, generator=g) * 0.002
            weights[layer, p] = (a, b)
    return weights


def write_peft(folder: Path, weights) -> Path:
    """The adapter as PEFT saves it: adapter_config.json + adapter_model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0}
    config |= {"target_modules": list(PROJECTIONS), "bias": "none", "use_rslora": False, "use_dora": False}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = {}
    for (layer, p), (a, b) in weights.items():
        key = f"base_model.model.model.layers.{layer}.{'self_attn' if p in PROJECTIONS[:4] else 'mlp'}.{p}"
        tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a.contiguous(), b.contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def rope_rows(b: torch.Tensor, n_heads: int) -> torch.Tensor:
    """B's rows (q or k outputs) in llama.cpp's order. HF's rotary pairs dimension i with i + d/2
    of a head; a GGUF's q and k weights are stored with each pair side by side (the original
    Llama's layout), so an adapter's B for q or k must be reordered the same way."""
    n_out = b.shape[0]
    half = n_out // n_heads // 2
    return b.reshape(n_heads, 2, half, -1).transpose(1, 2).reshape(n_out, -1)


def write_gguf_lora(path: Path, weights, config) -> Path:
    """The adapter as llama.cpp reads it (general.type adapter, adapter.type lora, alpha; tensors
    `blk.N.attn_q.weight.lora_a` [r, n_in] and `.lora_b` [n_out, r] in numpy order)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(ALPHA))
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for (layer, p), (a, b) in sorted(weights.items()):
        if p in heads:
            b = rope_rows(b, heads[p])
        name = f"blk.{layer}.{GGUF_NAMES[p]}.weight"
        writer.add_tensor(f"{name}.lora_a", a.numpy().astype(np.float32))
        writer.add_tensor(f"{name}.lora_b", b.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def prompts(n: int, run: int) -> list[list[int]]:
    """n different 16-token prompts, different again for every run (no cache could serve them)."""
    return [[1] + [1000 + 97 * run + 13 * i + 7 * j for j in range(15)] for i in range(n)]


def ours(engine, adapters: list[str | None], tokens: int, run: int) -> tuple[float, list[list[int]]]:
    """Generated tokens per second of one engine.generate over len(adapters) sequences."""
    reqs = [
        Request(p, SamplingParams(temperature=0), max_tokens=tokens, ignore_eos=True, adapter=a)
        for p, a in zip(prompts(len(adapters), run), adapters)
    ]
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    seconds = time.perf_counter() - t0
    return len(adapters) * tokens / seconds, [o[0].token_ids for o in outs]


def theirs(llm, tokens: int, run: int) -> tuple[float, list[int]]:
    """llama.cpp at batch 1: the prompt, then greedy tokens (argmax of its logits), per second."""
    import llama_cpp

    llm.reset()
    ids, n_vocab = [], llm.n_vocab()
    t0 = time.perf_counter()
    llm.eval(prompts(1, run)[0])
    for _ in range(tokens):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        ids.append(int(logits.argmax()))
        llm.eval([ids[-1]])
    return tokens / (time.perf_counter() - t0), ids


def llama_cpp_models(gguf_model: Path, gguf_lora: Path, tokens: int, threads: int):
    try:
        import llama_cpp
    except (ImportError, OSError) as e:
        print(f"[lora_bench] llama.cpp not usable ({e}): its rows are skipped", file=sys.stderr)
        return {}
    kw = dict(n_ctx=16 + tokens + 8, n_threads=threads, n_threads_batch=threads, verbose=False)
    return {
        "llama.cpp base": llama_cpp.Llama(model_path=str(gguf_model), **kw),
        "llama.cpp adapter": llama_cpp.Llama(model_path=str(gguf_model), lora_path=str(gguf_lora), **kw),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=positive_int, default=32, help="new tokens per sequence (default: %(default)s)")
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--batch", type=positive_int, default=16, help="sequences (and adapters) of the batched rows")
    add_int8_activations(ap)
    ap.add_argument("--out", type=Path, default=OUT, help="the figures' path, .json and .png added (default: %(default)s)")
    args = ap.parse_args()
    check_out(args.out.with_suffix(".json"))
    gguf_model = find_gguf()
    kernels = KernelFlags("auto", False, args.int8_activations)
    engine, _ = build_engine(
        str(gguf_model),
        "cpu",
        "auto",
        kernels=kernels,
        max_loras=args.batch,
        max_lora_rank=RANK,
        prefix_caching=False,
        num_blocks=512,
    )
    config, work = engine.model.config, Path(tempfile.mkdtemp(prefix="lora_bench-"))
    names = [f"random-{i}" for i in range(args.batch)]
    try:
        first = None
        for i, name in enumerate(names):
            weights = random_adapter(config, seed=i)
            engine.adapters.register(name, write_peft(work / name, weights))
            first = first or weights
        gguf_lora = write_gguf_lora(work / "random-0.gguf", first, config)
        record = measure(engine, names, gguf_model, gguf_lora, args)
    finally:
        shutil.rmtree(work)
    save_json(args.out.with_suffix(".json"), record)
    report(record, args.out.with_suffix(".png"))
    return 0


READ_ONLY = "base x1 + adapter's bytes"


def reading(engine, extra: torch.Tensor, case):
    """`case` with every engine step reading `extra` first (one sum: its bytes, next to no
    arithmetic). With `extra` as large as one adapter's tables, this is what those bytes alone
    cost a base step: where the caches hold much of the model, the bytes an adapter reads
    displace the base's weights, which the step then reads from further away."""
    step = engine.step
    engine.step = lambda: (extra.sum(), step())[1]
    try:
        return case()
    finally:
        del engine.step  # the class's method again


def same_start(a: list[int], b: list[int]) -> int:
    """How many tokens a and b have in common before the first that differs."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(engine, names: list[str], gguf_model: Path, gguf_lora: Path, args) -> dict:
    threads = torch.get_num_threads()
    size = LoraWeights.table_bytes(engine.model.config, 1, RANK, engine.model.lora.dtype)
    adapter_sized = torch.ones(size // 2, dtype=torch.bfloat16)
    cases = {
        f"base x{args.batch}": lambda run: ours(engine, [None] * args.batch, args.tokens, run),
        f"{args.batch} adapters x{args.batch}": lambda run: ours(engine, names, args.tokens, run),
        "base x1": lambda run: ours(engine, [None], args.tokens, run),
        "adapter x1": lambda run: ours(engine, names[:1], args.tokens, run),
        READ_ONLY: lambda run: reading(engine, adapter_sized, lambda: ours(engine, [None], args.tokens, run)),
    }
    for name, llm in llama_cpp_models(gguf_model, gguf_lora, args.tokens, threads).items():
        cases[name] = lambda run, llm=llm: theirs(llm, args.tokens, run)
    for case in cases.values():  # warm-up: thread pools, the slot table, page-ins
        case(0)
    tok_s = {name: [] for name in cases}
    ids = {name: [] for name in cases}  # each run's greedy tokens (its own prompts)
    for run in range(1, args.repeats + 1):
        for name, case in cases.items():  # interleaved: every case sees the same machine
            rate, out = case(run)
            tok_s[name].append(rate)
            ids[name].append(out if name.startswith("llama.cpp") else out[0])
    record = {
        "command": command_line(__file__, sys.argv[1:]),
        "machine": machine(),
        "model": gguf_model.name,
        "tokens": args.tokens,
        "batch": args.batch,
        "rank": RANK,
        "int8_activations": args.int8_activations,
        "kernels": engine.model.ops.describe(),
        "tok_s": tok_s,
        "median_tok_s": {name: statistics.median(v) for name, v in tok_s.items()},
    }
    # ratios within a round (the cases of a round ran back to back): steadier than medians' ratios
    n = args.batch
    pairs = {
        "adapters": (f"{n} adapters x{n}", f"base x{n}"),
        "adapter x1": ("adapter x1", "base x1"),
        "bytes x1": (READ_ONLY, "base x1"),
    }
    record["ratio_per_round"] = {k: [x / y for x, y in zip(tok_s[a], tok_s[b])] for k, (a, b) in pairs.items()}
    record["read_only_same_tokens"] = ids[READ_ONLY] == ids["base x1"]  # the extra read changes nothing else
    if "llama.cpp adapter" in ids:
        # Same weights, same adapter: the same greedy tokens, up to where a near tie between two
        # roundings of the activations (our int8 blocks, llama.cpp's Q8_1) first goes the other
        # way, which some runs' prompts meet (random ids make flat distributions). A wrong adapter
        # file differs on every run. Per run: the tokens equal up to the first difference.
        record["tokens_agree"] = {
            kind: [same_start(theirs, mine_) for theirs, mine_ in zip(ids[f"llama.cpp {kind}"], ids[mine])]
            for kind, mine in (("base", "base x1"), ("adapter", "adapter x1"))
        }
    return record


def report(record: dict, png: Path) -> None:
    med, rates = record["median_tok_s"], record["tok_s"]
    print(f"{'case':<24} {'tok/s median':>12}  range")
    for name, values in rates.items():
        print(f"{name:<24} {med[name]:>12.1f}  [{min(values):.1f}-{max(values):.1f}]")
    n = record["batch"]
    per_round = lambda k: ", ".join(f"{r:.2f}" for r in record["ratio_per_round"][k])  # noqa: E731
    ratio = med[f"{n} adapters x{n}"] / med[f"base x{n}"]
    print(f"{n} adapters x{n} / base x{n}: {ratio:.2f}x (per round: {per_round('adapters')})")
    ratio = med["adapter x1"] / med["base x1"]
    print(f"adapter x1 / base x1: {ratio:.2f}x (per round: {per_round('adapter x1')})")
    ratio = med[READ_ONLY] / med["base x1"]
    print(f"the base reading an adapter's bytes each step / base x1: {ratio:.2f}x (per round: {per_round('bytes x1')})")
    if "llama.cpp adapter" in med:
        print(f"ours / llama.cpp with the adapter at batch 1: {med['adapter x1'] / med['llama.cpp adapter']:.2f}x")
        agree, n = record["tokens_agree"], record["tokens"]
        print(f"greedy tokens equal to llama.cpp's before the first difference (of {n}, per run): {agree}")
        print(isa_line(record["machine"]["isa"]))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(med)
    ax.barh(names, [med[n] for n in names], xerr=[[med[n] - min(rates[n]) for n in names], [max(rates[n]) - med[n] for n in names]])
    ax.set_xlabel("generated tokens / s (median, range)")
    ax.set_title(f"LoRA rank {record['rank']} on all seven projections, {record['model']}")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    from common.cli import run_main

    run_main(main)
