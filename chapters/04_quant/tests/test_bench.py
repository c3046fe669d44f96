"""bench.py runs and saves its figures (timings are printed and saved, never asserted)."""

import json
from pathlib import Path

from common.tools.warm_python import run_python

REACHES = ["bench.py"]  # scripts run in a subprocess (common/tools/carried.py)

CHAPTER = Path(__file__).resolve().parents[1]


def run(*args):
    # one torch thread (bench.py's default is two): `make test` runs two suites side by side on two
    # cores, where a two-thread team waits on a descheduled sibling
    return run_python(["bench.py", "--threads", "1", *args], cwd=CHAPTER, timeout=600)


def test_bench_runs_and_saves_figures(tmp_path):
    r = run(
        "--model",
        "tiny-llama3",
        "--formats",
        "bf16,int8,int4-g32,gguf-q4_1",
        "--repeats",
        "1",
        "--prompt-tokens",
        "16",
        "--new-tokens",
        "8",
        "--ppl-tokens",
        "300",
        "--context",
        "128",
        "--stride",
        "64",
        "--out",
        str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    assert "gguf-q4_1 skipped: the bundled GGUF is smollm2-135m" in r.stderr
    result = json.loads((tmp_path / "ch04_quant_tiny-llama3.json").read_text())
    rows = {row["format"]: row for row in result["rows"]}
    # ch03-bf16 runs when chapter 03 sits beside this one (a copied chapter has no neighbour to time)
    assert {"bf16", "int8", "int4-g32"} <= set(rows) <= {"bf16", "int8", "int4-g32", "ch03-bf16"}
    for name in ("bf16", "int8", "int4-g32"):
        row = rows[name]
        assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 and row["peak_rss_bytes"] > 0
        assert row["perplexity"] > 1 and row["tokens_scored"] == 299
    assert rows["int8"]["weight_bytes"] < rows["bf16"]["weight_bytes"] * 0.6
    if "ch03-bf16" in rows:  # chapter 03's bf16 engine reads what this one's bf16 weights hold ("-" before)
        assert rows["ch03-bf16"]["weight_bytes"] == rows["bf16"]["weight_bytes"]
    assert rows["int4-g32"]["file_bytes"] < rows["int8"]["file_bytes"]
    assert (tmp_path / "ch04_quant_tiny-llama3.png").stat().st_size > 1000


def test_profile_splits_a_decode_step(tmp_path):
    r = run("--model", "tiny-llama3", "--profile", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "ch04_profile_decode.json").read_text())
    int4 = result["int4-g32"]
    assert int4["ops_per_token"] > 10 and int4["ms_per_token"]["matmul int4"] > 0


def test_unknown_format_is_a_clear_error():
    r = run("--formats", "int5")
    assert r.returncode == 2 and "unknown format(s) int5" in r.stderr
