"""The CPU linears' matrix product (kernels/csrc/cpu/gemm.cpp) against this machine's FMA peak and
torch's GEMM, on SmolLM2-135M's matrices, at each vector level the CPU offers.

    python bench/gemm.py                      # every level this CPU has, 2 threads, 16/128/512 rows
    python bench/gemm.py --isa avx2 --rows 16,256
    OMP_NUM_THREADS=1 python bench/gemm.py --threads 1 --clock cpu   # one core, CPU time (a busy machine)

For each level (the library's own switch, kernels.set_cpu_isa; torch's GEMM is not affected by it,
only by ATEN_CPU_CAPABILITY at start-up): the float32 FMA peak measured by independent FMA chains on
every thread (peak.cpp), then GFLOP/s (2 flops per multiply-add) of int4_linear, int8_linear and
bf16_linear over SmolLM2's four layer matrices (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536) at each row count, with bfloat16 and float32 x, and of torch's F.linear on the same
matrices as dense bf16 and float32 weights. "int4", "int8", "bf16": the float product (x widened to
float32, FMAs); "int4 pairs", "bf16 pairs" (AVX512-BF16, bf16 x): x in bf16 pairs and vdpbf16ps, two
multiply-adds per float32 lane, which the library runs by default where the CPU is AMD's (the
"gemm" field of each result names the default here). "int4 int8-x":
int4_linear with the weight's tiles, which quantizes bf16 x to int8 and multiplies in integers
(int4_q8_gemm.cpp: vpmaddubsw, or VNNI; what chapter 06's --int8-activations runs), its ceiling
above the float32 peak too; "int8 int8-x" the same for int8 weights (int8_q8_gemm.cpp); bf16 x only.
On a CPU with AMX the library hands bf16 weights times bf16 x of 16 rows or more to torch's GEMM
(ops.set_cpu_gemm_amx): "torch bf16" is that route, and "bf16" here is the library's own product,
the route switched off while this bench runs; and its integer products take every 16 rows of x on
AMX-INT8 tiles: "int4 int8-x amx" and "int8 int8-x amx" (at the AVX512-BF16 level of such a CPU),
where "int4 int8-x" and "int8 int8-x" are VNNI's alone. Each figure is the median
of --repeats timings of all four matrices. Results: a table, JSON at --out, a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common.tools.bench import ISA_LEVELS, RESULTS_DIR, machine

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def weights(n_out: int, n_in: int, g: torch.Generator) -> dict:
    w = torch.randn(n_out, n_in, generator=g) * 0.05
    codes = torch.randint(0, 256, (n_out, n_in // 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n_out, n_in // 32, generator=g) * 0.01).half()
    return {
        "int4": (codes, scale, (-8 * scale.float()).half()),
        "int8": (torch.randint(-127, 128, (n_out, n_in), generator=g, dtype=torch.int8), torch.rand(n_out) * 0.01),
        "bf16": (w.bfloat16(),),
        "torch bf16": w.bfloat16(),
        "torch f32": w,
    }


CLOCK = time.perf_counter  # --clock cpu: time.process_time


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = CLOCK()
        fn()
        times.append(CLOCK() - t)
    return statistics.median(times)


def fma_peak(ext, isa: str, threads: int) -> float:
    """GFLOP/s of the library's FMA chains (peak.cpp), the best of 3, timed by CLOCK (the library
    times itself in wall time, which a busy machine stretches)."""
    steps, lanes = 20_000_000, {"avx2": 8, "avx512": 16, "avx512_bf16": 16}.get(isa, 1)
    best = 0.0
    for _ in range(3):
        t = CLOCK()
        ext.cpu_fma_peak_gflops(steps)
        best = max(best, 2 * steps * 10 * lanes * threads / (CLOCK() - t) / 1e9)  # 10 chains, 2 flops an FMA
    return best


def measure(ext, rows: int, dtype: torch.dtype, mats: dict, repeats: int) -> dict:
    """GFLOP/s of each kind over the four matrices at `rows` rows of x."""
    g = torch.Generator().manual_seed(rows)
    xs = {name: torch.randn(rows, n_in, generator=g).to(dtype) for name, (_, n_in) in SHAPES.items()}
    calls = {
        "int4": lambda x, w: ext.int4_linear(x, *w["int4"], 32),
        "int4 int8-x": lambda x, w: ext.int4_linear(x, *w["int4"], 32, w["int4 tiles"]),
        "int8": lambda x, w: ext.int8_linear(x, *w["int8"]),
        "int8 int8-x": lambda x, w: ext.int8_linear(x, *w["int8"], w["int8 tiles"]),
        "int4 int8-x amx": lambda x, w: ext.int4_linear(x, *w["int4"], 32, w["int4 tiles"]),
        "int8 int8-x amx": lambda x, w: ext.int8_linear(x, *w["int8"], w["int8 tiles"]),
        "bf16": lambda x, w: ext.bf16_linear(x, *w["bf16"]),
        "int4 pairs": lambda x, w: ext.int4_linear(x, *w["int4"], 32),
        "bf16 pairs": lambda x, w: ext.bf16_linear(x, *w["bf16"]),
        "torch bf16": lambda x, w: F.linear(x.bfloat16(), w["torch bf16"]),
        "torch f32": lambda x, w: F.linear(x.float(), w["torch f32"]),
    }
    flops = sum(2 * rows * n_out * n_in for n_out, n_in in SHAPES.values())
    pairs = ext.cpu_isa() == "avx512_bf16" and dtype == torch.bfloat16
    out = {}
    for kind, call in calls.items():
        if "int8-x" in kind and dtype != torch.bfloat16:
            out[kind] = None  # float32 x keeps the float product
            continue
        ext.set_cpu_gemm_amx(None if kind.endswith("amx") else False)
        if kind.endswith("amx") and not ext.cpu_int8_amx():
            out[kind] = None  # AMX-INT8 tiles: a CPU that has them, at the AVX512-BF16 level
            continue
        if kind.endswith("pairs") and not pairs:
            out[kind] = None  # bf16 pairs: AVX512-BF16 and bf16 x only
            continue
        ext.set_cpu_gemm_pairs(kind.endswith("pairs"))  # "int4", "int8", "bf16": the float product
        seconds = timed(lambda: [call(xs[name], mats[name]) for name in SHAPES], repeats)  # noqa: B023
        out[kind] = flops / seconds / 1e9
    ext.set_cpu_gemm_pairs(None)
    ext.set_cpu_gemm_amx(False)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--isa", default=None, help="comma-separated: avx2, avx512, avx512_bf16 (default: all here)")
    ap.add_argument("--rows", default="16,128,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: process CPU time (use --threads 1)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "gemm.json")
    args = ap.parse_args()
    import kernels

    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    ext = kernels.load()
    torch.set_num_threads(args.threads)
    best = ext.best_cpu_isa()
    offered = [i for i in ISA_LEVELS[1:] if ISA_LEVELS.index(i) <= ISA_LEVELS.index(best)]
    levels = args.isa.split(",") if args.isa else offered
    rows_list = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    mats = {name: weights(n_out, n_in, g) for name, (n_out, n_in) in SHAPES.items()}
    results = []
    for isa in levels:
        ext.set_cpu_isa(isa)
        for name in SHAPES:  # laid out for this level's integer product (8 or 16 outputs wide)
            mats[name]["int4 tiles"] = ext.int4_tiles(*mats[name]["int4"], 32)
            mats[name]["int8 tiles"] = ext.int8_tiles(mats[name]["int8"][0])
        peak = fma_peak(ext, isa, args.threads)
        print(f"[gemm] {isa}: float32 FMA peak {peak:.0f} GFLOP/s, {args.threads} threads", file=sys.stderr, flush=True)
        for dtype in (torch.bfloat16, torch.float32):
            for rows in rows_list:
                figures = measure(ext, rows, dtype, mats, args.repeats)
                results.append({"isa": isa, "peak_gflops": peak, "x": str(dtype).removeprefix("torch."), "rows": rows,
                                "gflops": figures, "gemm": ext.cpu_gemm()})  # fmt: skip
    ext.set_cpu_isa(best)

    kinds = ["int4", "int4 int8-x", "int4 int8-x amx", "int4 pairs", "int8", "int8 int8-x", "int8 int8-x amx"]
    kinds += ["bf16", "bf16 pairs"]
    kinds += ["torch bf16", "torch f32"]
    print(f"\nGFLOP/s on SmolLM2-135M's layer matrices, {args.threads} threads (percent of the float32 FMA peak)")
    print(f"{'isa':<12}{'peak':>6} {'x':<9}{'rows':>5}" + "".join(f"{k:>17}" for k in kinds))

    def cell(r, k):
        g = r["gflops"][k]
        return f"{'-':>17}" if g is None else f"{g:>9.1f} ({100 * g / r['peak_gflops']:>3.0f}%)"

    for r in results:
        cells = "".join(cell(r, k) for k in kinds)
        print(f"{r['isa']:<12}{r['peak_gflops']:>6.0f} {r['x']:<9}{r['rows']:>5}{cells}")
    record = {"threads": args.threads, "clock": args.clock, "shapes": SHAPES, "results": results, "machine": machine()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    png = args.out.with_suffix(".png")
    plot(results, rows_list, png)
    print(f"saved {args.out} and {png.name}")
    return 0


def plot(results: list[dict], rows_list: list[int], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    isas = list(dict.fromkeys(r["isa"] for r in results))
    fig, axes = plt.subplots(1, len(isas), figsize=(5 * len(isas), 4), squeeze=False)
    for ax, isa in zip(axes[0], isas):
        styles = {"int4": "-o", "int4 int8-x": "-D", "int4 int8-x amx": "--D", "int4 pairs": "--o", "int8": "-s",
                  "int8 int8-x": "-d", "int8 int8-x amx": "--d", "bf16": "-^", "bf16 pairs": "--^",
                  "torch bf16": ":x", "torch f32": ":+"}  # fmt: skip
        for kind, style in styles.items():
            here = {r["rows"]: r["gflops"][kind] for r in results if r["isa"] == isa and r["x"] == "bfloat16"}
            ys = [here[n] for n in rows_list]
            if None not in ys:  # (pairs: AVX512-BF16 only; amx: a CPU with AMX-INT8)
                ax.plot(rows_list, ys, style, label=kind)
        peak = next(r["peak_gflops"] for r in results if r["isa"] == isa)
        ax.axhline(peak, color="grey", lw=0.8, ls="--", label="float32 FMA peak")
        ax.set(xscale="log", xlabel="rows of x (bf16)", ylabel="GFLOP/s", title=isa)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    from common.cli import run_main

    run_main(main)
