"""common.cli.run_main: a user's mistake is one line and exit status 2; a run that cannot go on, said
whole (a lost rank), one line and exit status 1; a bug keeps its traceback."""

import pytest

from common.cli import run_main
from common.errors import RunError, UserError
from common.tools.warm_python import run_python


@pytest.mark.parametrize(
    "error, status",
    [(UserError("--widgets must be at least 1, got 0"), 2), (RunError("rank 1 (pid 4242) exited with status -9"), 1)],
    ids=["user error: exit 2", "run error: exit 1"],
)
def test_a_user_error_or_a_run_error_is_one_line(capsys, error, status):
    def main():
        raise error

    with pytest.raises(SystemExit) as exited:
        run_main(main)
    assert exited.value.code == status
    assert capsys.readouterr().err == f"error: {error}\n"


def test_an_internal_value_error_keeps_its_traceback():
    # A ValueError from a bug (a shape check, a library's own) is not a user's mistake.
    code = "from common.cli import run_main\ndef main():\n    raise ValueError('shape mismatch')\nrun_main(main)\n"
    r = run_python(["-c", code], timeout=60)
    assert r.returncode == 1 and "Traceback" in r.stderr and "ValueError: shape mismatch" in r.stderr, r.stderr
    assert "error: shape mismatch" not in r.stderr


def test_the_positive_argument_types_refuse_what_would_read_as_not_given_or_nan():
    # `x or default` reads 0 as "not given"; float() takes "nan" and "inf": each is refused when the
    # flags are read, with the flag's name (argparse adds it), not deep in a run.
    import argparse

    from common.cli import positive_float, positive_int

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=positive_int)
    ap.add_argument("--gb", type=positive_float)
    assert ap.parse_args(["--n", "3", "--gb", "0.5"]) == argparse.Namespace(n=3, gb=0.5)
    for flags in (["--n", "0"], ["--n", "-2"], ["--gb", "0"], ["--gb", "nan"], ["--gb", "inf"], ["--gb", "-1"]):
        with pytest.raises(SystemExit):
            ap.parse_args(flags)


def test_a_prompt_is_checked_against_the_models_context_and_vocabulary():
    # ids past the model's vocabulary (a tokenizer larger than its embedding) were an IndexError
    from types import SimpleNamespace

    from common.cli import check_prompt

    config = SimpleNamespace(max_position_embeddings=16, vocab_size=1000)
    check_prompt([1, 999], 4, config)
    for ids, message in (
        ([], "the prompt is empty"),
        (list(range(16)), "the prompt has 16 tokens; the model's context is 16 tokens"),
        ([5, 1000, 19556], r"prompt token ids \[1000, 19556\] are outside the model's vocabulary \(0..999\)"),
    ):
        with pytest.raises(UserError, match=message):
            check_prompt(ids, 4, config)
