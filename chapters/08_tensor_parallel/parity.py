"""Per-layer parity of the torch engine against HF transformers (fp32, eager attention).

Usage, from this chapter's folder:

    python parity.py --model smollm2-135m --dtype bfloat16
    python parity.py --quant int8   # what quantization moves, layer by layer

Prints, for the embedding output, every decoder layer and the logits: the max absolute error,
the relative error (||ours - ref|| / ||ref||) and, for the logits, how often the argmax agrees.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common.cli import check_prompt, run_main
from common.config import load_config
from common.errors import UserError
from common.hf_reference import hf_hidden_states
from common.parity import compare, format_table
from common.tokenizer import Tokenizer
from loading import add_quant_args, load, quant_spec, resolve
import ops
from model import forward_sequence
from weights import spec_of

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
    ap.add_argument(
        "--reference",
        default=None,
        help="the plain checkpoint HF runs (default: --model; needed when --model is already quantized)",
    )
    add_quant_args(ap)
    args = ap.parse_args()
    model, model_dir = load(args.model, args.device, args.dtype, quant_spec(args), args.matmul, ops.from_args(args))
    reference = resolve(args.reference) if args.reference else model_dir
    if spec_of(reference) is not None:
        raise UserError(
            f"{reference} is a quantized checkpoint, which HF transformers does not read: "
            "pass the plain model with --quant, or --reference PLAIN_DIR"
        )
    device, dtype = model.device, model.dtype
    ids = Tokenizer(model_dir).encode(args.text)
    check_prompt(ids, 1, load_config(model_dir))  # not empty, inside the context and the vocabulary
    ours: dict = {}
    with torch.inference_mode():  # through the block pool and paged attention (model.forward_sequence)
        ours["logits"] = forward_sequence(model, ids, capture=ours).float().cpu().numpy()
    what = model.quant.name if model.quant else "unquantized"
    print(
        f"{model_dir.name}: {len(ids)} tokens, ch{CHAPTER} torch (paged) {device} {str(dtype).removeprefix('torch.')} {what} "
        f"vs HF transformers fp32 eager on {reference.name}"
    )
    print(format_table(compare(ours, hf_hidden_states(reference, ids))))
    return 0


if __name__ == "__main__":
    run_main(main)
