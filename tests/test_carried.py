"""common.tools.carried: a carried test file skips only when it and everything it reaches are the
same bytes as in the previous chapter, and runs again as soon as one of them changes. Checked on
small chapters made here, so each case says exactly which file differs."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.tools import carried

REPO = Path(__file__).resolve().parents[1]

FILES = {
    "conftest.py": "from common.tools.carried import pytest_collection_modifyitems  # noqa: F401\n",
    "util.py": "def one():\n    return 1\n",
    "engine.py": "import util\n\n\ndef two():\n    return util.one() + 1\n",
    "server.py": "import engine\n\nprint(engine.two())\n",  # a script: no test imports it
    "tests/test_util.py": "import util\n\n\ndef test_one():\n    assert util.one() == 1\n",
    "tests/test_engine.py": "def test_two():\n    from engine import two\n\n    assert two() == 2\n",
    # a test that runs server.py as a subprocess says so
    "tests/test_server.py": (
        "import subprocess, sys\nfrom pathlib import Path\n\n"
        'REACHES = ["server.py"]\n\n\n'
        "def test_server_prints_two():\n"
        "    here = Path(__file__).parents[1]\n"
        "    out = subprocess.run([sys.executable, 'server.py'], cwd=here, capture_output=True, text=True)\n"
        "    assert out.stdout == '2\\n', out.stderr\n"
    ),
    # ... or imports a helper that says so (as tests/live_server.py does)
    "tests/live.py": 'REACHES = ["server.py"]\n',
    "tests/test_live.py": "import live\n\n\ndef test_live():\n    assert live.REACHES\n",
}
TESTS = ("test_util", "test_engine", "test_server", "test_live")


def make_chapter(folder: Path, changes: dict[str, str] | None = None) -> Path:
    for name, text in (FILES | (changes or {})).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def edit(path: Path) -> None:
    path.write_text(path.read_text() + "\n")  # one byte


def verdicts(chapter: Path) -> dict[str, str | None]:
    """test file stem -> the chapter it ran in (it skips here), or None (it runs here)."""
    carried.reached.cache_clear()  # the cases edit files between calls
    carried.ran_in.cache_clear()
    return {t: carried.ran_in(chapter, f"tests/{t}.py") for t in TESTS}


@pytest.fixture
def chapters(tmp_path) -> Path:
    root = tmp_path / "chapters"
    make_chapter(root / "01_first")
    make_chapter(root / "02_second")
    return root


def test_an_identical_chapter_skips_every_carried_test_file(chapters):
    assert verdicts(chapters / "01_first") == dict.fromkeys(TESTS)  # no chapter before it
    assert verdicts(chapters / "02_second") == dict.fromkeys(TESTS, "01")


def test_a_changed_module_reruns_the_files_that_import_it_even_through_another_module(chapters):
    edit(chapters / "02_second" / "util.py")
    assert verdicts(chapters / "02_second") == dict.fromkeys(TESTS)  # engine and server.py import util


def test_a_change_reaches_only_the_files_that_import_it(chapters):
    edit(chapters / "02_second" / "engine.py")
    expected = {"test_util": "01", "test_engine": None, "test_server": None, "test_live": None}
    assert verdicts(chapters / "02_second") == expected


def test_a_script_counts_only_for_the_files_that_declare_it(chapters):
    edit(chapters / "02_second" / "server.py")
    # test_server declares it, test_live's helper does; nothing imports it
    expected = {"test_util": "01", "test_engine": "01", "test_server": None, "test_live": None}
    assert verdicts(chapters / "02_second") == expected


def test_the_conftest_and_the_test_file_itself_count(chapters):
    edit(chapters / "02_second" / "tests" / "test_util.py")
    assert verdicts(chapters / "02_second")["test_util"] is None
    edit(chapters / "02_second" / "conftest.py")
    assert verdicts(chapters / "02_second") == dict.fromkeys(TESTS)


def test_a_module_the_previous_chapter_lacks_counts_as_changed(chapters):
    # the same test file in both chapters, but `extra` is a chapter module only in the second
    optional = "try:\n    import extra\nexcept ImportError:\n    extra = None\n\n\ndef test_extra():\n    pass\n"
    for chapter in ("01_first", "02_second"):
        (chapters / chapter / "tests" / "test_optional.py").write_text(optional)
    assert carried.ran_in(chapters / "02_second", "tests/test_optional.py") == "01"
    (chapters / "02_second" / "extra.py").write_text("")
    verdicts(chapters / "02_second")  # clears the caches
    assert carried.ran_in(chapters / "02_second", "tests/test_optional.py") is None
    # and so does a declared file it lacks (a name missing from both chapters, a typo, always runs)
    for chapter in ("01_first", "02_second"):
        (chapters / chapter / "tests" / "test_tool.py").write_text('REACHES = ["tool.py"]\n')
    assert carried.ran_in(chapters / "02_second", "tests/test_tool.py") is None
    (chapters / "02_second" / "tool.py").write_text("")
    verdicts(chapters / "02_second")
    assert carried.ran_in(chapters / "02_second", "tests/test_tool.py") is None


def test_the_skip_names_the_chapter_where_the_file_last_ran(chapters):
    make_chapter(chapters / "03_third")
    assert verdicts(chapters / "03_third") == dict.fromkeys(TESTS, "01")
    for chapter in ("02_second", "03_third"):
        edit(chapters / chapter / "util.py")
    assert verdicts(chapters / "03_third")["test_util"] == "02"


def test_a_chapter_copied_out_alone_runs_everything(chapters, tmp_path):
    alone = make_chapter(tmp_path / "my_engine" / "02_second")
    assert verdicts(alone) == dict.fromkeys(TESTS)


def outcomes(chapter: Path, **env) -> dict[str, str]:
    """test file stem -> 'passed' or the skip reason, from a pytest run of the chapter's tests."""
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", str(chapter / "tests")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=chapter.parent,
        env={**__import__("os").environ, "RUN_CARRIED_TESTS": "", **env},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    found = {}
    for line in r.stdout.splitlines():
        if m := re.match(r"PASSED .*?(test_\w+)\.py", line):
            found[m[1]] = "passed"
        elif m := re.match(r"SKIPPED \[\d+\] .*?(test_\w+)\.py(?::\d+)?: (.*)", line):
            found[m[1]] = m[2]
    return found


def test_pytest_skips_with_the_reason_and_runs_everything_when_asked(chapters):
    # the hook as a chapter's conftest.py takes it, in a real pytest run: the changed script's
    # tests run (and pass: the subprocess really runs it), the others skip
    edit(chapters / "02_second" / "server.py")
    carried_unchanged = "carried unchanged: ran in chapter 01"
    assert outcomes(chapters / "02_second") == {
        "test_util": carried_unchanged,
        "test_engine": carried_unchanged,
        "test_server": "passed",
        "test_live": "passed",
    }
    assert set(outcomes(chapters / "02_second", RUN_CARRIED_TESTS="1").values()) == {"passed"}


def declares_reaches(path: Path) -> bool:
    assignments = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.Assign)]
    return any(getattr(t, "id", None) == "REACHES" for n in assignments for t in n.targets)


def test_every_carried_test_file_that_starts_a_subprocess_declares_what_it_reaches():
    # Without REACHES a script that only a subprocess runs is invisible to the rule: a change to it
    # would leave its test skipped. A file that runs nothing of its chapter declares REACHES = [].
    missing = []
    for test in sorted(REPO.glob("chapters/*/tests/*.py")):
        previous = carried.previous_chapter(test.parents[1])
        if previous is None or not (previous / "tests" / test.name).exists():
            continue  # not carried: it always runs
        if re.search(r"\b(run_python|start_python|subprocess)\b", test.read_text()) and not declares_reaches(test):
            missing.append(str(test.relative_to(REPO)))
    assert not missing, f"declare REACHES = [the chapter files they run] in {missing}"
