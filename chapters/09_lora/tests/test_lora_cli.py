"""The chat CLI with --lora: every reply through one adapter, and a bad adapter refused in a sentence."""

from pathlib import Path

from common.tools.warm_python import run_python

REACHES = ["cli.py"]  # scripts run in a subprocess (common/tools/carried.py)

CHAPTER = Path(__file__).resolve().parents[1]


def run(*args):
    return run_python([str(CHAPTER / "cli.py"), *args], cwd=CHAPTER, timeout=600)


def test_the_pirate_answers_through_the_cli():
    flags = ("--prompt", "Who wrote Hamlet?", "--temperature", "0", "--max-new-tokens", "12", "--dtype", "float32")
    r = run("--lora", "smollm2-135m-lora-pirate", *flags)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Ahoy, matey!") and "LoRA adapter smollm2-135m-lora-pirate" in r.stderr
    base = run(*flags)  # the same question without it: the base model's answer
    assert base.returncode == 0 and "Ahoy" not in base.stdout and "LoRA" not in base.stderr


def test_a_bad_adapter_is_one_line(tmp_path):
    r = run("--lora", str(tmp_path / "missing"), "--prompt", "hi")
    assert r.returncode == 2 and "no such directory, and not a known name" in r.stderr, r.stderr
    (tmp_path / "empty").mkdir()
    r = run("--lora", str(tmp_path / "empty"), "--prompt", "hi")
    assert r.returncode == 2 and "adapter_config.json" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run("--lora", "", "--prompt", "hi")  # Path("") is ".": it read the folder the command ran in
    assert r.returncode == 2 and "the adapter name is empty" in r.stderr, r.stderr
