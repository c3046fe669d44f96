"""Where a decode step's time goes: the newest chapter's engine (--chapter for an older one, 06 on:
the chapters with kernels) decoding one sequence (or several, --sequences), split into the kernels
of kernels/, torch's operators, and the rest (Python: the forward pass's glue, the scheduler, the
sampler, the step's bookkeeping).

    python bench/profile_step.py                   # int4 weights, kernels on
    python bench/profile_step.py --chapter 6       # chapter 06's engine
    python bench/profile_step.py --quant none      # bf16 weights
    python bench/profile_step.py --kernels off     # the PyTorch path (chapter 05's)
    python bench/profile_step.py --layers python   # each layer op by op from Python: the kernels one by one
    python bench/profile_step.py --sequences 16    # a step of 16 sequences decoding together
    python bench/profile_step.py --no-int8-activations   # int4 x bf16 in floats (chapter 06's README)

Three runs of --steps decode steps each, after a --prompt-tokens prompt and a warm-up:
  1. plain: the wall time per step, nothing instrumented;
  2. the library's functions wrapped in a timer (each call's time, by function; the wrapper
     adds well under a microsecond per call);
  3. under torch.profiler: torch's operators by name, calls and self time per step. The
     profiler costs a few microseconds per operator, so these times are high; the counts are exact.
The rest is run 1's step minus the kernels (run 2) and torch's operators (run 3): a lower bound on
the time in Python. With the kernels on, a decode step's layers run as one C++ call each
(ops.KernelOps.build_one_call_layer, run_one_call_layer); that call is one part,
DecoderLayer.decode, the kernels and torch operators it calls inside included. Results: a table on
stdout, JSON at --out.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from common.tools.bench import int8_activations_error, add_int8_activations, machine
from common.tools.chapters import chapter_number, newest_chapter
from common.tools.decoding import decoding_engine, time_steps

REPO = Path(__file__).resolve().parents[1]


class TimedLibrary:
    """The kernel library with each function call timed: seconds and calls by name."""

    def __init__(self, lib):
        self._lib, self.seconds, self.calls, self.on = lib, defaultdict(float), defaultdict(int), False

    def __getattr__(self, name):
        value = getattr(self._lib, name)
        if not callable(value) or name.startswith("_"):
            return value

        def timed(*args, **kwargs):
            if not self.on:
                return value(*args, **kwargs)
            t0 = time.perf_counter()
            out = value(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - t0
            self.calls[name] += 1
            return out

        return timed


class TimedLayer:
    """A layer's one C++ call per decode step (the library's DecoderLayer), timed as one part, and
    marked for the profiler so that the torch operators it calls inside count with it."""

    NAME = "DecoderLayer.decode"

    def __init__(self, layer, timed: TimedLibrary):
        self._layer, self._timed = layer, timed

    def decode(self, *args):
        t0 = time.perf_counter()
        with torch.profiler.record_function(self.NAME):
            out = self._layer.decode(*args)
        if self._timed.on:
            self._timed.seconds[self.NAME] += time.perf_counter() - t0
            self._timed.calls[self.NAME] += 1
        return out


def outside_layer_calls(events):
    """The profiler's events that did not run inside a TimedLayer's call."""
    for e in events:
        parent = e.cpu_parent
        while parent is not None and parent.name != TimedLayer.NAME:
            parent = parent.cpu_parent
        if parent is None and e.name != TimedLayer.NAME:
            yield e


def build(args, timed: TimedLibrary | None):
    import kernels

    if timed is not None:  # ops.resolve takes the library from kernels.load(): hand it the timed one
        kernels.load = lambda: timed
    steps = 3 * args.steps
    return decoding_engine(
        args.chapter, args.model, args.quant, args.dtype, args.kernels, args.prompt_tokens, steps, args.warmup,
        args.sequences, args.int8_activations,
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--chapter", type=chapter_number, default=newest_chapter(), help="06 on: 6, 06 or ch06 (default: the newest)"
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quant", choices=["int4", "int8", "none"], default="int4")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kernels", choices=["on", "off"], default="on")
    ap.add_argument(
        "--layers",
        choices=["one-call", "python"],
        default="one-call",
        help="decode steps' layers as the engine runs them, one C++ call each (the default), or op by op from "
        "Python (the per-kernel split)",
    )
    add_int8_activations(ap)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument(
        "--sequences", type=int, default=1, help="sequences decoding together (a step decodes one token of each)"
    )
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.chapter < 6:
        ap.error("--chapter: the kernels this bench times start in chapter 06")
    if why := int8_activations_error(args, args.quant, args.kernels):
        ap.error(why)
    from common.models import resolve_model

    args.model = str(resolve_model(args.model))
    torch.set_num_threads(args.threads)
    timed = None
    if args.kernels == "on":
        import kernels

        timed = TimedLibrary(kernels.load())
    engine = build(args, timed)
    for layer in engine.model.layers:
        if args.layers == "python":
            layer.one_call = None
        elif layer.one_call is not None and timed is not None:
            layer.one_call = TimedLayer(layer.one_call, timed)

    step_s = time_steps(engine, args.steps)  # 1: plain
    kernel_s: dict[str, float] = {}
    kernel_calls: dict[str, float] = {}
    if timed is not None:  # 2: the library's calls timed
        timed.on = True
        time_steps(engine, args.steps)
        timed.on = False
        kernel_s = {k: v / args.steps for k, v in timed.seconds.items()}
        kernel_calls = {k: v / args.steps for k, v in timed.calls.items()}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:  # 3
        time_steps(engine, args.steps)
    aten = defaultdict(lambda: {"calls": 0.0, "self_s": 0.0})
    for e in outside_layer_calls(prof.events()):  # inside, the operators are part of the layer's time
        if not e.name.startswith("llm_kernels::"):
            aten[e.name]["calls"] += 1 / args.steps
            aten[e.name]["self_s"] += e.self_cpu_time_total / 1e6 / args.steps
    aten_s = sum(v["self_s"] for v in aten.values())
    aten_calls = sum(v["calls"] for v in aten.values())
    top = dict(sorted(aten.items(), key=lambda kv: -kv[1]["self_s"])[:12])
    rest = step_s - sum(kernel_s.values()) - aten_s

    what = (
        f"chapter {args.chapter:02d}, {Path(args.model).name}, {args.quant} weights, {args.dtype}, "
        f"kernels {args.kernels}, layers: {args.layers}, "
        f"{args.threads} threads"
    )
    who = "one sequence" if args.sequences == 1 else f"{args.sequences} sequences, each"
    print(f"decode step, {who} after a {args.prompt_tokens}-token prompt ({what}): {step_s * 1e3:.2f} ms")
    print(f"{'part':40} {'ms/step':>8} {'calls/step':>11}")
    for name, s in sorted(kernel_s.items(), key=lambda kv: -kv[1]):
        print(f"{'kernels.' + name:40} {s * 1e3:8.2f} {kernel_calls[name]:11.0f}")
    print(f"{'torch operators (profiled), all':40} {aten_s * 1e3:8.2f} {aten_calls:11.0f}")
    for name, v in top.items():
        print(f"{'  ' + name:40} {v['self_s'] * 1e3:8.2f} {v['calls']:11.0f}")
    if rest >= 0:
        print(f"{'the rest: Python, at least':40} {rest * 1e3:8.2f}")
    else:  # the three runs' own spread is larger than it: no bound to give
        print(f"{'the rest: Python, at least':40} {'-':>8} (runs 2 and 3 took longer than run 1)")
    print(engine.model.ops.describe())
    result = {
        "machine": machine(),
        "kernels": engine.model.ops.describe(),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "step_ms": step_s * 1e3,
        "kernels_ms": {k: v * 1e3 for k, v in kernel_s.items()},
        "kernel_calls": kernel_calls,
        "torch_ops_ms": aten_s * 1e3,
        "torch_op_calls": aten_calls,
        "torch_top": {k: {"calls": v["calls"], "self_ms": v["self_s"] * 1e3} for k, v in top.items()},
        "rest_ms": rest * 1e3,
        "sequences_decoding": len(engine.scheduler.running),  # at the end: all of --sequences, still running
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    from common.cli import run_main

    run_main(main)
