"""The paged torch engine against HF transformers, against a full recompute, and against chapter 01."""

import os
import random

import numpy as np
import pytest
import torch

from common.hf_reference import hf_greedy, hf_hidden_states
from common.models import resolve_model
from common.parity import assert_parity, compare, format_table
from common.tokenizer import Tokenizer
from common.tools.testing import load_neighbour
from batch import Work, build_step
from generate import generate_all
from model import forward, forward_sequence, load_model
from paged_cache import PagedKVCache

TEXT = (
    "In 1969, the Apollo 11 mission landed the first humans on the Moon. Neil Armstrong and Buzz Aldrin "
    "spent about two and a quarter hours outside the lunar module, collecting samples and setting up "
    "experiments, while Michael Collins orbited above in the command module. The crew returned to Earth "
    "on July 24 and splashed down in the Pacific Ocean."
)
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
_models: dict = {}


def engine(name, device="cpu", dtype=torch.float32):
    key = (name, str(device), dtype)
    if key not in _models:
        d = resolve_model(name)
        _models[key] = (d, load_model(d, device, dtype), Tokenizer(d))
    return _models[key]


def run_with_capture(model, ids):
    out = {}
    logits = forward_sequence(model, ids, capture=out)  # one prefill through the block pool
    out["logits"] = logits.float().cpu().numpy()
    return out


class Decoder:
    """One sequence, step by step, through a pool of small blocks handed out in scrambled order: its
    K/V lie in no particular order in the pool, and each step reads them back through the table."""

    BLOCK_SIZE = 4

    def __init__(self, model, max_tokens: int):
        n_blocks = -(-max_tokens // self.BLOCK_SIZE)
        self.model, self.length = model, 0
        self.cache = PagedKVCache(model.config, n_blocks + 3, self.BLOCK_SIZE, model.device, model.dtype)
        self.table = random.Random(0).sample(range(n_blocks + 3), n_blocks)  # 3 blocks never used

    def __call__(self, tokens: list[int]) -> torch.Tensor:
        """Adds `tokens` to the sequence. -> logits [1, vocab] at the last of them"""
        step = build_step([Work(tokens, self.length, self.table)], self.BLOCK_SIZE, self.model.device)
        self.length += len(tokens)
        return forward(self.model, step, self.cache)


def test_tiny_every_layer_within_1e_4(device):
    d, model, tok = engine("tiny-llama3", device)
    ids = tok.encode(TEXT)
    assert_parity(run_with_capture(model, ids), hf_hidden_states(d, ids), atol=1e-4, min_top1=1.0)


def test_smollm2_every_layer_fp32(device):
    d, model, tok = engine("smollm2-135m", device)
    ids = tok.encode(TEXT)[:64]
    assert_parity(run_with_capture(model, ids), hf_hidden_states(d, ids), rtol=1e-5, min_top1=1.0)


def test_smollm2_every_layer_bf16(device):
    """bf16 activations carry ~3 significant digits, so every layer adds rounding to the residual
    stream. The yardstick is HF transformers' own bf16 error against the fp32 reference: ours is no
    worse on a typical layer, on none far worse, and the logits agree. Layer by layer the two differ
    as noise does: the RoPE kernel rotates in float32 and rounds once, where PyTorch rounds cos, sin
    and each product to bf16 (measured on a Xeon with AMX: 1.8x HF's error at layer 2, 0.6-0.8x
    from layer 9 on; chapter 05's one-layer bound of 1.5x holds there without the kernels)."""
    d, model, tok = engine("smollm2-135m", device, torch.bfloat16)
    ids = tok.encode(TEXT)[:64]
    ref = hf_hidden_states(d, ids)
    ours = compare(run_with_capture(model, ids), ref)
    hf_bf16 = compare(hf_hidden_states(d, ids, torch.bfloat16), ref)
    table = f"ours bf16 vs fp32:\n{format_table(ours)}\nHF bf16 vs fp32:\n{format_table(hf_bf16)}"
    ratios = sorted(o.rel / h.rel for o, h in zip(ours, hf_bf16) if h.rel > 0)
    assert ratios[len(ratios) // 2] <= 1.5, table
    assert all(o.rel <= 2.5 * h.rel + 1e-3 for o, h in zip(ours, hf_bf16)), table
    assert ours[-1].rel < 0.05 and ours[-1].top1 >= 0.9, table


TIE_STEPS = 4  # a near-tie: two fp32 logits at most this many bf16 steps apart


def bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at the magnitude of x (8 significant bits): 0.125 for |x| in [16, 32)."""
    return torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(x.abs()))


def test_smollm2_bf16_greedy_leaves_the_fp32_path_only_at_near_ties(device):
    """Greedy bf16 output is not one fixed string. Where the two best logits are closer than bf16
    arithmetic resolves, the winner depends on the bf16 kernels (CPU instruction set, GPU), for
    HF transformers as for us: "What is the capital of France?" starts with "The" ahead of "L" by
    0.098 in fp32, and bf16 engines pick either. So each token our bf16 engine picks is scored by
    the fp32 reference given the same prefix (HF fp32 over the prompt and our tokens): it must be
    the fp32 argmax, or a near-tie with it. Up to its first near-tie, a bf16 answer is therefore
    the fp32 answer token for token; a broken engine picks tokens logits below the best."""
    d, model, tok = engine("smollm2-135m", device, torch.bfloat16)
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    n, eos = 24, model.config.eos_token_ids
    picks = exact = 0
    for prompt, ours in zip(prompts, generate_all(model, prompts, n)):
        ref = torch.from_numpy(
            hf_hidden_states(d, prompt + ours)["logits"][len(prompt) - 1 :]
        )  # row i: fp32 logits for pick i
        chosen = ref[torch.arange(len(ours)), ours]
        names = [tok.decode([t]) for t in ours]
        if len(ours) < n:  # stopping early is a pick too: an EOS token
            chosen, names = torch.cat([chosen, ref[len(ours), eos].max()[None]]), names + ["<eos>"]
        best = ref[: len(chosen)].max(-1).values
        gap = best - chosen  # 0 where ours is the fp32 argmax
        off = [(i, name, round(float(g), 3)) for i, (name, g) in enumerate(zip(names, gap)) if g > 0]
        assert bool((gap <= TIE_STEPS * bf16_step(best)).all()), f"{tok.decode(ours)!r}: (step, pick, gap) {off}"
        picks, exact = picks + len(chosen), exact + len(chosen) - len(off)
    assert exact >= 0.85 * picks, f"{exact} of {picks} bf16 picks are the fp32 argmax"


@pytest.mark.parametrize("name, atol", [("tiny-llama3", 1e-4), ("smollm2-135m", 2e-3)])
def test_decode_with_cache_equals_full_recompute_at_every_step(name, atol, device):
    """The paged cache is exact: the logits of each decode step, its K/V read back through a
    scrambled block table, equal those of a forward pass over the whole sequence from scratch (no
    cache reuse), which is chapter 01's maths."""
    _, model, tok = engine(name, device)
    ids = tok.encode("The three laws of thermodynamics are")
    decode = Decoder(model, len(ids) + 12)
    logits = decode(ids)
    for _ in range(12):
        ids.append(int(logits[0].argmax()))
        logits = decode(ids[-1:])
        full = forward_sequence(model, ids)[-1:]  # a pool of its own, every position from scratch
        torch.testing.assert_close(logits, full, atol=atol, rtol=0)


def test_decode_logits_equal_chapter_01_numpy():
    _, model, tok = engine("tiny-llama3")
    ch01 = load_neighbour(1, "model")
    np_model = ch01.model.load_model(resolve_model("tiny-llama3"))
    ids = tok.encode("Rivers flow into the sea because")
    decode = Decoder(model, len(ids) + 6)
    logits = decode(ids)
    for _ in range(6):
        np.testing.assert_allclose(logits[0].numpy(), ch01.model.forward(np_model, ids, last_only=True)[0], atol=1e-4)
        ids.append(int(logits[0].argmax()))
        logits = decode(ids[-1:])


@pytest.mark.parametrize("name", ["tiny-llama3", "smollm2-135m"])
def test_greedy_equals_hf(name):
    d, model, tok = engine(name)
    prompt = tok.encode_chat([{"role": "user", "content": CHATS[1]}])
    ours = generate_all(model, [prompt], 24)[0]
    assert ours == hf_greedy(d, prompt, 24), tok.decode(ours)


def test_greedy_equals_chapter_01_numpy():
    # On SmolLM2 both chapters equal HF's tokens (above, and in chapter 01), and tests/test_chapters.py
    # runs every chapter on one prompt: here the cheap model, token for token.
    d, model, tok = engine("tiny-llama3")
    prompt = tok.encode_chat([{"role": "user", "content": CHATS[1]}])
    ch01 = load_neighbour(1, "model", "generate")
    assert generate_all(model, [prompt], 24)[0] == list(ch01.generate.generate(ch01.model.load_model(d), prompt, 24))


# tiny-llama3 in float32: a masking or a padding slip changes its tokens. On SmolLM2 the batched
# tokens are checked against HF's, prompt for prompt, by test_batched_greedy_equals_hf_generate_per_prompt.
@pytest.mark.parametrize("name", ["tiny-llama3"])
def test_ragged_batch_equals_each_prompt_alone(name, device):
    _, model, tok = engine(name, device)
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    prompts.append(tok.encode("Hi"))  # a much shorter prompt: its tokens end long before the others'
    assert len({len(p) for p in prompts}) == len(prompts)
    batched = generate_all(model, prompts, 20)
    alone = [generate_all(model, [p], 20)[0] for p in prompts]
    assert batched == alone


def test_batched_greedy_equals_hf_generate_per_prompt():
    d, model, tok = engine("smollm2-135m")
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    assert generate_all(model, prompts, 16) == [hf_greedy(d, p, 16) for p in prompts]


USER_MODEL = os.environ.get("MODEL", "")


@pytest.mark.skipif(
    USER_MODEL in ("", "smollm2-135m", "tiny-llama3"),
    reason="set MODEL=/path/to/a Llama 3.x checkpoint to check a real model too",
)
def test_user_model_every_layer_and_greedy(device):
    d, model, tok = engine(USER_MODEL, device)
    ids = tok.encode(TEXT)[:64]
    assert_parity(run_with_capture(model, ids), hf_hidden_states(d, ids), rtol=1e-4, min_top1=0.98)
    prompt = tok.encode_chat([{"role": "user", "content": "Write a short poem about the sea."}])
    assert generate_all(model, [prompt], 16)[0] == hf_greedy(d, prompt, 16)
