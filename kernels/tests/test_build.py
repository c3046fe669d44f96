"""The build: on-first-use messages, clear errors, run-time instruction-set choice, one OpenMP."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kernels
from kernels import build


def test_reports_what_it_built(ops):
    assert ops.cpu_isa() in ("scalar", "avx2", "avx512")
    r = subprocess.run([sys.executable, "-m", "kernels.build"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert f"cpu: {ops.best_cpu_isa()}" in r.stdout and "cuda: " in r.stdout


def test_aten_cpu_capability_caps_the_instruction_set():
    # The same variable that makes torch use another CPU's kernels makes ours do so too.
    code = "import kernels; print(kernels.load().cpu_isa())"
    for cap, expected in (("default", "scalar"), ("avx2", "avx2")):
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATEN_CPU_CAPABILITY": cap},
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        if cap == "avx2" and "scalar" in r.stdout:
            pytest.skip("this CPU has no AVX2")
        assert r.stdout.strip() == expected


def test_unknown_instruction_set_is_a_clear_error(ops):
    with pytest.raises(RuntimeError, match="unknown CPU instruction set sse9"):
        ops.set_cpu_isa("sse9")


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    # A fresh build folder (nothing built yet) and no compiler on PATH.
    monkeypatch.setenv("KERNELS_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-c++")
    monkeypatch.setattr(build, "_module", None)
    with pytest.raises(kernels.KernelBuildError, match="no C\\+\\+ compiler: `no-such-c\\+\\+` is not on PATH"):
        build.load()
    r = subprocess.run([sys.executable, "-m", "kernels.build"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KERNELS_BUILD_DIR": str(tmp_path), "CXX": "no-such-c++"})
    assert r.returncode == 2 and "Traceback" not in r.stderr and "apt install g++" in r.stderr, r.stderr


def test_one_openmp_runtime(ops):
    # Ours must share torch's thread pool: a second libgomp would keep its own threads spinning.
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps on this OS")
    gomp = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line}
    assert len(gomp) <= 1, gomp
