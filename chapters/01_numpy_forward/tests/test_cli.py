import subprocess
import sys
from pathlib import Path

import pytest

from common.tools.warm_python import run_python

CHAPTER = Path(__file__).resolve().parents[1]


def run(*args):
    return run_python(args, cwd=CHAPTER, timeout=300)


def test_generate_answers_a_chat_prompt():
    r = run(
        str(CHAPTER / "generate.py"), "--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "12"
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr and "tok/s" not in r.stdout  # statistics go to stderr


def test_parity_cli_prints_the_table():
    r = run(str(CHAPTER / "parity.py"), "--model", "tiny-llama3")
    assert r.returncode == 0, r.stderr
    assert "layer.3" in r.stdout and "100.0%" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/no/such/model"], "no such directory"),
        (["--model", "tiny-llama3", "--prompt", ""], "the prompt is empty"),
        (["--model", "tiny-llama3", "--max-new-tokens", "0"], "--max-new-tokens: must be at least 1"),
    ],
)
def test_bad_input_is_a_clear_error(args, message):
    r = run(str(CHAPTER / "generate.py"), *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("text, message", [("", "the prompt is empty"), ("abc\udcff", "not valid UTF-8")])
def test_parity_refuses_what_it_cannot_run(text, message):
    # An empty text was an IndexError; a text past the context ran past it unchecked.
    r = run(str(CHAPTER / "parity.py"), "--model", "tiny-llama3", "--text", text)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_bench_runs_and_saves_figures(tmp_path):
    r = run(
        str(CHAPTER / "bench.py"),
        "--model",
        "tiny-llama3",
        "--lengths",
        "8,32",
        "--repeats",
        "1",
        "--out",
        str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    import json

    rows = json.loads((tmp_path / "ch01_cost_per_token_tiny-llama3.json").read_text())["rows"]
    assert [row["context_tokens"] for row in rows] == [8, 32] and all(row["ms_per_token"] > 0 for row in rows)
    assert (tmp_path / "ch01_cost_per_token_tiny-llama3.png").stat().st_size > 1000


def test_engine_imports_numpy_only():
    """Chapter 01 is the NumPy chapter: its engine must not pull in torch (directly or through common/).
    parity.py may: it runs HF transformers as the reference."""
    code = "import sys; import model, rope, generate; assert 'torch' not in sys.modules, 'torch imported'"
    # `python -c` puts the working directory (the chapter) first on sys.path, as a script would.
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=CHAPTER, env={"PATH": "/usr/bin:/bin"}
    )
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    "flags, message",
    [(["--lengths", "0"], "expected positive integers, got '0'"), (["--repeats", "0"], "must be at least 1, got 0")],
)
def test_bench_refuses_what_it_cannot_time(flags, message):
    # --lengths 0: an IndexError; --repeats 0: "Infinity" ms per token in the JSON
    r = run(str(CHAPTER / "bench.py"), "--model", "tiny-llama3", *flags)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_logits_that_are_not_finite_end_the_run_instead_of_printing_a_token():
    # An overflow (weights that hold inf) made every logit NaN, and argmax answered token 0 each
    # step: an empty reply (token 0 is special), exit status 0.
    from common.errors import RunError
    from common.models import resolve_model
    from generate import generate
    from model import load_model

    model = load_model(resolve_model("tiny-llama3"))
    model.norm[:] = float("nan")
    with pytest.raises(RunError, match="logits are not finite"):
        list(generate(model, [300, 301, 302], 4))


def test_a_run_the_context_cut_short_says_so(tmp_path):
    # a 16-token context: 13 tokens for --max-new-tokens 50, and nothing said why
    import json

    from common.models import resolve_model

    tiny = resolve_model("tiny-llama3")
    for f in tiny.iterdir():
        (tmp_path / f.name).symlink_to(f)
    config = json.loads((tiny / "config.json").read_text()) | {"max_position_embeddings": 16}
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = run("generate.py", "--model", str(tmp_path), "--prompt", "hi", "--max-new-tokens", "50")
    assert r.returncode == 0, r.stderr
    assert "note: stopped after 15 of --max-new-tokens 50: the model's context (16 tokens) is full" in r.stderr
