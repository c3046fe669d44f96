"""Shared measurement helpers for the chapters' bench.py scripts.

The figures every bench reports: TTFT (prompt in -> first new token out, i.e. prefill plus one
sampling step), prefill tok/s (prompt tokens / TTFT), ITL (inter-token latency: the gaps between
consecutive new tokens) at p50/p99, decode tok/s (new tokens after the first / their total
time), and peak memory.
"""

from __future__ import annotations

import os
import platform
import resource
from pathlib import Path

import numpy as np

# Where every bench.py saves its JSON and plots by default (--out changes it).
RESULTS_DIR = Path(__file__).resolve().parent.parent / "bench" / "results"


def summarize(t_start: float, token_times: list[float], n_prompt: int) -> dict:
    """t_start: when the prompt was handed over; token_times: when each new token was ready."""
    ttft = token_times[0] - t_start
    gaps = np.diff(token_times)
    return {
        "prompt_tokens": n_prompt,
        "new_tokens": len(token_times),
        "ttft_ms": ttft * 1e3,
        "prefill_tok_s": n_prompt / ttft,
        "decode_tok_s": len(gaps) / gaps.sum() if len(gaps) else float("nan"),
        "itl_p50_ms": float(np.percentile(gaps, 50) * 1e3) if len(gaps) else float("nan"),
        "itl_p99_ms": float(np.percentile(gaps, 99) * 1e3) if len(gaps) else float("nan"),
        "step_ms": [float(g * 1e3) for g in gaps],
    }


def peak_memory_bytes(device) -> int:
    """Peak GPU memory allocated by torch on CUDA; peak resident set size of this process elsewhere."""
    import torch  # here, not at the top: chapter 01's NumPy bench uses this module without torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    # VmHWM, not getrusage's ru_maxrss: Linux keeps ru_maxrss across fork and exec, so a bench child
    # would report its parent's peak when that was higher.
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def machine() -> dict:
    import torch

    info = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return info
