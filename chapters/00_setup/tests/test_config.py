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
    assert (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) == (32.0, 1.0, 4.0, 8192)


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
    raw["eos_token_id"] = [128001, 128008, 128009]
    assert config_from_dict(raw).eos_token_ids == (128001, 128008, 128009)


def test_non_llama_architecture_is_rejected_by_name(tmp_path):
    raw = json.loads((resolve_model("smollm2-135m") / "config.json").read_text())
    raw |= {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="unsupported architecture MistralForCausalLM"):
        load_config(tmp_path)


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


def test_unknown_model_name():
    with pytest.raises(ModelNotFoundError, match="not a known name"):
        resolve_model("llama-9000")
