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
    "conftest.py": (
        "from common.tools.carried import pytest_collection_modifyitems  # noqa: F401\n"
        "from common.tools.testing import pytest_configure  # noqa: F401  (registers the reaches mark)\n"
    ),
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
    # ... or marks the one test that runs it: the file's other tests reach only what they import
    "tests/test_mixed.py": (
        "import subprocess, sys\nfrom pathlib import Path\n\nimport pytest\n\nimport util\n\n\n"
        "def test_in_process():\n    assert util.one() == 1\n\n\n"
        '@pytest.mark.reaches("server.py")\n'
        "def test_script():\n"
        "    here = Path(__file__).parents[1]\n"
        "    out = subprocess.run([sys.executable, 'server.py'], cwd=here, capture_output=True, text=True)\n"
        "    assert out.stdout == '2\\n', out.stderr\n"
    ),
}
TESTS = ("test_util", "test_engine", "test_server", "test_live", "test_mixed", "test_mixed::test_script")


def make_chapter(folder: Path, changes: dict[str, str] | None = None) -> Path:
    for name, text in (FILES | (changes or {})).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def edit(path: Path) -> None:
    path.write_text(path.read_text() + "\n")  # one byte


def verdicts(chapter: Path) -> dict[str, str | None]:
    """test file stem (a test's name after it for the one marked test) -> the chapter it ran in (it
    skips here), or None (it runs here)."""
    carried.reached.cache_clear()  # the cases edit files between calls
    carried.ran_in.cache_clear()
    declared = {"test_mixed::test_script": ("server.py",)}
    return {t: carried.ran_in(chapter, f"tests/{t.split('::')[0]}.py", declared.get(t, ())) for t in TESTS}


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
    expected = dict.fromkeys(TESTS) | {"test_util": "01", "test_mixed": "01"}
    assert verdicts(chapters / "02_second") == expected


def test_a_script_counts_only_for_the_files_and_tests_that_declare_it(chapters):
    edit(chapters / "02_second" / "server.py")
    # test_server declares it, test_live's helper does, test_mixed's marked test does; nothing imports it
    expected = dict.fromkeys(TESTS) | {"test_util": "01", "test_engine": "01", "test_mixed": "01"}
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
    """test name -> 'passed' or the skip reason, from a pytest run of the chapter's tests."""
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", str(chapter / "tests")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=chapter.parent,
        env={**__import__("os").environ, "RUN_CARRIED_TESTS": "", "COLUMNS": "300", **env},  # whole reasons
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    found = {}
    for line in r.stdout.splitlines():
        if m := re.match(r"\S*?::(test_\w+) (PASSED|SKIPPED)(?: \((.*)\))?", line):
            found[m[1]] = "passed" if m[2] == "PASSED" else m[3]
    return found


def test_pytest_skips_with_the_reason_and_runs_everything_when_asked(chapters):
    # the hooks as a chapter's conftest.py takes them, in a real pytest run: the changed script's
    # tests run (and pass: the subprocess really runs it), the others skip, the marked test's
    # neighbour in its file too
    edit(chapters / "02_second" / "server.py")
    carried_unchanged = "carried unchanged: ran in chapter 01"
    assert outcomes(chapters / "02_second") == {
        "test_one": carried_unchanged,
        "test_two": carried_unchanged,
        "test_server_prints_two": "passed",
        "test_live": "passed",
        "test_in_process": carried_unchanged,
        "test_script": "passed",
    }
    assert set(outcomes(chapters / "02_second", RUN_CARRIED_TESTS="1").values()) == {"passed"}


SPAWNS = re.compile(r"\b(run_python|start_python|subprocess)\b")


def declares_reaches(tree: ast.Module) -> bool:
    assignments = [n for n in tree.body if isinstance(n, ast.Assign)]
    return any(getattr(t, "id", None) == "REACHES" for n in assignments for t in n.targets)


def undeclared(path: Path) -> list[str]:
    """What in test file `path` starts a subprocess without declaring what it runs: each test that
    does (in its body, or through a function or fixture of the file that it calls or takes, however
    deep) without a `reaches` mark; the file itself where no function of it does. Nothing where
    the file declares REACHES for all its tests."""
    text = path.read_text()
    tree = ast.parse(text)
    if declares_reaches(tree) or not SPAWNS.search(text):
        return []
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def uses(f) -> set[str]:  # the names its body calls or reads, and the fixtures it takes
        return {n.id for n in ast.walk(f) if isinstance(n, ast.Name)} | {a.arg for a in f.args.args}

    spawning = {name for name, f in functions.items() if SPAWNS.search(ast.get_source_segment(text, f))}
    if not spawning:
        return [path.name]
    while grown := {name for name, f in functions.items() if name not in spawning and uses(f) & spawning}:
        spawning |= grown
    marked = {n for n, f in functions.items() if any("mark.reaches(" in ast.unparse(d) for d in f.decorator_list)}
    return [f"{path.name}::{name}" for name in sorted(spawning - marked) if name.startswith("test_")]


def test_a_test_that_spawns_through_a_fixture_of_its_file_must_be_marked(tmp_path):
    text = (
        "import pytest\nfrom common.tools.warm_python import run_python\n\n\n"
        "def run(*args):\n    return run_python(list(args))\n\n\n"
        "@pytest.fixture\ndef built():\n    return run('build.py')\n\n\n"
        "def test_in_process():\n    assert 1\n\n\n"
        "def test_uses_the_fixture(built):\n    assert built\n\n\n"
        '@pytest.mark.reaches("build.py")\ndef test_marked(built):\n    assert built\n'
    )
    (tmp_path / "test_x.py").write_text(text)
    assert undeclared(tmp_path / "test_x.py") == ["test_x.py::test_uses_the_fixture"]
    (tmp_path / "test_x.py").write_text(text + '\nREACHES = ["build.py"]\n')
    assert undeclared(tmp_path / "test_x.py") == []


def test_every_carried_test_that_starts_a_subprocess_declares_what_it_reaches():
    # Undeclared, a script that only a subprocess runs is invisible to the rule: a change to it
    # would leave its test skipped. A file that runs nothing of its chapter declares REACHES = [].
    missing = []
    for test in sorted(REPO.glob("chapters/*/tests/*.py")):
        previous = carried.previous_chapter(test.parents[1])
        if previous is None or not (previous / "tests" / test.name).exists():
            continue  # not carried: it always runs
        missing += [f"{test.parents[1].name}/{what}" for what in undeclared(test)]
    assert not missing, f"declare what they run (REACHES = [...] or @pytest.mark.reaches(...)): {missing}"
