"""LlamaConfig: the handful of numbers that define a Llama-architecture model.

Reads a checkpoint directory's config.json in both shapes found in the wild:
- a Llama-3.x download: top-level `rope_theta` and `rope_scaling` ({"rope_type": "llama3", "factor": 32, ...});
- a transformers-5 save: one `rope_parameters` dict holding `rope_theta` and the scaling fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


class ConfigError(ValueError):
    """config.json is missing, unreadable, or describes a model this engine does not run."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's frequency-dependent RoPE scaling (rope_type "llama3").

    Low frequencies (wavelength > original_max / low_freq_factor) are slowed down by `factor`,
    high frequencies (wavelength < original_max / high_freq_factor) are left alone, and the band
    between is interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str = "float32"
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def n_rep(self) -> int:
        """How many query heads share one key/value head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """K and V, for every layer, for one token: 2 * layers * kv_heads * head_dim * bytes."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * bytes_per_element


def _rope_fields(raw: dict) -> tuple[float, RopeScaling | None]:
    # transformers 5 folds everything into rope_parameters; Llama-3.x downloads keep
    # rope_theta at the top level and a separate rope_scaling dict (or null).
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ConfigError(f"unsupported rope_type {rope_type!r}: this engine implements 'default' and 'llama3'")
    try:
        return float(theta), RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise ConfigError(f"rope scaling of type llama3 lacks the field {missing}") from None


def config_from_dict(raw: dict, source: str = "config.json") -> LlamaConfig:
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if model_type != "llama" or (archs and not set(archs) & set(SUPPORTED_ARCHITECTURES)):
        shown = ", ".join(archs) or f"model_type={model_type!r}"
        raise ConfigError(
            f"{source}: unsupported architecture {shown}; this engine runs Llama-architecture models "
            f"(model_type 'llama', {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
    missing = [k for k in required if k not in raw]
    if missing:
        raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ConfigError(f"{source}: attention_bias/mlp_bias checkpoints are not supported")

    n_heads = raw["num_attention_heads"]
    n_kv_heads = raw.get("num_key_value_heads") or n_heads
    if n_heads % n_kv_heads:
        raise ConfigError(f"{source}: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv_heads}")
    rope_theta, rope_scaling = _rope_fields(raw)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return LlamaConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        # Older configs omit head_dim; it is then hidden / heads. Llama 3.2 3B and others set it explicitly.
        head_dim=raw.get("head_dim") or raw["hidden_size"] // n_heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        raw=raw,
    )


def load_config(model_dir: str | Path) -> LlamaConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"model directory not found: {model_dir}")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir} has no config.json: is this a Hugging Face checkpoint directory?")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return config_from_dict(raw, source=str(path))
