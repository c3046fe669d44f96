"""bench/prefill.py times a prompt's first token and a step of 16 sequences against a step of one;
bench/gemm.py the CPU matrix product against the FMA peak; bench/chunk_attention.py the chunk
kernel against gather + SDPA and a prompt's profile. Here on the tiny model and small sizes:
what they record, not how fast (llama.cpp runs beside SmolLM2 only, and only where installed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.tools.warm_python import run_python

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("int8_x", [False, True], ids=["float", "int8-activations"])
def test_prefill_records_ttft_per_prompt_length_and_the_step_ratio(tmp_path, int8_x):
    out = tmp_path / "p.json"
    args = ["--chapter", "6", "--model", "tiny-llama3", "--prompt-tokens", "5,40", "--rounds", "2", "--out", str(out)]
    args += [] if int8_x else ["--no-int8-activations"]  # int8 activations: the default
    r = run_python(["bench/prefill.py", *args], cwd=REPO)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert sorted(result["ttft"]) == ["40", "5"] and all(len(v["ours_ms"]) == 2 for v in result["ttft"].values())
    assert all(ms > 0 for v in result["ttft"].values() for ms in v["ours_ms"])
    assert set(result["step_ms"]) == {"1", "16"} and result["machine"]["isa"]["ours"]
    assert "decode step: 1 sequence" in r.stdout and "vector instructions: ours" in r.stdout
    assert result["int8_activations"] is int8_x
    if result["machine"]["isa"]["ours"] != "scalar":  # the portable C++ has no integer product
        assert ("int8 activations" in r.stdout) == int8_x


def test_prefill_of_bf16_weights_records_no_int8_activations(tmp_path):
    # they meet int4 and int8 weights only: a bf16 run was saved as an int8-activation one
    args = ["--chapter", "6", "--model", "tiny-llama3", "--quant", "none", "--prompt-tokens", "5", "--rounds", "1"]
    r = run_python(["bench/prefill.py", *args, "--out", str(tmp_path / "p.json")], cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "p.json").read_text())["int8_activations"] is False


def test_gemm_bench_reports_each_kind_against_the_peak(tmp_path):
    out = tmp_path / "g.json"
    args = ["--isa", "avx2", "--rows", "16", "--repeats", "1", "--threads", "1", "--clock", "cpu", "--out", str(out)]
    r = run_python(["bench/gemm.py", *args], cwd=REPO)
    if "this CPU does not support avx2" in r.stderr:
        pytest.skip("a CPU without AVX2: the library has no matrix product here")
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["results"]
    assert [row["x"] for row in rows] == ["bfloat16", "float32"]
    for row in rows:
        assert row["isa"] == "avx2" and row["gemm"] == "avx2-fma" and row["peak_gflops"] > 0
        kinds = {"int4", "int4 int8-x", "int4 pairs", "int8", "int8 int8-x", "bf16", "bf16 pairs"}
        kinds |= {"int4 int8-x amx", "int8 int8-x amx", "torch bf16", "torch f32"}
        assert set(row["gflops"]) == kinds
        for integer in ("int4 int8-x", "int8 int8-x"):
            assert (row["gflops"][integer] is None) == (row["x"] == "float32")
        assert row["gflops"]["int4 pairs"] is None and row["gflops"]["bf16 pairs"] is None  # AVX512-BF16 only
        assert row["gflops"]["int4 int8-x amx"] is None and row["gflops"]["int8 int8-x amx"] is None  # likewise
    assert out.with_suffix(".png").exists()


def test_chunk_attention_saves_each_part_and_names_only_the_plot_it_drew(tmp_path):
    for parts, drawn in [("attention", True), ("profile", False)]:
        out = tmp_path / f"{parts}.json"
        args = ["--parts", parts, "--prompt-tokens", "40", "--profile-tokens", "40", "--rounds", "1", "--out", str(out)]
        r = run_python(["bench/chunk_attention.py", *args], cwd=REPO)
        assert r.returncode == 0, r.stderr
        assert parts in json.loads(out.read_text()) and out.with_suffix(".png").exists() is drawn
        assert (f"and {parts}.png" in r.stdout) is drawn, r.stdout


@pytest.mark.parametrize("script", ["bench/prefill.py", "bench/chunk_attention.py"])
def test_a_chapter_without_the_kernels_is_refused(script):
    # chapter 05 has no ops.py: a ModuleNotFoundError; "ch06" was not a number
    r = run_python([script, "--chapter", "5"], cwd=REPO, timeout=120)
    assert r.returncode == 2 and "start in chapter 06" in r.stderr.replace("starts", "start"), r.stderr
    r = run_python([script, "--chapter", "ch06", "--help"], cwd=REPO, timeout=120)
    assert r.returncode == 0
