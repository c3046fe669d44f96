"""generate.py and parity.py from the command line: answers, batches, tables, clear errors."""

from pathlib import Path

import pytest

from common.tools.warm_python import run_python

REACHES = ["generate.py", "parity.py"]  # scripts run in a subprocess (common/tools/carried.py)

CHAPTER = Path(__file__).resolve().parents[1]


def run(*args):
    return run_python(args, cwd=CHAPTER, timeout=600)


# A bf16 answer is only as fixed as its closest greedy step. "What is the capital of France?" starts
# with "The" ahead of "L" (as in "L'Étoile") by 0.098 logits in fp32, less than one bf16 step near
# 25 (0.125): in bf16 either may win, depending on the CPU's bf16 kernels (README: "Logits stay in
# the model dtype"). Asked for one sentence, each greedy step up to "Paris" wins by >= 1.5 logits,
# and bf16 arithmetic moved a top-2 margin by at most 0.45 in our measurements.
PROMPT = "What is the capital of France? Answer in one sentence."
BF16_SAFE_MARGIN = 1.0


def fp32_greedy_margins(prompt: str, until: str, max_new_tokens: int = 12) -> tuple[str, list[float]]:
    """The fp32 greedy answer up to the token that completes `until`, and the top-2 logit margin of
    each of its steps."""
    import torch

    from common.models import resolve_model
    from common.tokenizer import Tokenizer
    from generate import generate_all
    from model import forward_sequence, load_model

    d = resolve_model("smollm2-135m")
    tok, model = Tokenizer(d), load_model(d)
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    answer = generate_all(model, [ids], max_new_tokens)[0]
    n = next((i + 1 for i in range(len(answer)) if until in tok.decode(answer[: i + 1])), None)
    assert n is not None, f"fp32 greedy answer {tok.decode(answer)!r} lacks {until!r}"
    with torch.inference_mode():
        logits = forward_sequence(model, ids + answer[:n])[len(ids) - 1 : -1]  # [n, vocab]
    top2 = logits.topk(2).values
    return tok.decode(answer[:n]), (top2[:, 0] - top2[:, 1]).tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generate_answers_a_chat_prompt(dtype):
    r = run(
        str(CHAPTER / "generate.py"),
        "--chat",
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "12",
        "--device",
        "cpu",
        "--dtype",
        dtype,
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    status = [line for line in r.stderr.splitlines() if line.startswith("[ch")]
    assert "TTFT" in status[-1] and "decode" in status[-1] and "tok/s" not in r.stdout
    assert "kernels: " in status[-1], status  # on, or off and why: the line says which path ran
    if dtype == "bfloat16":
        # No step up to "Paris" is a near-tie, so bf16 must follow the fp32 answer token for token.
        text, margins = fp32_greedy_margins(PROMPT, "Paris")
        assert min(margins) >= BF16_SAFE_MARGIN, f"{text!r}: top-2 margins {margins}"
        assert r.stdout.startswith(text), (r.stdout, text)


def test_generate_batch_prints_one_answer_per_prompt():
    second = "Name a fruit that is yellow."
    exact = ("--device", "cpu", "--dtype", "float32")  # equality across batch shapes: fp32 on CPU
    r = run(
        str(CHAPTER / "generate.py"),
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--prompt",
        second,
        "--max-new-tokens",
        "10",
        *exact,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    alone = run(
        str(CHAPTER / "generate.py"), "--chat", "--prompt", second, "--max-new-tokens", "10", *exact
    ).stdout.strip()
    assert len(lines) == 2 and "Paris" in lines[0] and lines[1] == alone


def test_parity_cli_prints_the_table():
    r = run(str(CHAPTER / "parity.py"), "--model", "tiny-llama3")
    assert r.returncode == 0, r.stderr
    assert "layer.3" in r.stdout and "100.0%" in r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/no/such/model"], "no such directory"),
        (["--model", "tiny-llama3", "--prompt", ""], "the prompt is empty"),
        (["--max-seq", "99999"], "exceeds the model's context of 8192 tokens"),
        (["--max-seq", "4"], "--max-seq is 4"),
        (["--dtype", "float8"], "--dtype must be"),
        (["--device", "tpu"], "--device must be"),
    ],
)
def test_bad_input_is_a_clear_error(args, message):
    r = run(str(CHAPTER / "generate.py"), *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_generation_stops_where_the_context_ends():
    # A reply may fill the context and no more (chapter 01's rule, and the engines' from chapter 03):
    # this loop yielded one token more, at the position the context's length, past its end.
    import dataclasses

    from common.models import resolve_model
    from generate import generate_all
    from model import load_model

    model = load_model(resolve_model("tiny-llama3"))
    model.config = dataclasses.replace(model.config, max_position_embeddings=16)
    prompt = list(range(300, 312))  # 12 tokens: room for 4
    assert len(generate_all(model, [prompt], 20)[0]) == 4
    alone = generate_all(model, [prompt[:9]], 20)[0]
    assert len(alone) == 7
    # the long prompt's end is not the short one's: it goes on, token for token as alone
    assert generate_all(model, [prompt, prompt[:9]], 20) == [generate_all(model, [prompt], 20)[0], alone]


def test_logits_that_are_not_finite_end_the_run_instead_of_printing_a_token():
    # An overflow (float16 activations, or weights that hold inf) made every logit NaN, and argmax
    # answered token 0 each step: an empty reply (token 0 is special), exit status 0.
    import torch

    from common.errors import RunError
    from common.models import resolve_model
    from generate import generate_all
    from model import load_model

    model = load_model(resolve_model("tiny-llama3"))
    with torch.no_grad():
        model.norm.fill_(float("nan"))
    with pytest.raises(RunError, match="logits are not finite"):
        generate_all(model, [[300, 301, 302]], 4)


def test_a_run_the_cache_cut_short_says_so():
    # --max-seq 14 for a 1-token prompt and 20 new tokens: 13 came, and nothing said why
    flags = (str(CHAPTER / "generate.py"), "--model", "tiny-llama3", "--prompt", "hi", "--device", "cpu")
    r = run(*flags, "--max-new-tokens", "20", "--max-seq", "14")
    assert r.returncode == 0 and "note: stopped after 13 of --max-new-tokens 20" in r.stderr, r.stderr
    assert "note: stopped" not in run(*flags, "--max-new-tokens", "3").stderr  # all it asked for
