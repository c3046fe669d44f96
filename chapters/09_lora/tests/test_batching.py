"""Continuous batching through the engine: many requests arriving at different steps, with a
pool small enough to preempt, prompts in chunks and shared prefixes, each giving exactly the
greedy output it gives alone in chapter 04 (float32, the tiny random model: no near ties)."""

import random

import pytest

from common.models import resolve_model
from common.tokenizer import Tokenizer
from common.tools.testing import load_neighbour
from engine import Engine, Request
from model import load_model
from sampling import SamplingParams
from sequence import Status

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def tiny():
    d = resolve_model("tiny-llama3")
    return load_model(d), Tokenizer(d)


def make_engine(tiny, **kw):
    model, tokenizer = tiny
    return Engine(model, tokenizer, {}, **({"num_blocks": 256} | kw))


def workload(n: int, seed: int, shared_prefix: int = 0) -> tuple[list[Request], list[int]]:
    """n greedy requests of mixed prompt lengths and max_tokens, and the step each arrives at.
    With shared_prefix, every prompt starts with the same tokens (a system prompt)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 250) for _ in range(shared_prefix)]
    reqs = [
        Request(
            prefix + [rng.randrange(3, 250) for _ in range(rng.choice([1, 3, 15, 16, 17, 40, 90]))],
            GREEDY,
            max_tokens=rng.randrange(1, 30),
            ignore_eos=True,
        )
        for _ in range(n)
    ]
    return reqs, [rng.randrange(0, 25) for _ in range(n)]


@pytest.fixture(scope="module")
def alone():
    """Chapter 04's greedy tokens for a request run on its own (cached per prompt). The tests without
    a shared prefix take their requests from one seed: each engine setting is what they vary,
    and the reference runs, most of their time, are then made once."""
    ch04 = load_neighbour(4, "engine")
    d = resolve_model("tiny-llama3")
    engine, _ = ch04.engine.build_engine(str(d), "cpu", "float32")
    memo = {}

    def run(req: Request) -> list[int]:
        key = (tuple(req.prompt_ids), req.max_tokens)
        if key not in memo:
            theirs = ch04.engine.Request(
                req.prompt_ids, ch04.engine.SamplingParams(temperature=0), max_tokens=req.max_tokens, ignore_eos=True
            )
            memo[key] = [t for events in engine.stream(theirs) for ev in events for t in ev.token_ids]
        return memo[key]

    return run


def check_equal(engine, reqs, arrivals, alone):
    outputs = engine.generate(reqs, arrivals)
    for i, (req, out) in enumerate(zip(reqs, outputs)):
        for choice in out:
            assert choice.token_ids == alone(req), f"request {i} ({len(req.prompt_ids)} prompt tokens)"
            assert choice.finish_reason == "length"
    # everything went back: nothing in use, nothing queued
    assert engine.blocks.num_used == 0 and not engine.has_work() and not engine.requests
    assert engine.blocks.num_used + engine.blocks.num_free == engine.blocks.num_blocks


def test_32_requests_arriving_over_time_equal_each_request_alone(tiny, alone):
    engine = make_engine(tiny, prefix_caching=False)
    reqs, arrivals = workload(32, seed=0)
    check_equal(engine, reqs, arrivals, alone)
    assert engine.scheduler.n_preemptions == 0


def test_a_pool_too_small_for_the_batch_preempts_and_loses_nothing(tiny, alone):
    engine = make_engine(tiny, num_blocks=12, prefix_caching=False)  # 192 slots for 32 requests
    reqs, arrivals = workload(32, seed=0)  # the first test's requests: chapter 04's answers are cached
    check_equal(engine, reqs, arrivals, alone)
    assert engine.scheduler.n_preemptions > 0


def test_chunked_prefill_splits_long_prompts_and_changes_no_token(tiny, alone):
    engine = make_engine(tiny, max_num_batched_tokens=7, prefix_caching=False)
    reqs, arrivals = workload(32, seed=0)
    chunks = []
    real_step = engine.step

    def step():
        out = real_step()
        if engine.last_plan:
            chunks.extend(
                n for seq, n in engine.last_plan.work if n < len(seq.prompt) and seq.n_computed < len(seq.prompt)
            )
            assert sum(n for _, n in engine.last_plan.work) <= 7
        return out

    engine.step = step
    check_equal(engine, reqs, arrivals, alone)
    assert chunks, "no prompt was split"


def test_without_chunked_prefill_a_prompt_runs_whole(tiny, alone):
    engine = make_engine(tiny, max_num_batched_tokens=7, chunked_prefill=False, prefix_caching=False)
    reqs, arrivals = workload(8, seed=0)  # the first 8 prompts of seed 0, arriving at other steps
    check_equal(engine, reqs, arrivals, alone)


def test_shared_prefixes_hit_the_cache_and_change_no_token(tiny, alone):
    engine = make_engine(tiny, num_blocks=64)
    reqs, arrivals = workload(32, seed=4, shared_prefix=40)
    check_equal(engine, reqs, arrivals, alone)
    assert engine.blocks.hit_rate > 0.2
    assert engine.stats()["prefix_cache_hit_rate"] == round(engine.blocks.hit_rate, 4)


def test_preemption_chunking_and_prefix_caching_together(tiny, alone):
    engine = make_engine(tiny, num_blocks=14, max_num_batched_tokens=9)
    reqs, arrivals = workload(32, seed=5, shared_prefix=20)
    check_equal(engine, reqs, arrivals, alone)
    assert engine.scheduler.n_preemptions > 0 and engine.blocks.hit_tokens > 0


def test_n_choices_share_the_prompt_blocks(tiny, alone):
    engine = make_engine(tiny, prefix_caching=False)
    req = Request(list(range(3, 43)), GREEDY, max_tokens=5, ignore_eos=True, n=3)  # 40 tokens: 2.5 blocks
    rid = engine.add(req)
    parent, *siblings = engine.requests[rid].seqs
    engine.step()  # choice 0 computes the prompt
    assert parent.n_computed == 40 and all(s.status is Status.WAITING for s in siblings)
    engine.step()  # the others fork from it and compute only the prompt's last token
    for s in siblings:
        assert s.block_table[:2] == parent.block_table[:2]  # the two full blocks, shared
        assert s.block_table[2] != parent.block_table[2]  # the partly filled one, copied
    assert all(engine.blocks.ref_count[b] == 3 for b in parent.block_table[:2])
    while engine.has_work():
        engine.step()
    assert engine.blocks.num_used == 0


def test_n_choices_greedy_all_equal_the_request_alone(tiny, alone):
    engine = make_engine(tiny, num_blocks=20)
    reqs, arrivals = workload(6, seed=0)
    for r in reqs:
        r.n = 4
    check_equal(engine, reqs, arrivals, alone)


def test_abort_frees_every_block_at_once(tiny):
    engine = make_engine(tiny)
    ids = [engine.add(Request(list(range(3, 60)), GREEDY, max_tokens=50, n=2)) for _ in range(3)]
    for _ in range(4):
        engine.step()
    assert engine.blocks.num_used > 0
    for rid in ids:
        engine.abort(rid)
    assert engine.blocks.num_used == 0 and not engine.has_work()


def test_a_request_that_can_never_fit_the_pool_is_refused(tiny):
    engine = make_engine(tiny, num_blocks=4)  # 64 tokens
    with pytest.raises(ValueError, match="KV cache holds 64 tokens"):
        engine.add(Request(list(range(3, 50)), GREEDY, max_tokens=20))
    engine.add(Request(list(range(3, 50)), GREEDY, max_tokens=17))  # 64 exactly: fits


def test_seeded_sampling_does_not_depend_on_the_other_requests(tiny):
    """A seeded choice draws from its own random stream: alone or among others, the same tokens."""
    seeded = Request(list(range(5, 30)), SamplingParams(temperature=1.0, seed=1234), max_tokens=12, ignore_eos=True)
    alone_out = make_engine(tiny).generate([seeded])[0][0].token_ids
    others = [Request(list(range(40, 40 + k)), SamplingParams(temperature=0.8), max_tokens=10) for k in (3, 9, 20)]
    together = make_engine(tiny).generate(others + [seeded], [0, 0, 2, 1])[3][0].token_ids
    assert together == alone_out


def test_steps_batch_decodes_together(tiny):
    engine = make_engine(tiny)
    for k in range(8):
        engine.add(Request(list(range(3, 10 + k)), GREEDY, max_tokens=6, ignore_eos=True))
    engine.step()  # all eight prompts in one step
    assert len(engine.last_plan.work) == 8
    engine.step()
    assert [n for _, n in engine.last_plan.work] == [1] * 8  # then one decode token each, together


def test_batched_greedy_on_every_device_equals_each_request_alone(device):
    """The engine on this device (cuda where present): requests together give the tokens each gives alone."""
    d = resolve_model("tiny-llama3")
    model, tokenizer = load_model(d, device=device), Tokenizer(d)
    reqs, arrivals = workload(8, seed=8)
    together = Engine(model, tokenizer, {}, num_blocks=64).generate(reqs, arrivals)
    for req, out in zip(reqs, together):
        alone = Engine(model, tokenizer, {}, num_blocks=64).generate([req])[0][0].token_ids
        assert out[0].token_ids == alone


def test_stop_ids_covering_the_vocabulary_with_min_tokens_are_refused_up_front(tiny):
    """Otherwise no token could be sampled, and the failure would take the whole step's batch down."""
    engine = make_engine(tiny)
    vocab = engine.model.config.vocab_size
    with pytest.raises(ValueError, match="leave no other token"):
        engine.add(Request([8, 9], GREEDY, max_tokens=5, min_tokens=1, stop_token_ids=list(range(vocab))))
    engine.add(
        Request([8, 9], GREEDY, max_tokens=5, stop_token_ids=list(range(vocab)))
    )  # no min_tokens: may stop at once
