"""bench/profile_step.py splits a decode step of the newest chapter's engine (or an older one's,
--chapter) into the library's kernels, torch's operators and the rest, and counts the calls of each
per step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.tools.warm_python import run_python

REPO = Path(__file__).resolve().parents[1]
# One torch thread (the script's default is two): `make test` runs two suites side by side on two
# cores, where a two-thread team waits on a descheduled sibling.
ONE_THREAD = ["--threads", "1"]


LAYERS = json.loads((REPO / "models" / "tiny-llama3" / "config.json").read_text())["num_hidden_layers"]


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    """layers -> (JSON result, stdout) of a profile with the layers as one C++ call each, or op by op."""
    out = {}
    for layers in ("one-call", "python"):
        path = tmp_path_factory.mktemp("p") / "p.json"
        args = ["--model", "tiny-llama3", "--quant", "none", "--dtype", "float32", "--prompt-tokens", "12", *ONE_THREAD]
        args += ["--layers", layers, "--warmup", "2", "--steps", "4", "--out", str(path)]
        r = run_python(["bench/profile_step.py", *args], cwd=REPO)
        assert r.returncode == 0, r.stderr
        out[layers] = json.loads(path.read_text()), r.stdout
    return out


def test_a_step_is_split_into_kernels_torch_and_the_rest(profiles):
    result, stdout = profiles["python"]
    # one decode token a step: per layer one attention, one rope_cache_, two norms, one silu_mul (+ the first norm)
    calls = result["kernel_calls"]
    assert calls["paged_decode_attention"] == LAYERS and calls["rope_cache_"] == LAYERS
    assert calls["silu_mul"] == LAYERS and calls["add_rms_norm"] == 2 * LAYERS + 1
    assert "bf16_linear" not in calls  # float32 weights: torch's GEMM (aten::linear / addmm / mm)
    assert any(name in result["torch_top"] for name in ("aten::addmm", "aten::mm", "aten::linear"))
    assert result["step_ms"] > 0 and result["torch_op_calls"] > 0
    assert "the rest: Python, at least" in stdout


def test_the_engine_s_step_is_one_call_per_layer(profiles):
    result, stdout = profiles["one-call"]
    assert result["kernel_calls"] == {"DecoderLayer.decode": LAYERS, "add_rms_norm": 1}  # the first norm, the layers
    assert "layers: one-call" in stdout
    # the layers' own torch operators (their GEMMs, their outputs' allocations) run inside their
    # calls: what is left outside is the step's embedding, LM head, sampling and bookkeeping
    assert result["torch_op_calls"] < profiles["python"][0]["torch_op_calls"] - 4 * LAYERS


def test_a_step_of_several_sequences(tmp_path):
    path = tmp_path / "p.json"
    args = ["--model", "tiny-llama3", "--quant", "none", "--dtype", "float32", "--prompt-tokens", "5", *ONE_THREAD]
    args += ["--sequences", "3", "--steps", "2", "--out", str(path), "--chapter", "ch06"]  # an older chapter by name
    r = run_python(["bench/profile_step.py", *args], cwd=REPO)
    assert r.returncode == 0, r.stderr
    result = json.loads(path.read_text())
    assert result["sequences_decoding"] == 3 and result["kernel_calls"]["DecoderLayer.decode"] == LAYERS
    assert "3 sequences, each after a 5-token prompt (chapter 06," in r.stdout


def test_the_timed_steps_come_after_every_prompt_is_in(tmp_path):
    # 3 x 200 prompt tokens take three steps of the engine's 256: a warm-up of one step left prompt
    # chunks in the timed steps, which then ran chunk attention instead of the decode layers
    path = tmp_path / "p.json"
    args = ["--model", "tiny-llama3", "--quant", "none", "--dtype", "float32", "--prompt-tokens", "200", *ONE_THREAD]
    args += ["--sequences", "3", "--warmup", "1", "--steps", "1", "--out", str(path)]
    r = run_python(["bench/profile_step.py", *args], cwd=REPO)
    assert r.returncode == 0, r.stderr
    calls = json.loads(path.read_text())["kernel_calls"]
    assert calls.get("DecoderLayer.decode") == LAYERS and "chunk_attention" not in calls, calls


def test_a_chapter_without_the_kernels_is_refused():
    r = run_python(["bench/profile_step.py", "--chapter", "5"], cwd=REPO, timeout=120)
    assert r.returncode == 2 and "start in chapter 06" in r.stderr


@pytest.mark.parametrize(
    "script, flags, why",
    [
        ("profile_step.py", ["--kernels", "off"], "with --kernels off it changes nothing"),
        ("workload.py", ["--quant", "none"], "with --quant none it changes nothing"),
        ("workload.py", ["--dtype", "float32"], "with --dtype float32 it changes nothing"),
        ("reproducibility.py", ["--batch-invariant"], "with --batch-invariant it changes nothing"),
    ],
)
def test_no_int8_activations_that_would_change_nothing_is_refused_before_anything_runs(script, flags, why):
    # the engines refuse it: the benches died with their traceback, workload.py after chapter 05 had run
    args = [f"bench/{script}", *flags, "--no-int8-activations", "--model", "tiny-llama3"]
    r = run_python(args, cwd=REPO, timeout=120)
    message = f"error: --no-int8-activations is for int4 and int8 weights on the CPU kernels: {why}"
    assert r.returncode == 2 and message in r.stderr
    assert "Traceback" not in r.stderr
