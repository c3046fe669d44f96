"""Per-layer parity of the NumPy engine against HF transformers (fp32, eager attention).

Usage, from this chapter's folder:

    python parity.py --model smollm2-135m

Prints, for the embedding output, every decoder layer and the logits: the max absolute error,
the relative error (||ours - ref|| / ||ref||) and, for the logits, how often the argmax agrees.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.cli import check_prompt, run_main
from common.config import load_config
from common.hf_reference import hf_hidden_states
from common.models import resolve_model
from common.parity import compare, format_table
from common.tokenizer import Tokenizer
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
    args = ap.parse_args()
    model_dir = resolve_model(args.model)
    ids = Tokenizer(model_dir).encode(args.text)
    check_prompt(ids, 1, load_config(model_dir))  # not empty, inside the context and the vocabulary
    ours: dict = {}
    ours["logits"] = forward(load_model(model_dir), ids, capture=ours)
    print(f"{model_dir.name}: {len(ids)} tokens, ch{CHAPTER} NumPy fp32 vs HF transformers fp32 eager")
    print(format_table(compare(ours, hf_hidden_states(model_dir, ids))))
    return 0


if __name__ == "__main__":
    run_main(main)
