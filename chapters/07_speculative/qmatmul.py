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

Chapter 06: with the kernels on (ops.KernelOps), "fast" means kernels/' own int4 and int8
matrix-vector products (csrc/cpu/quant_linear.cpp, csrc/cuda/quant_linear.cu), which the model's
ops build (`ops.quant_linear`). They read our codes as stored, two per byte, with the float16 scales
and mins of the checkpoint (0.625 bytes a weight, as Q4_1): no repacking into a private tile
layout, and no private torch op whose signature may change.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from quant import Int4Weight, Int8Weight, QuantWeight

if TYPE_CHECKING:
    from ops import Ops

OPS = torch.ops.aten
# --matmul when not told otherwise (loading.py, load_model, build_engine): see prepare
DEFAULT_PATH = "auto"


def fast_path_missing(w: QuantWeight, device: torch.device, dtype: torch.dtype) -> str | None:
    """None when a packed kernel serves this weight on this device and dtype, else the reason."""
    if isinstance(w, Int8Weight):
        if device.type not in ("cpu", "cuda", "mps"):
            return f"no int8 kernel on {device.type}"
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


class KernelInt4Linear:
    """kernels/' int4 matmul, as ops.KernelOps.quant_linear builds it; of the library `lib` it keeps int4_linear."""

    def __init__(self, w: Int4Weight, lib, device: torch.device):
        self.matmul, self.group_size = lib.int4_linear, w.group_size
        self.packed = aligned(w.packed.to(device).contiguous())  # uint8 [out, in / 2]
        self.scale, self.min = w.scale.to(device).contiguous(), w.min.to(device).contiguous()  # float16 [out, in / G]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, x.shape[-1]).contiguous(), self.packed, self.scale, self.min, self.group_size)
        return y.view(*x.shape[:-1], -1)

    def library_form(self) -> tuple[str, list[torch.Tensor], int]:
        """(kind, weight tensors, group size) as the library's Linear takes them (ops.KernelOps.decoder_layer)."""
        return "int4", [self.packed, self.scale, self.min], self.group_size


class KernelBf16Linear:
    """kernels/' bf16 matrix-vector product for a plain bf16 weight (ops.KernelOps.dense_linear); of
    the library `lib` it keeps bf16_linear. It reads the weight tensor as it is: no copy."""

    def __init__(self, w: torch.Tensor, lib):
        self.matmul, self.weight = lib.bf16_linear, w.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, x.shape[-1]).contiguous(), self.weight)
        return y.view(*x.shape[:-1], -1)

    def library_form(self) -> tuple[str, list[torch.Tensor], int]:
        return "bf16", [self.weight], 0


class KernelInt8Linear:
    """kernels/' int8 matmul, as ops.KernelOps.quant_linear builds it; of the library `lib` it keeps int8_linear."""

    def __init__(self, w: Int8Weight, lib, device: torch.device):
        self.matmul = lib.int8_linear
        self.q, self.scale = aligned(w.q.to(device).contiguous()), w.scale.float().to(device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, x.shape[-1]).contiguous(), self.q, self.scale)
        return y.view(*x.shape[:-1], -1)

    def library_form(self) -> tuple[str, list[torch.Tensor], int]:
        return "int8", [self.q, self.scale], 0


# Chapter 05: up to how many rows (tokens in a step) the packed kernels beat a dense GEMM. They
# are matrix-vector kernels: their time grows with the rows, where a dense GEMM reuses each weight
# it reads across rows (and at a few rows is bound by reading 2 bytes per weight from memory).
# Whole SmolLM2 decode steps, 2 AVX512 cores, bf16 activations, ms per step (packed | dense):
#   sequences        1           4           8           16          24          32
#   int4 (int8 head) 14.2|31.7   20.7|37.9   30.9|41.1   57.5|60.1   83.8|73.4   108|90.2
#   int8             -           24.4|34.5   39.6|38.0   63.1|51.3
# The int8 kernel loses from 8 rows on, the int4 one from about 20.
PACKED_MAX_ROWS = {Int4Weight: 16, Int8Weight: 6}
# kernels/' matmuls (chapter 06), per call against the dense bf16 GEMM (bench.py --parts kernels, 2 AVX512
# cores): they win at 4 rows on every SmolLM2 layer (qkv 33 vs 47 us, head 1786 vs 5393) and lose at 16
# (qkv 120 vs 76 us; head 6680 vs 6730): the crossover lies between, taken as 8.
KERNEL_MAX_ROWS = {Int4Weight: 8, Int8Weight: 8}
# kernels/' bf16 matvec against torch's bf16 GEMM on the same weight, per call, 2 AVX512 cores: 3-9x
# faster at 1 row (LM head 1.4-1.8 ms against 6.5; qkv 16 us against 150), 1.1-3x at 4 rows, even
# at 8 (LM head 5.0-5.8 ms against 8.0, the others within 10%), 1.3-2x slower at 16.
KERNEL_MAX_ROWS_BF16 = 8


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


def prepare(w: QuantWeight, device: torch.device, dtype: torch.dtype, path: str, ops: Ops | None = None):
    """A quantized weight -> a callable x -> x @ W.T on `device`. path: "fast" (falls back to the
    reference, with one warning per reason, where no kernel serves), "reference", or "auto" (fast
    for steps of up to PACKED_MAX_ROWS tokens, a dense copy beyond: PerStepLinear). ops: the
    model's operations (ops.py), whose own int matmul, where they have one, is the fast path."""
    if path not in ("fast", "reference", "auto"):
        raise ValueError(f"matmul path must be 'fast', 'reference' or 'auto', got {path!r}")
    if path == "auto" and getattr(ops, "batch_invariant", False):
        path = "fast"  # the kernel at every row count: no dense copy (ops.KernelOps)
    if path == "auto":
        fast = prepare(w, device, dtype, "fast", ops)
        kernel = isinstance(fast, (KernelInt4Linear, KernelInt8Linear))
        max_rows = (KERNEL_MAX_ROWS if kernel else PACKED_MAX_ROWS)[type(w)]
        return PerStepLinear(fast, w.dequantize(dtype).to(device), max_rows)
    kernel = ops.quant_linear(w) if path == "fast" and ops is not None else None
    if kernel is not None:
        return kernel
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
