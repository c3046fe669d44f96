"""Greedy generation on a paged KV cache: one prefill step over all prompts, then one token per sequence per step.

Usage, from this chapter's folder:

    python generate.py --chat --prompt "What is the capital of France?" --quant int4
    python generate.py --model ../../models/smollm2-135m-int8 --prompt "The sky is"
    python generate.py --model path/to/SmolLM2-135M-Instruct.Q4_1.gguf --chat
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from common.cli import DEFAULT_PROMPT, base_parser, check_prompt, positive_int, prompt_ids, run_main
from common.device import synchronize
from common.errors import UserError, check_logits
from common.tokenizer import Tokenizer
from batch import Work, build_step
from loading import add_quant_args, load, quant_spec
import ops
from model import Model, forward
from paged_cache import PagedKVCache

# This chapter's number, from its folder's name, so that a copied chapter reports its own.
CHAPTER = Path(__file__).resolve().parent.name[:2]


@torch.inference_mode()
def generate(
    model: Model, prompts: list[list[int]], max_new_tokens: int, max_seq: int | None = None, block_size: int = 16
):
    """Greedy decoding of a batch of prompts of any lengths. Yields, once per step, one entry per
    prompt: its new token id, or None once that prompt has finished (EOS or context end).

    No padding any more: the first step runs every prompt, end to end, as one batch of their
    tokens; each later step runs one token per unfinished sequence. Each sequence owns a fixed
    range of blocks of a pool sized for all of them (the engine hands blocks out as they are
    needed instead: engine.py)."""
    config, device = model.config, model.device
    for p in prompts:
        check_prompt(p, max_new_tokens, config)
    longest = max(len(p) for p in prompts)
    max_seq = max_seq or min(longest + max_new_tokens, config.max_position_embeddings)
    if max_seq > config.max_position_embeddings:
        raise UserError(f"max_seq={max_seq} exceeds the model's context of {config.max_position_embeddings} tokens")
    if longest >= max_seq:
        raise UserError(f"the longest prompt has {longest} tokens; --max-seq is {max_seq}")
    per_seq = -(-max_seq // block_size)  # blocks per sequence
    cache = PagedKVCache(config, per_seq * len(prompts), block_size, device, model.dtype)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(len(prompts))]

    work = [Work(list(p), 0, tables[b]) for b, p in enumerate(prompts)]
    logits = forward(model, build_step(work, block_size, device), cache)  # prefill: [batch, vocab]
    lengths = [len(p) for p in prompts]  # tokens in each sequence's blocks
    rows = list(range(len(prompts)))  # the prompt of each row of logits
    for i in range(max_new_tokens):
        check_logits(logits)
        step = [None] * len(prompts)
        for b, token in zip(rows, logits.argmax(-1).tolist()):  # [live sequences]
            step[b] = None if token in config.eos_token_ids else token
        if all(t is None for t in step):
            return
        yield step
        # Each one goes on unless its next token would sit past the context, as in chapter 01 (a
        # long prompt's end is not the others': they have blocks of their own).
        rows = [b for b, t in enumerate(step) if t is not None and lengths[b] + 1 < max_seq]
        if i + 1 == max_new_tokens or not rows:
            return
        work = [Work([step[b]], lengths[b], tables[b]) for b in rows]
        for b in rows:
            lengths[b] += 1
        logits = forward(model, build_step(work, block_size, device), cache)  # decode: [live, vocab]


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
        help="auto (float32 on CPU, bfloat16 on CUDA and for quantized weights), "
        "float32, bfloat16, float16 (default: $DTYPE, else auto)",
    )
    ap.add_argument(
        "--max-seq", type=positive_int, default=None, help="KV cache slots (default: longest prompt + max new tokens)"
    )
    add_quant_args(ap)
    args = ap.parse_args()
    model, model_dir = load(args.model, args.device, args.dtype, quant_spec(args), args.matmul, ops.from_args(args))
    device, dtype = model.device, model.dtype
    tokenizer = Tokenizer(model_dir)
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
            f"[ch{CHAPTER} {device.type} {str(dtype).removeprefix('torch.')}, {model.quant.name if model.quant else 'no quantization'}, "
            f"{model.weight_bytes / 1e6:.0f} MB of weights, {model.ops.describe()}] batch {len(prompts)}, "
            f"prompt {n_prompt} tokens, TTFT {ttft * 1e3:.0f} ms (prefill {n_prompt / ttft:.0f} tok/s), "
            f"decode {decoded} tokens at {decoded / decode_s if decode_s else float('nan'):.1f} tok/s",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    run_main(main)
