"""What chapter N adds to chapter N-1: the lesson, new code first.

    python -m common.tools.diff_chapters 3          # make diff-chapter3
    python -m common.tools.diff_chapters 3 --all    # then the benchmark, README and tests too

Chapter N starts as a copy of chapter N-1, so a diff between the two folders is exactly what
the chapter teaches. A summary of which files are new, changed and unchanged comes first, then
the engine's modules (every top-level .py but bench.py, its helpers and conftest.py) in reading
order: each new module in full (every line a `+` line), then each changed one as a unified diff,
or in full when more than half of its lines are new, then each removed one. The benchmark
(bench.py and its helpers) and the rest of the chapter (README, tests, images) are listed in the
summary and shown with --all. Colour when the output is a terminal.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CHAPTERS_DIR = REPO_ROOT / "chapters"
SKIP_PARTS = {"__pycache__", ".pytest_cache", ".ipynb_checkpoints", ".hypothesis"}  # what .gitignore leaves out
# bench.py's helpers measure the engine rather than teach it, so they are read with the benchmark.
BENCH_FILES = {"bench.py", "peers.py", "profile_decode.py"}
# A changed file more than this share of whose lines are new reads better whole than as a diff.
REWRITTEN = 0.5
KINDS = ("new", "changed", "removed", "unchanged")
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


def part_of(name: str) -> str:
    """ "code" (the engine's own modules: what the lesson is about), "bench" or "other"."""
    if name in BENCH_FILES:
        return "bench"
    if name.endswith(".py") and "/" not in name and name != "conftest.py":
        return "code"
    return "other"


def read_lines(path: Path) -> list[str] | None:
    """The file's lines, or None for a binary file (an image)."""
    try:
        return path.read_text(encoding="utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        return None


def imported_names(path: Path) -> set[str]:
    """Top-level names of everything the module imports, including imports inside functions."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def reading_order(folder: Path) -> list[str]:
    """The chapter's code modules, each after the sibling modules it imports.

    Dependencies first, rather than top-down from the entry points: a reader then meets every
    new class and function before the code that uses it, in the order the chapter builds its
    engine up, and the entry points (cli.py, server.py) come last, where they put it all
    together. Modules that do not depend on each other come in the order the chapter's README
    first names them, which is the order its prose explains them in, then alphabetically."""
    modules = {name for name in files_of(folder) if part_of(name) == "code"}
    deps = {name: {f"{m}.py" for m in imported_names(folder / name)} & modules - {name} for name in modules}
    readme = (folder / "README.md").read_text(encoding="utf-8") if (folder / "README.md").is_file() else ""

    def key(name: str) -> tuple[int, str]:
        mention = re.search(rf"(?<![\w/]){re.escape(name)}", readme)  # model.py, not test_model.py
        return (mention.start() if mention else len(readme), name)

    order, left = [], set(modules)
    while left:
        ready = [name for name in left if not deps[name] & left] or left  # `or`: an import cycle
        first = min(ready, key=key)
        order.append(first)
        left.remove(first)
    return order


def new_share(a: list[str], b: list[str]) -> float:
    """The share of b's lines that a diff from a marks as added."""
    if not b:
        return 0.0
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return 1 - sum(block.size for block in matcher.get_matching_blocks()) / len(b)


def with_newlines(lines) -> list[str]:
    return [line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines]


def file_diff(old: Path, new: Path, old_name: str, new_name: str) -> list[str]:
    a = read_lines(old) if old.is_file() else []
    b = read_lines(new) if new.is_file() else []
    if a is None or b is None:
        return [f"Binary files {old_name} and {new_name} differ\n"]
    # A new file is shown whole: one hunk that adds every line.
    context = len(b) if not a else 3
    return with_newlines(
        difflib.unified_diff(
            a, b, old_name if old.is_file() else "/dev/null", new_name if new.is_file() else "/dev/null", n=context
        )
    )


def whole_file(new: Path, new_name: str) -> list[str]:
    """A rewritten file, as if it were new: the old one is still in the previous chapter."""
    b = read_lines(new)
    return with_newlines(difflib.unified_diff([], b, "/dev/null", new_name, n=len(b)))


def classify(prev: Path, cur: Path) -> dict[str, list[str]]:
    """kind -> names: new and changed code modules in reading order, everything else alphabetically."""
    before, after = files_of(prev), files_of(cur)
    groups = {kind: [] for kind in KINDS}
    for name in sorted(before | after):
        if name not in before:
            groups["new"].append(name)
        elif name not in after:
            groups["removed"].append(name)
        elif (prev / name).read_bytes() != (cur / name).read_bytes():
            groups["changed"].append(name)
        else:
            groups["unchanged"].append(name)
    rank = {name: i for i, name in enumerate(reading_order(cur))}
    for kind in ("new", "changed"):
        groups[kind].sort(key=lambda name: (part_of(name) != "code", rank.get(name, 0), name))
    return groups


def rewritten(prev: Path, cur: Path, names: list[str]) -> dict[str, float]:
    """name -> the share of its lines that are new, for the changed files to show whole."""
    shares = {}
    for name in names:
        a, b = read_lines(prev / name), read_lines(cur / name)
        if a is not None and b is not None:
            shares[name] = new_share(a, b)
    return {name: share for name, share in shares.items() if share > REWRITTEN}


def uses_kernels(folder: Path) -> bool:
    return any("kernels" in imported_names(folder / name) for name in files_of(folder) if part_of(name) == "code")


KERNELS_NOTE = """\
= kernels/: the kernels this chapter calls are a library at the repository's root, kernels/, not
=   in this folder and not in this diff; the chapter loads them in ops.py (`kernels.load()`).
=   Read kernels/README.md first, then each kernel in kernels/csrc/cuda/*.cu beside its C++ twin
=   in kernels/csrc/cpu/*.cpp (the same algorithm, for a CPU), with the maths that both are
=   tested against in kernels/reference.py.
"""


def render(number: int, show_all: bool) -> list[str]:
    cur, prev = chapter_folder(number), chapter_folder(number - 1)
    groups = classify(prev, cur)
    whole = rewritten(prev, cur, [name for name in groups["changed"] if part_of(name) == "code"])
    out = [f"= chapter {cur.name} against {prev.name}\n"]
    for part, title in (("code", "code"), ("bench", "benchmark"), ("other", "other files")):
        out.append(f"= {title}:\n")
        for kind, names in groups.items():
            names = [n for n in names if part_of(n) == part]
            if names:
                out.append(f"=   {kind:9} ({len(names)}): {' '.join(names)}\n")
        if part == "code" and whole:
            shown = " ".join(n for n in groups["changed"] if n in whole)
            out.append(f"=   shown whole, as over {REWRITTEN:.0%} of their lines are new: {shown}\n")
    if uses_kernels(cur) and not uses_kernels(prev):
        out.append(KERNELS_NOTE)
    if not show_all:
        out.append(f"= only the code is shown below: `make diff-chapter{number} ALL=1` shows the other files too\n")

    def diffs(part: str) -> list[str]:
        shown = [
            (kind, name) for kind in ("new", "changed", "removed") for name in groups[kind] if part_of(name) == part
        ]
        shown.sort(key=lambda kind_name: kind_name[1] != "README.md")  # the prose before its tests
        lines = []
        for kind, name in shown:
            old_name, new_name = f"{prev.name}/{name}", f"{cur.name}/{name}"
            if name in whole:
                lines.append(f"\n= {name} (rewritten, {whole[name]:.0%} of its lines new: shown whole)\n")
                lines += whole_file(cur / name, new_name)
            else:
                lines.append(f"\n= {name} ({'new file' if kind == 'new' else kind})\n")
                lines += file_diff(prev / name, cur / name, old_name, new_name)
        return lines

    out += diffs("code")
    if show_all:
        out += diffs("bench") + diffs("other")
    return out


def colour(line: str) -> str:
    code = COLOURS.get(line[:1])
    if code is None or line.startswith(("+++", "---")):
        return line
    return code + line.rstrip("\n") + RESET + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("chapter", type=int, help="N: show what chapter N adds to chapter N-1 (N >= 1)")
    ap.add_argument("--all", action="store_true", help="also diff bench.py and its helpers, README, tests and figures")
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
