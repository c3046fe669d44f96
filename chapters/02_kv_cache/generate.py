"""Greedy generation with a KV cache: one prefill over the prompt, then one token per decode step.

Usage, from this chapter's folder:

    python generate.py --chat --prompt "What is the capital of France?"
    python generate.py --prompt "The sky is" --prompt "Two plus two is" --dtype bfloat16
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from common.cli import DEFAULT_PROMPT, base_parser, check_prompt, positive_int, prompt_ids, run_main
from common.device import pick_device, pick_dtype, synchronize
from common.errors import UserError, check_logits
from common.models import resolve_model
from common.tokenizer import Tokenizer
from kv_cache import KVCache
from model import Model, forward, load_model

# This chapter's number, from its folder's name, so that a copied chapter reports its own.
CHAPTER = Path(__file__).resolve().parent.name[:2]


@torch.inference_mode()
def generate(model: Model, prompts: list[list[int]], max_new_tokens: int, max_seq: int | None = None):
    """Greedy decoding of a batch of prompts of any lengths. Yields, once per step, one entry per
    prompt: its new token id, or None once that prompt has finished (EOS or context end).

    Prompts are left-padded to a common length so every sequence writes the same cache slot at
    each step; `pad` tells attention and RoPE which slots are padding."""
    config, device = model.config, model.device
    longest = max(len(p) for p in prompts)
    for p in prompts:
        check_prompt(p, max_new_tokens, config)
    max_seq = max_seq or min(longest + max_new_tokens, config.max_position_embeddings)
    if longest >= max_seq:
        raise UserError(f"the longest prompt has {longest} tokens; --max-seq is {max_seq}")
    cache = KVCache(config, len(prompts), max_seq, device, model.dtype)

    pad_id = config.eos_token_ids[0] if config.eos_token_ids else 0  # any id: padded slots are masked
    tokens = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts], device=device)  # [batch, longest]
    pad = torch.tensor([longest - len(p) for p in prompts], device=device)  # [batch]
    pad = pad if pad.any() else None

    logits = forward(model, tokens, cache, pad, last_only=True)  # prefill: [batch, 1, vocab]
    finished = [False] * len(prompts)
    for i in range(max_new_tokens):
        if cache.length >= max_seq:  # the next token would sit past the context, as in chapter 01
            return
        check_logits(logits)
        next_ids = logits[:, -1].argmax(-1)  # [batch]
        step = []
        for b, token in enumerate(next_ids.tolist()):
            finished[b] = finished[b] or token in config.eos_token_ids
            step.append(None if finished[b] else token)
        if all(finished):
            return
        yield step
        if i + 1 == max_new_tokens:
            return
        logits = forward(model, next_ids[:, None], cache, pad)  # decode: [batch, 1, vocab]


def generate_all(model: Model, prompts: list[list[int]], max_new_tokens: int, **kw) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in prompts]
    for step in generate(model, prompts, max_new_tokens, **kw):
        for b, token in enumerate(step):
            if token is not None:
                out[b].append(token)
    return out


def main() -> int:
    ap = base_parser(__doc__, batch=True)
    ap.add_argument("--device", default=None, help="auto, cpu, cuda, mps (default: $DEVICE, else auto)")
    ap.add_argument(
        "--dtype",
        default=None,
        help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16 (default: $DTYPE, else auto)",
    )
    ap.add_argument(
        "--max-seq", type=positive_int, default=None, help="KV cache slots (default: longest prompt + max new tokens)"
    )
    args = ap.parse_args()
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer(model_dir)
    model = load_model(model_dir, device, dtype)
    prompts = [prompt_ids(tokenizer, p, args.chat) for p in (args.prompt or [DEFAULT_PROMPT])]

    outputs: list[list[int]] = [[] for _ in prompts]
    step_times = []
    synchronize(device)
    t0 = time.perf_counter()
    for step in generate(model, prompts, args.max_new_tokens, args.max_seq):
        step_times.append(time.perf_counter())  # .tolist() inside generate already waited for the GPU
        for b, token in enumerate(step):
            if token is not None:
                outputs[b].append(token)
    if step_times and len(step_times) < args.max_new_tokens and any(token is not None for token in step):
        # its last step still gave tokens: not EOS but the end of the KV cache (or the context) ended the run
        print(
            f"note: stopped after {len(step_times)} of --max-new-tokens {args.max_new_tokens}: "
            "the KV cache (--max-seq) or the model's context is full",
            file=sys.stderr,
        )
    for out in outputs:
        print(tokenizer.decode(out, skip_special_tokens=True))
    if step_times:
        ttft = step_times[0] - t0
        n_prompt = sum(len(p) for p in prompts)
        decode_s = step_times[-1] - step_times[0]
        decoded = sum(len(o) for o in outputs) - len([o for o in outputs if o])
        print(
            f"[ch{CHAPTER} torch {device.type} {str(dtype).removeprefix('torch.')}, KV cache] batch {len(prompts)}, "
            f"prompt {n_prompt} tokens, TTFT {ttft * 1e3:.0f} ms (prefill {n_prompt / ttft:.0f} tok/s), "
            f"decode {decoded} tokens at {decoded / decode_s if decode_s else float('nan'):.1f} tok/s",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    run_main(main)
