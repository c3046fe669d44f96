"""What a quantized weight is: small integers, and the floats that map them back.

int8, per output channel, symmetric (one scale per row of W [out, in]):

    scale[o] = max_i |W[o, i]| / 127          q[o, i] = round(W[o, i] / scale[o])  in -127..127
    W[o, i] ~ scale[o] * q[o, i]

int4, group-wise along the input dimension (a scale and a min per G consecutive inputs of a row):

    asymmetric: scale = (max - min) / 15      q = round((W - min) / scale)         in 0..15
                W ~ min + scale * q           (llama.cpp's Q4_1: `d` is scale, `m` is min)
    symmetric:  scale = max |W| / 7           q = round(W / scale) + 8             in 1..15
                W ~ scale * (q - 8)           (min = -8 * scale: one float per group fewer)

Two 4-bit codes share a byte: element 2j in the low nibble of byte j, element 2j+1 in the high one.
Scales and mins are stored as float16 (as in GGUF), and the codes are computed with the stored,
rounded values, so the error bound below holds for what the file holds:
    |W - dequantize(quantize(W))| <= scale / 2 per weight (plus, asymmetric, the float16 rounding
    of the group's min, which a clamped code cannot absorb).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.errors import UserError

INT4_GROUP_SIZES = (32, 64, 128)


@dataclass
class Int8Weight:
    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return (self.q.to(torch.float32) * self.scale[:, None]).to(dtype)  # [out, in]

    def to(self, device) -> Int8Weight:
        return Int8Weight(self.q.to(device), self.scale.to(device))

    def rows(self, index: torch.Tensor, dtype) -> torch.Tensor:
        """Dequantized rows (an embedding lookup reads only the rows of its tokens)."""
        return (self.q[index].to(torch.float32) * self.scale[index, None]).to(dtype)


@dataclass
class Int4Weight:
    packed: torch.Tensor  # uint8 [out, in / 2]: two codes per byte
    scale: torch.Tensor  # float16 [out, in / G]
    min: torch.Tensor  # float16 [out, in / G]: the value of code 0 (= -8 * scale when symmetric)
    group_size: int
    symmetric: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def codes(self) -> torch.Tensor:
        return unpack_int4(self.packed)  # uint8 [out, in], 0..15

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return _dequantize_groups(self.codes(), self.scale, self.min, self.group_size).to(dtype)

    def to(self, device) -> Int4Weight:
        return Int4Weight(
            self.packed.to(device), self.scale.to(device), self.min.to(device), self.group_size, self.symmetric
        )

    def rows(self, index: torch.Tensor, dtype) -> torch.Tensor:
        return _dequantize_groups(
            unpack_int4(self.packed[index]), self.scale[index], self.min[index], self.group_size
        ).to(dtype)


QuantWeight = Int8Weight | Int4Weight


def _dequantize_groups(codes, scale, min_, group_size) -> torch.Tensor:
    out, n_in = codes.shape[-2], codes.shape[-1]
    q = codes.to(torch.float32).view(*codes.shape[:-1], n_in // group_size, group_size)
    w = min_.float()[..., None] + scale.float()[..., None] * q  # [..., out, groups, G]
    return w.view(*codes.shape[:-2], out, n_in)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] codes 0..15 -> [..., n / 2] bytes: element 2j low nibble, 2j+1 high nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[..., n / 2] bytes -> [..., n] codes 0..15 (the inverse of pack_int4)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def group_size_for(in_features: int, group_size: int) -> int:
    """The group size a row of `in_features` inputs gets: `group_size`, halved until it divides
    the row (SmolLM2's hidden size 576 = 4.5 x 128, so its G=128 rows of 576 use G=64)."""
    g = group_size
    while in_features % g and g > 32:
        g //= 2
    if in_features % g:
        raise UserError(f"a row of {in_features} inputs cannot be split into int4 groups of 32 or more")
    return g


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    w = w.to(torch.float32)
    scale = w.abs().amax(dim=1) / 127  # [out]
    if not bool(torch.isfinite(scale).all()):  # a NaN or inf weight: every code of its row is lost
        raise UserError("int8: a weight row holds NaN or infinity: there is nothing to quantize")
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: scale 0, codes 0
    q = torch.round(w / safe[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale)


def _round_up_f16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest float16 at or above x (x >= 0): a scale rounded down would push the
    group's extreme weight past the last code, where clamping costs more than half a step."""
    h = x.to(torch.float16)
    low = h.float() < x
    return torch.where(low, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def quantize_int4(w: torch.Tensor, group_size: int, symmetric: bool = False) -> Int4Weight:
    out, n_in = w.shape
    g = group_size_for(n_in, group_size)
    groups = w.to(torch.float32).reshape(out, n_in // g, g)  # [out, groups, G]
    if symmetric:
        scale = _round_up_f16(groups.abs().amax(-1) / 7)  # [out, groups]
        min_ = (-8 * scale.float()).to(torch.float16)  # exact: a power-of-two multiple
    else:
        lo, hi = groups.amin(-1), groups.amax(-1)
        min_ = lo.to(torch.float16)
        # clamped: a constant group's min can round up past its max, and a scale is never negative
        scale = _round_up_f16((hi - min_.float()).clamp_min(0) / 15)
    if not bool(torch.isfinite(scale).all() and torch.isfinite(min_).all()):
        # float16 holds up to 65504: scales and mins of weights past ~57,000 (symmetric: -8 x scale)
        # or of NaN / inf would dequantize to inf and NaN logits
        top = groups.abs().amax().item()
        raise UserError(
            f"int4: weights up to {top:.4g} give scales or minimums past float16's range: "
            "quantize this model with int8, or keep it unquantized"
        )
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    codes = torch.round((groups - min_.float()[..., None]) / safe[..., None]).clamp(0, 15)
    return Int4Weight(pack_int4(codes.reshape(out, n_in)), scale, min_, g, symmetric)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize a model: `bits` for every decoder linear layer; `head_bits` for the LM head
    (and the embedding it shares when tied): 8, 4, or None to keep it in the model dtype."""

    bits: int
    group_size: int = 32
    symmetric: bool = False
    head_bits: int | None = 8

    def __post_init__(self):
        # `in` compares by ==: 4.0 and True would pass as 4 and 1, and a config's "4" would print as 4.
        if not _whole(self.bits) or self.bits not in (4, 8):
            raise UserError(f"bits must be 4 or 8, got {self.bits!r}")
        if self.head_bits is not None and (not _whole(self.head_bits) or self.head_bits not in (4, 8)):
            raise UserError(f"the LM head's bits must be 4, 8 or none, got {self.head_bits!r}")
        int4 = self.bits == 4 or self.head_bits == 4
        if int4 and (not _whole(self.group_size) or self.group_size not in INT4_GROUP_SIZES):
            raise UserError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {self.group_size!r}")
        if not isinstance(self.symmetric, bool):
            raise UserError(f"symmetric must be true or false, got {self.symmetric!r}")

    def quantize(self, w: torch.Tensor, bits: int | None = None) -> QuantWeight:
        bits = bits or self.bits
        return quantize_int8(w) if bits == 8 else quantize_int4(w, self.group_size, self.symmetric)

    @property
    def name(self) -> str:
        """"int8", "int4 G=32", ...; a head other than the default int8 is named too."""
        int4 = f"int4 G={self.group_size}" + (" sym" if self.symmetric else "")
        weights = "int8" if self.bits == 8 else int4
        if self.head_bits == 8:
            return weights
        if self.head_bits is None:
            return f"{weights}, unquantized head"
        return f"{weights}, {'int4' if self.bits == 4 else int4} head"


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Stacks quantized weights along the output dimension (q, k, v -> qkv): every row keeps its
    own scales, so stacking commutes with quantizing."""
    first = parts[0]
    if isinstance(first, Int8Weight):
        return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
    return Int4Weight(
        torch.cat([p.packed for p in parts]),
        torch.cat([p.scale for p in parts]),
        torch.cat([p.min for p in parts]),
        first.group_size,
        first.symmetric,
    )


def nbytes(w) -> int:
    """Bytes a weight occupies (codes, scales and mins) — what a matmul reads per token."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    if isinstance(w, Int8Weight):
        return nbytes(w.q) + nbytes(w.scale)
    return nbytes(w.packed) + nbytes(w.scale) + (0 if w.symmetric else nbytes(w.min))
