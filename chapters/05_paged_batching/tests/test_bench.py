"""bench.py runs every part and saves its figures (timings are printed and saved, never asserted),
and stops the servers it starts, also when a part fails."""

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from common.tools.warm_python import start_python

REACHES = ["bench.py"]  # scripts run in a subprocess (common/tools/carried.py)

CHAPTER = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8
SMALL = [
    "--model",
    "tiny-llama3",
    "--dtype",
    "float32",
    "--max-tokens",
    str(MAX_TOKENS),
    "--repeats",
    "1",
    "--kv-cache-memory-gb",
    "0.05",
    "--long-prompt-tokens",
    "300",
    "--system-prompt-tokens",
    "200",
    "--stream-tokens",
    "256",
    "--warm-tokens",
    "4",
    "--engine-prompts",
    "4",
    "--decode-steps",
    "4",
    "--health-interval",
    "0.01",
    "--memory-max-tokens",
    "24",
    # one torch thread here and in each server (bench.py's default is every core): `make test` runs
    # two suites side by side on two cores, where a two-thread team waits on a descheduled sibling
    "--threads",
    "1",
]  # tiny-llama3's requests are short: poll /health often enough to see them


def run(*args, timeout=300):
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
    out = tmp_path / "ch05.json"
    r, stopped = run(*SMALL, "--concurrency", "1,2", "--ch04-concurrency", "1,2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert stopped, "a server outlived bench.py"
    result = json.loads(out.read_text())
    assert (
        result["machine"]["cores"]
        and result["threads"] == 1
        and result["parts"] == ["throughput", "engine", "chunked", "prefix", "memory"]
    )

    tp = result["throughput"]
    # chapter 04's server runs when chapter 04 sits beside this one (a copied chapter has no neighbour)
    servers = ["ch05", "ch04"] if tp["ch04"] else ["ch05"]
    if not tp["ch04"]:
        assert "chapter 04 is not beside this chapter" in r.stderr
    for label in servers:
        assert [row["concurrency"] for row in tp[label]] == [1, 2]
        for row in tp[label]:
            n = row["concurrency"]
            assert row["tokens"] == n * MAX_TOKENS and row["finish"] == ["length"]  # ignore_eos: all of them
            assert row["tok_s"] > 0 and row["ttft_ms_p50"] > 0 and row["itl_ms_p50"] > 0
            assert len(row["prompt_tokens"]) == n and all(p > 10 for p in row["prompt_tokens"])
    for row in tp["ch05"]:  # the ch05 server's /health was watched while it ran
        assert row["peak_kv_blocks_used"] > 0 and row["peak_running"] >= 1 and row["kv_blocks_total"] > 0
    if tp["ch04"]:
        assert tp["ratio_ch05_ch04"]["concurrency"] == 2 and tp["ratio_ch05_ch04"]["ratio"] > 0
        assert "ch05 / ch04 aggregate tok/s at N=2" in r.stdout

    en = result["engine"]
    assert en["ch05_tokens"] == en["hf_tokens"] == 4 * MAX_TOKENS
    assert en["ch05_tok_s"] > 0 and en["hf_tok_s"] > 0 and en["ratio_ch05_hf"] > 0
    assert en["decode_step_ms"]["1"] > 0 and en["decode_step_ms"]["4"] > 0 and en["step_ratio"] > 0

    ch = result["chunked"]
    for mode in ("chunked", "unchunked"):
        assert ch[mode]["long_ttft_ms"] > 0 and ch[mode]["itl_before_ms_p50"] > 0
        assert ch[mode]["gaps_during"] >= 1 and ch[mode]["itl_during_ms_max"] > 0  # the streams ran through it
        assert all(run["long_prompt_tokens"] == 300 for run in ch[mode]["runs"])

    px = result["prefix"]
    assert px["hit_rate"] > 0 and px["hit_rate_uncached_server"] == 0 and px["kv_blocks_cached"] > 0
    assert px["ttft_ms_cached_first"] > 0 and px["ttft_ms_cached_second"] > 0 and px["ttft_ms_uncached_second"] > 0
    assert all(p > 200 for p in px["prompt_tokens"])

    mem = result["memory"]
    assert mem["kv_bytes_per_token"] == 2 * 4 * 2 * 32 * 4  # tiny-llama3: K and V, 4 layers, 2 heads of 32, fp32
    lengths = list(zip(mem["prompt_tokens"], mem["generated_tokens"]))
    assert len(lengths) == mem["requests"] and all(1 <= g <= mem["max_tokens"] for _, g in lengths)
    assert mem["tokens_held"] == sum(p + g for p, g in lengths)
    paged, ch04, reserve, static = (
        mem["schemes"][k] for k in ("paged", "ch04_growing", "reserve_max_tokens", "static_padded")
    )
    # paged holds each sequence to the end of its last block: under one block more than it uses
    assert mem["tokens_held"] <= paged["slots"] < mem["tokens_held"] + 16 * mem["requests"]
    assert paged["bytes"] == paged["slots"] * mem["kv_bytes_per_token"]
    assert reserve["slots"] == sum(p + mem["max_tokens"] for p, _ in lengths) >= ch04["slots"]
    assert static["slots"] >= reserve["slots"] and 0 < static["used"] <= reserve["used"] <= 1

    assert (tmp_path / "ch05.png").stat().st_size > 1000
    assert "throughput: chat" in r.stdout and "prefix caching" in r.stdout and "KV memory" in r.stdout


def test_servers_are_stopped_when_a_part_fails(tmp_path):
    # streams of 2 tokens end before the long prompt can be sent: the part fails with servers running
    r, stopped = run(*SMALL, "--parts", "chunked", "--stream-tokens", "2", "--out", str(tmp_path))
    assert r.returncode != 0 and "raise --stream-tokens" in r.stderr
    assert stopped, "a server outlived bench.py"
    assert not list(tmp_path.iterdir())


def test_unknown_part_is_a_clear_error():
    r, _ = run("--parts", "throughput,speed")
    assert r.returncode == 2 and "unknown part(s) speed" in r.stderr
