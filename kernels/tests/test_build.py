"""The build: on-first-use messages, clear errors, run-time instruction-set choice, one OpenMP."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kernels
from kernels import build


def test_reports_what_it_built(ops):
    assert ops.cpu_isa() in ("scalar", "avx2", "avx512", "avx512_bf16")
    r = subprocess.run([sys.executable, "-m", "kernels.build"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert f"cpu: {ops.best_cpu_isa()}" in r.stdout and "cuda: " in r.stdout


def test_module_entry_runs_without_runpy_warning():
    # `import kernels` must not import kernels.build, or runpy warns that the module it is about
    # to run as __main__ is already in sys.modules (and the two copies would differ).
    r = subprocess.run([sys.executable, "-m", "kernels.build", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "usage: python -m kernels.build" in r.stdout, r.stderr
    assert "RuntimeWarning" not in r.stderr, r.stderr


def test_aten_cpu_capability_caps_the_instruction_set():
    # The same variable that makes torch use another CPU's kernels makes ours do so too.
    code = "import kernels; print(kernels.load().cpu_isa())"
    for cap, expected in (("default", "scalar"), ("avx2", "avx2"), ("avx512", "avx512")):
        r = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "ATEN_CPU_CAPABILITY": cap},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr
        if cap == "avx2" and "scalar" in r.stdout:
            pytest.skip("this CPU has no AVX2")
        if cap == "avx512" and r.stdout.strip() == "avx2":
            break  # this CPU has no AVX512
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
    r = subprocess.run(
        [sys.executable, "-m", "kernels.build"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KERNELS_BUILD_DIR": str(tmp_path), "CXX": "no-such-c++"},
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and "apt install g++" in r.stderr, r.stderr


def test_one_openmp_runtime(ops):
    # Ours must share torch's thread pool: a second libgomp would keep its own threads spinning.
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps on this OS")
    gomp = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line}
    assert len(gomp) <= 1, gomp


def test_a_copy_with_the_same_sources_loads_the_build_without_compiling(ops, tmp_path):
    # What a copied chapter does (tests/test_copy_chapter.py): its own kernels/ package, the same
    # bytes, pointed at this build. No compiler may run: CXX names none, and a build would fail.
    import shutil

    shutil.copytree(build.HERE, tmp_path / "kernels", ignore=shutil.ignore_patterns("build", "__pycache__"))
    code = "import kernels; m = kernels.load(); print(m.__file__, kernels.__file__)"
    env = {**os.environ, "KERNELS_BUILD_DIR": str(build.build_root()), "CXX": "no-such-c++"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "building" not in r.stderr, r.stderr
    built, package = r.stdout.split()
    assert built == ops.__file__ and package == str(tmp_path / "kernels" / "__init__.py")
    # One changed byte in any source is another build: the stamp no longer matches.
    source = tmp_path / "kernels" / "csrc" / "cpu" / "isa.cpp"
    source.write_bytes(source.read_bytes() + b"\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no C++ compiler" in r.stderr, r.stderr


def test_the_fingerprint_covers_sources_headers_and_flags():
    files = build.sources(with_cuda=False)
    base = build.fingerprint(files, ["-O3"])
    assert build.fingerprint(files, ["-O2"]) != base
    assert build.fingerprint(files[:-1], ["-O3"]) != base
    assert base == build.fingerprint(list(reversed(files)), ["-O3"])


@pytest.mark.parametrize(
    "spec, archs",
    [
        ("8.0;9.0+PTX", [(8, 0, False), (9, 0, True)]),
        ("7.5 8.6", [(7, 5, False), (8, 6, False)]),
        ("10.0+PTX", [(10, 0, True)]),
        ("9.0a", [(9, 0, False)]),  # sm_90a: the plain sm_90 code these kernels need
    ],
)
def test_torch_cuda_arch_list_is_honoured(monkeypatch, spec, archs):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", spec)
    assert build.cuda_archs() == archs


def test_without_the_variable_or_a_gpu_a_login_node_builds_a100_h100_and_ptx(monkeypatch):
    import torch

    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    archs = build.cuda_archs()
    assert archs == [(8, 0, False), (9, 0, True)]
    assert build.gencode_flags(archs) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]


def test_a_bad_arch_list_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "ampere")
    with pytest.raises(kernels.KernelBuildError, match="'ampere' is not an architecture like 8.0"):
        build.cuda_archs()


def test_which_gpus_a_build_runs_on():
    a100_h100_ptx = [(8, 0, False), (9, 0, True)]
    assert build.runs_on((8, 0), a100_h100_ptx) and build.runs_on((8, 6), a100_h100_ptx)  # same major
    assert build.runs_on((9, 0), a100_h100_ptx) and build.runs_on((10, 0), a100_h100_ptx)  # Blackwell: the PTX
    assert not build.runs_on((7, 5), a100_h100_ptx) and not build.runs_on((7, 0), a100_h100_ptx)  # T4, V100
    assert not build.runs_on((10, 0), [(8, 0, False), (9, 0, False)])  # machine code only


def test_gpu_not_covered_names_the_build_and_the_fix(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    module = type("Built", (), {"cuda_archs": [(8, 0, False), (9, 0, True)]})
    why = build.gpu_not_covered(module, "cuda")
    assert "built for sm_80, sm_90 +PTX, not this GPU's sm_75" in why and 'TORCH_CUDA_ARCH_LIST="7.5"' in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert build.gpu_not_covered(module, "cuda") is None


def test_a_failed_cuda_half_still_gives_the_cpu_half(monkeypatch, capsys):
    # Where nvcc fails (an unsupported toolkit, a compiler error), the CPU kernels still load.
    cpu_half = build.load()  # built already: the import below reuses it
    if cpu_half.with_cuda:
        pytest.skip(
            "kernels/ has its CUDA half here: a CPU-only build would register the same torch ops again in "
            "this process (an abort); the fallback is checked where kernels/ is CPU-only, as on CI"
        )
    monkeypatch.setattr(build, "_module", None)
    monkeypatch.setattr(build, "cuda_build_possible", lambda: None)
    real = build._build

    def failing_cuda(with_cuda, verbose, werror):
        if with_cuda:
            raise kernels.KernelBuildError("building kernels/ failed (nvcc: unsupported gpu architecture)")
        return real(with_cuda, verbose, werror)

    monkeypatch.setattr(build, "_build", failing_cuda)
    module = build.load()
    assert module.__file__ == cpu_half.__file__ and not module.with_cuda
    assert "the CUDA half failed to build; building the CPU half alone" in capsys.readouterr().err


def test_werror_checked_says_whether_the_build_in_place_compiled_with_the_warnings(monkeypatch, tmp_path):
    monkeypatch.setenv("KERNELS_BUILD_DIR", str(tmp_path))
    with_cuda = build.cuda_build_possible() is None
    folder, stamp = build.build_dir(with_cuda), build._build_plan(with_cuda).stamp
    assert "no build of these sources" in build.werror_checked()
    folder.mkdir(parents=True)
    (folder / build.STAMP).write_text(stamp)
    assert "built without -Wall -Wextra -Werror" in build.werror_checked()
    (folder / build.WERROR_STAMP).write_text("0" * 64)  # checked, but other sources
    assert "built without" in build.werror_checked()
    (folder / build.WERROR_STAMP).write_text(stamp)
    assert build.werror_checked() is None
    (folder / build.STAMP).write_text("0" * 64)  # the sources changed since
    assert "no build of these sources" in build.werror_checked()
