"""common.carried: a carried test skips only where it cannot find anything new, and runs again as
soon as one byte of anything it reaches changes. Checked on small chapters made here, so each case
says exactly which file differs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = "from common.tools.carried import pytest_collection_modifyitems  # noqa: F401\n"
FILES = {
    "conftest.py": CONFTEST,
    "util.py": "def one():\n    return 1\n",
    "engine.py": "import util\n\n\ndef two():\n    return util.one() + 1\n",
    "script.py": "print('hello from the script')\n",
    "notes.md": "a data file a test reads\n",
    "tests/test_util.py": "import util\n\n\ndef test_one():\n    assert util.one() == 1\n",
    "tests/test_engine.py": "import engine\n\n\ndef test_two():\n    assert engine.two() == 2\n",
    # a script run as a subprocess and a data file, both named only in strings
    "tests/test_script.py": (
        "import subprocess, sys\nfrom pathlib import Path\n\n\n"
        "def test_script_runs():\n"
        "    here = Path(__file__).parent.parent\n"
        "    out = subprocess.run([sys.executable, 'script.py'], cwd=here, capture_output=True, text=True).stdout\n"
        "    assert 'hello' in out and (here / 'notes.md').read_text()\n"
    ),
    # comparing with a chapter chosen by a computed number: never skipped
    "tests/test_neighbour.py": (
        "from common.tools.testing import load_neighbour\n\n\n"
        "def previous(number):\n    return load_neighbour(number - 1, 'util')\n\n\n"
        "def test_neighbour():\n    assert callable(previous)\n"
    ),
}


def make_chapter(folder: Path, changes: dict[str, str] | None = None) -> Path:
    for name, text in (FILES | (changes or {})).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def pytest_report(chapter: Path, **env) -> str:
    """The -rA report of a passing pytest run of the chapter's tests."""
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", str(chapter / "tests")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=chapter.parent,
        env={**__import__("os").environ, **env},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return r.stdout


def outcomes(chapter: Path, **env) -> dict[str, str]:
    """test file stem -> 'passed' or the skip reason, from a pytest run of the chapter's tests."""
    found = {}
    for line in pytest_report(chapter, **env).splitlines():
        if m := re.match(r"PASSED .*?(test_\w+)\.py", line):
            found[m[1]] = "passed"
        elif m := re.match(r"SKIPPED \[\d+\] .*?(test_\w+)\.py(?::\d+)?: (.*)", line):
            found[m[1]] = m[2]
    return found


@pytest.fixture
def chapters(tmp_path) -> Path:
    root = tmp_path / "chapters"
    make_chapter(root / "01_first")
    make_chapter(root / "02_second")
    return root


def test_identical_chapter_skips_every_carried_test_but_a_computed_neighbour(chapters):
    first, second = outcomes(chapters / "01_first"), outcomes(chapters / "02_second")
    assert set(first.values()) == {"passed"} and len(first) == 4, first
    carried = "carried unchanged: ran in chapter 01"
    assert second == {
        "test_util": carried,
        "test_engine": carried,
        "test_script": carried,
        "test_neighbour": "passed",
    }, second


def test_one_changed_byte_runs_again_every_test_that_reaches_it(chapters):
    util = chapters / "02_second" / "util.py"
    util.write_text(util.read_text() + " ")  # one byte
    second = outcomes(chapters / "02_second")
    # engine imports util, so both run; the script test reaches neither
    assert second["test_util"] == second["test_engine"] == "passed", second
    assert second["test_script"].startswith("carried unchanged"), second


def test_a_change_reaches_only_its_importers(chapters):
    engine = chapters / "02_second" / "engine.py"
    engine.write_text(engine.read_text() + "\n")
    second = outcomes(chapters / "02_second")
    assert second["test_engine"] == "passed" and second["test_util"].startswith("carried unchanged"), second


@pytest.mark.parametrize("changed", ["script.py", "notes.md", "conftest.py", "tests/test_script.py"])
def test_files_named_in_strings_and_the_conftest_count(chapters, changed):
    path = chapters / "02_second" / changed
    path.write_text(path.read_text() + "\n# changed\n" if path.suffix == ".py" else "changed\n")
    second = outcomes(chapters / "02_second")
    assert second["test_script"] == "passed", second
    if changed == "conftest.py":  # every test uses the conftest
        assert set(second.values()) == {"passed"}, second


def test_a_removed_module_is_a_difference(chapters):
    # 02 drops util.py: test_util now fails to import there, so it must not be skipped as carried
    (chapters / "02_second" / "util.py").unlink()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            str(chapters / "02_second" / "tests" / "test_util.py"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stdout, r.stdout[-2000:]


def test_skip_names_the_chapter_where_it_last_ran(chapters):
    make_chapter(chapters / "03_third")
    assert outcomes(chapters / "03_third")["test_util"] == "carried unchanged: ran in chapter 01"
    util = chapters / "02_second" / "util.py"
    util.write_text(util.read_text() + "\n")
    (chapters / "03_third" / "util.py").write_text(util.read_text())
    assert outcomes(chapters / "03_third")["test_util"] == "carried unchanged: ran in chapter 02"


def test_a_chapter_copied_out_alone_or_a_forced_run_runs_everything(chapters, tmp_path):
    alone = tmp_path / "my_engine" / "02_second"
    shutil.copytree(chapters / "02_second", alone)
    assert set(outcomes(alone).values()) == {"passed"}
    assert set(outcomes(chapters / "02_second", RUN_CARRIED_TESTS="1").values()) == {"passed"}


def passed_tests(chapter: Path) -> set[str]:
    """The names of the test functions that ran and passed."""
    return set(re.findall(r"^PASSED \S*?::(\w+)", pytest_report(chapter), re.M))


def test_a_test_reaches_what_it_uses_not_what_its_file_neighbours_use(chapters):
    # One file, two tests: a change to the script one of them runs reruns that one only.
    mixed = (
        "import subprocess, sys\nfrom pathlib import Path\n\nimport util\n\n\n"
        "def test_runs_the_script():\n"
        "    here = Path(__file__).parent.parent\n"
        "    assert subprocess.run([sys.executable, 'script.py'], cwd=here).returncode == 0\n\n\n"
        "def test_uses_util():\n    assert util.one() == 1\n"
    )
    for chapter in ("01_first", "02_second"):
        (chapters / chapter / "tests" / "test_mixed.py").write_text(mixed)
    script = chapters / "02_second" / "script.py"
    script.write_text(script.read_text() + "\n")
    ran = passed_tests(chapters / "02_second")
    assert "test_runs_the_script" in ran and "test_uses_util" not in ran, ran


def test_a_module_reaches_a_script_it_names_whole_not_one_its_messages_mention(chapters):
    # hints.py only mentions script.py in a message and has a field called "script"; runner.py
    # names it on its own, as a run does
    files = {
        "hints.py": "ROW = {'script': 0}\n\n\ndef hint():\n    return 'quantize the model with script.py first'\n",
        "runner.py": "COMMAND = ['python', 'script.py']\n",
        "tests/test_hints.py": "import hints\n\n\ndef test_hint():\n    assert hints.hint().endswith('first')\n",
        "tests/test_runner.py": "import runner\n\n\ndef test_runner():\n    assert runner.COMMAND\n",
    }
    for chapter in ("01_first", "02_second"):
        make_chapter(chapters / chapter, files)
    script = chapters / "02_second" / "script.py"
    script.write_text(script.read_text() + "\n")
    second = outcomes(chapters / "02_second")
    assert second["test_runner"] == "passed" and second["test_hints"].startswith("carried unchanged"), second
