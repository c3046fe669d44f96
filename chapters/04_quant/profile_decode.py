"""Where one decode step's time goes: matmuls, attention, the rest, and the ops launched per token.

Usage, from this chapter's folder:

    python bench.py --profile

Runs 64 decode steps (after a 128-token prompt) under torch.profiler for int4 G=32 and for bf16,
and sums the time of the top-level operators by kind (matmuls, attention, norms, the rest: RoPE,
cache writes, casts, adds, views). What the profiled wall time holds beyond them is Python. The
profiler adds its own cost to every operator, so op counts are exact and the split is approximate;
the unprofiled time per token is printed beside it.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kv_cache import KVCache
from loading import load
from model import forward
from quant import QuantSpec

GROUPS = {  # a top-level operator -> what it is; anything else is "other ops"
    "aten::_weight_int4pack_mm_for_cpu": "matmul int4",
    "aten::_weight_int8pack_mm": "matmul int8",
    "aten::linear": "matmul bf16",
    "aten::scaled_dot_product_attention": "attention",
    "aten::rms_norm": "rms_norm",
    "aten::argmax": "argmax",
}


@torch.inference_mode()
def profile_steps(model, prompt_len: int = 128, steps: int = 64) -> dict:
    cache = KVCache(model.config, 1, prompt_len + 2 * steps + 8, model.device, model.dtype)
    logits = forward(model, torch.arange(1000, 1000 + prompt_len)[None], cache, last_only=True)
    token = logits[:, -1].argmax(-1)[:, None]
    for _ in range(4):  # warm-up
        token = forward(model, token, cache)[:, -1].argmax(-1)[:, None]
    t0 = time.perf_counter()
    for _ in range(steps):
        token = forward(model, token, cache)[:, -1].argmax(-1)[:, None]
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            token = forward(model, token, cache)[:, -1].argmax(-1)[:, None]
        profiled_ms = (time.perf_counter() - t0) * 1e3 / steps
    # Top-level operators (those no other operator called), each with everything it ran inside:
    # their sum is the time spent in torch; the rest of the wall time is Python and the dispatcher
    # between calls.
    top = [e for e in prof.events() if e.cpu_parent is None]
    group_ms: Counter = Counter()
    for e in top:
        group_ms[GROUPS.get(e.name, "other ops")] += e.cpu_time_total / 1e3 / steps
    return {
        "wall_ms_per_token": wall_ms,
        "profiled_ms_per_token": profiled_ms,
        "ops_per_token": len(top) / steps,
        "other_ops_per_token": sum(1 for e in top if e.name not in GROUPS) / steps,
        "ms_per_token": dict(group_ms.most_common()),
        "python_ms_per_token": max(profiled_ms - sum(group_ms.values()), 0.0),
    }


def main(args) -> int:
    torch.set_num_threads(args.threads)
    results = {}
    for name, spec in [("int4-g32", QuantSpec(4, 32)), ("bf16", None)]:
        model, _ = load(args.model, "cpu", "bfloat16", spec)
        r = results[name] = profile_steps(model)
        print(
            f"{name}: {r['wall_ms_per_token']:.2f} ms per token ({1e3 / r['wall_ms_per_token']:.0f} tok/s); under the "
            f"profiler {r['profiled_ms_per_token']:.2f} ms, {r['ops_per_token']:.0f} top-level ops per token "
            f"({r['other_ops_per_token']:.0f} of them 'other')"
        )
        for group, ms in r["ms_per_token"].items():
            print(f"  {group:<12} {ms:6.2f} ms")
        print(f"  {'Python':<12} {r['python_ms_per_token']:6.2f} ms (profiled wall time minus the operators')")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ch{Path(__file__).resolve().parent.name[:2]}_profile_decode.json"  # ch04, from the folder's name
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"saved {path}", file=sys.stderr)
    return 0
