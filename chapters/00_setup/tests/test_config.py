import json

import pytest

from common.config import ConfigError, config_from_dict, load_config
from common.models import ModelNotFoundError, resolve_model


def test_smollm2_config():
    c = load_config(resolve_model("smollm2-135m"))
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.n_rep) == (9, 3, 64, 3)
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.tie_word_embeddings and c.vocab_size == 49152
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)


def test_tiny_llama3_config_uses_llama3_rope_scaling():
    c = load_config(resolve_model("tiny-llama3"))
    assert c.num_attention_heads // c.num_key_value_heads == 4
    assert c.rope_theta == 500000.0
    s = c.rope_scaling
    assert (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) == (
        32.0,
        1.0,
        4.0,
        8192,
    )


def test_download_form_and_transformers5_form_agree():
    """A Llama-3.x download (rope_theta + rope_scaling) and a transformers-5 save (rope_parameters) of the
    same model must parse to the same config."""
    t5 = json.loads((resolve_model("tiny-llama3") / "config.json").read_text())
    assert "rope_parameters" in t5
    download = {k: v for k, v in t5.items() if k != "rope_parameters"}
    params = dict(t5["rope_parameters"])
    download["rope_theta"] = params.pop("rope_theta")
    download["rope_scaling"] = params
    assert config_from_dict(download) == config_from_dict(t5)


def test_head_dim_defaults_to_hidden_over_heads():
    raw = json.loads((resolve_model("smollm2-135m") / "config.json").read_text())
    del raw["head_dim"]
    assert config_from_dict(raw).head_dim == 576 // 9


def test_eos_list_is_kept():
    raw = json.loads((resolve_model("smollm2-135m") / "config.json").read_text())
    raw["eos_token_id"] = [2, 7, 49151]
    assert config_from_dict(raw).eos_token_ids == (2, 7, 49151)


def test_non_llama_architecture_is_rejected_by_name(tmp_path):
    raw = json.loads((resolve_model("smollm2-135m") / "config.json").read_text())
    raw |= {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="unsupported architecture model_type 'mistral', architectures MistralForCausalLM"):
        load_config(tmp_path)
    # a Qwen2 config with a Llama class name: the model_type is what is wrong, and it is named
    with pytest.raises(ConfigError, match="unsupported architecture model_type 'qwen2', architectures LlamaForCausalLM"):
        config_from_dict(raw | {"model_type": "qwen2", "architectures": ["LlamaForCausalLM"]})


def test_a_config_without_model_type_is_read_by_its_architectures():
    # as transformers reads it; refused before, naming LlamaForCausalLM as what is not supported
    raw = json.loads((resolve_model("smollm2-135m") / "config.json").read_text())
    del raw["model_type"]
    assert config_from_dict(raw).num_hidden_layers == 30
    with pytest.raises(ConfigError, match="unsupported architecture model_type None, architectures MistralForCausalLM"):
        config_from_dict(raw | {"architectures": ["MistralForCausalLM"]})
    with pytest.raises(ConfigError, match="unsupported architecture model_type None;"):
        config_from_dict({k: v for k, v in raw.items() if k != "architectures"})


def test_unsupported_rope_type_is_rejected():
    raw = json.loads((resolve_model("smollm2-135m") / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ConfigError, match="unsupported rope_type 'yarn'"):
        config_from_dict(raw)


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(ConfigError, match="model directory not found"):
        load_config(tmp_path / "nope")
    with pytest.raises(ConfigError, match="has no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ConfigError, match="missing required field"):
        load_config(tmp_path)


def test_an_empty_model_name_is_refused_not_read_as_the_default():
    for empty in ("", "  "):
        with pytest.raises(ModelNotFoundError, match="the model name is empty: give a name"):
            resolve_model(empty)


def test_unknown_model_name():
    with pytest.raises(ModelNotFoundError, match="not a known name"):
        resolve_model("llama-9000")


def _smollm2():
    return json.loads((resolve_model("smollm2-135m") / "config.json").read_text())


BAD_FIELDS = [
    # (field, value, what the message must say)
    ("tie_word_embeddings", "false", "'tie_word_embeddings' must be true or false, got \"false\" \\(a string\\)"),
    ("hidden_size", "256", "'hidden_size' must be an integer, got \"256\" \\(a string\\)"),
    ("max_position_embeddings", -1, "'max_position_embeddings' must be at least 1, got -1"),
    ("max_position_embeddings", 1e8, "'max_position_embeddings' must be an integer, got 100000000.0 \\(a number\\)"),
    ("num_hidden_layers", 1e7, "'num_hidden_layers' must be an integer, got 10000000.0"),
    ("num_hidden_layers", True, "'num_hidden_layers' must be an integer, got true \\(a boolean\\)"),
    ("num_key_value_heads", 0, "'num_key_value_heads' must be at least 1"),
    ("vocab_size", None, "'vocab_size' must be an integer, got null"),
    ("rms_norm_eps", "1e-5", "'rms_norm_eps' must be a number"),
    ("rms_norm_eps", float("nan"), "'rms_norm_eps' must be a finite number"),
    ("rope_theta", 0, "'rope_theta' must be a finite number greater than 0"),
    ("rope_scaling", "llama3", "'rope_scaling' must be an object"),
    ("attention_bias", "no", "'attention_bias' must be true or false"),
    ("head_dim", 33, "head_dim=33 must be even"),
    ("hidden_act", "gelu", "unsupported hidden_act 'gelu'"),
    ("eos_token_id", 49152, "'eos_token_id' must hold token ids in 0..49151"),
    ("eos_token_id", [2, "3"], "'eos_token_id' must hold token ids"),
    ("bos_token_id", [1, 2], "'bos_token_id' must be one token id"),
    ("architectures", "LlamaForCausalLM", "'architectures' must be a list of names"),
]


@pytest.mark.parametrize("field,value,message", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v, _ in BAD_FIELDS])
def test_wrongly_typed_field_is_named(tmp_path, field, value, message):
    raw = _smollm2() | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=f"config.json: .*{message}"):
        load_config(tmp_path)


def test_llama3_scaling_fields_are_checked():
    raw = json.loads((resolve_model("tiny-llama3") / "config.json").read_text())
    raw["rope_parameters"] = raw["rope_parameters"] | {"original_max_position_embeddings": "8192"}
    with pytest.raises(
        ConfigError, match="\\(rope scaling\\): field 'original_max_position_embeddings' must be an integer"
    ):
        config_from_dict(raw)
    raw["rope_parameters"] |= {"original_max_position_embeddings": 8192, "high_freq_factor": 1.0}
    with pytest.raises(ConfigError, match="high_freq_factor \\(1.0\\) must be greater than low_freq_factor \\(1.0\\)"):
        config_from_dict(raw)
    del raw["rope_parameters"]["factor"]
    with pytest.raises(ConfigError, match="lacks the field\\(s\\) factor"):
        config_from_dict(raw)


def test_large_integer_context_is_accepted():
    # 100,000,000 positions is a legal integer: what must not happen is a table for all of them
    # (see test_model_loading.py).
    assert (
        config_from_dict(_smollm2() | {"max_position_embeddings": 100_000_000}).max_position_embeddings == 100_000_000
    )


@pytest.mark.parametrize("text,kind", [("[1, 2]", "a list"), ('"llama"', "a string"), ("null", "null")])
def test_config_that_is_not_an_object(tmp_path, text, kind):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=f"config.json: must hold a JSON object, got {kind}"):
        load_config(tmp_path)


def test_config_that_is_not_utf8(tmp_path):
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{\x00")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_config(tmp_path)


def test_generation_config_eos_ids_count_too(tmp_path):
    # HF's generate stops on generation_config.json's EOS ids; a checkpoint whose config.json names
    # fewer (Llama-3-Instruct's) ran on past its end of turn in chapters 01 and 02.
    raw = json.loads((resolve_model("smollm2-135m") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"eos_token_id": 0}))
    assert load_config(tmp_path).eos_token_ids == (0,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert load_config(tmp_path).eos_token_ids == (0, 2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [10**6]}))
    with pytest.raises(ConfigError, match=r"generation_config.json: field 'eos_token_id' must hold token ids"):
        load_config(tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"generation_config.json is not valid JSON"):
        load_config(tmp_path)
