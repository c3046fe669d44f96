"""Skip a carried test where it cannot find anything new.

Chapter N starts as a copy of chapter N-1 and carries its tests, so that a chapter copied out of
the repository is a whole, tested engine. Inside the repository most of those copies would only
run again what already passed one chapter earlier: a test file that is byte-identical to the
previous chapter's, and reaches only chapter files that are byte-identical too, runs the same
code on the same inputs. Such a test is skipped with the reason `carried unchanged: ran in
chapter NN`, naming the chapter where it last differed (where it really runs).

What a test "reaches" is read from the source, conservatively, so that a change can only make
more tests run:
- the test's own definition and the fixtures and helpers it names (not its file's other tests),
  the chapter's conftest.py files, and every chapter-local module they import, followed
  transitively (`import engine`, `from sampling import ...`);
- any chapter file named in a string (`"server.py"` started as a subprocess, `"engine"` loaded
  through common.chapters, `"README.md"` read), so scripts and data count too; in a chapter
  module only a whole string counts, since its longer strings are messages to a user, and
  nowhere a dict key or subscript (`row["engine"]` is a field);
- the whole chapter folder when a test-side file (tests/, conftest.py) lists a folder (`glob(`,
  `iterdir(`, `listdir(`, `os.walk(`), since it may read any file there.
A test that loads another chapter by a computed number (`load_chapter(n - 1, ...)`) never
skips: the same text then tests different code in each chapter.

`common/` and `kernels/` are one copy for every chapter, so they never differ between neighbours.
A chapter with no previous chapter beside it (copied out on its own) runs everything, and so does
any run with RUN_CARRIED_TESTS=1 (say, a GPU node checking one chapter whole).

A chapter's conftest.py takes this hook by importing it:
    from common.carried import pytest_collection_modifyitems  # noqa: F401
"""

from __future__ import annotations

import ast
import os
import re
from functools import cache
from pathlib import Path

import pytest

CHAPTER_NAME = re.compile(r"^(\d\d)_\w+$")
FILE_NAME = re.compile(r"[\w./\-]+")
FOLDER_LISTING = {"glob", "rglob", "iterdir", "listdir", "walk", "scandir"}
CHAPTER_LOADERS = {"load_chapter", "load_neighbour"}
COMPUTED_LOAD = "<a chapter loaded by a computed number>"
FILE = "file:"  # marks a word that names a chapter file, not a Python name


def chapter_of(path: Path) -> Path | None:
    """The chapter folder (`.../NN_name/`, with a conftest.py) holding `path`, if any."""
    for folder in path.parents:
        if CHAPTER_NAME.match(folder.name) and (folder / "conftest.py").exists():
            return folder
    return None


def previous_chapter(chapter: Path) -> Path | None:
    """The chapter numbered one less, beside this one; None when there is none (a chapter copied
    out on its own, or chapter 00)."""
    number = int(chapter.name[:2])
    matches = sorted(chapter.parent.glob(f"{number - 1:02d}_*")) if number > 0 else []
    return matches[0] if matches and matches[0].is_dir() else None


@cache
def chapter_files(chapter: Path) -> dict[str, Path]:
    """Every file a test could name, by file name and (for .py files) by module name."""
    files = [p for p in (*chapter.iterdir(), *(chapter / "tests").glob("*")) if p.is_file()]
    names = {p.name: p for p in files}
    names.update({p.stem: p for p in files if p.suffix == ".py"})
    return names


def string_words(text: str, inside_too: bool) -> set[str]:
    # A whole string may be a module name ("engine", for common.chapters) or a file ("server.py",
    # ".../server.py"). Inside a longer string (inside_too: test-side files) only a file name counts
    # ("python server.py"), not prose ("the model"); a chapter module's longer strings are messages
    # ("quantize the model with quantize.py"), so there only whole strings count.
    whole = text.strip()
    words = {FILE + whole, FILE + whole.rsplit("/", 1)[-1]}
    if inside_too:
        files = {w.rsplit("/", 1)[-1] for w in FILE_NAME.findall(text)}
        words |= {FILE + f for f in files if "." in f}
    return words


def words_of(node: ast.AST, docstrings: set[int], names_too: bool) -> set[str]:
    """What `node` may use: FILE + the name of each module it imports or file a string may name,
    and (names_too) every name, attribute and argument it uses, so that a test's fixtures and
    helpers can be followed to their definitions (a local variable called `batch` is not batch.py)."""
    words: set[str] = set()
    # A dict's key or a subscript (`{"engine": ...}`, `row["engine"]`) is a field name, not a module.
    keys = {id(k) for n in ast.walk(node) if isinstance(n, ast.Dict) for k in n.keys if k is not None}
    keys |= {id(n.slice) for n in ast.walk(node) if isinstance(n, ast.Subscript)}
    not_names = docstrings | keys
    for n in ast.walk(node):
        if isinstance(n, ast.Import):
            words.update(FILE + alias.name.split(".")[0] for alias in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            words.add(FILE + n.module.split(".")[0])
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in not_names:
            words |= string_words(n.value, inside_too=names_too)
        elif isinstance(n, ast.Call):
            called = getattr(n.func, "id", None) or getattr(n.func, "attr", None)
            if called in CHAPTER_LOADERS and n.args and not isinstance(n.args[0], ast.Constant):
                words.add(COMPUTED_LOAD)
        if names_too and isinstance(n, (ast.Name, ast.Attribute, ast.arg)):
            words.add(getattr(n, "id", None) or getattr(n, "attr", None) or n.arg)
    return words


def docstrings_of(tree: ast.AST) -> set[int]:
    """Docstrings are prose: a module named there is not run or read."""
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
    }


@cache
def module_words(path: Path) -> frozenset[str]:
    """A chapter module reaches what it imports and the files it names."""
    if path.suffix != ".py":
        return frozenset()
    tree = ast.parse(path.read_text(), filename=str(path))
    return frozenset(words_of(tree, docstrings_of(tree), names_too=False))


@cache
def test_side(path: Path) -> tuple[dict[str, frozenset[str]], frozenset[str], dict[str, ast.AST]]:
    """A test file or conftest.py: (what each top-level name's definition uses, what runs for every
    test (statements that define nothing, autouse fixtures), the top-level definitions by name)."""
    if not path.exists():
        return {}, frozenset(), {}
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = docstrings_of(tree)
    defs: dict[str, frozenset[str]] = {}
    nodes: dict[str, ast.AST] = {}
    always: set[str] = set()
    for stmt in tree.body:
        words = frozenset(words_of(stmt, docstrings, names_too=True))
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for alias in stmt.names:
                defs[alias.asname or alias.name.split(".")[0]] = words
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[stmt.name], nodes[stmt.name] = words, stmt
            if any(
                isinstance(d, ast.Call) and any(k.arg == "autouse" for k in d.keywords) for d in stmt.decorator_list
            ):
                always |= {stmt.name}
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and all(
            isinstance(t, ast.Name) for t in getattr(stmt, "targets", [getattr(stmt, "target", None)])
        ):
            for target in getattr(stmt, "targets", [getattr(stmt, "target", None)]):
                defs[target.id] = words
        elif not (isinstance(stmt, ast.Expr) and id(getattr(stmt, "value", None)) in docstrings):
            always |= words
    return defs, frozenset(always), nodes


def reached(test_file: Path, test_name: str, chapter: Path) -> frozenset[Path] | None:
    """Chapter files one test may run or read, relative to the chapter: its own definition (a test
    function, or its class), the fixtures and helpers it names, followed through the test file and
    the conftests, then every chapter module those import, transitively. None when the test must
    always run (it loads a chapter by a computed number)."""
    conftests = [p for p in (chapter / "conftest.py", chapter / "tests" / "conftest.py") if p.exists()]
    defs, always, nodes = {}, set(), {}
    for path in (*conftests, test_file):  # the test file's own names shadow the conftests'
        d, a, n = test_side(path)
        defs, always, nodes = defs | d, always | a, nodes | n
    if test_name not in nodes:
        return None
    words, todo = set(), [*defs[test_name], *always]
    while todo:  # follow names through the test-side definitions
        word = todo.pop()
        if word not in words:
            words.add(word)
            todo.extend(defs.get(word, ()))
    if COMPUTED_LOAD in words:
        return None
    names = chapter_files(chapter)
    named = {w[len(FILE) :] for w in words if w.startswith(FILE)}
    files = set(names.values()) if words & FOLDER_LISTING else {names[w] for w in named if w in names}
    # The test file is compared whole, but followed only through what this test uses (above): its
    # other tests' imports and scripts are not this test's.
    todo, seen = [*conftests, *files], {test_file}
    while todo:  # follow imports and named files through the chapter's modules
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo.extend(names[w[len(FILE) :]] for w in module_words(path) if w[len(FILE) :] in names)
    return frozenset(p.relative_to(chapter) for p in seen)


@cache
def ran_in(test_file: Path, test_name: str) -> str | None:
    """The chapter where this carried test last differed, or None when it must run here."""
    chapter = chapter_of(test_file)
    previous = previous_chapter(chapter) if chapter else None
    if previous is None or not (previous / test_file.relative_to(chapter)).exists():
        return None
    here = reached(test_file, test_name, chapter)
    there = reached(previous / test_file.relative_to(chapter), test_name, previous)
    if here is None or here != there:
        return None
    if any((chapter / p).read_bytes() != (previous / p).read_bytes() for p in here):
        return None
    return ran_in(previous / test_file.relative_to(chapter), test_name) or previous.name[:2]


def pytest_collection_modifyitems(config, items):
    if os.environ.get("RUN_CARRIED_TESTS") == "1":
        return
    for item in items:
        # a test method is judged by its whole class
        name = item.cls.__name__ if getattr(item, "cls", None) else getattr(item, "originalname", item.name)
        where = ran_in(Path(item.path).resolve(), name)
        if where is not None:
            item.add_marker(pytest.mark.skip(reason=f"carried unchanged: ran in chapter {where}"))
