"""bench/reproducibility.py counts, on the tiny model in float32, every request as reproducible
(float32 is the precision the README tells readers to use for it), and refuses a chapter without
the batching engine."""

from __future__ import annotations

import json
from pathlib import Path

from common.tools.warm_python import run_python

REPO = Path(__file__).resolve().parents[1]


def test_float32_greedy_outputs_do_not_depend_on_what_else_runs(tmp_path):
    out = tmp_path / "r.json"
    args = ["--model", "tiny-llama3", "--dtype", "float32", "--quant", "none", "--requests", "3", "--max-tokens", "6"]
    r = run_python(["bench/reproducibility.py", "--chapter", "6", *args, "--out", str(out)], cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["requests"] == 3 and result["dtype"] == "float32"
    counts = ("batch_equals_alone", "n2_choices_equal", "cached_prefix_equals_first_run")
    assert [result[k] for k in counts] == [3, 3, 3], result
    assert "all at once == each alone:            3 of 3" in r.stdout


def test_a_chapter_before_the_batching_engine_is_refused():
    r = run_python(["bench/reproducibility.py", "--chapter", "4"], cwd=REPO, timeout=120)
    assert r.returncode == 2 and "starts in chapter 05" in r.stderr


def test_batch_invariant_runs_on_chapter_06_and_reports_its_throughput(tmp_path):
    out = tmp_path / "r.json"
    args = ["--model", "tiny-llama3", "--dtype", "bfloat16", "--quant", "int4", "--requests", "3", "--max-tokens", "4"]
    r = run_python(
        ["bench/reproducibility.py", "--chapter", "6", *args, "--batch-invariant", "--out", str(out)], cwd=REPO
    )
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["batch_invariant"] is True and result["tok_s_all_at_once"] > 0 and result["tok_s_one_at_a_time"] > 0
    counts = ("batch_equals_alone", "n2_choices_equal", "cached_prefix_equals_first_run")
    assert [result[k] for k in counts] == [3, 3, 3], result  # bf16, and still every one
    r = run_python(["bench/reproducibility.py", "--chapter", "5", "--batch-invariant"], cwd=REPO, timeout=120)
    assert r.returncode == 2 and "--batch-invariant: chapter 06 on" in r.stderr
