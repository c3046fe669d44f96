"""y = x @ W.T for a quantized W: a reference path, and a fast path through torch's packed kernels.

Reference: dequantize W to the activation dtype, then F.linear. The clearest code, and the
slowest: it writes and reads a full-precision copy of W for every call.

Fast: torch ships matrix-vector kernels that read the small integers and dequantize in registers,
so a decode step reads 1 byte (int8) or about 0.6 (int4) per weight instead of 2 (bf16):
    CPU   aten._weight_int8pack_mm                        int8 codes, a scale per row
    CPU   aten._convert_weight_to_int4pack_for_cpu        int4 codes -> the kernel's tile layout,
          aten._weight_int4pack_mm_for_cpu                 then the matmul
    CUDA  aten._convert_weight_to_int4pack / _weight_int4pack_mm   (sm80+, bfloat16)
They are private ops (leading underscore): their signatures have changed between torch releases.
This file is the only place that calls them, requirements.txt pins torch, and tests/test_qmatmul.py
checks each against the reference. Where an op is missing, or does not exist for this device and
dtype, the reference runs and `fast_path_missing` says why.

The int4 kernels define a weight as (code - 8) * scale + zero, so zero is our group min moved to
the middle code: zero = min + 8 * scale. On CPU they are fast only for bfloat16/float16
activations (float32 runs a slow generic loop), which is why quantized models default to bfloat16.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from quant import Int4Weight, Int8Weight, QuantWeight

OPS = torch.ops.aten
# --matmul when not told otherwise (loading.py, load_model, build_engine): see prepare
DEFAULT_PATH = "auto"


def fast_path_missing(w: QuantWeight, device: torch.device, dtype: torch.dtype) -> str | None:
    """None when a packed kernel serves this weight on this device and dtype, else the reason."""
    if isinstance(w, Int8Weight):
        if device.type not in ("cpu", "cuda", "mps"):
            return f"no int8 kernel on {device.type}"
        # torch 2.13's CPU kernel reads past a bf16 row whose width is not a multiple of 16: NaN,
        # garbage or a segfault, run to run (float32 and float16 rows are read correctly)
        if device.type == "cpu" and dtype == torch.bfloat16 and w.shape[1] % 16:
            return f"torch's int8 kernel misreads bfloat16 rows of {w.shape[1]} inputs (not a multiple of 16)"
        return None if hasattr(OPS, "_weight_int8pack_mm") else "torch has no aten._weight_int8pack_mm"
    n_out, n_in = w.shape
    if n_out % 16 or n_in % 32:
        return f"the int4 kernels need rows in multiples of 16 and inputs in multiples of 32, not {n_out} x {n_in}"
    if device.type == "cpu":
        if not hasattr(OPS, "_weight_int4pack_mm_for_cpu"):
            return "torch has no aten._weight_int4pack_mm_for_cpu"
        return None
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return "the CUDA int4 kernel takes bfloat16 activations only"
        if torch.cuda.get_device_capability(device)[0] < 8:
            return "the CUDA int4 kernel needs compute capability 8.0 (Ampere) or newer"
        return None if hasattr(OPS, "_weight_int4pack_mm") else "torch has no aten._weight_int4pack_mm"
    return f"no int4 kernel on {device.type}"


class ReferenceLinear:
    """Dequantize, then multiply."""

    def __init__(self, w: QuantWeight):
        self.weight = w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.dequantize(x.dtype))


def aligned(t: torch.Tensor, to: int = 64) -> torch.Tensor:
    """t, in memory that starts on a `to`-byte boundary. safetensors hands out tensors at whatever
    offset the file puts them; the int8 kernel's vector loads assume alignment, and on an
    unaligned weight it crashed the process (segfault) for inputs of more than one row."""
    return t if t.data_ptr() % to == 0 else t.clone()


class Int8PackedLinear:
    def __init__(self, w: Int8Weight, dtype: torch.dtype):
        self.q = aligned(w.q.contiguous())  # int8 [out, in]: already the layout the kernel reads
        self.scale = w.scale.to(dtype)  # [out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = OPS._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.q, self.scale)  # the op takes 2-D x
        return y.view(*x.shape[:-1], -1)


def _inner_k_tiles(n_in: int) -> int:
    """The kernels tile the input dimension by innerKTiles * 16; use the largest tiling that divides it."""
    return next(t for t in (8, 4, 2) if n_in % (t * 16) == 0)


class Int4PackedLinear:
    def __init__(self, w: Int4Weight, device: torch.device, dtype: torch.dtype):
        n_out, n_in = w.shape
        codes = w.codes()  # uint8 [out, in]
        tiles = _inner_k_tiles(n_in)
        if device.type == "cpu":
            self.packed = OPS._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), tiles)
            self.matmul = OPS._weight_int4pack_mm_for_cpu
        else:
            # The CUDA converter takes two codes per byte, the first input in the HIGH nibble.
            pairs = (codes[:, 0::2] << 4 | codes[:, 1::2]).to(device)
            self.packed = OPS._convert_weight_to_int4pack(pairs, tiles)
            self.matmul = OPS._weight_int4pack_mm
        self.group_size = w.group_size
        zero = w.min.float() + 8 * w.scale.float()  # the value of the middle code
        # [in / G, out, 2]: per group, per output row, (scale, zero)
        self.scale_zero = torch.stack([w.scale.float().t(), zero.t()], dim=-1).to(device, dtype).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, x.shape[-1]), self.packed, self.group_size, self.scale_zero)
        return y.view(*x.shape[:-1], -1)


# Up to how many rows (tokens in a step) the packed kernels beat a dense GEMM: they are
# matrix-vector kernels, whose time grows with the rows, where a dense GEMM reads each weight once
# for all rows. Measured on whole SmolLM2 decode steps on a 2-core AVX512 CPU (chapter 05's README,
# "Which matmul wins at which batch size").
PACKED_MAX_ROWS = {Int4Weight: 16, Int8Weight: 6}


class PerStepLinear:
    """Both forms of one weight, and per call the faster for its number of rows: the packed int
    kernel for decode steps of a few sequences, a dense copy in the activation dtype for batched
    decode and prompt chunks. The price is memory: the dense copy is the unquantized weight.
    (A plain bf16 weight has both forms in one tensor, which the matvec kernel reads as it is:
    `copy_bytes` is then 0.)"""

    def __init__(self, packed, dense: torch.Tensor, max_rows: int, dense_is_copy: bool = True):
        self.packed, self.dense, self.max_rows = packed, dense, max_rows
        self.copy_bytes = dense.numel() * dense.element_size() if dense_is_copy else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return self.packed(x) if rows <= self.max_rows else F.linear(x, self.dense)


_warned: set[str] = set()


def prepare(w: QuantWeight, device: torch.device, dtype: torch.dtype, path: str = "fast"):
    """A quantized weight -> a callable x -> x @ W.T on `device`. path: "fast" (falls back to the
    reference, with one warning per reason, where no kernel serves), "reference", or "auto" (fast
    for steps of up to PACKED_MAX_ROWS tokens, a dense copy beyond: PerStepLinear)."""
    if path not in ("fast", "reference", "auto"):
        raise ValueError(f"matmul path must be 'fast', 'reference' or 'auto', got {path!r}")
    if path == "auto":
        return PerStepLinear(
            prepare(w, device, dtype, "fast"), w.dequantize(dtype).to(device), PACKED_MAX_ROWS[type(w)]
        )
    missing = fast_path_missing(w, device, dtype) if path == "fast" else "reference path chosen"
    if missing:
        if path == "fast" and missing not in _warned:
            _warned.add(missing)
            warnings.warn(f"quantized matmul falls back to dequantize-and-multiply: {missing}", stacklevel=2)
        return ReferenceLinear(w.to(device))
    if isinstance(w, Int8Weight):
        return Int8PackedLinear(w.to(device), dtype)
    return Int4PackedLinear(w, device, dtype)


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x @ W.T whether W is a plain tensor or a prepared quantized weight."""
    return F.linear(x, w) if isinstance(w, torch.Tensor) else w(x)
