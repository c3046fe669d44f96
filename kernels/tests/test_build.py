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
    # What `python -m kernels.build` then says of the CUDA half (it fell over on a None reason)
    monkeypatch.setattr(sys, "argv", ["kernels.build"])
    assert build.main() == 0
    assert "  cuda: not built: its build failed (above)" in capsys.readouterr().out.splitlines()


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


def _fake_compile(monkeypatch, tmp_path, outcome):
    """build._build with cpp_extension.load replaced by `outcome(folder)` (no compiler runs), into
    its own KERNELS_BUILD_DIR. -> (the build folder, the plan's stamp)."""
    from torch.utils import cpp_extension

    kernels.load()  # the real build, loaded before the variable moves: `outcome` may hand it back
    monkeypatch.setenv("KERNELS_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_check_tools", lambda: None)
    monkeypatch.setattr(cpp_extension, "load", lambda name, *a, build_directory, **kw: outcome(Path(build_directory)))
    plan = build._build_plan(False)
    return plan.folder, plan.stamp


def test_a_failed_build_leaves_no_stamp_to_vouch_for_the_old_module(monkeypatch, tmp_path):
    # The stamp of the sources before stayed: reverted to them, the sources matched it again and the
    # .so a failed build left was imported (an ImportError on every run, or old code silently).
    def failing(folder):
        raise RuntimeError("error: boom")

    folder, stamp = _fake_compile(monkeypatch, tmp_path, failing)
    folder.mkdir(parents=True)
    (folder / build.STAMP).write_text("0" * 64)  # an earlier build's
    with pytest.raises(build.KernelBuildError, match="building kernels/ failed .*\nerror: boom"):
        build._build(False, verbose=False)
    assert not (folder / build.STAMP).exists()


def test_a_stamped_module_that_does_not_import_is_built_again(monkeypatch, tmp_path):
    built = []
    folder, stamp = _fake_compile(monkeypatch, tmp_path, lambda folder: built.append(folder) or kernels.load())
    folder.mkdir(parents=True)
    (folder / "llm_kernels_cpu.so").write_bytes(b"not an ELF file")
    (folder / build.STAMP).write_text(stamp)
    assert build._build(False, verbose=False) is kernels.load() and built == [folder]
    assert (folder / build.STAMP).read_text() == stamp


def test_a_lock_left_by_a_killed_build_does_not_stall_the_next(monkeypatch, tmp_path):
    # cpp_extension's lock file outlives a build killed by SIGKILL, the OOM killer or a time limit:
    # the next build waited for it forever.
    seen = []
    def build_seeing_the_lock(folder):
        seen.append((folder / "lock").exists())
        return kernels.load()

    folder, _ = _fake_compile(monkeypatch, tmp_path, build_seeing_the_lock)
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")
    build._build(False, verbose=False)
    assert seen == [False]


def test_two_builds_at_once_take_turns(tmp_path):
    # The second waits for the first's flock (which a dying process gives back), then builds.
    code = (
        "import fcntl, sys, time; from pathlib import Path; from kernels import build\n"
        "folder = Path(sys.argv[1])\n"
        "with build._folder_lock(folder):\n"
        "    print(time.monotonic(), flush=True); time.sleep(1.0); print(time.monotonic(), flush=True)\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    spans = sorted(tuple(map(float, p.communicate(timeout=60)[0].split())) for p in procs)
    assert spans[0][1] <= spans[1][0], spans  # one after the other, never both inside


def test_a_source_whose_bytes_changed_loses_its_object_whatever_its_time(tmp_path):
    # ninja goes by modification times: a source restored from a copy with its old time was older
    # than its object, and the edited object stayed in the module.
    files = build.sources(with_cuda=False)
    record = build._drop_stale_objects(tmp_path, files)
    (tmp_path / build.OBJECTS).write_text(__import__("json").dumps(record | {"cpu/isa.cpp": "0" * 64}))
    for f in files:
        (tmp_path / f"{f.stem}.o").write_text("")
    build._drop_stale_objects(tmp_path, files)
    assert sorted(p.name for p in tmp_path.glob("*.o")) == sorted(f"{f.stem}.o" for f in files if f.name != "isa.cpp")


def test_an_unwritable_build_folder_is_one_line(monkeypatch, tmp_path):
    def refuse(*a, **kw):
        raise PermissionError(13, "Permission denied")

    _fake_compile(monkeypatch, tmp_path, lambda folder: kernels.load())
    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(build.KernelBuildError, match="cannot write the build folder .* set KERNELS_BUILD_DIR"):
        build._build(False, verbose=False)


def test_an_empty_build_dir_variable_means_the_default(monkeypatch):
    monkeypatch.setenv("KERNELS_BUILD_DIR", "")
    assert build.build_root() == build.HERE / "build"



def test_ninja_from_its_python_package_is_found_or_named(monkeypatch, tmp_path):
    import types

    program = tmp_path / "user-bin" / "ninja"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(build.shutil, "which", lambda name, real=build.shutil.which: "/usr/bin/c++" if name != "ninja" else real(name))
    # a --user install: the package's BIN_DIR names the folder
    monkeypatch.setitem(sys.modules, "ninja", types.SimpleNamespace(BIN_DIR=str(program.parent), __file__="x"))
    build._check_tools()
    assert os.environ["PATH"].split(os.pathsep)[0] == str(program.parent)
    # `pip install --target DIR` leaves the program in DIR/bin and BIN_DIR empty: named, not a
    # failure of torch's builder later
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setitem(sys.modules, "ninja", types.SimpleNamespace(BIN_DIR="", __file__="/t/ninja/__init__.py"))
    monkeypatch.setattr(build.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(build.KernelBuildError, match=r"ninja's Python package is installed \(/t/ninja/__init__.py\) but"):
        build._check_tools()
