"""What this machine offers for running an LLM: Python and library versions, CPU threads,
CUDA / MPS devices, nvcc. Prints advice for whatever is missing.

Usage, from this chapter's folder:

    python check_env.py
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys

REQUIRED = ["numpy", "torch", "transformers", "tokenizers", "safetensors", "jinja2"]


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvcc_version() -> str | None:
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return None
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    return next((line.split("release")[-1].strip() for line in out.splitlines() if "release" in line), "unknown")


def report() -> tuple[list[tuple[str, str]], list[str]]:
    rows = [("python", f"{platform.python_version()} ({sys.executable})"), ("platform", platform.platform())]
    advice = []
    for package in REQUIRED:
        v = version(package)
        rows.append((package, v or "MISSING"))
        if v is None:
            advice.append(f"{package} is missing: run `make setup` (installs requirements.txt into .venv)")
    rows.append(("cpu threads", f"{os.cpu_count()} logical cores"))
    try:
        import torch

        rows.append(("torch threads", str(torch.get_num_threads())))
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                rows.append((f"cuda:{i}", f"{p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB"))
        else:
            built = torch.version.cuda
            rows.append(("cuda", f"not available (torch built for {'CUDA ' + built if built else 'CPU only'})"))
            if shutil.which("nvidia-smi"):
                advice.append("nvidia-smi exists but torch sees no GPU: install the CUDA build of torch==2.13.0")
        rows.append(("mps", "available" if torch.backends.mps.is_available() else "not available"))
    except ImportError:
        pass
    nvcc = nvcc_version()
    rows.append(("nvcc", nvcc or "not found (chapter 06 then builds its C++ CPU kernels only)"))
    return rows, advice


def main() -> int:
    rows, advice = report()
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    for line in advice:
        print(f"advice: {line}")
    return 1 if any("missing" in a for a in advice) else 0


if __name__ == "__main__":
    sys.exit(main())
