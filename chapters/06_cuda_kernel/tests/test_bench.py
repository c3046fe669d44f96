"""bench.py runs every part in miniature and saves its figures (timings are printed and saved, never
asserted), and stops the servers it starts, also when a part fails."""

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import peers
from common.tools.warm_python import start_python

REACHES = ["bench.py"]  # scripts run in a subprocess (common/tools/carried.py)

CHAPTER = Path(__file__).resolve().parents[1]
TINY = [
    "--model",
    "tiny-llama3",
    "--repeats",
    "1",
    "--threads",
    "1",
    "--kv-cache-memory-gb",
    "0.05",
    "--health-interval",
    "0.01",
]
# part kernels in miniature: short contexts, small matrices, few timed calls
SMALL_KERNELS = [
    "--contexts",
    "32,64",
    "--batches",
    "1,2",
    "--rows",
    "1,16",
    "--norm-rows",
    "1,4",
    "--linear-shapes",
    "qkv:64x64,head:256x64",
    "--calls",
    "3",
    "--min-seconds",
    "0",
]


def run(*args, timeout=240):
    """bench.py in a fork of the warm interpreter (it starts 2.5 s later into its life, torch
    imported), leading a process group of its own: on a timeout the whole group goes (servers
    included). -> (the completed process, whether its group is empty now that it has exited)."""
    with tempfile.TemporaryDirectory(prefix="bench-io-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = start_python(["bench.py", *args], cwd=CHAPTER, stdout=out, stderr=err)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"bench.py did not finish in {timeout} s")
        try:
            os.killpg(proc.pid, 0)  # anything left in its process group: a server it did not stop
            left = True
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            left = False
        completed = subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), err.read_text())
    return completed, not left


def test_bench_runs_every_part_and_saves_figures(tmp_path):
    out = tmp_path / "ch06.json"
    r, stopped = run(
        *TINY,
        *SMALL_KERNELS,
        "--prompt-tokens",
        "48",
        "--decode-tokens",
        "4",
        "--concurrency",
        "2",
        "--max-tokens",
        "6",
        "--peers",
        "llama.cpp",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert stopped, "a server outlived bench.py"
    result = json.loads(out.read_text())
    assert result["parts"] == ["kernels", "decode", "throughput"] and result["quant"] == "int4"
    assert result["machine"]["cores"] and result["threads"] == 1

    kr = result["kernels"]
    assert kr["device"] == "cpu" and kr["cpu_isa"] in ("scalar", "avx2", "avx512", "avx512_bf16")
    att = kr["attention"]
    assert [(a["batch"], a["context"]) for a in att] == [(1, 32), (1, 64), (2, 32), (2, 64)]
    for a in att:
        assert a["model"] == "SmolLM2-135M" and a["shape"] == [9, 3, 64]
        assert all(a["us"][k] > 0 for k in ("kernel", "ch05 gather+SDPA", "SDPA gathered"))
        assert a["gb_s"]["kernel"] > 0 and a["max_abs_diff"] < 0.05  # the kernel computes what SDPA does
    for op in ("add_rms_norm", "rope"):
        assert [x["rows"] for x in kr[op]] == [1, 4]
        assert all(x["us"]["kernel"] > 0 and x["us"]["torch"] > 0 for x in kr[op])
    lin = {(x["layer"], x["rows"]): x for x in kr["linear"]}
    assert set(lin) == {("qkv", 1), ("qkv", 16), ("head", 1), ("head", 16)}
    # from gemm_min_rows rows the library's linears are matrix products: their summary against the dense GEMM
    assert kr["gemm_min_rows"] == 16 and "from 16 rows the kernels are matrix products (cpu/gemm.cpp" in r.stdout
    # bf16 activations (the default): the bf16 matvec on the dense weight beside the dense GEMM, and
    # on an AVX512-BF16 CPU the int4 kernel also kept to AVX512 (its tiles without vdpbf16ps)
    with_bf16_dots = {"int4 kernel avx512"} if kr["cpu_isa"] == "avx512_bf16" else set()
    assert set(lin["qkv", 1]["us"]) == {
        "int4 kernel",
        "int4 torch",
        "int8 kernel",
        "int8 torch",
        "dense",
        "bf16 kernel",
    } | with_bf16_dots
    assert set(lin["head", 1]["us"]) == {"int8 kernel", "int8 torch", "dense", "bf16 kernel"}  # the LM head: int8 only
    assert lin["qkv", 1]["bytes"]["bf16 kernel"] == lin["qkv", 1]["bytes"]["dense"]
    assert lin["qkv", 1]["bytes"]["dense"] == 64 * 64 * 2  # bf16
    assert lin["qkv", 1]["bytes"]["int4 kernel"] == 64 * 32 + 2 * 64 * 2 * 2  # codes, float16 scale and min
    assert all(v > 0 for x in kr["linear"] for v in x["gb_s"].values())

    de = result["decode"]
    assert de["weights"] == ["int4", "bf16"] and de["decode_tokens"] == 4 and de["prompt_tokens"] >= 48
    expected = [
        f"{who} {w}{on}"
        for w in ("int4", "bf16")
        for who, on in (("ch06", " kernels on"), ("ch06", " kernels off"), ("ch06", " float x"), ("ch05", ""))
        if on != " float x" or w == "int4"  # int4 also --no-int8-activations, beside the default's int8 x
    ]
    if "ch05 int4" not in de["series"]:  # a copied chapter has no neighbour
        assert "[decode] chapter 05 is not beside this chapter" in r.stderr
        expected = [e for e in expected if not e.startswith("ch05")]
    assert list(de["series"]) == expected
    for s in de["series"].values():
        assert s["decode_tok_s"] > 0 and s["step_ms"] > 0 and s["ttft_ms"] > 0 and s["tok_s"] > 0
        assert len(s["decode_tok_s_runs"]) == 1 and 0 <= s["same_tokens_as_kernels_off"] <= 4
    assert de["series"]["ch06 int4 kernels off"]["same_tokens_as_kernels_off"] == 4
    assert de["ratios"]["int4: kernels on / off"] > 0 and de["ratios"]["bf16: kernels on / off"] > 0
    assert de["ratios"]["int4: int8 activations / float x"] > 0  # --no-int8-activations beside the default
    assert "bf16: int8 activations / float x" not in de["ratios"]  # bf16 weights: no integer product
    assert "smollm2-135m" in de["llama_cpp"]["skipped"] or "llama_cpp" in de["llama_cpp"]["skipped"]

    tp = result["throughput"]
    servers = ["ch06", "ch05"] if "ch05" in tp else ["ch06"]
    if "ch05" not in tp:
        assert "[throughput] chapter 05 is not beside this chapter" in r.stderr
    for label in servers:
        (row,) = tp[label]
        assert row["concurrency"] == 2 and row["tokens"] == 2 * 6 and row["finish"] == ["length"]
        assert row["tok_s"] > 0 and row["ttft_ms_p50"] > 0 and row["itl_ms_p50"] > 0
        assert row["kv_blocks_total"] > 0 and row["peak_kv_blocks_used"] is not None  # /health was watched
    command = result["servers"]["ch06"]["command"]
    assert "--kernels on" in command and "--quant int4" in command
    if "ch05" in tp:
        assert tp["ratio_ch06_ch05"]["2"] > 0 and "ch06 / ch05 aggregate tok/s at N=2" in r.stdout

    assert (tmp_path / "ch06.png").stat().st_size > 1000
    for title in ("paged decode attention", "add_rms_norm", "matmuls x @ W.T", "decode, batch 1", "throughput:"):
        assert title in r.stdout


@pytest.mark.skipif(
    peers.llama_cpp_available() is not None, reason=f"optional llama.cpp peer: {peers.llama_cpp_available()}"
)
def test_decode_beside_llama_cpp(tmp_path):
    out = tmp_path / "decode.json"
    r, _ = run(
        "--parts",
        "decode",
        "--peers",
        "llama.cpp",
        "--repeats",
        "1",
        "--threads",
        "1",
        "--prompt-tokens",
        "40",
        "--decode-tokens",
        "3",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    de = json.loads(out.read_text())["decode"]
    assert de["llama_cpp"]["version"] and "llama.cpp Q4_1" in de["series"] and "llama.cpp BF16" in de["series"]
    assert de["series"]["llama.cpp Q4_1"]["decode_tok_s"] > 0 and de["series"]["llama.cpp Q4_1"]["weights"] == "int4"
    assert de["ratios"]["int4: ch06 kernels on / llama.cpp Q4_1"] > 0
    assert "(goal >= 1.3x)" in r.stdout


def test_servers_are_stopped_when_a_part_fails(tmp_path):
    # more tokens than tiny-llama3's KV pool holds: the server answers 400 and the part fails with both servers up
    r, stopped = run(
        *TINY, "--parts", "throughput", "--concurrency", "1", "--max-tokens", "100000", "--out", str(tmp_path)
    )
    assert r.returncode != 0 and "HTTP 400" in r.stderr
    assert stopped, "a server outlived bench.py"
    assert not list(tmp_path.iterdir())


def test_unknown_part_is_a_clear_error():
    r, _ = run("--parts", "kernels,speed")
    assert r.returncode == 2 and "unknown part(s) speed" in r.stderr


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--budget-s", "nan", "must be a finite number of seconds, 0 or more, got nan"),  # measured on, unbounded
        ("--budget-s", "-1", "must be a finite number of seconds, 0 or more, got -1"),  # saved an empty table
        ("--max-num-seqs", "0", "must be at least 1, got 0"),  # the server's refusal, as a traceback
        ("--kv-cache-memory-gb", "nan", "must be a finite number above 0, got nan"),
    ],
)
def test_bad_values_are_usage_errors_before_anything_runs(flag, value, message):
    r, _ = run("--parts", "kernels", flag, value)
    assert r.returncode == 2 and f"argument {flag}: {message}" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_part_kernels_saves_each_case_as_it_is_measured_and_keeps_to_its_budget(tmp_path):
    # What slurm/gpu_check.sh relies on: a run its timeout stops still leaves what it measured.
    out = tmp_path / "k.json"
    args = [sys.executable, "bench.py", "--parts", "kernels", *SMALL_KERNELS, "--out", str(out)]
    proc = subprocess.Popen(args, cwd=CHAPTER, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stderr:
            if line.startswith("[kernels] attention"):
                proc.terminate()
                break
    finally:
        proc.communicate(timeout=60)
    partial = json.loads(out.read_text())
    assert partial["complete"] is False and len(partial["kernels"]["attention"]) >= 1

    # --kernel-cases keeps the two linear shapes of SMALL_KERNELS (slurm/gpu_check.sh times them on their own)
    r, _ = run("--parts", "kernels", *SMALL_KERNELS, "--kernel-cases", "linear", "--budget-s", "0", "--out", str(out))
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["complete"] is True and result["kernels"]["attention"] == []
    assert result["kernels"]["stopped"] == "--budget-s 0 spent: 2 of 2 cases not measured"
