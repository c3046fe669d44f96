"""bench.py runs every part in miniature and saves its figures (timings are printed and saved, never
asserted)."""

import json
from pathlib import Path

import pytest

import peers
from common.tools.warm_python import run_python

REACHES = ["bench.py"]  # scripts run in a subprocess (common/tools/carried.py)

CHAPTER = Path(__file__).resolve().parents[1]
# two of the four tasks: the one prompt lookup helps, and a chat; float32, whose greedy reply is the
# same on every CPU (in bf16 the code edit's first tokens copy the prompt or not, by the vector
# instructions' rounding and whether x is rounded to int8)
SMALL = ["--tasks", "code edit,chat: cooking", "--ks", "1,3", "--max-tokens", "6", "--dtype", "float32"]
SMALL += ["--batches", "2", "--batch-tokens", "4", "--repeats", "1"]


def run(*args, timeout=300):
    return run_python([str(CHAPTER / "bench.py"), *args], cwd=CHAPTER, timeout=timeout)


def test_bench_runs_every_part_and_saves_figures(tmp_path):
    out = tmp_path / "bench.json"
    proc = run(*SMALL, "--threads", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    one = result["one"]
    assert set(one) == {"code edit", "chat: cooking"} and set(result["draft"]) == set(one)
    for rows in one.values():
        assert set(rows) == {"off", "ngram k=1", "ngram k=3"}
        assert rows["off"]["acceptance"] is None and rows["off"]["same_tokens_as_plain"]
        for r in rows.values():
            assert 1 <= r["tokens"] <= 6 and r["decode_tok_s"] > 0 and len(r["speedup_per_round"]) == 1
    # the code edit copies its input: prompt lookup proposes there, and the rows say how it went
    edit = one["code edit"]["ngram k=3"]
    assert edit["acceptance"] is not None and 1 <= edit["tokens_per_verify"] <= 4
    assert set(result["batch"]) == {"2"}
    for r in result["batch"].values():
        assert r["off"]["tok_s"] > 0 and r["on"]["tok_s"] > 0 and r["on_over_off"] > 0
    draft = result["draft"]["code edit"]
    assert set(draft) == {"bf16", "int4", "bf16 + int4 draft k=2", "bf16 + int4 draft k=4"}
    assert draft["bf16 + int4 draft k=2"]["acceptance"] is not None and draft["bf16"]["acceptance"] is None
    assert "One stream" in proc.stdout and "Many streams" in proc.stdout and "int4 copy drafting" in proc.stdout


@pytest.mark.parametrize("flag", [[], ["--no-int8-activations"]], ids=["default", "no-int8-activations"])
def test_int8_activations_reach_the_engines(tmp_path, flag):
    import kernels

    out = tmp_path / "bench.json"
    args = ["--tasks", "code edit", "--ks", "1", "--max-tokens", "3", "--repeats", "1", "--threads", "1"]
    proc = run("--parts", "one", *args, *flag, "--out", str(out))  # bf16 activations, the default
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["int8_activations"] is not flag  # int8 activations: the engines' default
    # where the CPU has an integer product the engines' kernels line names it (none in portable C++)
    has_product = kernels.load().cpu_int8_product() != "none" and not flag
    assert ("int8 activations" in result["kernels"]) == has_product, result["kernels"]


def test_beside_llama_cpp(tmp_path):
    why = peers.llama_cpp_available()
    if why:
        pytest.skip(why)
    out = tmp_path / "bench.json"
    proc = run("--parts", "one", *SMALL, "--peers", "llama.cpp", "--threads", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["one"]["code edit"]
    assert rows["llama.cpp"]["tokens"] >= 1 and rows["llama.cpp lookup k=3"]["decode_tok_s"] > 0
    # llama.cpp's prompt lookup keeps llama.cpp's own greedy tokens
    assert rows["llama.cpp lookup k=3"]["same_tokens_as_plain"]


def test_bad_arguments_are_clear_errors():
    for args, message in [
        (["--parts", "kernels"], "unknown part"),
        (["--tasks", "poetry"], "--tasks takes some of code edit"),
        (["--ks", "0"], "positive integers"),
        (["--peers", "vllm"], "--peers takes llama.cpp"),
        (["--ks", "4,1000", "--model", "tiny-llama3"], "--ks: a prompt-lookup engine drafts at most 255 tokens a step"),
        (["--parts", "draft", "--quant", "int8"], "--quant is for parts one and batch"),
    ]:
        proc = run(*args, timeout=60)
        assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr
