"""Greedy generation with the NumPy engine, no KV cache: every step recomputes the whole sequence.

Usage, from this chapter's folder:

    python generate.py --chat --prompt "What is the capital of France?"
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from common.cli import base_parser, check_prompt, prompt_ids, run_main
from common.errors import check_logits
from common.models import resolve_model
from common.tokenizer import Tokenizer
from model import Model, forward, load_model

# This chapter's number, from its folder's name, so that a copied chapter reports its own.
CHAPTER = Path(__file__).resolve().parent.name[:2]


def generate(model: Model, prompt: list[int], max_new_tokens: int, step_times: list | None = None):
    """Yields new token ids, greedy, until an EOS id, max_new_tokens, or the end of the context.

    Without a cache, step t runs the full forward pass over prompt + t tokens: the cost of a
    token grows with the length of everything before it."""
    config = model.config
    check_prompt(prompt, max_new_tokens, config)
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        if len(tokens) >= config.max_position_embeddings:
            return
        t0 = time.perf_counter()
        logits = forward(model, tokens, last_only=True)  # [1, vocab]
        check_logits(logits)
        next_id = int(np.argmax(logits[0]))
        if step_times is not None:
            step_times.append(time.perf_counter() - t0)
        if next_id in config.eos_token_ids:
            return
        tokens.append(next_id)
        yield next_id


def main() -> int:
    args = base_parser(__doc__).parse_args()
    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer(model_dir)
    model = load_model(model_dir)
    prompt = prompt_ids(tokenizer, args.prompt, args.chat)

    step_times: list[float] = []
    t0 = time.perf_counter()
    new = list(generate(model, prompt, args.max_new_tokens, step_times))
    elapsed = time.perf_counter() - t0
    if len(new) < args.max_new_tokens and len(step_times) == len(new):  # no EOS: the context ended the run
        context = model.config.max_position_embeddings
        print(f"note: stopped after {len(new)} of --max-new-tokens {args.max_new_tokens}: the model's context "
              f"({context} tokens) is full", file=sys.stderr)  # fmt: skip
    print(tokenizer.decode(new, skip_special_tokens=True))
    print(
        f"[ch{CHAPTER} numpy, no cache] prompt {len(prompt)} tokens, {len(step_times)} steps "
        f"({len(new)} tokens{' + EOS' if len(step_times) > len(new) else ''}) in {elapsed:.2f} s "
        f"({len(step_times) / elapsed:.1f} tok/s); first step {step_times[0] * 1e3:.0f} ms, "
        f"last step {step_times[-1] * 1e3:.0f} ms",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    run_main(main)
