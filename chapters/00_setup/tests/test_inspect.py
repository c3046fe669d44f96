import subprocess
import sys

import pytest
import torch

from common.config import load_config
from common.hf_reference import load_hf_model
from common.models import resolve_model
from common.tools.warm_python import run_python
from inspect_model import CONTEXTS, kv_cache_table, parameter_counts, weight_bytes_by_dtype

MODELS = ["smollm2-135m", "tiny-llama3"]


@pytest.mark.parametrize("name", MODELS)
def test_parameter_count_equals_hf(name):
    d = resolve_model(name)
    model = load_hf_model(str(d))
    hf_total = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    counts = parameter_counts(load_config(d))
    assert counts["total"] == hf_total
    assert counts["embedding"] == model.model.embed_tokens.weight.numel()
    assert counts["mlp"] == sum(p.numel() for n, p in model.named_parameters() if ".mlp." in n)


def test_weight_bytes_match_file():
    d = resolve_model("smollm2-135m")
    by_dtype = weight_bytes_by_dtype(d)
    assert list(by_dtype) == ["BF16"]
    assert by_dtype["BF16"][0] == parameter_counts(load_config(d))["total"]
    assert by_dtype["BF16"][1] == 2 * by_dtype["BF16"][0]


@pytest.mark.parametrize("name", MODELS)
def test_kv_bytes_per_token_equal_hf_cache(name):
    """What HF's cache really holds after a prompt, divided by the prompt length."""
    d = resolve_model(name)
    config = load_config(d)
    model = load_hf_model(str(d))
    seq = 11
    with torch.no_grad():
        cache = model(torch.arange(3, 3 + seq)[None], use_cache=True).past_key_values
    nbytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert nbytes / seq == config.kv_bytes_per_token(4)  # the reference runs in fp32
    fp16, fp32 = kv_cache_table(config)
    assert fp32[1] == 2 * fp16[1] == nbytes / seq
    assert fp16[2]["8k"] == fp16[1] * CONTEXTS["8k"]


def test_smollm2_kv_bytes_figure():
    # 2 (K and V) * 30 layers * 3 KV heads * 64 dims * 2 bytes = 23,040 bytes per token in fp16
    assert load_config(resolve_model("smollm2-135m")).kv_bytes_per_token(2) == 23040


def test_inspect_cli_prints_report():
    out = subprocess.run(
        [sys.executable, "chapters/00_setup/inspect_model.py", "--model", "smollm2-135m"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "134,515,008" in out and "22.5 KiB" in out and "round trip ok" in out


def test_inspect_cli_bad_model_is_a_clear_error(tmp_path):
    r = run_python(["chapters/00_setup/inspect_model.py", "--model", str(tmp_path)])
    assert r.returncode == 2 and "has no config.json" in r.stderr and "Traceback" not in r.stderr


def test_check_env_reports_versions():
    r = run_python(["chapters/00_setup/check_env.py"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"torch          {torch.__version__}" in r.stdout and "cuda" in r.stdout
