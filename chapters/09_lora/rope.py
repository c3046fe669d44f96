"""Rotary position embedding (RoPE), in the convention HF Llama checkpoints use.

Each head vector of size head_dim is treated as head_dim/2 pairs; pair i is rotated by the angle
position * inv_freq[i]. HF's Llama pairs dimension i with dimension i + head_dim/2 ("rotate
half"), not neighbours (2i, 2i+1) as in the Llama paper's complex-number form and llama2.c. Both
are the same rotation on a permuted vector, and HF's conversion script permutes the q/k weight
rows to match, so with HF weights we must rotate halves.

With a KV cache, keys are rotated once, when written, at their absolute position. cos/sin are
computed per forward call for exactly the positions of its new tokens (a few hundred numbers
per decode step), rather than tabulated for the whole context at load time: a table for a
config's max_position_embeddings (131072 for Llama 3.1, and whatever a broken config claims)
costs memory for positions no request reaches.
"""

from __future__ import annotations

import math

import torch


def inv_frequencies(config) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i / head_dim), i < head_dim/2, with Llama 3.1 scaling if configured.  # [head_dim/2]

    Computed in float32 like the reference, so angles at large positions agree to the last bit
    we can hope for (a float32 angle near 10^4 has an ulp of ~1e-3 anyway).
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    if config.rope_scaling is not None:
        inv_freq = llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq


def llama3_scale(inv_freq: torch.Tensor, s) -> torch.Tensor:
    """Llama 3.1 context extension: slow down only the low frequencies.

    A frequency whose wavelength (2*pi / inv_freq, in tokens) is longer than
    original_max / low_freq_factor never completed a turn in training: divide it by `factor`
    (interpolation). Wavelengths shorter than original_max / high_freq_factor encode local
    order: keep them. In between, blend the two linearly in original_max / wavelength.
    """
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelength = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelength - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    return torch.where(
        wavelength > low_freq_wavelength,
        inv_freq / s.factor,
        torch.where(wavelength < high_freq_wavelength, inv_freq, blended),
    )


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every angle position * inv_freq, each half repeated to span head_dim.  # [*positions.shape, head_dim]

    Angles in float32 whatever the model dtype, like the reference: in bf16 an angle near 1000
    radians is only known to the nearest 4. The caller casts the result."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)  # [..., head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [..., head_dim]
    return angles.cos(), angles.sin()


def cos_sin_table(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0 .. max_positions-1 (for plots and tests).  # [max_positions, head_dim]"""
    return cos_sin(inv_freq, torch.arange(max_positions))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last axis."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates each (x[i], x[i + head_dim/2]) pair by its angle.  x: [batch, seq, heads, head_dim], cos/sin: [batch, seq, 1, head_dim]"""
    return x * cos + rotate_half(x) * sin
