"""Where one decode step's time goes: matmuls, attention, the rest, and the ops launched per token.

    python chapters/04_quant/bench.py --profile

Runs 64 decode steps (after a 128-token prompt) under torch.profiler for int4 G=32 and for bf16,
groups the operators' own CPU time, and compares their sum with the wall time of the same steps
run without the profiler: what is left is Python and the dispatcher between ops. The profiler adds
its own cost to every op, so the op counts are exact and the split is approximate.
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

GROUPS = {  # operator -> what it is; anything else is "other" (norms, RoPE, adds, copies, casts)
    "aten::_weight_int4pack_mm_for_cpu": "matmul (int4)",
    "aten::_weight_int8pack_mm": "matmul (int8)",
    "aten::mm": "matmul (float)", "aten::addmm": "matmul (float)", "aten::bmm": "matmul (float)",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::_fused_rms_norm": "rms_norm",
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
        for _ in range(steps):
            token = forward(model, token, cache)[:, -1].argmax(-1)[:, None]
    self_us: Counter = Counter()
    for e in prof.key_averages():
        self_us[GROUPS.get(e.key, "other ops")] += e.self_cpu_time_total
    top_level = sum(1 for e in prof.events() if e.cpu_parent is None)
    ops_ms = sum(self_us.values()) / 1e3 / steps
    return {
        "wall_ms_per_token": wall_ms,
        "ops_per_token": top_level / steps,
        "self_ms_per_token": {k: v / 1e3 / steps for k, v in self_us.most_common()},
        "python_and_dispatch_ms": max(wall_ms - ops_ms, 0.0),
    }


def main(args) -> int:
    torch.set_num_threads(args.threads)
    results = {}
    for name, spec in [("int4-g32", QuantSpec(4, 32)), ("bf16", None)]:
        model, _ = load(args.model, "cpu", "bfloat16", spec)
        r = results[name] = profile_steps(model)
        print(f"{name}: {r['wall_ms_per_token']:.2f} ms per token without the profiler "
              f"({1e3 / r['wall_ms_per_token']:.0f} tok/s), {r['ops_per_token']:.0f} top-level ops per token")
        for group, ms in r["self_ms_per_token"].items():
            print(f"  {group:<16} {ms:6.2f} ms")
        print(f"  {'Python+dispatch':<16} {r['python_and_dispatch_ms']:6.2f} ms (wall minus the ops' own time)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ch04_profile_decode.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"saved {out / 'ch04_profile_decode.json'}", file=sys.stderr)
    return 0
