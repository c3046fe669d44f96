"""bench/workload.py runs the standard throughput workload on each engine with the same requests,
every request yielding exactly its drawn output length, and names why an engine is skipped. Our
engines by default: the newest chapter's, whichever that is, and chapter 05's."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from common.tools.chapters import newest_chapter
from common.tools.warm_python import run_python

REPO = Path(__file__).resolve().parents[1]
NEWEST = f"ch{newest_chapter():02d}"


def test_every_engine_serves_the_same_requests_to_their_length(tmp_path):
    out = tmp_path / "w.json"
    args = ["--model", "tiny-llama3", "--quant", "none", "--dtype", "float32", "--requests", "5"]
    args += ["--min-len", "3", "--max-len", "12", "--max-num-seqs", "3", "--hf-batch", "2", "--out", str(out)]
    r = run_python(["bench/workload.py", *args], cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    # the draw: 5 (prompt length, output length) pairs in [3, 12], seed 0
    rng = random.Random(0)
    lengths = [(len([rng.randint(0, 9999) for _ in range(rng.randint(3, 12))]), rng.randint(3, 12)) for _ in range(5)]
    assert result["workload"]["prompt_tokens"] == sum(p for p, _ in lengths)
    assert result["workload"]["output_tokens"] == sum(n for _, n in lengths)
    assert set(result["runs"]) == {NEWEST, "ch05", "hf"}
    for run in result["runs"].values():
        assert run["output_tokens"] == sum(n for _, n in lengths) and run["tok_s"] > 0
    assert "GGUFs are smollm2-135m's" in result["skipped"]["llama.cpp"]  # tiny-llama3 has no GGUF peer
    assert result[f"{NEWEST}_tokens_equal_ch05"] == 5  # float32 greedy: the kernels change no token
    assert f"{NEWEST} tokens = ch05 tokens for 5 of 5 requests" in r.stdout
    assert out.with_suffix(".png").exists()


def test_bad_lengths_and_engines_are_usage_errors():
    r = run_python(["bench/workload.py", "--min-len", "50", "--max-len", "10"], cwd=REPO, timeout=120)
    assert r.returncode == 2 and "--min-len <= --max-len" in r.stderr
    # chapter 04's engine does not batch; there is no chapter 99; an older batching one is fine
    r = run_python(["bench/workload.py", "--engines", "ch06,ch04,ch99,hf"], cwd=REPO, timeout=120)
    assert r.returncode == 2 and "unknown engines ['ch04', 'ch99']" in r.stderr
    r = run_python(["bench/workload.py", "--max-num-seqs", "0"], cwd=REPO, timeout=120)  # was a ValueError
    assert r.returncode == 2 and "--max-num-seqs: must be at least 1, got 0" in r.stderr


def test_a_run_where_no_engine_ran_saves_nothing(tmp_path, monkeypatch):
    # every engine skipped: it saved a JSON and a plot of nothing over the last result
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    (tmp_path / "llama_cpp.py").write_text("raise ImportError('not here')\n")  # llama.cpp absent, here or not
    out = tmp_path / "w.json"
    r = run_python(["bench/workload.py", "--engines", "llama.cpp", "--out", str(out)], cwd=REPO, timeout=120)
    assert r.returncode == 1 and "error: no engine ran (llama.cpp: " in r.stderr and not out.exists(), r.stderr


@pytest.mark.parametrize("int8_x", [True, False], ids=["int8-activations", "float"])
def test_int8_activations_reach_the_chapter_engine_and_the_record(tmp_path, int8_x):
    # int8 activations (the engines' default) or --no-int8-activations reach the newest chapter's
    # engine (int4 weights, bf16); the record says which, and the requests are served to their length
    out = tmp_path / "w.json"
    args = ["--model", "tiny-llama3", "--engines", NEWEST, "--requests", "3", "--min-len", "3", "--max-len", "20"]
    args += [] if int8_x else ["--no-int8-activations"]
    r = run_python(["bench/workload.py", *args, "--out", str(out)], cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["int8_activations"] is int8_x and result["runs"][NEWEST]["tok_s"] > 0
    assert result["runs"][NEWEST]["output_tokens"] == result["workload"]["output_tokens"]
    if "avx" in result["runs"][NEWEST]["ops"]:  # a CPU with an integer product: the engine names it
        assert ("int8 activations" in result["runs"][NEWEST]["ops"]) == int8_x, result["runs"][NEWEST]["ops"]
