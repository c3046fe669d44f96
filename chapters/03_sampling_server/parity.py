"""Per-layer parity of the torch engine against HF transformers (fp32, eager attention).

Usage, from this chapter's folder:

    python parity.py --model smollm2-135m --dtype bfloat16

Prints, for the embedding output, every decoder layer and the logits: the max absolute error,
the relative error (||ours - ref|| / ||ref||) and, for the logits, how often the argmax agrees.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common.cli import check_prompt, run_main
from common.config import load_config
from common.device import pick_device, pick_dtype
from common.hf_reference import hf_hidden_states
from common.models import resolve_model
from common.parity import compare, format_table
from common.tokenizer import Tokenizer
from kv_cache import KVCache
from model import forward, load_model

# This chapter's number, from its folder's name, so that a copied chapter reports its own.
CHAPTER = Path(__file__).resolve().parent.name[:2]

DEFAULT_TEXT = (
    "The Llama architecture is a decoder-only transformer. Each layer normalizes its input with RMSNorm, "
    "attends to earlier tokens with rotary position embeddings, and then applies a gated MLP. "
    "Grouped-query attention shares each key and value head among several query heads."
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--device", default=None, help="default: $DEVICE, else auto")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    model_dir = resolve_model(args.model)
    ids = Tokenizer(model_dir).encode(args.text)
    check_prompt(ids, 1, load_config(model_dir))  # not empty, inside the context and the vocabulary
    model = load_model(model_dir, device, dtype)
    cache = KVCache(model.config, 1, len(ids), device, dtype)
    ours: dict = {}
    with torch.inference_mode():
        ours["logits"] = (
            forward(model, torch.tensor([ids], device=device), cache, capture=ours)[0].float().cpu().numpy()
        )
    print(
        f"{model_dir.name}: {len(ids)} tokens, ch{CHAPTER} torch {device} {str(dtype).removeprefix('torch.')} vs HF transformers fp32 eager"
    )
    print(format_table(compare(ours, hf_hidden_states(model_dir, ids))))
    return 0


if __name__ == "__main__":
    run_main(main)
