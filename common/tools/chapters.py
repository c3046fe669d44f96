"""Load a chapter's modules under unique names, so one process can hold two chapters.

Every chapter has its own `model.py` and imports its siblings by plain name (`import model`).
`load_chapter(2)` imports the requested modules with the chapter folder first on sys.path, then
renames them in sys.modules (`ch02.model`) and removes the plain names, so that loading chapter
3 next imports chapter 3's files rather than reusing chapter 2's.

Chapters are found in the `chapters/` folder beside this package: in a clone, the repository's.
A chapter copied on its own has no neighbours; tests that compare with one skip (common.tools.testing).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import types
from pathlib import Path

CHAPTERS_DIR = Path(__file__).resolve().parents[2] / "chapters"


class ChapterNotFoundError(FileNotFoundError):
    pass


def chapter_dir(number: int) -> Path:
    matches = sorted(CHAPTERS_DIR.glob(f"{number:02d}_*"))
    if not matches:
        raise ChapterNotFoundError(f"no chapter {number:02d} in {CHAPTERS_DIR}")
    return matches[0]


def chapter_exists(number: int) -> bool:
    return any(CHAPTERS_DIR.glob(f"{number:02d}_*"))


def newest_chapter() -> int:
    """The highest chapter number here: what the benches run unless told otherwise, so that a new
    chapter is benchable the day it is added."""
    return max(int(p.name[:2]) for p in CHAPTERS_DIR.glob("[0-9][0-9]_*") if p.is_dir())


def chapter_number(name: str) -> int:
    """A chapter as a command line names it, "7", "07", "ch07" or its folder "07_speculative" -> 7.
    An argparse type (`type=chapter_number`): a name of no chapter here is a usage error."""
    m = re.fullmatch(r"(?:ch)?(\d{1,2})(?:_\w+)?", name.strip())
    if m is None or not chapter_exists(int(m[1])):
        raise argparse.ArgumentTypeError(f"no chapter {name!r} here (name one by number, chNN or its folder)")
    return int(m[1])


def load_chapter(number: int, *module_names: str) -> types.SimpleNamespace:
    """load_chapter(1, "model", "generate") -> namespace with .model and .generate."""
    folder = chapter_dir(number)
    own = {p.stem for p in folder.glob("*.py")}
    saved = {name: sys.modules.pop(name) for name in own if name in sys.modules}
    sys.path.insert(0, str(folder))
    loaded = {}
    try:
        for name in module_names:
            loaded[name] = importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))
        for name in own:
            module = sys.modules.pop(name, None)
            if module is not None:
                sys.modules[f"ch{number:02d}.{name}"] = module
        sys.modules.update(saved)
    return types.SimpleNamespace(**loaded)
