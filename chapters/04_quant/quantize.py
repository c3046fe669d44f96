"""Writes a quantized checkpoint directory that every entry point of this chapter loads with --model.

Usage, from this chapter's folder:

    python quantize.py --model smollm2-135m --bits 4 --group-size 32 --out ../../models/smollm2-135m-int4
    python quantize.py --model smollm2-135m --bits 8 --out ../../models/smollm2-135m-int8
    python quantize.py --from-gguf path/to/SmolLM2-135M-Instruct.Q4_1.gguf --out ../../models/smollm2-q4_1

The directory holds config.json (with a quantization_config block), model.safetensors (codes,
scales and mins: see weights.py) and the tokenizer files, as a Hugging Face download does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from common.checkpoint import load_checkpoint_torch
from common.cli import run_main
from common.config import load_config
from common.errors import UserError
from common.models import resolve_model
from gguf_file import convert_gguf
from quant import INT4_GROUP_SIZES, QuantSpec
from weights import quantize_weights, save_quantized, spec_of, weight_bytes

# Everything of a model directory except its weights and config.json.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def quantize_dir(model: str, spec: QuantSpec, out: Path) -> dict:
    """A plain checkpoint directory -> a quantized one at `out`; -> sizes for the report."""
    src = resolve_model(model)
    if spec_of(src) is not None:
        raise UserError(f"{src} is already quantized; quantize the original checkpoint")
    if out.resolve() == src.resolve():
        raise UserError("--out must not be the source directory")
    config = load_config(src)
    weights = load_checkpoint_torch(src, config, None)  # the stored floats, not a cast copy
    before = weight_bytes(weights)
    quantized = quantize_weights(weights, config, spec)
    save_quantized(quantized, json.loads((src / "config.json").read_text()), spec, out)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    return {"source_bytes": before, "bytes": weight_bytes(quantized)}


def check_out(out: Path) -> Path:
    """--out must be a new directory (or an empty one) in a folder that exists: quantize.py never
    deletes or overwrites what is there (a source GGUF, another model, a user's notes)."""
    out = out.expanduser().resolve()
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise UserError(f"--out {out} exists: give a new directory (nothing there is overwritten)")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: its folder {out.parent} does not exist")
    if not os.access(out.parent, os.W_OK):
        raise UserError(f"--out {out}: its folder {out.parent} is not writable")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a known name or a plain checkpoint directory")
    src.add_argument("--from-gguf", help="a llama.cpp Q4_1 .gguf file: codes copied, no float detour")
    ap.add_argument("--bits", type=int, choices=[4, 8], help="with --model: 8 (per channel) or 4 (per group)")
    ap.add_argument("--group-size", type=int, choices=INT4_GROUP_SIZES, help="with --bits 4: inputs per group (default: 32)")
    ap.add_argument("--symmetric", action="store_true", help="int4 without a zero point")
    ap.add_argument(
        "--lm-head",
        choices=["int8", "int4", "none"],
        help="the LM head (and tied embedding): int8 (default), int4, or none (kept as stored)",
    )
    ap.add_argument("--out", required=True, help="the directory to write")
    args = ap.parse_args()
    out = check_out(Path(args.out))
    t0 = time.perf_counter()
    given = [flag for flag, value in (("--bits", args.bits), ("--group-size", args.group_size),
             ("--symmetric", args.symmetric or None), ("--lm-head", args.lm_head)) if value is not None]  # fmt: skip
    if args.from_gguf and given:  # they were ignored without a word
        raise UserError(f"--from-gguf copies the file's own Q4_1 codes: {', '.join(given)} would not apply")
    if args.from_gguf:
        convert_gguf(args.from_gguf, out)
        what = f"{Path(args.from_gguf).name} (Q4_1 codes copied)"
    else:
        if args.bits is None:
            ap.error("--model needs --bits 8 or 4")
        if args.bits == 8 and args.lm_head != "int4":  # int4 options would go unused
            flags = (("--group-size", args.group_size is not None), ("--symmetric", args.symmetric))
            if unused := [flag for flag, given in flags if given]:
                ap.error(f"{', '.join(unused)} is for int4 weights (--bits 4, or --lm-head int4): int8 scales by row")
        head = {"int8": 8, "int4": 4, "none": None}[args.lm_head or "int8"]
        spec = QuantSpec(args.bits, args.group_size or 32, args.symmetric, head)
        sizes = quantize_dir(args.model, spec, out)
        what = f"{args.model} as {spec.name}: weights {sizes['source_bytes'] / 1e6:.0f} MB -> {sizes['bytes'] / 1e6:.0f} MB"
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.0f} MB on disk) from {what} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_main(main)
