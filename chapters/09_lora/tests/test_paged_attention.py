"""Paged attention and the step batch against chapter 04's contiguous attention: random block
tables, prefills, chunked prefills, decodes and mixed steps, in float32 with a tight tolerance."""

import random

import pytest
import torch
import torch.nn.functional as F

from batch import Work, build_step
from common.models import resolve_model
from common.tools.testing import load_neighbour
from model import forward, forward_sequence, load_model
from paged_attention import gather, paged_attention, reference_attention
from paged_cache import PagedKVCache

N_HEADS, N_KV, DIM, BS = 6, 2, 8, 4


def contiguous_attention(q, k, v, start):
    """Chapter 04's attention for one sequence whose keys 0..start+new-1 are k, v ([keys, n_kv, dim]):
    q [new, n_heads, dim] -> [new, n_heads, dim]."""
    new, keys = q.shape[0], k.shape[0]
    causal = torch.arange(keys)[None, :] <= torch.arange(start, start + new)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=causal, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def scattered(pool_blocks, n_tokens, rng):
    """A block table of random, distinct blocks for n_tokens."""
    return rng.sample(range(pool_blocks), -(-n_tokens // BS))


@pytest.mark.parametrize("seed", range(6))
def test_a_mixed_step_equals_contiguous_attention_per_sequence(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    n_blocks = 64
    k_pool, v_pool = torch.randn(n_blocks, BS, N_KV, DIM), torch.randn(n_blocks, BS, N_KV, DIM)
    # Sequences: (tokens already cached, tokens added now): decodes (1), prefills from 0,
    # chunks of a prefill that started earlier, lengths that do and do not end on a block edge.
    shapes = [(rng.randrange(0, 30), rng.choice([1, 1, 2, 5, 8, 13])) for _ in range(rng.randrange(1, 7))]
    free = list(range(n_blocks))
    rng.shuffle(free)
    work, keys, values = [], [], []
    for start, new in shapes:
        table = [free.pop() for _ in range(-(-(start + new) // BS))]
        work.append(Work([0] * new, start, table))
        k = k_pool[table].flatten(0, 1)[: start + new]  # what the pool holds for it, contiguous
        keys.append(k), values.append(v_pool[table].flatten(0, 1)[: start + new])
    step = build_step(work, BS, "cpu")
    q = torch.randn(len(step.tokens), N_HEADS, DIM)
    out = paged_attention(q, k_pool, v_pool, step.groups)
    first = 0
    for w, k, v in zip(work, keys, values):
        n = len(w.tokens)
        want = contiguous_attention(q[first : first + n], k, v, w.start)
        torch.testing.assert_close(out[first : first + n], want, rtol=1e-5, atol=1e-5)
        ref = reference_attention(q[first : first + n], k_pool, v_pool, w.block_table, w.start)
        torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
        first += n


def test_the_step_puts_each_token_at_its_slot_and_groups_decodes_apart():
    work = [Work([7], 5, [3, 9]), Work([1, 2, 3], 0, [4]), Work([8], 0, [6])]
    step = build_step(work, BS, "cpu")
    assert step.tokens.tolist() == [7, 1, 2, 3, 8]
    assert step.positions.tolist() == [5, 0, 1, 2, 0]
    assert step.slots.tolist() == [9 * BS + 1, 4 * BS, 4 * BS + 1, 4 * BS + 2, 6 * BS]
    assert step.last.tolist() == [0, 3, 4]
    decode, prefill = step.groups
    assert decode.token_index.tolist() == [[0], [4]] and not decode.padded
    assert prefill.token_index.tolist() == [[1, 2, 3]]
    # the decode at position 5 reads slots 0..5 of its two blocks, the other decode slot 0
    assert decode.mask[:, 0, 0].tolist() == [[True] * 6 + [False] * 2, [True] + [False] * 7]


def test_a_table_too_short_for_the_tokens_is_refused():
    with pytest.raises(ValueError, match="cannot hold"):
        build_step([Work([1, 2, 3, 4, 5], 0, [0])], BS, "cpu")


def test_gather_reads_blocks_in_table_order():
    pool = torch.arange(5 * BS * N_KV * DIM, dtype=torch.float32).view(5, BS, N_KV, DIM)
    got = gather(pool, torch.tensor([[3, 1]]))  # [1, n_kv, 2 * BS, dim]
    torch.testing.assert_close(got[0].transpose(0, 1), torch.cat([pool[3], pool[1]]))


@pytest.fixture(scope="module")
def tiny():
    return load_model(resolve_model("tiny-llama3"))


def test_a_prompt_in_chunks_then_decodes_equals_one_pass(tiny):
    """The model through the pool: a prompt fed as chunks of 5 into scattered blocks, then
    decodes, gives the logits of one pass over the whole sequence."""
    rng = random.Random(0)
    ids = [rng.randrange(3, 250) for _ in range(37)]
    whole = forward_sequence(tiny, ids)  # [37, vocab]
    cache = PagedKVCache(tiny.config, 40, BS, "cpu", torch.float32)
    table = rng.sample(range(40), -(-len(ids) // BS))
    got = []
    for start in range(0, 30, 5):
        got.append(forward(tiny, build_step([Work(ids[start : start + 5], start, table)], BS, "cpu"), cache))
    for p in range(30, 37):
        got.append(forward(tiny, build_step([Work([ids[p]], p, table)], BS, "cpu"), cache))
    want = whole[[min(s + 4, 29) for s in range(0, 30, 5)] + list(range(30, 37))]
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)


def test_one_pass_equals_chapter_04(tiny):
    ch04 = load_neighbour(4, "model", "kv_cache")
    theirs = ch04.model.load_model(resolve_model("tiny-llama3"))
    ids = list(range(3, 60))
    cache = ch04.kv_cache.KVCache(theirs.config, 1, len(ids), "cpu", torch.float32)
    want = ch04.model.forward(theirs, torch.tensor([ids]), cache)[0]
    torch.testing.assert_close(forward_sequence(tiny, ids), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_on_every_device(device, dtype):
    """The batched path on this device (cuda and mps where present) equals the per-sequence reference."""
    rng = random.Random(7)
    g = torch.Generator().manual_seed(7)
    k_pool = torch.randn(32, BS, N_KV, DIM, generator=g).to(device, dtype)
    v_pool = torch.randn(32, BS, N_KV, DIM, generator=g).to(device, dtype)
    free = list(range(32))
    rng.shuffle(free)
    work = []
    for start, new in ((0, 9), (13, 1), (4, 3), (22, 1)):
        work.append(Work([0] * new, start, [free.pop() for _ in range(-(-(start + new) // BS))]))
    step = build_step(work, BS, device)
    q = torch.randn(len(step.tokens), N_HEADS, DIM, generator=g).to(device, dtype)
    out = paged_attention(q, k_pool, v_pool, step.groups)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    first = 0
    for w in work:
        n = len(w.tokens)
        want = reference_attention(q[first : first + n], k_pool, v_pool, w.block_table, w.start)
        torch.testing.assert_close(out[first : first + n].float(), want.float(), rtol=tol, atol=tol)
        first += n
