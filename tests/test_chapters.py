"""Across chapters: each engine agrees with the one before, and the make targets work."""

import subprocess
from pathlib import Path

import pytest
import torch

from common.models import resolve_model
from common.tokenizer import Tokenizer
from common.tools.chapters import chapter_dir, load_chapter

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["tiny-llama3", "smollm2-135m"])
def test_greedy_tokens_agree_from_chapter_01_to_07(name):
    d = resolve_model(name)
    tok = Tokenizer(d)
    prompt = tok.encode_chat([{"role": "user", "content": "Give me two facts about owls."}])
    n = 12
    ch01 = load_chapter(1, "model", "generate")
    ch02 = load_chapter(2, "model", "generate")
    ch03 = load_chapter(3, "model", "engine", "sampling")
    out01 = list(ch01.generate.generate(ch01.model.load_model(d), prompt, n))
    out02 = ch02.generate.generate_all(ch02.model.load_model(d), [prompt], n)[0]
    engine = ch03.engine.Engine(ch03.model.load_model(d), tok, {})
    req = ch03.engine.Request(prompt, ch03.sampling.SamplingParams(temperature=0), max_tokens=n)
    out03 = [t for events in engine.stream(req) for ev in events for t in ev.token_ids if t not in engine.eos_ids]
    # chapter 04 unquantized is chapter 03; quantized, it is checked against HF in its own tests
    ch04 = load_chapter(4, "model", "engine", "sampling")
    engine = ch04.engine.Engine(ch04.model.load_model(d), tok, {})
    req = ch04.engine.Request(prompt, ch04.sampling.SamplingParams(temperature=0), max_tokens=n)
    out04 = [t for events in engine.stream(req) for ev in events for t in ev.token_ids if t not in engine.eos_ids]
    # chapter 05: the same request through the paged cache and the scheduler, beside two others
    ch05 = load_chapter(5, "model", "engine", "sampling")
    engine = ch05.engine.Engine(ch05.model.load_model(d), tok, {}, num_blocks=64)
    greedy = ch05.sampling.SamplingParams(temperature=0)
    others = [
        ch05.engine.Request(tok.encode_chat([{"role": "user", "content": q}]), greedy, max_tokens=n)
        for q in ("What is a prime number?", "Name a color.")
    ]
    out05 = engine.generate([others[0], ch05.engine.Request(prompt, greedy, max_tokens=n), others[1]], [0, 0, 3])[1][0]
    out05 = [t for t in out05.token_ids if t not in engine.eos_ids]
    # chapter 06: the same, with kernels/ (C++ on this CPU) for norms, RoPE and decode attention
    ch06 = load_chapter(6, "model", "engine", "sampling", "ops")
    engine = ch06.engine.Engine(
        ch06.model.load_model(d, ops=ch06.ops.resolve("on", torch.device("cpu"))), tok, {}, num_blocks=64
    )
    req = ch06.engine.Request(prompt, ch06.sampling.SamplingParams(temperature=0), max_tokens=n)
    out06 = [t for events in engine.stream(req) for ev in events for t in ev.token_ids if t not in engine.eos_ids]
    # chapter 07: the same, with prompt lookup guessing and the model verifying its guesses
    ch07 = load_chapter(7, "model", "engine", "sampling", "ops", "proposers")
    engine = ch07.engine.Engine(
        ch07.model.load_model(d, ops=ch07.ops.resolve("on", torch.device("cpu"))),
        tok,
        {},
        num_blocks=64,
        proposer=ch07.proposers.NgramProposer(min_n=1),
    )
    req = ch07.engine.Request(prompt, ch07.sampling.SamplingParams(temperature=0), max_tokens=n)
    out07 = [t for events in engine.stream(req) for ev in events for t in ev.token_ids if t not in engine.eos_ids]
    assert engine.speculator.stats.verifies > 0 or name == "tiny-llama3"  # the random model's 12 tokens may repeat nothing
    assert out01 == out02 == out03 == out04 == out05 == out06 == out07, tok.decode(out01)


def test_chapter_modules_load_under_unique_names():
    a, b = load_chapter(1, "model"), load_chapter(2, "model")
    assert a.model is not b.model
    assert hasattr(a.model, "np") and not hasattr(a.model, "torch") and hasattr(b.model, "KVCache")
    assert chapter_dir(2).name == "02_kv_cache"


def make(*args):
    return subprocess.run(["make", "-s", *args], capture_output=True, text=True, cwd=REPO, timeout=600)


def test_make_diff_chapter_shows_the_lesson():
    r = make("diff-chapter2")
    assert r.returncode == 0, r.stderr
    assert "+import torch" in r.stdout and "kv_cache.py" in r.stdout.split("\n= ")[2]  # listed as new code
    r = make("diff-chapter3")
    assert r.returncode == 0, r.stderr
    assert "+def sample(" in r.stdout
    ch02, ch03 = chapter_dir(2), chapter_dir(3)
    plus_lines = {line[1:] for line in r.stdout.splitlines() if line.startswith("+")}
    new_code = [p for p in ch03.glob("*.py") if not (ch02 / p.name).exists() and p.name != "bench.py"]
    assert new_code, "chapter 03 adds modules"
    for path in new_code:  # every new module, in full
        missing = [line for line in path.read_text().splitlines() if line not in plus_lines]
        assert not missing, f"{path.name}: {missing[:3]}"
    # Code first: the README and tests are listed in the summary, and diffed only with ALL=1, after the code.
    assert "README.md" in r.stdout and "= README.md (changed)" not in r.stdout
    everything = make("diff-chapter3", "ALL=1").stdout
    assert everything.index("= sampling.py (new file)") < everything.index("= README.md (changed)")


def shown_files(diff: str) -> list[str]:
    """The file headers after the summary, in order: `= name (new file)` -> name."""
    body = diff.split("\n\n", 1)[1]  # the summary ends at the first blank line
    return [line[2:].split(" (")[0] for line in body.splitlines() if line.startswith("= ") and " (" in line]


@pytest.mark.parametrize("number", [5, 6, 7])
def test_make_diff_chapter_starts_with_the_new_modules(number):
    r = make(f"diff-chapter{number}")
    assert r.returncode == 0, r.stderr
    prev, cur = chapter_dir(number - 1), chapter_dir(number)
    new = {p.name for p in cur.glob("*.py") if not (prev / p.name).exists()} - {"bench.py", "peers.py", "conftest.py"}
    shown = shown_files(r.stdout)
    assert set(shown[: len(new)]) == new, shown
    # the summary is all that comes before them (2,486 lines of other files once did, in chapter 05)
    assert r.stdout.splitlines().index(f"= {shown[0]} (new file)") < 30
    # dependencies first: a new module comes after every new module it imports
    for name in new:
        text = (cur / name).read_text()
        for dep in new - {name}:
            if f"from {dep[:-3]} import" in text or f"import {dep[:-3]}\n" in text:
                assert shown.index(dep) < shown.index(name), (dep, name)
    # bench.py's helpers are read with the benchmark, under ALL=1, not among the engine's modules
    assert "peers.py" not in shown
    everything = shown_files(make(f"diff-chapter{number}", "ALL=1").stdout)
    if (prev / "peers.py").read_bytes() != (cur / "peers.py").read_bytes():  # shown only where it changed
        assert everything.index("bench.py") < everything.index("peers.py")


def test_make_diff_chapter_shows_rewritten_modules_whole_and_points_at_kernels():
    r = make("diff-chapter5")
    assert r.returncode == 0, r.stderr
    assert shown_files(r.stdout)[:2] == ["block_manager.py", "paged_cache.py"]  # as chapter 05's README tells it
    # chapter 05's engine is mostly new: every line of it is a `+` line, not a diff against chapter 04's
    assert "= engine.py (rewritten" in r.stdout
    plus_lines = {line[1:] for line in r.stdout.splitlines() if line.startswith("+")}
    engine = (chapter_dir(5) / "engine.py").read_text().splitlines()
    assert [line for line in engine if line not in plus_lines] == []
    assert "= model.py (changed)" in r.stdout  # a module with a smaller change stays a diff
    r = make("diff-chapter6")
    summary = r.stdout.split("shows the other files too\n", 1)[0]
    assert "kernels/README.md" in summary and "kernels/csrc/cuda/*.cu" in summary
    assert "kernels/README.md" not in make("diff-chapter5").stdout.split("shows the other files too\n", 1)[0]
    assert shown_files(r.stdout)[:2] == ["ops.py", "cuda_graphs.py"]


def test_make_run_takes_each_branch_of_its_recipe():
    r = make("run", "CHAPTER=00")
    assert r.returncode == 0 and "134,515,008" in r.stdout and "note:" not in r.stderr
    # chapter 00 prints the model report: a prompt given to it was dropped without a word
    r = make("run", "CHAPTER=0", "PROMPT=Hello")
    assert r.returncode == 0 and "note: 00_setup generates nothing (it prints the model report)" in r.stderr
    r = make("run", "CHAPTER=1", "MODEL=tiny-llama3", "MAX_NEW_TOKENS=3")
    assert r.returncode == 0, r.stderr
    assert "ch01 numpy" in r.stderr
    # --dtype auto: bf16 on a GPU. The Makefile's PROMPT ("... Answer in one sentence.") reaches "Paris"
    # by fp32 top-2 margins >= 1.5 logits, far beyond what bf16 arithmetic moves them (chapter 02's
    # test_generate_answers_a_chat_prompt[bfloat16] asserts those margins).
    r = make("run", "CHAPTER=03", "MAX_NEW_TOKENS=16")
    assert r.returncode == 0 and "Paris" in r.stdout, r.stderr
    # Chapters 04 and 05 take the recipe's branch of the newest chapter (cli.py, QUANT=int4 since
    # quantize.py is there): each chapter's test_cli.py runs its cli.py the same way.
    # The newest chapter, `make run`'s default: int4 weights, bf16 activations, kernels/' C++ kernels
    r = make("run", "MAX_NEW_TOKENS=16")
    assert r.returncode == 0 and "Paris" in r.stdout, r.stderr
    assert "int4 G=32" in r.stderr and "kernels: on" in r.stderr


@pytest.mark.parametrize("number", ["8", "08", "09"])
def test_make_test_chapter_runs_that_chapters_tests(number):
    # "08" and "09" read as octal numbers made printf fail and pytest run chapter 00's tests
    (folder,) = (REPO / "chapters").glob(f"0{number[-1]}_*")
    r = make("-n", f"test-chapter{number}")
    assert r.returncode == 0 and r.stdout.split()[-1] == f"chapters/{folder.name}/tests"


def test_make_says_which_chapters_there_are_when_a_chapter_is_not_one():
    # a full name must be a folder's own: "03_nope" ran chapter 03
    # one chapter: "3 4" was read as 3
    cases = [("run", ["CHAPTER=99"]), ("serve", ["CHAPTER=abc"]), ("test-chapter99", []), ("run", ["CHAPTER=03_nope"])]
    cases += [("run", ["CHAPTER=3 4"]), ("serve", ["CHAPTER=03_sampling_server 04_quant"])]
    for target, args in cases:
        r = make(target, *args)
        assert r.returncode == 2 and "no such chapter here (00_setup 01_numpy_forward" in r.stderr, (target, r.stderr)
    r = make("serve", "CHAPTER=2")
    assert r.returncode == 2 and "error: 02_kv_cache has no server (chapters 03 on have one)" in r.stderr


def test_make_refuses_a_quant_that_is_none_and_says_where_it_changes_nothing():
    # QUANT=int3 was dropped without a word by the chapters before 04 (and their QUANT=int8 too)
    for target in ("run", "serve"):
        r = make(target, "CHAPTER=3", "QUANT=int3")
        assert r.returncode == 2 and "error: QUANT=int3: none, int8 or int4" in r.stderr, r.stderr
    r = make("run", "CHAPTER=2", "QUANT=int8", "MODEL=tiny-llama3", "MAX_NEW_TOKENS=2")
    assert r.returncode == 0 and "note: QUANT=int8 applies from chapter 04 on: 02_kv_cache" in r.stderr, r.stderr
    assert "note: QUANT" not in make("run", "CHAPTER=2", "MODEL=tiny-llama3", "MAX_NEW_TOKENS=2").stderr


def changed_files(chapter: Path) -> list[str]:
    """The engine files (*.py beside the README) that chapter N adds to N-1 or changes."""
    previous = next((REPO / "chapters").glob(f"{int(chapter.name[:2]) - 1:02d}_*"))
    return [
        f.name
        for f in sorted(chapter.glob("*.py"))
        if not (previous / f.name).is_file() or (previous / f.name).read_bytes() != f.read_bytes()
    ]


@pytest.mark.parametrize("chapter", sorted((REPO / "chapters").glob("0[1-9]_*")), ids=lambda p: p.name)
def test_the_readme_names_every_file_the_chapter_adds_or_changes(chapter):
    # The root README promises a "What changed from chapter N-1" section with a line per file: a file
    # that changed without a word there is a lesson the reader does not know to look for.
    readme = (chapter / "README.md").read_text()
    start = readme.index("## What changed from chapter")
    end = readme.find("\n## ", start + 1)
    section = readme[start : end if end > 0 else None]
    missing = [name for name in changed_files(chapter) if f"`{name}`" not in section]
    assert not missing, f"{chapter.name}/README.md's 'What changed' section does not name {missing}"


def test_the_lesson_leaves_out_what_git_ignores(tmp_path):
    # a .hypothesis/ folder a test run left in a chapter was listed (and, ALL=1, printed) as new files
    from common.tools.diff_chapters import files_of

    for name in ("engine.py", ".hypothesis/examples/x", "__pycache__/engine.pyc", ".pytest_cache/v"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert files_of(tmp_path) == {"engine.py"}
