"""What every chapter's bench.py measures and records, shared so their figures mean the same.

The figures: TTFT (prompt in -> first new token out, i.e. prefill plus one sampling step),
prefill tok/s (prompt tokens / TTFT), ITL (inter-token latency: the gaps between consecutive new
tokens) at p50/p99, decode tok/s (new tokens after the first / their total time), and peak
memory; the machine they ran on; the requests the serving benches send (PROMPTS, LONG_TEXT); and
the JSON record, saved whole. Starting servers and streaming from them is serving.py's; building
an engine to time its steps is decoding.py's.
"""

from __future__ import annotations

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


