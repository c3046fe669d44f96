"""bench/profile_step.py splits a decode step into the library's kernels, torch's operators and the
rest, and counts the calls of each per step."""

from __future__ import annotations

import json
from pathlib import Path

from common.warm_python import run_python

REPO = Path(__file__).resolve().parents[1]


def test_a_step_is_split_into_kernels_torch_and_the_rest(tmp_path):
    out = tmp_path / "p.json"
    args = ["--model", "tiny-llama3", "--quant", "none", "--dtype", "float32", "--prompt-tokens", "12"]
    r = run_python(["bench/profile_step.py", *args, "--warmup", "2", "--steps", "4", "--out", str(out)], cwd=REPO)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    layers = json.loads((REPO / "models" / "tiny-llama3" / "config.json").read_text())["num_hidden_layers"]
    # one decode token a step: per layer one attention, one rope_cache_, two norms, one silu_mul (+ the first norm)
    calls = result["kernel_calls"]
    assert calls["paged_decode_attention"] == layers and calls["rope_cache_"] == layers and calls["silu_mul"] == layers
    assert calls["add_rms_norm"] == 2 * layers + 1
    assert "bf16_linear" not in calls  # float32 weights: torch's GEMM (aten::linear / addmm / mm)
    assert any(name in result["torch_top"] for name in ("aten::addmm", "aten::mm", "aten::linear"))
    assert result["step_ms"] > 0 and result["torch_op_calls"] > 0
    assert "the rest: Python, at least" in r.stdout
