"""The hot operations of a decoder layer, from the kernel library or from PyTorch.

Chapter 06 runs chapter 05's engine with its inner loops replaced by the kernels of kernels/
(a CUDA kernel on a GPU, its C++ twin on a CPU). The forward pass (model.py) calls the four
operations below through one of two objects with the same methods:

    KernelOps   kernels/: fused residual-add + RMSNorm, RoPE in place, paged decode attention
                (flash-decoding, reading K/V where they lie in the pool), int4/int8 matmuls (qmatmul.py)
    TorchOps    chapter 05's PyTorch code, for `--kernels off` and for devices the library lacks (mps)

Both compute the same maths; what differs is how many passes over memory it takes. Per layer
and decode token, chapter 05 launches about 25 small PyTorch operations (each reading and writing
its whole input); the kernels make that about 10, and attention stops copying each sequence's
context out of the pool.
"""

from __future__ import annotations

import torch

from batch import AttentionGroup
from paged_attention import paged_attention
from rope import apply_rope, cos_sin


class TorchOps:
    """Chapter 05's operations."""

    name = "off"
    ext = None  # no kernels: qmatmul.prepare takes torch's packed ops

    @staticmethod
    def angles(inv_freq: torch.Tensor, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a step's tokens, in the form rope_ takes: [tokens, 1, head_dim] in `dtype`
        (angles in float32, then cast: the reference's rounding)."""
        cos, sin = cos_sin(inv_freq, positions)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += delta (the residual stream, in place); -> rms_norm(x) * weight."""
        if delta is not None:
            x.add_(delta)
        return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)

    @staticmethod
    def rope_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        qk.copy_(apply_rope(qk, cos, sin))

    @staticmethod
    def attention(q, k_pool, v_pool, groups: list[AttentionGroup]) -> torch.Tensor:
        return paged_attention(q, k_pool, v_pool, groups)


class KernelOps:
    """The kernel library's operations. `partition_size`: keys per flash-decoding partition."""

    name = "on"

    def __init__(self, ext, partition_size: int = 256):
        self.ext, self.partition_size = ext, partition_size

    @staticmethod
    def angles(inv_freq: torch.Tensor, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as the RoPE kernel takes them: float32 [tokens, head_dim / 2], computed once per
        step for all layers; the kernel rotates in float32 and rounds once."""
        angles = positions.to(torch.float32)[:, None] * inv_freq
        return angles.cos(), angles.sin()

    def add_rms_norm(self, x, delta, weight, eps) -> torch.Tensor:
        return self.ext.add_rms_norm(x, delta, weight, eps)

    def rope_(self, qk, cos, sin) -> None:
        self.ext.rope_(qk, cos, sin)

    def attention(self, q, k_pool, v_pool, groups: list[AttentionGroup]) -> torch.Tensor:
        """Decodes (one query per sequence) through the paged kernel; prompt chunks through
        chapter 05's gather + SDPA, which is compute-bound there and already good at it."""
        return paged_attention(q, k_pool, v_pool, groups, decode=self.decode)

    def decode(self, q: torch.Tensor, k_pool, v_pool, g: AttentionGroup) -> torch.Tensor:
        """q: [B, n_heads, head_dim], one query per sequence of the group -> the same shape."""
        return self.ext.paged_decode_attention(q, k_pool, v_pool, g.tables32, g.context_lens, q.shape[-1] ** -0.5,
                                               self.partition_size)


def pick_ops(choice: str, device: torch.device):
    """choice: "on" (the kernels, an error where they cannot run), "off" (PyTorch), or "auto"
    (the kernels where they run on this device, else PyTorch). -> (ops, why the kernels are off or None)."""
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"kernels must be 'auto', 'on' or 'off', got {choice!r}")
    if choice == "off":
        return TorchOps(), "--kernels off"
    if device.type not in ("cpu", "cuda"):
        why = f"kernels/ has no {device.type} implementation"
    else:
        import kernels  # builds the library on first use (a minute), with a message

        try:
            ext = kernels.load()
            why = None if device.type == "cpu" or ext.with_cuda else "kernels/ was built without CUDA here"
        except kernels.KernelBuildError as e:
            why = str(e)
        if why is None:
            return KernelOps(ext), None
    if choice == "on":
        raise ValueError(f"--kernels on: {why}")
    return TorchOps(), why


def describe(model) -> str:
    """For the startup line: which path runs, e.g. "kernels: on (cpu, avx512)"."""
    if model.ops.ext is None:
        return f"kernels: off ({model.kernels_off})"
    where = f"cpu, {model.ops.ext.cpu_isa()}" if model.device.type == "cpu" else model.device.type
    return f"kernels: on ({where})"
