"""The reference every chapter is checked against: HF transformers on the same directory.

fp32 and eager attention, so the reference does the textbook maths. Forward hooks capture the
embedding output, each decoder layer's output and the logits; that is the same set of
checkpoints every chapter's engine exposes, so `common.parity` can compare them one by one.

Results are kept on disk (MODELS_DIR/.hf_reference/), keyed by everything they depend on: the
checkpoint's files (names, sizes, modification times), the input, the dtype and the transformers
version. Seven chapters ask HF the same questions; loading HF and running it costs seconds each
time, reading the answer back milliseconds. HF_REFERENCE_CACHE=0 turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

from common.models import MODELS_DIR


def _kept(kind: str, model_dir: str | Path, question: list, compute) -> dict[str, np.ndarray]:
    """compute()'s arrays, from disk when this question about this checkpoint was answered before."""
    if os.environ.get("HF_REFERENCE_CACHE", "1") == "0":
        return compute()
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(model_dir).iterdir() if p.is_file())
    key = json.dumps([kind, str(Path(model_dir).resolve()), files, version("transformers"), question])
    path = MODELS_DIR / ".hf_reference" / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.npz"
    if path.is_file():
        with np.load(path) as kept:
            return {name: kept[name] for name in kept.files}
    arrays = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)  # one rename: another worker never reads half a file
    return arrays


@lru_cache(maxsize=2)
def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="eager")
    return model.eval()


def hf_hidden_states(
    model_dir: str | Path, input_ids: list[int], dtype: torch.dtype = torch.float32
) -> dict[str, np.ndarray]:
    """{"embedding": [seq, hidden], "layer.0" ... "layer.N-1": [seq, hidden], "logits": [seq, vocab]},
    returned as fp32 arrays; `dtype` is what the reference computes in."""
    return _kept(
        "hidden", model_dir, [list(input_ids), str(dtype)], lambda: _hidden_states(model_dir, input_ids, dtype)
    )


@torch.no_grad()
def _hidden_states(model_dir: str | Path, input_ids: list[int], dtype: torch.dtype) -> dict[str, np.ndarray]:
    model = load_hf_model(str(model_dir), dtype)
    captured: dict[str, np.ndarray] = {}

    def keep(name):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            captured[name] = out[0].float().numpy().copy()

        return hook

    handles = [model.model.embed_tokens.register_forward_hook(keep("embedding"))]
    for i, layer in enumerate(model.model.layers):
        handles.append(layer.register_forward_hook(keep(f"layer.{i}")))
    try:
        logits = model(torch.tensor([input_ids])).logits
    finally:
        for h in handles:
            h.remove()
    captured["logits"] = logits[0].float().numpy()
    return captured


def hf_greedy(model_dir: str | Path, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """New token ids from HF `generate`, greedy, up to (not including) the first EOS id, as our engines return them."""
    new = _kept(
        "greedy",
        model_dir,
        [list(input_ids), max_new_tokens],
        lambda: {"tokens": np.array(_greedy(model_dir, input_ids, max_new_tokens), dtype=np.int64)},
    )
    return new["tokens"].tolist()


@torch.no_grad()
def _greedy(model_dir: str | Path, input_ids: list[int], max_new_tokens: int) -> list[int]:
    model = load_hf_model(str(model_dir))
    out = model.generate(
        torch.tensor([input_ids]),
        attention_mask=torch.ones(1, len(input_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    new = out[0, len(input_ids) :].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return next((new[:i] for i, t in enumerate(new) if t in eos), new)
