"""slurm/'s GPU scripts where there is no GPU: what they can show without one."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "slurm" / "gpu_decode_bench.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("gpu_decode_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "name, gbs",
    [
        ("NVIDIA H100 PCIe", 2000),
        ("NVIDIA H100 80GB HBM3", 3350),
        ("NVIDIA H100 NVL", 3900),
        ("NVIDIA H200", 4800),
        ("NVIDIA A100-SXM4-80GB", 2039),
        ("NVIDIA A100 80GB PCIe", 1935),
        ("NVIDIA A100-PCIE-40GB", 1555),
        ("Tesla T4", None),
    ],
)
def test_the_nominal_bandwidth_is_the_named_models_not_its_family(name, gbs):
    assert load_bench().nominal_gbs(name) == gbs


def test_without_common_on_the_path_it_says_how_to_run_it(tmp_path, hiding):
    # A bare machine: python with torch, the repository, no `make setup`. Hiding `common` stands
    # in for the editable install this venv has.
    path = hiding("common")
    r = subprocess.run(
        [sys.executable, str(BENCH)],
        cwd=tmp_path,
        env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "PYTHONPATH=. (slurm/gpu_check.sh does)" in r.stderr
