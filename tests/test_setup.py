"""`make setup`: its venv recipe (run with a stand-in python that records what it is asked to do), its models."""

import functools
import os
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FAKE_PYTHON = """#!/bin/bash
echo "$*" >> "$(dirname "$0")/../calls"
case "$*" in *"torch.version.cuda"*) exit 1 ;; esac  # the torch here is not a CUDA build
exit 0
"""


def make_venv(tmp_path: Path, *variables: str) -> list[str]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    (venv / "calls").unlink(missing_ok=True)
    r = subprocess.run(
        ["make", "--no-print-directory", f"VENV={venv}", *variables, f"{venv}/.stamp"],
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "TORCH_INDEX_URL"},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    calls = venv / "calls"
    return calls.read_text().splitlines() if calls.exists() else []


def test_torch_index_url_puts_the_cuda_build_in_before_the_pinned_requirements(tmp_path):
    pin = next(line for line in (REPO / "requirements.txt").read_text().splitlines() if line.startswith("torch=="))
    url = "https://download.pytorch.org/whl/cu128"
    calls = make_venv(tmp_path, f"TORCH_INDEX_URL={url}")
    cuda = calls.index(f"-m pip install -q --no-compile {pin} --index-url {url}")
    assert "-m pip uninstall -q -y torch" in calls[:cuda]  # the CPU build goes first
    assert calls.index("-m pip install -q --no-compile -r requirements.txt") > cuda
    assert make_venv(tmp_path, f"TORCH_INDEX_URL={url}") == []  # set up: nothing to do
    assert any(
        "--index-url https://example.org/whl" in c
        for c in make_venv(tmp_path, "TORCH_INDEX_URL=https://example.org/whl")
    )


def test_without_it_pip_takes_torch_from_requirements_alone(tmp_path):
    calls = make_venv(tmp_path)
    assert not any("--index-url" in c or "uninstall" in c for c in calls)
    assert "-m pip install -q --no-compile -r requirements.txt" in calls


def make_dry_run(tmp_path: Path, *args: str) -> list[str]:
    """The lines `make -n` prints for `args`, with KERNELS_MADE at tmp_path/.made (a library never built
    unless the test makes that file) and without the variables of a make this test may run under
    (make test's own: KERNELS_BUILD_FLAGS).
    Never `make -n test`: make runs a recipe line that calls $(MAKE) even under -n."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "KERNELS_BUILD_FLAGS")}
    r = subprocess.run(["make", "-n", f"KERNELS_MADE={tmp_path / '.made'}", *args], cwd=REPO, capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_setup_asks_for_a_kernels_build_only_when_a_library_source_changed(tmp_path):
    (tmp_path / ".made").touch()  # newer than every source: the library was built after the last change

    def dry_run(*args):
        return any("-m kernels.build" in line for line in make_dry_run(tmp_path, *args, "setup"))

    assert not dry_run()
    assert dry_run("-W", "kernels/csrc/kernels.h")  # as if just edited
    assert dry_run("-W", "kernels/csrc/cuda/paged_attention.cu")
    assert not dry_run("-W", "kernels/csrc/emulator/emu.cpp")  # the test tool is not the library


def test_make_test_builds_with_werror_and_its_cpp_check_asks_the_build_first(tmp_path):
    dry_run = functools.partial(make_dry_run, tmp_path)
    # make test passes its suites --werror for the build (the database: the recipe as written)
    database = dry_run("-p", "help")
    start = database.index("test:")
    test_recipe = "\n".join(database[start + 1 : database.index("", start)])
    assert "$(addprefix suite-,$(SUITES))" in test_recipe and "KERNELS_BUILD_FLAGS=--werror" in test_recipe, test_recipe
    # its setup then builds a library never built here with the warnings as errors, and the C++
    # check compiles only where the build did not
    lines = dry_run("KERNELS_BUILD_FLAGS=--werror", "suite-kernels-cpu-check")
    assert any("-m kernels.build --werror ||" in line for line in lines), lines
    check = next(line for line in lines if "cpu/check_compile.sh" in line)
    assert "-m kernels.build --werror-checked || " in check
    # make run's setup builds as before
    lines = dry_run("setup")
    assert any("-m kernels.build " in line for line in lines) and not any("--werror" in line for line in lines)


def test_the_kernel_suites_start_without_the_models(tmp_path):
    # They need the venv and the library only: under make test they run beside the model step.
    for suite in ("suite-kernels", "suite-kernels-cpu-check"):
        lines = "\n".join(make_dry_run(tmp_path, suite))  # (their recipes call no $(MAKE))
        assert "-m kernels.build" in lines and "common.prepare_models" not in lines, lines
    assert "common.prepare_models" in "\n".join(make_dry_run(tmp_path, "suite-00_setup"))


def test_tiny_llama3_is_not_made_by_a_transformers_that_would_drop_its_rope(monkeypatch, tmp_path):
    import transformers

    from common.prepare_models import prepare_tiny_llama3

    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    with pytest.raises(SystemExit, match="tiny-llama3 needs transformers 5 .*this Python has 4.57.1"):
        prepare_tiny_llama3(tmp_path / "tiny", tmp_path)
    assert not (tmp_path / "tiny").exists()


@pytest.mark.parametrize("value, where", [("", "models"), ("elsewhere", "elsewhere")])
def test_models_dir_set_but_empty_means_the_default(value, where, tmp_path):
    # MODELS_DIR= (set, empty) was read as the current folder: "model 'smollm2-135m' is not prepared at smollm2-135m"
    import sys

    repo = Path(__file__).resolve().parents[1]
    code = "from common.models import MODELS_DIR; print(MODELS_DIR)"
    env = {**os.environ, "MODELS_DIR": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()) == (repo / "models" if where == "models" else Path(where))
