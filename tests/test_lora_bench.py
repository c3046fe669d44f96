"""bench/lora.py times the LoRA shrink + expand against the base int4 linear per projection and per
layer. Here at small sizes: what it records, not how fast."""

from __future__ import annotations

import json
from pathlib import Path

from common.tools.warm_python import run_python

REPO = Path(__file__).resolve().parents[1]


def test_lora_bench_records_each_projection_and_the_layer(tmp_path):
    out = tmp_path / "l.json"
    args = ["--rows", "2", "--dtypes", "float32", "--repeats", "1", "--calls", "1", "--adapters", "3", "--out", str(out)]
    r = run_python(["bench/lora.py", *args], cwd=REPO)
    assert r.returncode == 0, r.stderr
    record = json.loads(out.read_text())
    (result,) = record["results"]
    assert result["rows"] == 2 and result["dtype"] == "float32"
    assert set(result["projections"]) == {"q", "k", "v", "o", "gate", "up", "down"}
    for p in [*result["projections"].values(), result["layer"]]:
        assert p["base_us"] > 0 and p["lora_us"] > 0 and 0 < p["ratio"] < 1
    assert record["threads"] == 1 and record["adapters"] == 3 and "layer" in r.stdout
    assert out.with_suffix(".png").exists()
