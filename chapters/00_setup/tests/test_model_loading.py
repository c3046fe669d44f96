"""The loaders of chapters 01-03 on corrupted copies of tiny-llama3: a bad file is an
`error: <message>` (exit 2) from every entry point, and a huge context is not a huge allocation."""

import json
import re
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from common.models import resolve_model
from common.tools.warm_python import run_python

SCRIPTS = {
    "ch00": ["chapters/00_setup/inspect_model.py"],
    "ch01": ["chapters/01_numpy_forward/generate.py", "--prompt", "hi", "--max-new-tokens", "2"],
    "ch02": ["chapters/02_kv_cache/generate.py", "--prompt", "hi", "--max-new-tokens", "2"],
}


def _copy(tmp_path):
    d = tmp_path / "m"
    shutil.copytree(resolve_model("tiny-llama3"), d)
    return d


def _edit_config(d, **fields):
    path = d / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


def _run(script, d):
    args = SCRIPTS[script]
    return run_python([args[0], "--model", str(d), *args[1:]], timeout=120)


def _nan_weights(d):
    tensors = load_file(d / "model.safetensors")
    tensors["model.embed_tokens.weight"][7, 3] = np.nan
    save_file(tensors, d / "model.safetensors")


def _one_byte_short_header(d):
    data = (d / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    (d / "model.safetensors").write_bytes((n - 1).to_bytes(8, "little") + data[8:])


CORRUPTIONS = {
    "layers as a float": (lambda d: _edit_config(d, num_hidden_layers=1e7), "'num_hidden_layers' must be an integer"),
    "context as a float": (
        lambda d: _edit_config(d, max_position_embeddings=1e8),
        "'max_position_embeddings' must be an integer",
    ),
    "hidden size as a string": (lambda d: _edit_config(d, hidden_size="256"), "'hidden_size' must be an integer"),
    "tie as a string": (
        lambda d: _edit_config(d, tie_word_embeddings="false"),
        "'tie_word_embeddings' must be true or false",
    ),
    "config is a list": (lambda d: (d / "config.json").write_text("[]"), "must hold a JSON object"),
    "empty tokenizer": (lambda d: (d / "tokenizer.json").write_text(""), "not a valid tokenizer.json"),
    "template syntax": (
        lambda d: (d / "chat_template.jinja").write_text("{% if %}"),
        "syntax error in the chat template",
    ),
    "10M layers": (
        lambda d: _edit_config(d, num_hidden_layers=10_000_000),
        "missing tensors: model.layers.4.\\* ... model.layers.9999999.\\* \\(config says 10000000 layers, checkpoint has 4\\)",
    ),
    "NaN weight": (_nan_weights, "'model.embed_tokens.weight' contains NaN or infinite values"),
    "header one byte short": (_one_byte_short_header, "1 bytes after the last tensor"),
}


# Config and tokenizer checks are shared code: one entry point each is enough. The weights
# travel two paths (our NumPy reader in chapter 01, the safetensors library in 02+): both.
CASES = [(c, "ch01") for c in CORRUPTIONS] + [
    (c, "ch02") for c in ("10M layers", "NaN weight", "header one byte short", "tie as a string")
]


@pytest.mark.parametrize("corruption,script", CASES)
def test_entry_points_report_bad_checkpoints_in_one_line(tmp_path, script, corruption):
    corrupt, message = CORRUPTIONS[corruption]
    d = _copy(tmp_path)
    corrupt(d)
    r = _run(script, d)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[0]
    assert line.startswith("error: ") and len(line) > len("error: ") + 10
    assert re.search(message, r.stderr), r.stderr


def test_inspect_model_reports_a_bad_config(tmp_path):
    d = _copy(tmp_path)
    _edit_config(d, num_hidden_layers=1e7)
    r = _run("ch00", d)
    assert r.returncode == 2 and "error: " in r.stderr and "'num_hidden_layers' must be an integer" in r.stderr


# A subprocess, so that its peak memory is its own: load a chapter's model and run one step.
_MEMORY_SCRIPT = """
import resource, sys, torch
from common.tools.chapters import load_chapter
ch = load_chapter({chapter}, "model", "kv_cache")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model = ch.model.load_model(sys.argv[1], "cpu", getattr(torch, sys.argv[2]))
cache = ch.kv_cache.KVCache(model.config, 1, 8, "cpu", model.dtype)
logits = ch.model.forward(model, torch.tensor([[1, 2, 3, 4]]), cache)
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
print(grown, float(logits.float().abs().sum()))
"""


def _load_in_subprocess(chapter, d, dtype="float32"):
    r = run_python(["-c", _MEMORY_SCRIPT.format(chapter=chapter), str(d), dtype], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    grown_mib, logits_sum = r.stdout.split()
    return int(grown_mib), float(logits_sum)


@pytest.mark.parametrize("chapter", [2, 3])
def test_a_huge_context_builds_no_huge_rope_table(tmp_path, chapter):
    # 100,000,000 positions built a 6.4 GB cos/sin table at load time; 2,000,000 keep a
    # regression survivable (about 750 MB) while still far above what loading should cost.
    d = _copy(tmp_path)
    _edit_config(d, max_position_embeddings=2_000_000)
    grown, logits = _load_in_subprocess(chapter, d)
    assert grown < 300, f"loading tiny-llama3 grew the process by {grown} MiB"
    _, reference = _load_in_subprocess(chapter, resolve_model("tiny-llama3"))
    assert logits == reference  # RoPE computed per call gives the same numbers


def test_bf16_checkpoint_is_not_widened_on_the_way_to_a_bf16_model():
    # smollm2-135m is 269 MB of bf16. The old path made fp32 NumPy copies (538 MB) first.
    grown, _ = _load_in_subprocess(2, resolve_model("smollm2-135m"), "bfloat16")
    assert grown < 600, f"loading smollm2-135m in bf16 grew the process by {grown} MiB"
