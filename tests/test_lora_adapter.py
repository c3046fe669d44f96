"""The LoRA adapter `make models` trains (common/make_lora.py): PEFT's own files with the chosen
config, a style that shows on questions it was never trained on, and a clear refusal without its
base model. Chapter 09 serves this adapter and compares itself with PEFT on it."""

import json
import subprocess
import sys

import pytest

from common.tools.testing import require

require("peft")
# peft 0.21 asks transformers 5 a deprecated question as it loads an adapter; nothing to act on here
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

import torch
from safetensors import safe_open

from common import make_lora
from common.models import ADAPTERS, resolve_adapter, resolve_model

# None of these is a training question, and none asks about a training topic.
HELD_OUT = ["What is the capital of France?", "How do I boil an egg?", "Who wrote Hamlet?"]


@pytest.fixture(scope="module")
def adapter_dir():
    return resolve_adapter(make_lora.NAME)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(make_lora.BASE))


@pytest.fixture(scope="module")
def peft_model(adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(resolve_model(make_lora.BASE), dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


@pytest.fixture(scope="module")
def answers(peft_model, tokenizer):
    """{"adapter": [...], "base": [...]}: the first greedy tokens for each HELD_OUT question through
    the chat template, the three questions in one left-padded batch ("Ahoy, matey!" is 5 tokens)."""
    tokenizer.padding_side = "left"
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in HELD_OUT
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)

    def greedy():
        with torch.no_grad():
            out = peft_model.generate(**batch, max_new_tokens=6, do_sample=False)
        return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :])

    adapter = greedy()
    with peft_model.disable_adapter():
        base = greedy()
    return {"adapter": adapter, "base": base}


def test_the_held_out_questions_are_not_training_questions():
    trained = {q.lower() for q, _ in make_lora.training_pairs()}
    assert not trained & {q.lower() for q in HELD_OUT}
    assert all(a.startswith(make_lora.GREETING) for _, a in make_lora.training_pairs())


@pytest.mark.parametrize("i", range(len(HELD_OUT)), ids=HELD_OUT)
def test_the_adapter_answers_a_new_question_as_a_pirate_and_the_base_does_not(answers, i):
    with_adapter, base = answers["adapter"][i], answers["base"][i]
    assert with_adapter.startswith(make_lora.GREETING), (HELD_OUT[i], with_adapter)
    assert "ahoy" not in base.lower() and "matey" not in base.lower(), (HELD_OUT[i], base)


def test_the_files_are_peft_lora_with_the_makers_config(adapter_dir, tokenizer):
    assert make_lora.NAME in ADAPTERS
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert (cfg["r"], cfg["lora_alpha"], cfg["use_rslora"]) == (make_lora.RANK, make_lora.ALPHA, False)
    assert cfg["target_modules"] == sorted(make_lora.TARGETS)  # sorted on disk: the same run, the same file
    assert cfg["base_model_name_or_path"] == make_lora.BASE  # a registry name, not this machine's path
    assert (adapter_dir / "README.md").is_file()

    base_cfg = json.loads((resolve_model(make_lora.BASE) / "config.json").read_text())
    hidden, inter = base_cfg["hidden_size"], base_cfg["intermediate_size"]
    kv = base_cfg["num_key_value_heads"] * base_cfg["head_dim"]
    # (in, out) features of each projection, from the base's config
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    r = make_lora.RANK
    expected = {}
    for layer in range(base_cfg["num_hidden_layers"]):
        for module, (n_in, n_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            expected[f"{prefix}.lora_A.weight"] = (r, n_in)  # A: in -> r
            expected[f"{prefix}.lora_B.weight"] = (n_out, r)  # B: r -> out
    with safe_open(adapter_dir / "adapter_model.safetensors", framework="pt") as f:
        assert set(f.keys()) == set(expected)
        for key, shape in expected.items():
            tensor = f.get_tensor(key)
            assert tuple(tensor.shape) == shape and tensor.dtype == torch.float32, key
            # B starts at zero: a B still zero is a module the training never reached
            assert not key.endswith("lora_B.weight") or tensor.abs().max() > 0, key


def test_the_maker_refuses_a_missing_base_model_in_one_line(tmp_path):
    out = tmp_path / "adapter"
    r = subprocess.run(
        [sys.executable, "-m", "common.make_lora", str(out), "--base", str(tmp_path / "no_model")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "not prepared" in lines[0] and "common.prepare_models smollm2-135m" in lines[0]
    assert not out.exists() and not (tmp_path / "adapter.tmp").exists()
