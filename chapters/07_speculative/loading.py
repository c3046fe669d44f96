"""The model options every entry point of this chapter shares, and where a model comes from.

--model takes a known name, a checkpoint directory (plain, or quantized by quantize.py), or a
llama.cpp .gguf file (converted once into a quantized directory under MODELS_DIR/gguf/, codes
copied: see gguf_file.py). --quant int8|int4 --group-size G quantizes a plain checkpoint on load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch

from common.config import load_config
from common.device import pick_device, pick_dtype
from common.errors import UserError
from common.models import MODELS_DIR, ModelNotFoundError, resolve_model
from gguf_file import convert_gguf
from model import load_model
from ops import KernelFlags, KernelOps, add_arguments
from qmatmul import DEFAULT_PATH
from quant import INT4_GROUP_SIZES, QuantSpec
from weights import spec_of

FORMAT_VERSION = 1  # bumped when a converted GGUF directory would differ: the cache is then rebuilt


def add_quant_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("quantization")
    g.add_argument(
        "--quant",
        choices=["int8", "int4"],
        default=None,
        help="quantize a plain checkpoint on load (a quantized directory or .gguf needs none)",
    )
    g.add_argument(
        "--group-size", type=int, default=32, choices=INT4_GROUP_SIZES, help="int4 weights per scale (default 32)"
    )
    g.add_argument("--symmetric", action="store_true", help="int4 without a zero point (a scale per group only)")
    g.add_argument(
        "--lm-head",
        choices=["int8", "int4", "none"],
        default="int8",
        help="the LM head (and tied embedding) with --quant: int8 (default), int4, or none (model dtype)",
    )
    g.add_argument(
        "--matmul",
        choices=["auto", "fast", "reference"],
        default=DEFAULT_PATH,
        help="auto (default): on a CPU with kernels/, their int matmul at every row count; elsewhere packed int "
        "kernels for steps of a few tokens (kernels/ on a GPU: 8; torch's: int4 16, int8 6) and a dense copy of each "
        "weight for larger ones (more memory); fast: the packed kernels always; reference: dequantize-and-multiply",
    )
    add_arguments(ap)  # --kernels (ops.py)


def quant_spec(args) -> QuantSpec | None:
    """The --quant flags as a QuantSpec (None: no quantizing on load). A value other than the
    default that would change nothing is refused: it was ignored without a word."""
    int4_flags = [f for f, given in (("--group-size", args.group_size != 32), ("--symmetric", args.symmetric)) if given]
    if args.quant is None:
        given = int4_flags + (["--lm-head"] if args.lm_head != "int8" else [])
        if given:
            raise UserError(f"{', '.join(given)} goes with --quant int8 or int4 (quantizing on load)")
        return None
    head = {"int8": 8, "int4": 4, "none": None}[args.lm_head]
    if args.quant == "int8" and head != 4 and int4_flags:
        raise UserError(f"{', '.join(int4_flags)} is for int4 weights (--quant int4, or --lm-head int4)")
    return QuantSpec(
        bits=8 if args.quant == "int8" else 4, group_size=args.group_size, symmetric=args.symmetric, head_bits=head
    )


def resolve(name_or_path: str | None) -> Path:
    """A model directory for a name, a directory, or a .gguf file (converted on first use)."""
    path = Path(str(name_or_path or "")).expanduser()
    if path.suffix.lower() != ".gguf":
        return resolve_model(name_or_path)
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such GGUF file")
    # Keyed by size and modification time too: a file of the same name (another fine-tune, a download
    # replaced after a corrupt one) is converted anew, never served another file's weights.
    st = path.stat()
    out = MODELS_DIR / "gguf" / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}-v{FORMAT_VERSION}"
    if not (out / "config.json").is_file():
        print(f"[gguf] {path.name} -> {out} (codes copied, once) ...", file=sys.stderr, flush=True)
        try:
            mine = convert_gguf(path, out.with_name(f"{out.name}.{os.getpid()}"))
        except OSError as e:  # MODELS_DIR a file, read-only, or full: a traceback before
            raise UserError(
                f"cannot convert {path.name} into {out.parent}: {e.strerror} ({e.filename}); "
                "MODELS_DIR= sets where converted models go"
            ) from None
        try:  # a rename is atomic: of two processes converting the same file at once, one keeps its copy
            mine.rename(out)
        except OSError:
            shutil.rmtree(mine)
    return out


def refuse_idle_quant_flags(
    matmul: str, flags: KernelFlags, quantized: bool, dtype: torch.dtype, ops, model_dir: Path
) -> None:
    """--matmul and --no-int8-activations pick how quantized weights multiply: where a run's other
    choices (the dtype, the resolved `ops`) leave them nothing to change, they were taken and changed
    nothing. On a CPU the kernels' int matmul serves every row count: "auto" is "fast" there."""
    idle = [f"--matmul {matmul}"] if matmul != DEFAULT_PATH else []
    idle += [] if flags.int8_x else ["--no-int8-activations"]
    if idle and not quantized:
        raise UserError(
            f"{', '.join(idle)}: for quantized weights (--quant int8 or int4, a quantized checkpoint, a GGUF "
            f"file); {model_dir.resolve().name} runs unquantized"
        )
    if not flags.int8_x:  # int8 x come from bf16 x, in the kernels' int matmul (--batch-invariant runs a float matvec)
        floats = [
            f"{str(dtype).removeprefix('torch.')} activations (--dtype or DTYPE)" if dtype != torch.bfloat16 else None,
            "--matmul reference" if matmul == "reference" else None,
            "--batch-invariant" if flags.batch_invariant else None,
        ]
        if any(floats):
            raise UserError(
                f"--no-int8-activations: with {' and '.join(filter(None, floats))} the int weights are multiplied in "
                "floats already"
            )
    if matmul == "fast" and isinstance(ops, KernelOps) and ops.device.type == "cpu":
        raise UserError(
            "--matmul fast: on a CPU the kernels multiply the int weights as they are at every row count, as "
            "--matmul auto does"
        )


def load(
    name_or_path: str | None,
    device: str | None,
    dtype: str | None,
    spec: QuantSpec | None = None,
    matmul: str = DEFAULT_PATH,
    kernel_flags: KernelFlags | str = KernelFlags(),
    check_quant_flags: bool = True,
):
    """-> (Model, its directory). dtype "auto" is bfloat16 for quantized weights: torch's packed
    int kernels are fast only with 16-bit activations on CPU (see qmatmul.py). kernel_flags: as
    ops.from_args parses them, or only a --kernels choice. check_quant_flags False: --matmul and
    --no-int8-activations are taken for unquantized weights too: they may be for another model loaded
    beside this one (chapter 07's draft); quantized weights are checked all the same."""
    if spec is not None and Path(str(name_or_path or "")).suffix.lower() == ".gguf":  # before its conversion
        raise UserError(f"{name_or_path}: --quant applies to a plain checkpoint; a GGUF file runs as its own Q4_1 codes")
    model_dir = resolve(name_or_path)
    dev = pick_device(device)
    quantized = spec is not None or spec_of(model_dir) is not None
    auto = (dtype or os.environ.get("DTYPE") or "auto") == "auto"
    dt = torch.bfloat16 if quantized and auto and dev.type in ("cpu", "cuda") else pick_dtype(dtype, dev)
    flags = KernelFlags(kernel_flags) if isinstance(kernel_flags, str) else kernel_flags
    ops = flags.ops(dev, load_config(model_dir).head_dim)
    if check_quant_flags or quantized:
        refuse_idle_quant_flags(matmul, flags, quantized, dt, ops, model_dir)
    return load_model(model_dir, dev, dt, spec, matmul, ops), model_dir
