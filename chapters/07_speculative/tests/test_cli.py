import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.tools.warm_python import run_python
from sampling import SamplingParams

REACHES = ["cli.py"]  # scripts run in a subprocess (common/tools/carried.py)

CHAPTER = Path(__file__).resolve().parents[1]


def run(*args, stdin=None):
    return run_python([str(CHAPTER / "cli.py"), *args], input=stdin, cwd=CHAPTER, timeout=600)


# Exact answers are checked in float32: --dtype auto means bf16 on a GPU, where greedy picks at
# near-ties depend on the bf16 kernels ("What is the capital of France?" may start "L'Étoile"; see
# chapters/02_kv_cache/README.md, "Logits stay in the model dtype").
EXACT = ("--dtype", "float32")


def test_one_shot_streams_an_answer():
    r = run("--prompt", "What is the capital of France?", "--temperature", "0", "--max-new-tokens", "20", *EXACT)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "tok/s" in r.stderr and "finish: stop" in r.stderr


def test_interactive_chat_keeps_history():
    r = run(
        "--temperature",
        "0",
        "--max-new-tokens",
        "16",
        *EXACT,
        stdin="What is the capital of France?\nAnd what did I just ask you?\n/reset\nHi\n/quit\n",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("model> ") == 3 and "Paris" in r.stdout
    prompt_sizes = [int(line.split()[0][1:]) for line in r.stderr.splitlines() if "prompt tokens" in line]
    assert len(prompt_sizes) == 3
    assert prompt_sizes[1] > prompt_sizes[0] + 10  # the second turn carries the first exchange
    assert prompt_sizes[2] < prompt_sizes[1]  # /reset forgot it


def test_raw_completion_and_stop_string():
    r = run("--raw", "--prompt", "1, 2, 3, 4,", "--temperature", "0", "--max-new-tokens", "20", "--stop", " 7", *EXACT)
    assert r.returncode == 0, r.stderr
    assert "5" in r.stdout and " 7" not in r.stdout and "finish: stop" in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "2"], "top_p"),
        (["--max-new-tokens", "0"], "--max-new-tokens: must be at least 1"),
        (["--model", "/nope"], "no such directory"),
    ],
)
def test_bad_flags_are_clear_errors(args, message):
    # tiny-llama3 (a case's own --model comes later and wins): cli.py checks the sampling flags once
    # its model is loaded, and SmolLM2's float32 weights take seconds to load for each error
    r = run("--model", "tiny-llama3", "--prompt", "hi", *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--raw"], "--raw completes a --prompt"),
        (["--raw", "--chat", "--prompt", "hi"], "--chat goes into the chat template, which --raw leaves out"),
        (["--raw", "--system", "Be brief.", "--prompt", "hi"], "--system goes into the chat template"),
    ],
)
def test_raw_with_the_chats_settings_is_refused(args, message, monkeypatch, capsys):
    # --raw completes --prompt as plain text: a --system message, --chat, or the chat itself were dropped unseen
    import cli

    monkeypatch.setattr(sys, "argv", ["cli.py", *args])
    with pytest.raises(SystemExit) as stop:
        cli.parse_args()
    assert stop.value.code == 2 and message in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["cli.py", "--raw", "--prompt", "hi"])
    assert cli.parse_args().raw


def test_a_chat_with_stdin_closed_is_a_clear_error(monkeypatch):
    import cli
    from common.errors import UserError

    monkeypatch.setattr(sys, "stdin", None)  # what Python makes of a closed fd 0
    with pytest.raises(UserError, match="stdin, which is closed: give --prompt"):
        cli.chat_loop(None, SimpleNamespace(system=None))


def test_the_terminal_chat_does_not_load_the_http_layer():
    code = (
        "import sys\n"
        "sys.argv = ['cli.py', '--model', 'tiny-llama3', '--prompt', 'hi', '--max-new-tokens', '2',\n"
        "            '--temperature', '0']\n"
        "import cli\n"
        "cli.main()\n"
        "print('LOADED', sorted(m for m in ('fastapi', 'uvicorn', 'starlette', 'server') if m in sys.modules))\n"
    )
    r = run_python(["-c", code], cwd=CHAPTER, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "LOADED []" in r.stdout and "2 generated" in r.stderr
    # one conversation, one sequence: a pool of one full context, not a server's share of the memory
    assert "KV cache: 8192 blocks of 16 tokens = 131072 tokens in 0.25 GiB" in r.stderr


def test_sampling_flags_override_the_model_defaults():
    from cli import request_params

    engine = SimpleNamespace(default_params=lambda: SamplingParams(temperature=0.6, top_p=0.9, top_k=50))
    args = argparse.Namespace(temperature=0.0, top_k=None, top_p=None, min_p=None, repetition_penalty=None, seed=3)
    params = request_params(args, engine)
    # 0.0 is a value (greedy), not "unset"; what the flags leave out stays the model's
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.0, 0.9, 50, 3)


def test_a_line_that_is_not_utf8_is_refused_and_the_chat_goes_on():
    # bytes from a terminal in another encoding: strict decoding ended the whole chat (exit 2)
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, str(CHAPTER / "cli.py"), "--model", "tiny-llama3", "--max-new-tokens", "4", "--temperature", "0"],
        input=b"caf\xe9 au lait\nHi\n/quit\n",
        capture_output=True,
        cwd=CHAPTER,
        timeout=300,
    )
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 0, err
    assert "error: that line is not UTF-8 text; the chat goes on without it" in err
    assert r.stdout.decode(errors="replace").count("model> ") == 1  # "Hi" was answered
