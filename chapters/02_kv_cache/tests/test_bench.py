"""bench.py runs and saves its figures (timings are printed and saved, never asserted)."""

import json
from pathlib import Path

from common.tools.warm_python import run_python

REACHES = ["bench.py"]  # scripts run in a subprocess (common/tools/carried.py)

CHAPTER = Path(__file__).resolve().parents[1]


def run(*args):
    return run_python(args, cwd=CHAPTER, timeout=600)


def test_bench_runs_and_saves_figures(tmp_path):
    r = run(
        str(CHAPTER / "bench.py"),
        "--model",
        "tiny-llama3",
        "--prompt-tokens",
        "16",
        "--new-tokens",
        "8",
        "--ch01-new-tokens",
        "4",
        "--out",
        str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "ch02_decode_tiny-llama3_float32.json").read_text())
    # ch01 runs when chapter 01 sits beside this one (a copied chapter has no neighbour to time)
    assert {"ch02", "hf"} <= {e["engine"] for e in result["engines"]} <= {"ch02", "hf", "ch01"}
    for e in result["engines"]:
        assert e["decode_tok_s"] > 0 and e["ttft_ms"] > 0 and e["itl_p50_ms"] > 0
    assert (tmp_path / "ch02_decode_tiny-llama3_float32.png").stat().st_size > 1000


def test_bench_refuses_what_it_cannot_time():
    r = run(str(CHAPTER / "bench.py"), "--engines", "ch02,foo")
    assert r.returncode == 2 and "--engines: no engine 'foo'; there are ch02, hf and ch01" in r.stderr
    r = run(str(CHAPTER / "bench.py"), "--new-tokens", "1")  # decode columns of nan
    assert r.returncode == 2 and "--new-tokens: at least 2" in r.stderr
