"""The reference every chapter is checked against: HF transformers on the same directory.

fp32 and eager attention, so the reference does the textbook maths. Forward hooks capture the
embedding output, each decoder layer's output and the logits; that is the same set of
checkpoints every chapter's engine exposes, so `common.parity` can compare them one by one.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import torch


@lru_cache(maxsize=2)
def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="eager")
    return model.eval()


@torch.no_grad()
def hf_hidden_states(
    model_dir: str | Path, input_ids: list[int], dtype: torch.dtype = torch.float32
) -> dict[str, np.ndarray]:
    """{"embedding": [seq, hidden], "layer.0" ... "layer.N-1": [seq, hidden], "logits": [seq, vocab]},
    returned as fp32 arrays; `dtype` is what the reference computes in."""
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


@torch.no_grad()
def hf_greedy(model_dir: str | Path, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """New token ids from HF `generate`, greedy, up to (not including) the first EOS id, as our engines return them."""
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
