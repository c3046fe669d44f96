"""Prompt chunks shrink deep into a long context while other sequences run (scheduler.chunk_limit):
a chunk's attention grows with the context it reads, and the other streams wait for the whole step."""

import pytest

from engine import Request, build_engine
from sampling import SamplingParams
from scheduler import CHUNK_CONTEXT, chunk_limit

GREEDY = SamplingParams(temperature=0)
BUDGET = 64
LONG = [1] + [(i * 7919) % 40000 + 100 for i in range(1999)]  # 2,000 tokens, past CHUNK_CONTEXT


def test_chunk_limit_keeps_the_query_key_pairs_of_a_full_chunk_at_chunk_context():
    full = BUDGET * (CHUNK_CONTEXT + BUDGET)
    assert chunk_limit(0, BUDGET) == chunk_limit(CHUNK_CONTEXT, BUDGET) == BUDGET
    for start in (CHUNK_CONTEXT + 1, 2000, 5000, 50_000):
        n = chunk_limit(start, BUDGET)
        assert n < BUDGET and n * (start + n) <= full < (n + 1) * (start + n + 1) or n == 16
    assert chunk_limit(10**7, BUDGET) == 16  # never below 16 tokens
    assert chunk_limit(10**7, 8) == 8  # nor above the budget


@pytest.fixture(scope="module")
def engine():
    eng, _ = build_engine(
        "tiny-llama3", "cpu", "float32", max_num_batched_tokens=BUDGET, num_blocks=512, max_model_len=4096, prefix_caching=False
    )  # no prefix cache: the second run of LONG computes it again
    return eng


def chunks_of(engine, rid: str) -> tuple[list[tuple[int, int]], list[int]]:
    """Steps the engine until `rid` ends: its (start, tokens) per prompt chunk, and its output."""
    starts, out = [], []
    while rid in engine.requests:
        for r, events, _done in engine.step():
            if r == rid:
                out += [t for e in events for t in e.token_ids]
        for seq, n in engine.last_plan.work:
            if seq.request_id == rid and n > 1:
                starts.append((seq.n_computed - n, n))
    return starts, out


def test_a_long_prompt_runs_full_chunks_alone_and_shrinking_ones_beside_a_stream(engine):
    engine.add(Request(LONG, GREEDY, max_tokens=4, ignore_eos=True), "alone")
    alone, alone_out = chunks_of(engine, "alone")
    assert {n for _, n in alone[:-1]} == {BUDGET}  # nothing else runs: every chunk is full

    engine.add(Request([1, 5, 6, 7], GREEDY, max_tokens=400, ignore_eos=True), "stream")
    engine.step()
    engine.add(Request(LONG, GREEDY, max_tokens=4, ignore_eos=True), "beside")
    beside, beside_out = chunks_of(engine, "beside")
    engine.abort("stream")
    assert beside_out == alone_out  # the chunking changes no token
    late = [(start, n) for start, n in beside[:-1] if start > CHUNK_CONTEXT]
    assert late and all(n == chunk_limit(start, BUDGET) < BUDGET for start, n in late)
    assert [n for _, n in late] == sorted((n for _, n in late), reverse=True)  # smaller as the context grows
