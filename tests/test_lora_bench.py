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
    r = run_python(["bench/lora.py", *args, "--layers", "2", "--step-threads", "2"], cwd=REPO)
    assert r.returncode == 0, r.stderr
    record = json.loads(out.read_text())
    (result,) = record["results"]
    assert result["rows"] == 2 and result["dtype"] == "float32"
    assert set(result["projections"]) == {"q", "k", "v", "o", "gate", "up", "down"}
    for p in [*result["projections"].values(), result["layer"]]:
        assert p["base_us"] > 0 and p["lora_us"] > 0 and 0 < p["ratio"] < 1
    assert record["threads"] == 1 and record["adapters"] == 3 and "layer" in r.stdout
    # the step from memory: 2 layers of 7 projections' tables for the 2 adapters the 2 rows use
    (step,) = record["step_from_memory"]
    a_and_b = sum(n_out + n_in for n_out, n_in in record["projections"].values()) * 16 * 4  # rank 16, float32
    assert step["layers"] == 2 and step["adapters_read"] == 2 and step["table_mb"] == 2 * 2 * a_and_b / 1e6
    assert step["ms"] > 0 and step["gb_s"] > 0 and record["step_threads"] == 2 and "from memory" in r.stdout
    assert out.with_suffix(".png").exists()


def test_the_base_is_the_engines_default_product_unless_told_otherwise(tmp_path):
    # bf16 x meets the int4 weight as int8 on its tiles in the engines (where the CPU has the integer
    # product): against the float product the adapters' share looked half as large
    common = ["--rows", "2", "--dtypes", "bfloat16", "--repeats", "1", "--calls", "1", "--adapters", "2"]
    bases = {}
    for flag in ("--int8-activations", "--no-int8-activations"):
        out = tmp_path / f"{flag}.json"
        r = run_python(["bench/lora.py", *common, flag, "--out", str(out)], cwd=REPO)
        assert r.returncode == 0, r.stderr
        record = json.loads(out.read_text())
        bases[flag] = record["results"][0]["base"]
        assert record["int8_activations"] is (flag == "--int8-activations")
    assert bases["--no-int8-activations"] == "float product"
    if record["isa"] != "scalar":  # the portable C++ has no integer product
        assert bases["--int8-activations"] == "int8 x, integer product"
