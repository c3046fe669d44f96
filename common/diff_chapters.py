"""What chapter N adds to chapter N-1: the lesson, code first.

    python -m common.diff_chapters 3          # make diff-chapter3
    python -m common.diff_chapters 3 --all    # then the README, tests, benches, figures too

Chapter N starts as a copy of chapter N-1, so a diff between the two folders is exactly what
the chapter teaches. The engine's modules (every top-level .py but bench.py and conftest.py)
come first: a summary of which files are new, changed and unchanged, then each changed file as
a unified diff and each new file in full (every line a `+` line). The rest of the chapter
(README, tests, bench.py, images) is listed after the code, and shown with --all. Colour when
the output is a terminal.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

CHAPTERS_DIR = Path(__file__).resolve().parent.parent / "chapters"
SKIP_PARTS = {"__pycache__", ".pytest_cache", ".ipynb_checkpoints"}
COLOURS = {"+": "\033[32m", "-": "\033[31m", "@": "\033[36m", "=": "\033[1m"}
RESET = "\033[0m"


def chapter_folder(number: int) -> Path:
    matches = sorted(CHAPTERS_DIR.glob(f"{number:02d}_*"))
    if not matches:
        raise SystemExit(f"error: no chapter {number:02d} in {CHAPTERS_DIR}")
    return matches[0]


def files_of(folder: Path) -> set[str]:
    return {
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if p.is_file() and not SKIP_PARTS & set(p.relative_to(folder).parts) and p.suffix != ".pyc"
    }


def is_code(name: str) -> bool:
    """The engine's own modules: what the lesson is about."""
    return name.endswith(".py") and "/" not in name and name not in ("bench.py", "conftest.py")


def read_lines(path: Path) -> list[str] | None:
    """The file's lines, or None for a binary file (an image)."""
    try:
        return path.read_text(encoding="utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        return None


def file_diff(old: Path, new: Path, old_name: str, new_name: str) -> list[str]:
    a = read_lines(old) if old.is_file() else []
    b = read_lines(new) if new.is_file() else []
    if a is None or b is None:
        return [f"Binary files {old_name} and {new_name} differ\n"]
    # A new file is shown whole: one hunk that adds every line.
    context = len(b) if not a else 3
    lines = list(difflib.unified_diff(a, b, old_name if old.is_file() else "/dev/null",
                                      new_name if new.is_file() else "/dev/null", n=context))
    return [line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines]


def classify(prev: Path, cur: Path) -> dict[str, list[str]]:
    before, after = files_of(prev), files_of(cur)
    groups = {"new": [], "changed": [], "removed": [], "unchanged": []}
    for name in sorted(before | after):
        if name not in before:
            groups["new"].append(name)
        elif name not in after:
            groups["removed"].append(name)
        elif (prev / name).read_bytes() != (cur / name).read_bytes():
            groups["changed"].append(name)
        else:
            groups["unchanged"].append(name)
    return groups


def render(number: int, show_all: bool) -> list[str]:
    cur, prev = chapter_folder(number), chapter_folder(number - 1)
    groups = classify(prev, cur)
    out = [f"= chapter {cur.name} against {prev.name}\n"]
    for part, wanted in (("code", True), ("other files", False)):
        out.append(f"= {part}:\n")
        for kind, names in groups.items():
            names = [n for n in names if is_code(n) == wanted]
            if names:
                out.append(f"=   {kind:9} ({len(names)}): {' '.join(names)}\n")
    if not show_all:
        out.append(f"= only the code is shown below: `make diff-chapter{number} ALL=1` shows the other files too\n")

    def diffs(wanted: bool) -> list[str]:
        lines = []
        for kind in ("changed", "new", "removed"):
            for name in groups[kind]:
                if is_code(name) == wanted:
                    label = {"new": "new file", "changed": "changed", "removed": "removed"}[kind]
                    lines.append(f"\n= {name} ({label})\n")
                    lines += file_diff(prev / name, cur / name, f"{prev.name}/{name}", f"{cur.name}/{name}")
        return lines

    out += diffs(True)
    if show_all:
        out += diffs(False)
    return out


def colour(line: str) -> str:
    code = COLOURS.get(line[:1])
    if code is None or line.startswith(("+++", "---")):
        return line
    return code + line.rstrip("\n") + RESET + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("chapter", type=int, help="N: show what chapter N adds to chapter N-1 (N >= 1)")
    ap.add_argument("--all", action="store_true", help="also diff README, tests, bench.py and figures")
    ap.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    args = ap.parse_args()
    if args.chapter < 1:
        raise SystemExit("error: chapter 00 has no chapter before it: give N >= 1")
    use_colour = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    lines = render(args.chapter, args.all)
    try:
        sys.stdout.writelines(colour(line) for line in lines) if use_colour else sys.stdout.writelines(lines)
    except BrokenPipeError:  # `| head`: the reader has seen enough
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
