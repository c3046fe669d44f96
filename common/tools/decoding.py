"""A chapter's engine set up in the middle of decoding, for the benches that time its steps
(bench/profile_step.py, bench/compile_step.py). Unlike the rest of common.tools, this builds an
engine: one of a chapter loaded by number (common.tools.chapters), never one of its own.
"""

from __future__ import annotations

import time


def decoding_engine(
    chapter: int,
    model: str,
    quant: str,
    dtype: str,
    kernels: str,
    prompt_tokens: int,
    steps: int,
    warmup: int,
    sequences: int = 1,
    int8_activations: bool = True,
):
    """A chapter's engine (05 on) on the CPU, decoding `sequences` greedy sequences together, each
    a prompt of `prompt_tokens` ids (different ones), then `warmup` steps taken, and more until a
    step decodes every sequence (no prompt chunk left); room for `steps` more decode steps
    (ignore_eos). -> the engine, whose step() decodes the next token of every sequence.
    int8_activations: chapter 06's --int8-activations (int4 x bf16 as int8 at every row count, in
    integers; the engines' default), False for --no-int8-activations."""
    from types import SimpleNamespace

    from common.tools.chapters import load_chapter

    ch = load_chapter(chapter, "engine", "loading", "sampling", *(["ops"] if chapter >= 6 else []))
    if chapter >= 6:  # --[no-]int8-activations (ops.py's flags, of this same load)
        kernels = ch.ops.KernelFlags(kernels, False, int8_activations)
    spec = ch.loading.quant_spec(
        SimpleNamespace(quant=None if quant == "none" else quant, group_size=32, symmetric=False, lm_head="int8")
    )
    blocks = 64 * sequences
    engine, _ = ch.engine.build_engine(
        model, "cpu", dtype, spec, kernels=kernels, num_blocks=blocks, prefix_caching=False
    )
    greedy = ch.sampling.SamplingParams(temperature=0)
    # The prompts take as many steps as the step's token budget needs (16 x 256 tokens: 16 steps at
    # the engine's 256 a step), during which the first sequences decode, a token a step: `settle`
    # bounds those steps at 16 prompt tokens a step, a budget no engine here goes below.
    settle = -(-sequences * prompt_tokens // 16)
    for s in range(sequences):
        prompt = list(range(1000 + 7 * s, 1000 + 7 * s + prompt_tokens))
        request = ch.engine.Request(prompt, greedy, max_tokens=warmup + settle + steps + 8, ignore_eos=True)
        engine.add(request, f"r{s}")
    news = []  # of the latest step: a (request id, events, finished) per request it gave a token
    for _ in range(warmup):
        news = engine.step()
    # Then steps until one decodes every sequence: the timed steps are decode steps, no prompt in them.
    for _ in range(settle + 1):  # the checks: before each of `settle` steps, and after the last
        if len(news) == sequences:
            return engine
        news = engine.step()
    raise RuntimeError(f"{sequences} sequences of {prompt_tokens}-token prompts: not all decoding after the warm-up")


def time_steps(engine, n: int) -> float:
    """Seconds per engine step, over n steps."""
    t0 = time.perf_counter()
    for _ in range(n):
        engine.step()
    return (time.perf_counter() - t0) / n
