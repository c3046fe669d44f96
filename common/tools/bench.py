"""What every chapter's bench.py measures and records, shared so their figures mean the same.

The figures: TTFT (prompt in -> first new token out, i.e. prefill plus one sampling step),
prefill tok/s (prompt tokens / TTFT), ITL (inter-token latency: the gaps between consecutive new
tokens) at p50/p99, decode tok/s (new tokens after the first / their total time), and peak
memory; the machine they ran on; the requests the serving benches send (PROMPTS, LONG_TEXT); and
the JSON record, saved whole. Starting servers and streaming from them is serving.py's; building
an engine to time its steps is decoding.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import tempfile
from pathlib import Path

import numpy as np

from common.errors import UserError

# The folder that holds common/: the repository, or a reader's copy of a chapter and common/.
ROOT = Path(__file__).resolve().parents[2]
# Where every bench.py saves its JSON and plots by default (--out changes it).
RESULTS_DIR = ROOT / "bench" / "results"

# 32 short chat questions of varied length and topic: the serving benches' requests.
PROMPTS = [
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "What is the capital of Australia, and why was it chosen over Sydney and Melbourne?",
    "Explain recursion to a ten-year-old.",
    "List three uses of baking soda around the house.",
    "How do vaccines train the immune system?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a short motivational quote.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Why do cats purr?",
    "How does a refrigerator keep food cold?",
    "What are the main causes of the French Revolution? Keep it brief.",
    "Suggest a name for a small coffee shop near the sea.",
    "What is photosynthesis?",
    "How many legs does a spider have, and how many does an insect have?",
    "Describe the smell of rain.",
    "What should I pack for a three-day hiking trip in the mountains in early spring?",
    "Explain what a black hole is in simple words.",
    "Is a tomato a fruit or a vegetable?",
    "Write one sentence that uses the word 'serendipity'.",
    "How do I make a cup of green tea properly?",
    "What is the Pythagorean theorem, with an example?",
    "Why do leaves change colour in the autumn?",
    "Tell me a fun fact about octopuses.",
    "What does a database index do, and when can it slow things down?",
    "How far is the Moon from the Earth?",
    "Give two tips for a job interview.",
    "What is the boiling point of water at the top of Mount Everest, roughly, and why is it lower?",
    "Name three famous painters of the Renaissance.",
    "What is the difference between weather and climate?",
    "Compose a limerick about a forgetful robot.",
]

# Filler for long prompts, repeated or cut to the length a bench asks for.
LONG_TEXT = (
    "The lighthouse keeper kept a careful log of every ship that passed the headland. In the spring the "
    "fishing boats went out before dawn and came back heavy with mackerel; in the summer the yachts of the "
    "wealthy drifted by under white sails, and in the autumn the cargo steamers ploughed south with coal, "
    "timber and grain. Each entry recorded the hour, the wind, the state of the sea and the name of the "
    "vessel when it could be read. Over forty years the log filled twenty-three volumes, and historians "
    "later used it to reconstruct the trade of the whole coast, the decline of sail and the storms that "
    "wrecked eleven ships on the rocks below. The keeper himself wrote little about his own life: a note "
    "on the birth of a daughter, the death of a dog, a winter so cold that the oil froze in the lamp. "
)


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


# x86 vector levels, narrowest first: the kernel library's names (csrc/cpu/isa.cpp).
ISA_LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16")


def our_isa() -> str | None:
    """The vector level the kernel library runs at here (the CPU's best, capped by
    ATEN_CPU_CAPABILITY); None where the library cannot be built."""
    try:
        import kernels

        return kernels.load().cpu_isa()
    except Exception:  # noqa: BLE001  (a machine without a compiler: no figure, not an error)
        return None


def llama_cpp_isa() -> str | None:
    """The widest vector level llama.cpp (llama-cpp-python) was compiled for, from its own system
    info ("AVX2 = 1 | AVX512 = 0 | ..."), in ISA_LEVELS' names; None where it is not installed. A
    native build (peers.py's INSTALL) has what the CPU has. For a fair AVX2 comparison on a wider
    CPU, an AVX2 build beside it, put first on the path for the run:
        CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
          pip install --no-deps --target ~/llama-cpp-avx2 llama-cpp-python==0.3.36
        ATEN_CPU_CAPABILITY=avx2 PYTHONPATH=~/llama-cpp-avx2 python bench/workload.py"""
    try:
        import llama_cpp

        return isa_from_system_info(llama_cpp.llama_print_system_info().decode())
    except (ImportError, OSError, AttributeError):
        return None


def isa_from_system_info(info: str) -> str:
    """llama.cpp's "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 0 | ..." -> the widest level it has."""
    flags = {k.split(":")[-1].strip(): v.strip() for k, v in (p.split("=", 1) for p in info.split("|") if "=" in p)}
    on = {name for name, value in flags.items() if value == "1"}
    if "AVX512_BF16" in on:
        return "avx512_bf16"
    return "avx512" if "AVX512" in on else "avx2" if "AVX2" in on else "scalar"


def isa_report() -> dict:
    """Which vector instructions each side used: a ratio against llama.cpp counts only where both
    ran the same level (ours capped by ATEN_CPU_CAPABILITY=avx2 against an AVX2 build of llama.cpp)."""
    ours, theirs = our_isa(), llama_cpp_isa()
    report = {"ours": ours, "llama.cpp": theirs, "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY")}
    if ours and theirs:
        report["same_level"] = ours == theirs
    return report


def isa_line(report: dict) -> str:
    """What a bench prints beside its ratios against llama.cpp: the vector level each side used, and
    a warning where they differ (ours on AVX512-BF16 against an AVX2 build measures two builds)."""
    line = f"vector instructions: ours {report['ours']}, llama.cpp {report['llama.cpp']}"
    return line + ("" if report.get("same_level") else " (not the same level: the ratios compare builds, not engines)")


def machine() -> dict:
    import torch

    info = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "isa": isa_report(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return info


# --- statistics, formatting, arguments, records ---------------------------------------------------


def median(xs) -> float | None:
    """The median of the values that are there (not None, not NaN: a part that did not run); None if none is."""
    xs = [x for x in xs if x is not None and x == x]
    return statistics.median(xs) if xs else None


def pct(xs, q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def fmt(x, spec: str = ".1f", none: str = "-") -> str:
    """A table cell: `none` for a figure that is missing (None or NaN)."""
    return none if x is None or x != x else format(x, spec)


def add_int8_activations(ap: argparse.ArgumentParser, scope: str = "") -> None:
    """--int8-activations / --no-int8-activations for a bench, on by default as in the engines
    (chapter 06's ops.py); `scope` opens the help (e.g. "chapters 06 on: ")."""
    ap.add_argument(
        "--int8-activations",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"{scope}int4 and int8 weights meet bf16 x as int8 at every row count, as the engines do by default "
        "(a CPU); "
        "--no-int8-activations: the float product (chapter 06's README)",
    )


def int8_activations_error(args, quant: str | None, kernels: str = "auto") -> str | None:
    """Why --no-int8-activations changes nothing in this run (no int weights, --kernels off, float32
    activations, --batch-invariant), for the bench's ap.error before anything runs (the engines would
    refuse it, after the first ran)."""
    if args.int8_activations:
        return None
    dtype = getattr(args, "dtype", "bfloat16")
    why = (
        "--quant none" if quant in (None, "none")
        else "--kernels off" if kernels == "off"
        else f"--dtype {dtype}" if dtype not in ("bfloat16", "auto")
        else "--batch-invariant" if getattr(args, "batch_invariant", False)
        else None
    )
    return why and (
        f"--no-int8-activations is for int4 and int8 weights on the CPU kernels: with {why} it changes nothing"
    )


def int_list(text: str) -> list[int]:
    """ "1,4,16" -> [1, 4, 16]: sorted, without repeats, every one positive, at least one."""
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UserError(f"expected positive integers, got {text!r}")
    return values


def shown(path) -> str:
    """A script's path as a JSON records it: relative to the folder that holds common/, when inside it,
    so a record reads the same on every machine (chapters/06_cuda_kernel/bench.py in the repository)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def check_out(path: Path) -> None:
    """UserError unless a bench can write `path` (its folder made if need be): checked before the
    measuring, where a bad --out failed after the whole run, with a traceback."""
    if path.is_dir():
        raise UserError(f"--out {path} is a folder: give the file's name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".check"):
            pass
    except OSError as e:
        raise UserError(f"--out {path}: cannot write there ({e.strerror or e})") from None


def save_json(path: Path, record: dict) -> None:
    """Write `record` to `path` whole or not at all: a temporary file beside it, then renamed over it.
    A run stopped mid-write (a timeout's SIGTERM between the truncate and the write) keeps the last
    complete file instead of leaving an empty one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def command_line(script, args: list[str]) -> str:
    """The command that ran `script` with `args`, for the record: command_line(__file__, sys.argv[1:])."""
    return " ".join(["python", shown(script), *args])


