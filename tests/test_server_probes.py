"""bench/server_probes.py: a probe's figures say which server they came from, a run of one probe
keeps the others' with theirs, and a probe that is not one is refused before a server starts."""

from __future__ import annotations

import json
from pathlib import Path

from common.tools.testing import SERVER_STACK, require
from common.tools.warm_python import run_python

require(*SERVER_STACK)
REPO = Path(__file__).resolve().parents[1]


def test_the_long_stop_probe_reaches_the_stop_limit_and_keeps_the_other_probes_figures(tmp_path):
    out = tmp_path / "probes.json"
    kept = {"chapter": 3, "flood": {"served": 10, "of": 10, "server": "an earlier server"}}
    out.write_text(json.dumps(kept))
    args = ["--chapter", "3", "--model", "tiny-llama3", "--probes", "long_stop", "--out", str(out)]
    r = run_python(["bench/server_probes.py", *args], cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    # a stop string the body limit lets in, refused by the stop strings' own limit (not a 413)
    assert result["long_stop"]["status"] == 400 and "stop strings must be at most" in result["long_stop"]["message"]
    assert result["long_stop"]["server"].startswith("chapters/03_sampling_server/server.py --model tiny-llama3")
    assert result["flood"] == kept["flood"]


def test_a_probe_that_is_not_one_is_refused(tmp_path):
    r = run_python(["bench/server_probes.py", "--probes", "flod", "--out", str(tmp_path / "p.json")], cwd=REPO)
    assert r.returncode == 2 and "--probes: no probe 'flod'; there are big_bodies" in r.stderr
    assert not (tmp_path / "p.json").exists()
