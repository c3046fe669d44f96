"""bench.py runs and saves its figures (timings are printed and saved, never asserted)."""

import json
from pathlib import Path

from common.tools.warm_python import run_python

REACHES = ["bench.py"]  # scripts run in a subprocess (common/tools/carried.py)

CHAPTER = Path(__file__).resolve().parents[1]


def run(*args):
    return run_python(args, cwd=CHAPTER, timeout=600)


def test_server_bench_runs_and_saves_figures(tmp_path):
    r = run(
        str(CHAPTER / "bench.py"),
        "--model",
        "tiny-llama3",
        "--requests",
        "2",
        "--max-tokens",
        "8",
        "--out",
        str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "ch03_server_stream_tiny-llama3.json").read_text())
    assert result["requests"] == 2 and result["ttft_ms_p50"] > 0 and result["itl_ms_p50"] > 0
    assert (tmp_path / "ch03_server_stream_tiny-llama3.png").stat().st_size > 1000
