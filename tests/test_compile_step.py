"""bench/compile_step.py compiles the newest chapter's static decode step with torch.compile (the
kernels as opaque operators), times it beside the same step run eagerly, and checks both decode the
same tokens."""

from __future__ import annotations

import json
from pathlib import Path

from common.tools.chapters import newest_chapter
from common.tools.warm_python import run_python

REPO = Path(__file__).resolve().parents[1]


def test_the_compiled_step_decodes_what_the_eager_one_does(tmp_path):
    out = tmp_path / "c.json"
    args = ["--model", "tiny-llama3", "--quant", "none", "--dtype", "float32", "--prompt-tokens", "9"]
    # one torch thread (the script's default is two): `make test` runs two suites side by side on two
    # cores, where a two-thread team waits on a descheduled sibling
    args += ["--threads", "1"]
    r = run_python(["bench/compile_step.py", *args, "--rounds", "2", "--steps", "3", "--out", str(out)], cwd=REPO)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert (
        result["same_tokens"] is True and result["tokens"] == 9 + 2 + 1 + 2 + 2 * 3
    )  # prompt, warm-up, compile, warm-up, rounds
    assert result["compile_s"] > 0 and all(len(v) == 2 for v in result["ms_per_step"].values())
    assert "compiled / eager:" in r.stdout and "loop / eager:" in r.stdout
    assert result["args"]["chapter"] == newest_chapter() and f"chapter {newest_chapter():02d}," in r.stdout
    assert set(result["ms_per_step"]) == {"eager", "loop", "compiled"}
