"""tp_bench.py runs both parts in miniature and saves its figures (timings are printed and saved, never
asserted)."""

import json
from pathlib import Path

import pytest

from common.tools.warm_python import run_python

REACHES = ["tp_bench.py"]  # a script run in a subprocess (common/tools/carried.py)

CHAPTER = Path(__file__).resolve().parents[1]


def test_tp_bench_runs_both_parts_and_saves_figures(tmp_path):
    out = tmp_path / "tp"
    args = ["--calls", "50", "--cases", "tiny-llama3:2", "--batches", "1,2", "--new-tokens", "3", "--rounds", "2"]
    proc = run_python([str(CHAPTER / "tp_bench.py"), *args, "--out", str(out)], cwd=CHAPTER, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    # three ways (gloo, shared memory in Python and in the kernel library's C++) x rows 1, 16 x hidden 256, 576
    # x float32, bfloat16
    calls = result["allreduce_us"]
    assert len(calls) == 24 and {k.split()[0] for k in calls} == {"gloo", "shm", "shm-c++"}
    assert all(v > 0 for v in calls.values())
    per_batch = result["decode_tok_s"]["tiny-llama3 TP=2"]
    assert set(per_batch) == {"1", "2"}
    for rates in per_batch.values():  # every round has both engines' runs and their ratio
        assert set(rates) == {"TP=1", "TP=2", "ratio"} and all(len(v) == 2 for v in rates.values())
        assert all(x > 0 for v in rates.values() for x in v)
        assert rates["ratio"] == pytest.approx([n / one for n, one in zip(rates["TP=2"], rates["TP=1"])])
    assert "TP=2 / TP=1" in proc.stdout and result["quant"] == "int4"
    # One part again, with other weights: the decode part's figures stay, with the weights they had
    proc = run_python(
        [str(CHAPTER / "tp_bench.py"), "--parts", "allreduce", "--calls", "5", "--quant", "none", "--out", str(out)],
        cwd=CHAPTER,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads(out.with_suffix(".json").read_text())
    assert again["decode_tok_s"] == result["decode_tok_s"] and again["quant"] == "int4"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cases", "tiny-llama3"], "each case is model:N with N at least 2"),  # a ValueError
        (["--parts", "nothing"], "the parts are allreduce and decode"),  # wrote the JSON of nothing
    ],
)
def test_tp_bench_refuses_what_it_cannot_run(tmp_path, flags, message):
    proc = run_python([str(CHAPTER / "tp_bench.py"), *flags, "--out", str(tmp_path / "tp")], cwd=CHAPTER)
    assert proc.returncode == 2 and message in proc.stderr and not (tmp_path / "tp.json").exists()
