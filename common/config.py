"""LlamaConfig: the handful of numbers that define a Llama-architecture model.

Reads a checkpoint directory's config.json in both shapes found in the wild:
- a Llama-3.x download: top-level `rope_theta` and `rope_scaling` ({"rope_type": "llama3", "factor": 32, ...});
- a transformers-5 save: one `rope_parameters` dict holding `rope_theta` and the scaling fields.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


class ConfigError(ValueError):
    """config.json is missing, unreadable, or describes a model this engine does not run."""


_REQUIRED = object()  # the default of a field that must be present


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


def _show(value) -> str:
    """A value as the user wrote it in JSON, shortened: error messages quote it."""
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _kind(value) -> str:
    """The JSON name of a value's type, for messages like 'got "256" (a string)'."""
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def _int(raw: dict, key: str, source: str, default=_REQUIRED, minimum: int = 1) -> int | None:
    """An integer field. JSON has one number type, so 1e8 arrives as a float and "256" as a
    string: both are rejected rather than converted, because a config that says either was
    written wrong, and guessing hides it (1e8 positions once built a 6 GB RoPE table)."""
    value = raw.get(key, default)
    if value is _REQUIRED:
        raise ConfigError(f"{source}: missing required field {key!r}")
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{source}: field {key!r} must be an integer, got {_show(value)} ({_kind(value)})")
    if value < minimum:
        raise ConfigError(f"{source}: field {key!r} must be at least {minimum}, got {value}")
    return value


def _number(raw: dict, key: str, source: str, default: float, positive: bool = True) -> float:
    """A real-valued field (int or float in JSON), finite, and > 0 unless `positive` is False (then >= 0)."""
    value = raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{source}: field {key!r} must be a number, got {_show(value)} ({_kind(value)})")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "greater than 0" if positive else "at least 0"
        raise ConfigError(f"{source}: field {key!r} must be a finite number {bound}, got {value}")
    return float(value)


def _bool(raw: dict, key: str, source: str, default: bool = False) -> bool:
    """A true/false field. bool("false") is True, so a string here once silently tied the LM
    head to the embedding and dropped lm_head.weight: only JSON true/false (or null) pass."""
    value = raw.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: field {key!r} must be true or false, got {_show(value)} ({_kind(value)})")
    return value


def _optional(raw: dict, key: str, source: str, types: type | tuple, expected: str):
    """A field that may be absent or null, else must have one of `types`."""
    value = raw.get(key)
    if value is not None and not isinstance(value, types):
        raise ConfigError(f"{source}: field {key!r} must be {expected}, got {_show(value)} ({_kind(value)})")
    return value


def _token_ids(raw: dict, key: str, source: str, vocab_size: int) -> tuple[int, ...]:
    """bos_token_id / eos_token_id: null, one id, or (eos) a list of ids, each inside the vocabulary."""
    value = raw.get(key)
    ids = value if isinstance(value, list) else ([] if value is None else [value])
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            raise ConfigError(
                f"{source}: field {key!r} must hold token ids in 0..{vocab_size - 1} (vocab_size), got {_show(value)}"
            )
    return tuple(ids)


def _rope_fields(raw: dict, source: str) -> tuple[float, RopeScaling | None]:
    # transformers 5 folds everything into rope_parameters; Llama-3.x downloads keep
    # rope_theta at the top level and a separate rope_scaling dict (or null).
    params = _optional(raw, "rope_parameters", source, dict, "an object") or {}
    scaling = _optional(raw, "rope_scaling", source, dict, "an object") or params
    theta = _number(params if "rope_theta" in params else raw, "rope_theta", source, 10000.0)
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ConfigError(
            f"{source}: unsupported rope_type {rope_type!r}: this engine implements 'default' and 'llama3'"
        )
    missing = [
        k
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if k not in scaling
    ]
    if missing:
        raise ConfigError(f"{source}: rope scaling of type llama3 lacks the field(s) {', '.join(missing)}")
    where = f"{source} (rope scaling)"
    s = RopeScaling(
        factor=_number(scaling, "factor", where, 1.0),
        low_freq_factor=_number(scaling, "low_freq_factor", where, 1.0),
        high_freq_factor=_number(scaling, "high_freq_factor", where, 1.0),
        original_max_position_embeddings=_int(scaling, "original_max_position_embeddings", where),
    )
    # The blend between the two wavelength bounds divides by their difference.
    if s.high_freq_factor <= s.low_freq_factor:
        raise ConfigError(
            f"{where}: high_freq_factor ({s.high_freq_factor}) must be greater than low_freq_factor ({s.low_freq_factor})"
        )
    return theta, s


def config_from_dict(raw: dict, source: str = "config.json") -> LlamaConfig:
    """Checks every field this engine reads, by type and range, and builds the config. A wrong
    type is an error naming the field, never a silent conversion."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: must hold a JSON object, got {_kind(raw)}")
    archs = _optional(raw, "architectures", source, list, "a list of names") or []
    model_type = raw.get("model_type")
    if model_type is None and set(map(str, archs)) & set(SUPPORTED_ARCHITECTURES):
        model_type = "llama"  # transformers reads such a config by its architectures: so do we
    if model_type != "llama" or (archs and not set(map(str, archs)) & set(SUPPORTED_ARCHITECTURES)):
        parts = [f"model_type {model_type!r}"] if model_type != "llama" else []  # the field at fault first
        shown = ", ".join(parts + [f"architectures {', '.join(map(str, archs))}"] * bool(archs))
        raise ConfigError(
            f"{source}: unsupported architecture {shown}; this engine runs Llama-architecture models "
            f"(model_type 'llama', {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
    missing = [k for k in required if k not in raw]
    if missing:
        raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
    if _bool(raw, "attention_bias", source) or _bool(raw, "mlp_bias", source):
        raise ConfigError(f"{source}: attention_bias/mlp_bias checkpoints are not supported")
    act = _optional(raw, "hidden_act", source, str, "a string")
    if act not in (None, "silu"):
        raise ConfigError(f"{source}: unsupported hidden_act {act!r}: Llama's MLP (and this engine) uses 'silu'")

    vocab_size = _int(raw, "vocab_size", source)
    hidden_size = _int(raw, "hidden_size", source)
    n_heads = _int(raw, "num_attention_heads", source)
    n_kv_heads = _int(raw, "num_key_value_heads", source, default=None) or n_heads
    if n_heads % n_kv_heads:
        raise ConfigError(
            f"{source}: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv_heads}"
        )
    # Older configs omit head_dim; it is then hidden / heads. Llama 3.2 3B and others set it explicitly.
    head_dim = _int(raw, "head_dim", source, default=None)
    if head_dim is None:
        if hidden_size % n_heads:
            raise ConfigError(f"{source}: hidden_size={hidden_size} is not a multiple of num_attention_heads={n_heads}")
        head_dim = hidden_size // n_heads
    if head_dim % 2:
        raise ConfigError(f"{source}: head_dim={head_dim} must be even (RoPE rotates pairs of dimensions)")
    rope_theta, rope_scaling = _rope_fields(raw, source)
    torch_dtype = _optional(raw, "torch_dtype", source, str, "a string") or _optional(
        raw, "dtype", source, str, "a string"
    )
    bos = _token_ids(raw, "bos_token_id", source, vocab_size)
    if len(bos) > 1:
        raise ConfigError(f"{source}: field 'bos_token_id' must be one token id, got {_show(raw['bos_token_id'])}")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=_int(raw, "intermediate_size", source),
        num_hidden_layers=_int(raw, "num_hidden_layers", source),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_number(raw, "rms_norm_eps", source, 1e-6, positive=False),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=_int(raw, "max_position_embeddings", source, default=2048),
        tie_word_embeddings=_bool(raw, "tie_word_embeddings", source),
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=_token_ids(raw, "eos_token_id", source, vocab_size),
        torch_dtype=torch_dtype or "float32",
        raw=raw,
    )


def load_config(model_dir: str | Path) -> LlamaConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"model directory not found: {model_dir}")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir} has no config.json: is this a Hugging Face checkpoint directory?")
    config = config_from_dict(_read_json(path), source=str(path))
    # HF's generate stops on generation_config.json's EOS ids, and a checkpoint's two files may
    # differ (Llama-3-Instruct's config.json names only <|end_of_text|>, not <|eot_id|>): both count.
    generation = model_dir / "generation_config.json"
    if not generation.is_file():
        return config
    raw = _read_json(generation)
    if not isinstance(raw, dict):
        raise ConfigError(f"{generation}: must hold a JSON object, got {_kind(raw)}")
    eos = _token_ids(raw, "eos_token_id", str(generation), config.vocab_size)
    extra = tuple(i for i in eos if i not in config.eos_token_ids)
    return replace(config, eos_token_ids=config.eos_token_ids + extra) if extra else config


def _read_json(path: Path):
    try:
        return json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
