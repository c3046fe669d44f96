"""Choosing a torch device and dtype from `--device auto|cpu|cuda|mps` and `--dtype auto|...`."""

from __future__ import annotations

import os

import torch

from common.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str | None = None) -> torch.device:
    name = name or os.environ.get("DEVICE") or "auto"
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA device (CPU build of torch, or no GPU)")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError("--device mps: MPS is not available on this machine")
    if name.split(":")[0] not in ("cpu", "cuda", "mps"):
        raise UserError(f"--device must be auto, cpu, cuda or mps, got {name!r}")
    return torch.device(name)


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU (exact parity, and fast everywhere), bfloat16 on CUDA, float16 on MPS."""
    name = name or os.environ.get("DTYPE") or "auto"
    if name == "auto":
        return {"cuda": torch.bfloat16, "mps": torch.float16}.get(device.type, torch.float32)
    if name not in DTYPES:
        raise UserError(f"--dtype must be auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
