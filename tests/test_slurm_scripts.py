"""slurm/'s GPU scripts where there is no GPU: what they can show without one."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "slurm" / "gpu_decode_bench.py"
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


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


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    """slurm/pack_gpu_check.sh's folder for this machine's Python (pip downloads the wheels: a package
    registry is needed)."""
    out = tmp_path_factory.mktemp("pack") / "gpu-pack"
    r = subprocess.run(
        ["bash", str(REPO / "slurm" / "pack_gpu_check.sh"), str(out)],
        cwd=REPO,
        env=os.environ | {"PACK_PYTHON": PYTHON},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def test_the_pack_holds_what_a_bare_torch_machine_lacks_in_40_mib(pack):
    wheels = {p.name.split("-")[0].lower() for p in (pack / "wheels").glob("*.whl")}
    # The server stack and its compiled parts (built for PACK_PYTHON), and gguf.
    assert {"fastapi", "uvicorn", "pydantic", "pydantic_core", "openai", "jiter", "starlette", "gguf"} <= wheels
    assert "numpy" not in wheels and "torch" not in wheels
    cp = "cp" + PYTHON.replace(".", "")
    assert all(f"{cp}-{cp}" in p.name or "py3-none" in p.name for p in (pack / "wheels").glob("*.whl"))
    assert (pack / "tokenizer" / "tokenizer.json").is_file() and (
        pack / "tokenizer" / "tokenizer_config.json"
    ).is_file()
    listing = subprocess.run(["tar", "tzf", str(pack / "repo.tar.gz")], capture_output=True, text=True).stdout
    assert "slurm/gpu_check.sh" in listing.split() and "models/" not in listing
    assert sum(p.stat().st_size for p in pack.rglob("*") if p.is_file()) <= 40 * 2**20


def test_gpu_check_without_a_gpu_uses_the_pack_and_says_no_gpu(pack, tmp_path):
    # No models here: tiny-llama3 comes from the pack's tokenizer files, as on a bare GPU machine.
    env = os.environ | {"GPU_CHECK_PACK": str(pack), "MODELS_DIR": str(tmp_path / "models"), "OUT": str(tmp_path)}
    env.pop("TOKENIZER_DIR", None)
    r = subprocess.run(
        ["bash", str(REPO / "slurm" / "gpu_check.sh")], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "summary" in r.stdout and "no GPU here" in r.stdout, r.stdout
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert any("wheels from" in p and "installed offline" in p for p in parts), parts
    assert any(p.startswith("tiny-llama3 made on the spot") for p in parts), parts
    assert (tmp_path / "models" / "tiny-llama3" / "config.json").is_file()
    assert not any("FAILED" in p for p in parts), parts
