"""lora_bench.py runs in miniature and saves its figures (timings are printed and saved, never
asserted)."""

import json
from pathlib import Path

import kernels
import peers
from common.tools.warm_python import run_python

REACHES = ["lora_bench.py"]  # a script run in a subprocess (common/tools/carried.py)

CHAPTER = Path(__file__).resolve().parents[1]


def test_lora_bench_runs_and_saves_figures(tmp_path):
    out = tmp_path / "lora"
    args = ["--tokens", "3", "--repeats", "1", "--batch", "2", "--out", str(out)]
    proc = run_python([str(CHAPTER / "lora_bench.py"), *args], cwd=CHAPTER, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    ours = {"base x2", "2 adapters x2", "base x1", "adapter x1", "base x1 + adapter's bytes"}
    assert ours <= set(result["tok_s"]) and result["batch"] == 2 and result["rank"] == 16
    for name in ours:
        assert len(result["tok_s"][name]) == 1 and result["tok_s"][name][0] > 0
    assert {k: len(v) for k, v in result["ratio_per_round"].items()} == {"adapters": 1, "adapter x1": 1, "bytes x1": 1}
    assert result["read_only_same_tokens"] is True  # the base's tokens, with the extra read or without
    if peers.llama_cpp_available() is None:  # the same adapter through llama.cpp, its tokens compared
        assert {"llama.cpp base", "llama.cpp adapter"} <= set(result["tok_s"])
        assert set(result["tokens_agree"]) == {"base", "adapter"}  # per run: tokens equal before the first difference
        assert all(len(v) == 1 and 0 <= v[0] <= result["tokens"] for v in result["tokens_agree"].values())
    assert "adapter x1 / base x1" in proc.stdout and "the base reading an adapter's bytes" in proc.stdout
    # int8 activations by default: where the CPU has an integer product the kernels line names it
    assert result["int8_activations"] is True
    has_product = kernels.load().cpu_int8_product() != "none"  # none in portable C++
    assert ("int8 activations" in result["kernels"]) == has_product, result["kernels"]


def test_no_int8_activations_reaches_the_engine(tmp_path):
    # int8 activations are the default (test_lora_bench_runs_and_saves_figures); the flag turns them off
    out = tmp_path / "lora"
    args = ["--tokens", "2", "--repeats", "1", "--batch", "1", "--no-int8-activations", "--out", str(out)]
    proc = run_python([str(CHAPTER / "lora_bench.py"), *args], cwd=CHAPTER, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["int8_activations"] is False
    assert "int8 activations" not in result["kernels"], result["kernels"]


def test_bad_values_are_usage_errors_before_anything_runs():
    # --batch 0 was an AttributeError after the model loaded, --repeats 0 a StatisticsError after the
    # whole run, and --tokens 0 blamed max_tokens, a field the bench has no flag for
    for flag in ("--batch", "--repeats", "--tokens"):
        proc = run_python([str(CHAPTER / "lora_bench.py"), flag, "0"], cwd=CHAPTER, timeout=120)
        assert proc.returncode == 2 and f"argument {flag}: must be at least 1, got 0" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
