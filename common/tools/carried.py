"""Carried tests skip where nothing they reach has changed.

Chapter N starts as a copy of chapter N-1, tests included, so that a chapter copied out on its own
is a whole, tested engine. Inside the repository most of those copies would run again what already
passed one chapter earlier. The rule:

    A carried test skips when its file, its chapter's conftest.py, the chapter files it declares,
    and every chapter module these import (transitively, by flat name) are the same files, byte
    for byte, as in the previous chapter.

A test that runs a chapter script in a subprocess (or reads a chapter file) imports nothing of it,
so it declares it: one test by `@pytest.mark.reaches("generate.py")`, every test of a file by
`REACHES = ["server.py"]` at module level, in the test file or in a test helper it imports
(tests/live_server.py). The mark keeps a file's in-process tests skipped where only the script
its subprocess tests run has changed. A file the previous chapter lacks counts as changed. The skip
names the chapter where the file really ran. common/ and kernels/ are one copy for every chapter,
so they never differ. A chapter with no previous chapter beside it, and a run with
RUN_CARRIED_TESTS=1, run everything. A chapter's conftest.py takes the hook by importing it.
"""

from __future__ import annotations

import ast
import os
from functools import cache
from pathlib import Path

import pytest


def previous_chapter(chapter: Path) -> Path | None:
    """`NN-1_*` beside `chapter` (a folder `NN_name` holding the tests/ folder), if there is one."""
    if not (chapter.name[:2].isdigit() and int(chapter.name[:2]) > 0):
        return None
    return next(iter(sorted(chapter.parent.glob(f"{int(chapter.name[:2]) - 1:02d}_*"))), None)


@cache
def reached(chapter: Path, test: str, declared: tuple[str, ...] = ()) -> frozenset[str]:
    """The chapter files (relative paths) that a test of file `test` reaches, the file included;
    `declared`: the files its `reaches` mark names."""
    modules = {p.stem: p for folder in (chapter, chapter / "tests") for p in sorted(folder.glob("*.py"))}
    todo, seen = [chapter / test, chapter / "conftest.py", *(chapter / name for name in declared)], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)  # a declared file that is missing stays in: it differs, so the test runs
        if path.suffix != ".py" or not path.is_file():
            continue
        imported, reaches = names_in(path)
        todo += [modules[name] for name in imported if name in modules]
        todo += [chapter / name for name in reaches]
    return frozenset(str(p.relative_to(chapter)) for p in seen)


@cache
def names_in(path: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the top-level names a file imports, the files its REACHES lists), parsed once a run: a
    chapter's test files reach the same modules, each chapter's back to the first."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    imported = []
    for node in ast.walk(tree):  # imports inside functions count too: they run when the test does
        if isinstance(node, ast.Import):
            imported += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.append(node.module.split(".")[0])
    reaches = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "REACHES" for t in node.targets):
            reaches += ast.literal_eval(node.value)
    return tuple(imported), tuple(reaches)


@cache
def ran_in(chapter: Path, test: str, declared: tuple[str, ...] = ()) -> str | None:
    """The chapter where a carried test of file `test` (its mark declaring `declared`) last
    differed; None where it runs here."""
    previous = previous_chapter(chapter)
    if previous is None or reached(chapter, test, declared) != reached(previous, test, declared):
        return None
    for name in reached(chapter, test, declared):
        here, there = chapter / name, previous / name
        if not (here.is_file() and there.is_file() and here.read_bytes() == there.read_bytes()):
            return None
    return ran_in(previous, test, declared) or previous.name[:2]


def pytest_collection_modifyitems(config, items):
    if os.environ.get("RUN_CARRIED_TESTS") == "1":
        return
    for item in items:
        path = Path(item.path).resolve()
        declared = tuple(sorted({name for mark in item.iter_markers("reaches") for name in mark.args}))
        if path.parent.name == "tests" and (where := ran_in(path.parents[1], f"tests/{path.name}", declared)):
            item.add_marker(pytest.mark.skip(reason=f"carried unchanged: ran in chapter {where}"))
