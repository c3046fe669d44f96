"""Rotary position embedding (RoPE), in the convention HF Llama checkpoints use.

Each head vector of size head_dim is treated as head_dim/2 pairs; pair i is rotated by the angle
position * inv_freq[i]. HF's Llama pairs dimension i with dimension i + head_dim/2 ("rotate
half"), not neighbours (2i, 2i+1) as in the Llama paper's complex-number form and llama2.c. Both
are the same rotation on a permuted vector, and HF's conversion script permutes the q/k weight
rows to match, so with HF weights we must rotate halves.
"""

from __future__ import annotations

import math

import numpy as np


def inv_frequencies(config) -> np.ndarray:
    """inv_freq[i] = theta^(-2i / head_dim), i < head_dim/2, with Llama 3.1 scaling if configured.  # [head_dim/2]

    Computed in float32 like the reference, so angles at large positions agree to the last bit
    we can hope for (a float32 angle near 10^4 has an ulp of ~1e-3 anyway).
    """
    d = config.head_dim
    inv_freq = 1.0 / (np.float32(config.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))
    if config.rope_scaling is not None:
        inv_freq = llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq.astype(np.float32)


def llama3_scale(inv_freq: np.ndarray, s) -> np.ndarray:
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
    return np.where(
        wavelength > low_freq_wavelength,
        inv_freq / s.factor,
        np.where(wavelength < high_freq_wavelength, inv_freq, blended),
    ).astype(np.float32)


def cos_sin(inv_freq: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every angle, each half repeated to span head_dim.  # [seq, head_dim] each"""
    angles = positions.astype(np.float32)[:, None] * inv_freq[None, :]  # [seq, head_dim/2]
    angles = np.concatenate([angles, angles], axis=-1)  # [seq, head_dim]
    return np.cos(angles), np.sin(angles)


def rotate_half(x: np.ndarray) -> np.ndarray:
    """(x1, x2) -> (-x2, x1) on the two halves of the last axis."""
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotates each (x[i], x[i + head_dim/2]) pair by its angle.  x: [heads, seq, head_dim]"""
    return x * cos + rotate_half(x) * sin
