"""A reader copies the newest chapter, common/ and kernels/ out of the repository as the start of
their own engine: it must run and pass its own tests there, on the copy's own common/ and kernels/
(ARCHITECTURE.md's recipe installs them, `pip install -e .`), with no sys.path edits."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from common.models import MODELS_DIR
from kernels.build import build_root

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((REPO / "chapters").glob("[0-9][0-9]_*"))
NEWEST = CHAPTERS[-1]


def copy_out(tmp_path: Path) -> Path:
    root = tmp_path / "my_engine"
    ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache")
    shutil.copytree(REPO / "common", root / "common", ignore=ignore)
    shutil.copytree(REPO / "kernels", root / "kernels", ignore=shutil.ignore_patterns("__pycache__", "build"))
    shutil.copytree(NEWEST, root / NEWEST.name, ignore=ignore)
    return root


def clean_env(root: Path) -> dict:
    """This environment with the copy's root first on PYTHONPATH: what its own `pip install -e .`
    gives, without a venv of its own (this one's editable install would otherwise import the
    repository's common/ and kernels/, and a file the copy lacks would go unnoticed). MODELS_DIR says
    where the prepared models are, as a reader with a copy would set it (the copy has no models/ of
    its own). KERNELS_BUILD_DIR points at the repository's build of kernels/: the copy's sources
    are the same bytes, so it loads that build instead of compiling its own (a minute), as a copy
    with changed sources would not."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        PYTHONPATH=str(root),
        MODELS_DIR=str(MODELS_DIR),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        KERNELS_BUILD_DIR=str(build_root()),
    )
    return env


def test_entry_points_do_not_edit_sys_path():
    # Not even conftest.py: pytest itself puts a chapter's conftest folder first on sys.path.
    offenders = [
        str(p.relative_to(REPO))
        for p in REPO.glob("chapters/*/**/*.py")
        if re.search(r"sys\.path\s*(\[|\.insert|\.append|=)", p.read_text())
    ]
    assert not offenders, f"sys.path edited in {offenders}"


def test_copied_chapter_answers_a_chat_prompt(tmp_path):
    root = copy_out(tmp_path)
    r = subprocess.run(
        [
            sys.executable,
            "generate.py",
            "--chat",
            "--prompt",
            "What is the capital of France?",
            "--max-new-tokens",
            "12",
            "--dtype",
            "float32",
        ],
        cwd=root / NEWEST.name,
        env=clean_env(root),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_copied_chapter_says_where_models_are_looked_for(tmp_path):
    root = copy_out(tmp_path)
    env = clean_env(root) | {"MODELS_DIR": str(tmp_path / "no_models")}
    r = subprocess.run(
        [sys.executable, "generate.py", "--model", "tiny-llama3"],
        cwd=root / NEWEST.name,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "MODELS_DIR" in r.stderr and "common.prepare_models" in r.stderr


def test_copied_chapter_passes_its_own_tests(tmp_path):
    root = copy_out(tmp_path)
    # The copy's own common/ and kernels/ are the ones imported, from its chapter's folder too (where
    # its scripts and the servers its tests start run); tests that compare with another chapter skip.
    code = "import common, kernels; print(common.__file__, kernels.__file__)"
    env = clean_env(root)
    where = subprocess.run([sys.executable, "-c", code], cwd=root / NEWEST.name, env=env, capture_output=True, text=True)
    own = [str(root / "common" / "__init__.py"), str(root / "kernels" / "__init__.py")]
    assert where.stdout.split() == own, where
    # Every test module of the copy must import there, and the tests that reach what a copy
    # changes run: the kernels it loads, a server it starts as a subprocess (two requests are
    # enough to show it serves), the engine beside the comparisons that must skip. The rest of the
    # chapter's suite ran in its own `make test` step on the same bytes. One pytest run does both:
    # it collects the whole folder (a module that does not import is a collection error, and the
    # run fails) and runs, by name (-k), the engine on kernels/ loaded from the shared build (tiny
    # model), a comparison with chapter 05 that must skip (it is not there), the components, and the
    # server.
    picked = (
        "test_kernels_engine.py::test_padded_static_decode_steps_equal_the_eager_engine",
        "test_kernels_engine.py::test_greedy_output_equals_chapter_05_on_every_test_prompt",
        "test_components.py",
        "test_server.py::test_models_and_health",
        "test_server.py::test_chat_streaming_equals_non_streaming_and_reports_usage",
    )
    names = [t.split("::")[-1] for t in picked if (NEWEST / "tests" / t.split("::")[0]).exists()]
    select = ["-k", " or ".join(names)] if names else []
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *select, NEWEST.name],
        cwd=root,
        env=clean_env(root),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert re.search(r"\d+ passed", r.stdout), r.stdout[-2000:]
    assert not names or "deselected" in r.stdout, r.stdout[-2000:]  # it collected the whole folder
    assert "carried unchanged" not in r.stdout, "a chapter on its own has no neighbour to have run its tests"
    compares = any("load_neighbour(" in p.read_text() for p in (root / NEWEST.name / "tests").glob("*.py"))
    assert not compares or "compares with chapter" in r.stdout, r.stdout[-2000:]
