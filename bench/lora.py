"""What many LoRA adapters cost in one batch on the CPU: the library's shrink + expand
(kernels/csrc/cpu/lora.cpp) on SmolLM2-135M's seven projections, against the int4 linear of the
base model (int4_linear) that they ride on, at 16 rows each with its own rank-16 adapter (16
adapters in one decode step) and at 1 row. The base runs as the engines run it by default: bf16 x
quantized to int8 and multiplied in integers on the weight's tiles (--int8-activations, where this
CPU has the integer product); --no-int8-activations times the float product instead (float32 x
always takes it).

    python bench/lora.py                                   # one thread, CPU time, rows 1 and 16
    python bench/lora.py --rows 16 --rank 16 --adapters 16 --isa avx2

Per projection (n_out x n_in): the base int4 linear's time at that shape, the LoRA delta's (shrink,
then expand in place on the linear's output), and base / (base + LoRA): the speed left to the
projection once it carries adapters. Then a layer: the base linears as the engine runs them (q, k,
v fused into one 960 x 576 matrix, gate and up into one 3072 x 576) against the same plus LoRA on
all seven projections. That ratio counts the linears only; attention, norms and Python take the
rest of a step, on which adapters cost nothing, so a whole step keeps a larger share. For context,
the same delta by torch: the adapters of each row gathered and multiplied by torch.bmm.

One thread and CPU time (process_time), the median of --repeats samples of --calls calls each,
every kind timed in turn within each sample (interleaved: a busy machine slows them alike).

Those tables fit the caches; in a decode step they do not (16 rank-16 adapters on SmolLM2 are 156
MB). So a second part times a whole step's deltas from memory: --layers layers (SmolLM2's 30) of
tables of their own, each layer's four matmul groups (q k v, o, gate up, down) through lora_group_
as the one-call layer runs them, on --step-threads threads (default: the engines', one per core),
wall time, the median of --repeats steps, and the rate the tables were read at.
Results: a table, JSON at --out (bench/results/lora.json), a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from common.tools.bench import RESULTS_DIR, add_int8_activations, machine

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query heads and 3 KV heads of 64. (n_out, n_in)
PROJECTIONS = {
    "q": (576, 576),
    "k": (192, 576),
    "v": (192, 576),
    "o": (576, 576),
    "gate": (1536, 576),
    "up": (1536, 576),
    "down": (576, 1536),
}
# The base linears as the engine runs them (q, k, v in one matrix, gate and up in another), each with
# its projections: the group whose deltas lora_group_ adds after the matmul.
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
ENGINE_LINEARS = {name: (sum(PROJECTIONS[p][0] for p in ps), PROJECTIONS[ps[0]][1]) for name, ps in GROUPS.items()}


def int4_weights(n_out: int, n_in: int, g: torch.Generator, ops, tiles: bool) -> tuple:
    """int4_linear's arguments after x: random int4 codes, scales and mins (bench/gemm.py's: the
    speed does not depend on the values), the group size, and with `tiles` their layout for int8 x
    (ops.KernelInt4Linear's; None where this CPU has none, and without `tiles`)."""
    codes = torch.randint(0, 256, (n_out, n_in // 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n_out, n_in // 32, generator=g) * 0.01).half()
    mins = (-8 * scale.float()).half()
    laid = ops.int4_tiles(codes, scale, mins, 32) if tiles else None
    return codes, scale, mins, 32, laid if laid is not None and laid.numel() else None


def adapter_table(n_out: int, n_in: int, adapters: int, rank: int, dtype: torch.dtype, g: torch.Generator):
    """`adapters` slots of rank `rank`: a [slots, r, n_in], b_t [slots, r, n_out], ranks, scale."""
    a = (torch.randn(adapters, rank, n_in, generator=g) * n_in**-0.5).to(dtype)
    b_t = (torch.randn(adapters, rank, n_out, generator=g) * 0.01).to(dtype)
    ranks = torch.full((adapters,), rank, dtype=torch.int32)
    return a, b_t, ranks, torch.full((adapters,), 2.0)


def sample(fn, calls: int) -> float:
    t = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t) / calls


def measure(ops, rows: int, args, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(rows)
    row_slots = [r % args.adapters for r in range(rows)]  # every row its own adapter (up to --adapters)
    starts = torch.arange(rows + 1, dtype=torch.int32)  # decode rows: segments of one
    seg_slots = torch.tensor(row_slots, dtype=torch.int32)
    index = seg_slots.long()
    kinds = {}  # name -> callable
    tiles = args.int8_activations and dtype == torch.bfloat16  # as ops.KernelOps.quant_linear
    for name, (n_out, n_in) in PROJECTIONS.items():
        x = torch.randn(rows, n_in, generator=g).to(dtype)
        w = int4_weights(n_out, n_in, g, ops, tiles)
        a, b_t, ranks, scale = adapter_table(n_out, n_in, args.adapters, args.rank, dtype, g)
        y = ops.int4_linear(x, *w)

        def lora(x=x, y=y, a=a, b_t=b_t, ranks=ranks, scale=scale):
            ops.lora_expand_(y, ops.lora_shrink(x, a, ranks, starts, seg_slots), b_t, ranks, scale, starts, seg_slots)

        def torch_bmm(x=x, y=y, a=a, b_t=b_t, scale=scale):
            v = torch.bmm(a[index], x[:, :, None])  # [rows, r, 1]
            y.add_((torch.bmm(v.transpose(1, 2), b_t[index])[:, 0] * scale[index, None]).to(y.dtype))

        kinds[f"base {name}"] = lambda x=x, w=w: ops.int4_linear(x, *w)
        kinds[f"lora {name}"] = lora
        kinds[f"torch {name}"] = torch_bmm
        kinds[f"shrink {name}"] = lambda x=x, a=a, ranks=ranks: ops.lora_shrink(x, a, ranks, starts, seg_slots)
    for name, (n_out, n_in) in ENGINE_LINEARS.items():
        x = torch.randn(rows, n_in, generator=g).to(dtype)
        w = int4_weights(n_out, n_in, g, ops, tiles)
        kinds[f"engine {name}"] = lambda x=x, w=w: ops.int4_linear(x, *w)
    samples = {k: [] for k in kinds}
    for fn in kinds.values():
        fn()  # warm: caches, the kernels' scratch
    for _ in range(args.repeats):
        for k, fn in kinds.items():
            samples[k].append(sample(fn, args.calls))
    us = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
    per = {}
    for name in PROJECTIONS:
        base, lora = us[f"base {name}"], us[f"lora {name}"]
        per[name] = {
            "base_us": base,
            "lora_us": lora,
            "shrink_us": us[f"shrink {name}"],
            "torch_bmm_us": us[f"torch {name}"],
            "ratio": base / (base + lora),
        }
    engine = sum(us[f"engine {n}"] for n in ENGINE_LINEARS)
    lora_all = sum(p["lora_us"] for p in per.values())
    layer = {"base_us": engine, "lora_us": lora_all, "ratio": engine / (engine + lora_all)}
    base = "int8 x, integer product" if w[-1] is not None else "float product"
    return {"rows": rows, "dtype": str(dtype).removeprefix("torch."), "base": base, "projections": per, "layer": layer}


def step_from_memory(ops, rows: int, args, dtype: torch.dtype) -> dict:
    """A decode step's deltas, every layer's tables its own (the caches hold few of them), as the
    one-call layer adds them: per layer, one lora_group_ per matmul. Row i uses slot i % adapters."""
    g = torch.Generator().manual_seed(rows)
    slots = torch.arange(rows, dtype=torch.int32) % args.adapters
    step = ops.StepLora(torch.arange(rows + 1, dtype=torch.int32), slots, [True] * len(PROJECTIONS))
    used = len(set(slots.tolist()))
    layers, table_bytes = [], 0
    for _ in range(args.layers):
        groups = []
        for name, projections in GROUPS.items():
            parts = []
            for p in projections:
                a, b_t, ranks, scale = adapter_table(*PROJECTIONS[p], args.adapters, args.rank, dtype, g)
                parts.append(ops.LoraProjection(a, b_t, ranks))
                table_bytes += (a[0].numel() + b_t[0].numel()) * a.element_size() * used  # the slots read
            n_out, n_in = ENGINE_LINEARS[name]
            x, y = torch.randn(rows, n_in, generator=g).to(dtype), torch.zeros(rows, n_out, dtype=dtype)
            groups.append((y, x, parts, scale))
        layers.append(groups)

    def run():
        for groups in layers:
            for y, x, parts, scale in groups:
                ops.lora_group_(y, x, parts, scale, step)

    run()  # warm: page-ins, the thread team
    seconds = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - t)
    ms = statistics.median(seconds) * 1e3
    return {"rows": rows, "dtype": str(dtype).removeprefix("torch."), "layers": args.layers,
            "adapters_read": used, "table_mb": table_bytes / 1e6, "ms": ms,
            "ms_range": [min(seconds) * 1e3, max(seconds) * 1e3], "gb_s": table_bytes / ms / 1e6}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--adapters", type=int, default=16, help="slots; row i uses adapter i %% adapters")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtypes", default="bfloat16,float32", help="x and the adapters' dtype")
    ap.add_argument("--isa", default=None, help="the library's CPU level (default: the best here)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--layers", type=int, default=30, help="layers of the step from memory (default: SmolLM2's 30)")
    ap.add_argument("--step-threads", type=int, default=None, help="threads of the step (default: one per core)")
    add_int8_activations(ap)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "lora.json")
    args = ap.parse_args()
    import kernels

    step_threads = args.step_threads or torch.get_num_threads()
    torch.set_num_threads(1)
    ops = kernels.load()
    if args.isa:
        ops.set_cpu_isa(args.isa)
    results = []
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            results.append(measure(ops, rows, args, dtype))
            print(f"[lora] {results[-1]['dtype']} {rows} rows done", file=sys.stderr, flush=True)
    torch.set_num_threads(step_threads)
    steps = [
        step_from_memory(ops, rows, args, getattr(torch, d)) for d in args.dtypes.split(",") for rows in
        (int(r) for r in args.rows.split(","))
    ]  # fmt: skip

    print(
        f"\nLoRA shrink + expand against the base int4 linear, rank {args.rank}, row i on adapter i % "
        f"{args.adapters}; one thread, CPU time, us per call (ISA {ops.cpu_isa()}, gemm {ops.cpu_gemm()})"
    )
    print(f"{'dtype':<9}{'rows':>5} {'proj':<7}{'n_out x n_in':>13}{'base':>9}{'lora':>9}{'shrink':>9}"
          f"{'torch bmm':>11}{'base/(base+lora)':>18}")  # fmt: skip
    for r in results:
        print(f"{r['dtype']} x, {r['rows']} rows: the base int4 linear as {r['base']}")
        for name, p in r["projections"].items():
            n_out, n_in = PROJECTIONS[name]
            print(f"{r['dtype']:<9}{r['rows']:>5} {name:<7}{f'{n_out} x {n_in}':>13}{p['base_us']:>9.1f}"
                  f"{p['lora_us']:>9.1f}{p['shrink_us']:>9.1f}{p['torch_bmm_us']:>11.1f}{p['ratio']:>18.2f}")  # fmt: skip
        lay = r["layer"]
        print(f"{r['dtype']:<9}{r['rows']:>5} {'layer':<7}{'(engine)':>13}{lay['base_us']:>9.1f}{lay['lora_us']:>9.1f}"
              f"{'':>9}{'':>11}{lay['ratio']:>18.2f}")  # fmt: skip
    print(f"\nA step's deltas from memory: {args.layers} layers of tables of their own through lora_group_, "
          f"{step_threads} threads, wall time")  # fmt: skip
    for st in steps:
        lo, hi = st["ms_range"]
        print(f"{st['dtype']:<9}{st['rows']:>5} rows, {st['adapters_read']} adapters: {st['table_mb']:.1f} MB of "
              f"tables in {st['ms']:.2f} ms [{lo:.2f}-{hi:.2f}], {st['gb_s']:.1f} GB/s")  # fmt: skip
    record = {
        "what": "LoRA shrink+expand vs the base int4 linear per projection and per layer (linears only)",
        "command": "python " + " ".join(sys.argv),
        "threads": 1,
        "clock": "cpu (process_time)",
        "isa": ops.cpu_isa(),
        "gemm": ops.cpu_gemm(),
        "rank": args.rank,
        "adapters": args.adapters,
        "int8_activations": args.int8_activations,
        "repeats": args.repeats,
        "calls": args.calls,
        "projections": PROJECTIONS,
        "engine_linears": ENGINE_LINEARS,
        "results": results,
        "step_threads": step_threads,
        "step_from_memory": steps,
        "machine": machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    png = args.out.with_suffix(".png")
    plot(results, png)
    print(f"saved {args.out} and {png.name}")
    return 0


def plot(results: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.8), squeeze=False)
    for ax, r in zip(axes[0], results):
        names = list(r["projections"]) + ["layer"]
        base = [r["projections"][n]["base_us"] for n in names[:-1]] + [r["layer"]["base_us"]]
        lora = [r["projections"][n]["lora_us"] for n in names[:-1]] + [r["layer"]["lora_us"]]
        xs = range(len(names))
        ax.bar([i - 0.2 for i in xs], base, 0.4, label="base int4 linear")
        ax.bar([i + 0.2 for i in xs], lora, 0.4, label="LoRA shrink + expand")
        ax.set_xticks(list(xs), names)
        ax.set(ylabel="us per call (1 thread, CPU time)", title=f"{r['dtype']}, {r['rows']} rows: layer ratio "
               f"{r['layer']['ratio']:.2f}")  # fmt: skip
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    from common.cli import run_main

    run_main(main)
