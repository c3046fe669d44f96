"""Choosing a torch device and dtype from `--device auto|cpu|cuda|mps` and `--dtype auto|...`."""

from __future__ import annotations

import os

import torch

from common.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str | None = None) -> torch.device:
    flag = "DEVICE" if not name and os.environ.get("DEVICE") else "--device"  # which one said it
    name = name or os.environ.get("DEVICE") or "auto"
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    kind, colon, index = name.partition(":")
    if kind not in ("cpu", "cuda", "mps") or (colon and not index.isdigit()):  # torch.device raised on "cpu:abc"
        raise UserError(f"{flag} must be auto, cpu, cuda or mps (cuda:N for one GPU of several), got {name!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{flag} {name}: torch sees no CUDA device (CPU build of torch, or no GPU)")
    if kind == "cuda" and colon and int(index) >= torch.cuda.device_count():
        raise UserError(f"{flag} {name}: torch sees {torch.cuda.device_count()} CUDA devices (cuda:0 on)")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"{flag} {name}: MPS is not available on this machine")
    return torch.device(name)


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU (exact parity, and fast everywhere), bfloat16 on CUDA, float16 on MPS."""
    flag = "DTYPE" if not name and os.environ.get("DTYPE") else "--dtype"  # which one said it
    name = name or os.environ.get("DTYPE") or "auto"
    if name == "auto":
        return {"cuda": torch.bfloat16, "mps": torch.float16}.get(device.type, torch.float32)
    if name not in DTYPES:
        raise UserError(f"{flag} must be auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
