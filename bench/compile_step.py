"""torch.compile of a chapter's decode step on a CPU, against the same step run eagerly: the newest
chapter's, or an older one's from 06 on (--chapter 6), the chapters with kernels and CUDA graphs.

    python bench/compile_step.py                      # int4 weights, bf16, 2 threads
    python bench/compile_step.py --quant none         # bf16 weights
    python bench/compile_step.py --cpp-wrapper        # Inductor's C++ wrapper instead of its Python one

Issue 20 asked whether compiling the decode step removes the Python between the kernels, as CUDA
graphs do on a GPU. The step compiled is the one CUDA graphs capture (cuda_graphs.DecodeGraphs,
capture=False): one sequence, static buffers, so every step has the same shapes and compiles once
(fullgraph, dynamic=False). The kernels go through torch's dispatcher (torch.ops.llm_kernels.*,
opaque to Inductor, which compiles the glue around them) instead of the pybind11 functions that
dynamo cannot trace. Three engines on the same weights and prompt, their steps interleaved in
rounds: "eager" runs the static step as the engine does, each layer one C++ call
(ops.KernelOps.build_one_call_layer, run_one_call_layer); "loop" runs its layers op by op from
Python; "compiled" is that Python loop compiled: issue 20's two ways of removing the per-op
overhead, side by side.
Results: a table, JSON at --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from common.tools.bench import int8_activations_error, add_int8_activations, machine
from common.tools.chapters import chapter_number, newest_chapter
from common.tools.decoding import decoding_engine, time_steps


def static_steps(engine, chapter: int, how: str, cpp_wrapper: bool):
    """Makes the engine (chapter `chapter`'s) run its decode steps through DecodeGraphs without
    capture. how: "eager" (as the engine does: each layer one C++ call), "loop" (the layers op by op
    from Python) or "compiled" (that Python loop compiled)."""
    prefix = f"ch{chapter:02d}."  # load_chapter keeps a chapter's modules under chNN.*
    graphs_mod, ops, qmatmul = (sys.modules[prefix + name] for name in ("cuda_graphs", "ops", "qmatmul"))
    model = engine.model
    compiled = how == "compiled"
    if how != "eager":
        for layer in model.layers:  # dynamo cannot trace into a pybind11 call: the Python loop
            layer.one_call = None
    if compiled:
        # The library through the dispatcher: ops.KernelOps calls model.ops._ext.<kernel>, the
        # prepared linears their .matmul; both are pointed at torch.ops.llm_kernels.
        lib, ext = torch.ops.llm_kernels, model.ops._ext

        class Dispatcher:
            def __getattr__(self, name):
                return getattr(lib, name)

            def cpu_isa(self):
                return ext.cpu_isa()

        model.ops._ext = Dispatcher()
        kinds = {
            ops.KernelInt4Linear: lib.int4_linear,
            ops.KernelInt8Linear: lib.int8_linear,
            ops.KernelBf16Linear: lib.bf16_linear,
        }
        for w in [model.lm_head] + [
            getattr(layer, f) for layer in model.layers for f in ("wqkv", "wo", "w_gate_up", "w_down")
        ]:
            kernel = w.packed if isinstance(w, qmatmul.PerStepLinear) else w
            if type(kernel) in kinds:
                kernel.matmul = kinds[type(kernel)]
    runner = engine.runner  # runner.py's ModelRunner: the KV cache, and the decode graphs it replays
    max_blocks = -(-engine.context // runner.cache.block_size)
    graphs = graphs_mod.DecodeGraphs(model, runner.cache, 1, max_blocks, 0, capture=False)  # batch 1: no padding
    if compiled:
        import torch._inductor.config as inductor

        inductor.cpp_wrapper = cpp_wrapper
        # Dynamo re-imports the modules of the code it traces by name; chapter modules are loaded
        # under chNN.* (common.tools.chapters): give them their plain names too.
        for name in [n for n in sys.modules if n.startswith(prefix)]:
            sys.modules[name[len(prefix) :]] = sys.modules[name]
        graphs._forward = torch.compile(graphs._forward, fullgraph=True, dynamic=False)
    runner.graphs = graphs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--chapter", type=chapter_number, default=newest_chapter(), help="06 on: 6, 06 or ch06 (default: the newest)"
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quant", choices=["int4", "int8", "none"], default="int4")
    ap.add_argument("--dtype", default="bfloat16")
    add_int8_activations(ap)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=12, help="decode steps per engine per round")
    ap.add_argument("--cpp-wrapper", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.chapter < 6:
        ap.error("--chapter: the static decode step (cuda_graphs.DecodeGraphs) starts in chapter 06")
    if why := int8_activations_error(args, args.quant):
        ap.error(why)
    from common.models import resolve_model

    args.model = str(resolve_model(args.model))
    torch.set_num_threads(args.threads)
    engines = {}
    for name in ("eager", "loop", "compiled"):
        total = args.rounds * args.steps + 8
        engines[name] = decoding_engine(
            args.chapter, args.model, args.quant, args.dtype, "on", args.prompt_tokens, total, 2, args.int8_activations
        )
        static_steps(engines[name], args.chapter, name, args.cpp_wrapper)
    engines["eager"].step()
    engines["loop"].step()
    t0 = time.perf_counter()
    engines["compiled"].step()  # compiles
    compile_s = time.perf_counter() - t0
    for engine in engines.values():
        time_steps(engine, 2)
    ms = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            ms[name].append(time_steps(engine, args.steps) * 1e3)
    median = {name: sorted(v)[len(v) // 2] for name, v in ms.items()}
    # All took the same steps on the same prompt: the same tokens (exactly, in float32).
    tokens = {name: list(next(iter(e.scheduler.running)).tokens) for name, e in engines.items()}
    same = tokens["eager"] == tokens["loop"] == tokens["compiled"]
    what = f"chapter {args.chapter:02d}, {Path(args.model).name}, {args.quant} weights, {args.dtype}"
    what += f", {args.threads} threads"
    print(f"decode step, one sequence, static buffers ({what}); compiling took {compile_s:.1f} s")
    for name, v in ms.items():
        print(f"{name:9} ms/step  median {median[name]:6.2f}   rounds: " + " ".join(f"{x:.2f}" for x in v))
    print(f"loop / eager: {median['loop'] / median['eager']:.2f}x the time (the layers op by op from Python)")
    print(f"compiled / eager: {median['compiled'] / median['eager']:.2f}x the time; the same tokens: {same}")
    if args.out:
        result = {
            "machine": machine(),
            "args": {k: v for k, v in vars(args).items() if k != "out"},
            "compile_s": compile_s,
            "ms_per_step": ms,
            "median_ms": median,
            "same_tokens": same,
            "tokens": len(tokens["eager"]),
        }
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    from common.cli import run_main

    run_main(main)
