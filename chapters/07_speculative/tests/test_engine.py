"""The request loop: sampling, stop rules and streaming text around the paged, batched model."""

import os
from pathlib import Path

import pytest
import torch

from common.models import resolve_model
from common.tokenizer import Tokenizer
from common.tools.testing import load_neighbour
from engine import Engine, Request
from model import load_model
from sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
# The fixture's pool: 512 blocks of 16 tokens, the whole 8192-token context (377 MB in float32).
# Always a sized pool: without one the engine takes a quarter of the free memory (memory.py).
POOL_BLOCKS = 512


@pytest.fixture(scope="module")
def engine():
    """SmolLM2 in float32: for what needs a reply that makes sense and ends on its own."""
    d = resolve_model("smollm2-135m")
    return Engine(load_model(d), Tokenizer(d), Engine.read_generation_config(d), num_blocks=POOL_BLOCKS)


@pytest.fixture(scope="module")
def tiny():
    """tiny-llama3 in float32 (random weights; SmolLM2's tokenizer): for what needs tokens and text,
    not sense. A step costs a seventh of SmolLM2's, whose float32 weights (540 MB) every decode
    step reads; its replies run to max_tokens."""
    d = resolve_model("tiny-llama3")
    return Engine(load_model(d), Tokenizer(d), Engine.read_generation_config(d), num_blocks=POOL_BLOCKS)


def run(engine, req, cancelled=lambda: False):
    """-> per choice: (text, token ids, finish_reason)"""
    out = [["", [], None] for _ in range(req.n)]
    for events in engine.stream(req, cancelled):
        for ev in events:
            out[ev.index][0] += ev.text
            out[ev.index][1] += ev.token_ids
            out[ev.index][2] = ev.finish_reason or out[ev.index][2]
    return out


def chat(engine, text):
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def test_greedy_equals_chapter_04(tiny):
    """The paged, batched engine picks the tokens of the previous chapter's contiguous cache, one
    request at a time and with both requests in the same steps (float32 on both sides: the same
    tokens. SmolLM2's are chained through every chapter in tests/test_chapters.py)."""
    ch04 = load_neighbour(4, "model", "generate")
    d = resolve_model("tiny-llama3")
    prompts = [chat(tiny, "Write a haiku about the sea."), chat(tiny, "What is 2 + 2?")]
    expected = ch04.generate.generate_all(ch04.model.load_model(d), prompts, 24)
    for prompt, ids in zip(prompts, expected):
        text, tokens, _ = run(tiny, Request(prompt, GREEDY, max_tokens=24))[0]
        assert [t for t in tokens if t not in tiny.eos_ids] == ids
        assert text == tiny.tokenizer.decode(ids, skip_special_tokens=True)
    together = tiny.generate([Request(p, GREEDY, max_tokens=24) for p in prompts])
    assert [[t for t in out.token_ids if t not in tiny.eos_ids] for (out,) in together] == expected


def test_finish_reasons_stop_and_length(engine):
    text, tokens, finish = run(engine, Request(chat(engine, "What is the capital of France?"), GREEDY, max_tokens=40))[
        0
    ]
    assert finish == "stop" and tokens[-1] in engine.eos_ids and "Paris" in text
    text, tokens, finish = run(engine, Request(chat(engine, "Write a long essay."), GREEDY, max_tokens=5))[0]
    assert finish == "length" and len(tokens) == 5


def test_min_tokens_and_ignore_eos(engine):
    prompt = chat(engine, "What is the capital of France?")
    natural = run(engine, Request(prompt, GREEDY, max_tokens=40))[0][1]
    assert len(natural) < 15
    _, tokens, _ = run(engine, Request(prompt, GREEDY, max_tokens=40, min_tokens=15))[0]
    assert len(tokens) >= 15 and not set(tokens[:15]) & engine.eos_ids
    _, tokens, finish = run(engine, Request(prompt, GREEDY, max_tokens=20, ignore_eos=True))[0]
    assert len(tokens) == 20 and finish == "length"


def test_stop_token_ids(tiny):
    prompt = chat(tiny, "Write a haiku about the sea.")
    _, tokens, _ = run(tiny, Request(prompt, GREEDY, max_tokens=20))[0]
    text, stopped, finish = run(tiny, Request(prompt, GREEDY, max_tokens=20, stop_token_ids=[tokens[5]]))[0]
    assert finish == "stop" and stopped == tokens[: tokens.index(tokens[5]) + 1]
    assert text == tiny.tokenizer.decode(stopped[:-1], skip_special_tokens=True)


def test_stop_string_across_token_boundaries(tiny):
    prompt = chat(tiny, "Write a haiku about the sea.")
    full, tokens, _ = run(tiny, Request(prompt, GREEDY, max_tokens=30))[0]
    # a stop string that starts inside one token and ends inside a later one
    pieces = [tiny.tokenizer.decode(tokens[: i + 1], skip_special_tokens=True) for i in range(len(tokens))]
    start = len(pieces[3]) - 2
    stop = full[start : len(pieces[6]) - 1]
    assert len(stop) > 4
    text, _, finish = run(tiny, Request(prompt, GREEDY, max_tokens=30, stop=[stop]))[0]
    assert finish == "stop" and text == full[: full.index(stop)]
    text, _, _ = run(tiny, Request(prompt, GREEDY, max_tokens=30, stop=[stop], include_stop_str_in_output=True))[0]
    assert text == full[: full.index(stop) + len(stop)]


def test_min_tokens_bans_the_stop_tokens_but_reports_the_raw_logprobs(tiny):
    # The ban shapes the draw as the penalties do; the logprobs stay the model's (vLLM's raw
    # logprobs). Masked first, they were renormalised over what was left, and -inf (not JSON) in
    # the alternatives.
    prompt = chat(tiny, "Write a haiku about the sea.")
    params = SamplingParams(temperature=0, logprobs=3)

    def logprobs(req):
        return [lp for events in tiny.stream(req) for ev in events for lp in ev.logprobs]

    free = logprobs(Request(prompt, params, max_tokens=6, ignore_eos=True))
    chosen = {lp.token_id for lp in free}
    banned = [t for t in range(tiny.model.config.vocab_size) if t not in chosen]  # all but the greedy path
    held = logprobs(Request(prompt, params, max_tokens=6, min_tokens=6, ignore_eos=True, stop_token_ids=banned))
    assert [lp.token_id for lp in held] == [lp.token_id for lp in free]
    assert [(lp.logprob, lp.top) for lp in held] == [(lp.logprob, lp.top) for lp in free]


def test_stop_strings_wait_for_min_tokens(tiny):
    # vLLM's rule: no stop rule before min_tokens, stop strings included.
    prompt = chat(tiny, "Write a haiku about the sea.")
    full, tokens, _ = run(tiny, Request(prompt, GREEDY, max_tokens=12, ignore_eos=True))[0]
    pieces = [tiny.tokenizer.decode(tokens[: i + 1], skip_special_tokens=True) for i in range(len(tokens))]
    stop = full[len(pieces[0]) : len(pieces[2])]  # the text of tokens 1 and 2
    assert len(stop) >= 3 and full.count(stop) == 1
    text, _, finish = run(tiny, Request(prompt, GREEDY, max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert finish == "stop" and text == full[: full.index(stop)]
    text, _, finish = run(tiny, Request(prompt, GREEDY, max_tokens=12, ignore_eos=True, stop=[stop], min_tokens=4))[0]
    assert finish == "length" and text == full


def test_min_tokens_with_every_token_a_stop_token_is_refused(engine):
    # Nothing could be drawn: a NoTokenError mid-request (a 500) before.
    every = list(range(engine.model.config.vocab_size))
    with pytest.raises(ValueError, match="stop_token_ids leave no other token to generate"):
        engine.validate(Request([5], GREEDY, max_tokens=3, min_tokens=1, stop_token_ids=every))

def test_streamed_text_equals_one_shot_decode_with_sampling(tiny):
    params = SamplingParams(temperature=1.0, seed=3)
    text, tokens, _ = run(
        tiny, Request(chat(tiny, "Say something in Chinese and use emoji."), params, max_tokens=40)
    )[0]
    assert text == tiny.tokenizer.decode([t for t in tokens if t not in tiny.eos_ids], skip_special_tokens=True)


def test_seeded_n_choices(tiny):
    req = Request(chat(tiny, "Tell me a story."), SamplingParams(temperature=1.0, seed=11), max_tokens=12, n=3)
    a, b = run(tiny, req), run(tiny, req)
    assert a == b
    assert len({text for text, _, _ in a}) > 1


def test_the_largest_seed_works_for_every_choice(engine):
    req = Request(chat(engine, "Hi"), SamplingParams(temperature=1.0, seed=2**64 - 1), max_tokens=2, n=3)
    assert all(len(tokens) >= 1 for _, tokens, _ in run(engine, req))  # seed + 2 would overflow torch's seed


def test_cancel_stops_the_stream(engine):
    steps = []

    def cancelled():
        steps.append(1)
        return len(steps) > 3

    out = run(engine, Request(chat(engine, "Write a long essay."), GREEDY, max_tokens=100), cancelled)
    assert len(out[0][1]) == 3 and out[0][2] is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt_ids=[]), "the prompt is empty"),
        (dict(prompt_ids=[5] * 8192), "context is 8192 tokens"),
        (dict(prompt_ids=[5] * 100, max_tokens=8100), "lower max_tokens"),
        (dict(prompt_ids=[5], n=0), "n must be"),
        (dict(prompt_ids=[5], max_tokens=0), "max_tokens must be"),
        (dict(prompt_ids=[5], max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(prompt_ids=[5], stop_token_ids=[10**6]), "outside the vocabulary"),
        (dict(prompt_ids=[5, 10**6]), r"prompt token ids \[1000000\] are outside the model.s vocabulary"),
        (dict(prompt_ids=[5], stop=["x" * 257]), "at most 256 characters, got one of 257"),
        (dict(prompt_ids=[5], params=SamplingParams(temperature=-0.5)), "temperature"),
    ],
)
def test_bad_requests(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.validate(Request(**kwargs))


def test_defaults_follow_generation_config(tmp_path):
    d = resolve_model("tiny-llama3")
    engine = Engine(
        load_model(d), Tokenizer(d), {"temperature": 0.6, "top_p": 0.9, "eos_token_id": [2, 7]}, num_blocks=16
    )
    assert engine.default_params().temperature == 0.6 and engine.default_params().top_p == 0.9
    assert engine.eos_ids == {2, 7}


# --- limits and memory ----------------------------------------------------------------------


def limited(engine, **limits):
    """The fixture's model and tokenizer under other operator limits, in a pool of their own
    (POOL_BLOCKS blocks unless the limits size it)."""
    if "num_blocks" not in limits and "kv_cache_bytes" not in limits:
        limits["num_blocks"] = POOL_BLOCKS
    return Engine(engine.model, engine.tokenizer, engine.generation_config, **limits)


def block_bytes(engine, block_size: int = 16) -> int:
    """What one block of the pool takes: K and V of block_size tokens in every layer."""
    return engine.model.config.kv_bytes_per_token(engine.model.dtype.itemsize) * block_size


def test_a_request_without_max_tokens_gets_the_operator_default(engine):
    prompt = chat(engine, "Write a long essay.")
    _, tokens, finish = run(limited(engine, max_tokens_default=5), Request(prompt, GREEDY, ignore_eos=True))[0]
    assert len(tokens) == 5 and finish == "length"
    # the context still wins over the default
    short = limited(engine, max_model_len=len(prompt) + 3, max_tokens_default=50)
    assert len(run(short, Request(prompt, GREEDY, ignore_eos=True))[0][1]) == 3


def test_max_model_len_caps_the_context(engine):
    capped = limited(engine, max_model_len=64)
    assert capped.context == 64
    with pytest.raises(ValueError, match="context is 64 tokens"):
        capped.validate(Request([5] * 64))
    with pytest.raises(ValueError, match="max_model_len"):
        limited(engine, max_model_len=10**6)


def test_blocks_are_taken_as_the_sequence_grows_without_changing_the_tokens(tiny):
    prompt = chat(tiny, "Write a haiku about the sea.")
    req = Request(prompt, GREEDY, max_tokens=40, ignore_eos=True)
    expected = run(tiny, req)[0][1]
    small = limited(tiny, block_size=4)  # blocks of 4 tokens: a new one every fourth step
    tokens, used = [], []
    for events in small.stream(req):
        tokens += [t for ev in events for t in ev.token_ids]
        used.append(small.stats()["kv_blocks_used"])
    assert tokens == expected  # the sequence's K/V spread over 15 blocks, read back in table order
    # After the step that samples token k, the prompt and tokens 1..k-1 have K/V in the cache: the
    # sequence holds the blocks those need, not the prompt + 40 max_tokens it may never reach.
    assert used[:-1] == [-(-(len(prompt) + k - 1) // 4) for k in range(1, 40)]
    assert used[-1] == 0  # its last token given, every block goes back at once


def test_the_prompt_runs_once_for_n_choices(tiny, monkeypatch):
    import runner as runner_module

    prompt = chat(tiny, "Name a colour.")
    one = run(tiny, Request(prompt, GREEDY, max_tokens=6, ignore_eos=True))[0][1]
    fresh = limited(tiny)  # an empty prefix cache: the prompt's blocks are not found there
    steps = []  # (new tokens, sequences) of each forward pass
    real_forward = runner_module.forward
    monkeypatch.setattr(
        runner_module,
        "forward",
        lambda m, step, *a, **k: steps.append((len(step.tokens), len(step.last))) or real_forward(m, step, *a, **k),
    )
    out = run(fresh, Request(prompt, GREEDY, max_tokens=6, n=3, ignore_eos=True))
    # Choice 0 runs the prompt. Then choices 1 and 2 start from its blocks and compute only the
    # prompt's last token (for their logits), in the step where choice 0 decodes its second: one
    # step behind it, all three decode together, and 1 and 2 finish one step after it.
    assert steps == [(len(prompt), 1)] + [(3, 3)] * 5 + [(2, 2)]
    assert [tokens for _, tokens, _ in out] == [one] * 3


def test_the_pool_holds_what_kv_cache_bytes_buy_and_at_most_max_num_seqs_contexts(engine):
    per_block = block_bytes(engine)
    sized = limited(engine, kv_cache_bytes=10 * per_block + per_block // 2)  # a part of a block buys nothing
    assert sized.blocks.num_blocks == 10 and sized.runner.cache.nbytes == 10 * per_block
    assert sized.describe_pool() == f"KV cache: 10 blocks of 16 tokens = 160 tokens in {10 * per_block / 2**30:.2f} GiB"
    assert limited(engine, kv_cache_bytes=10 * per_block, block_size=8).blocks.num_blocks == 20
    # no more than max_num_seqs sequences of a whole context each could ever use: 3 x ceil(100 / 16)
    capped = limited(engine, kv_cache_bytes=2**40, max_model_len=100, max_num_seqs=3)
    assert capped.blocks.num_blocks == 21
    assert limited(engine, num_blocks=5, kv_cache_bytes=2**40).blocks.num_blocks == 5  # num_blocks is the pool
    with pytest.raises(ValueError, match="holds no block of 16 tokens: raise --kv-cache-memory-gb"):
        limited(engine, kv_cache_bytes=per_block - 1)


def test_without_a_size_the_pool_takes_the_default_share_of_free_memory(engine, monkeypatch):
    import runner as runner_module

    asked = []
    monkeypatch.setattr(
        runner_module, "default_kv_bytes", lambda device: asked.append(device) or 7 * block_bytes(engine)
    )
    default = Engine(engine.model, engine.tokenizer, engine.generation_config)
    assert asked == [engine.model.device] and default.blocks.num_blocks == 7
    # memory unknown (an MPS device): max_num_seqs full contexts
    monkeypatch.setattr(runner_module, "default_kv_bytes", lambda device: None)
    assert Engine(engine.model, engine.tokenizer, max_model_len=64, max_num_seqs=2).blocks.num_blocks == 8


def test_a_request_that_can_never_fit_the_pool_is_refused_before_it_runs(engine):
    small = limited(engine, num_blocks=8)  # 128 tokens
    req = Request([5] * 100, max_tokens=100)
    message = (
        r"this request needs room for 199 tokens \(100 in the prompt, 99 of the 100 to generate: the last is never "
        r"cached\), but this server's KV cache holds 128 tokens: lower max_tokens or the prompt's length"
    )
    with pytest.raises(ValueError, match=message):
        small.validate(req)
    with pytest.raises(ValueError, match=message):
        next(small.stream(req))  # refused before it is queued
    assert not small.requests and not small.has_work() and small.stats()["kv_blocks_used"] == 0
    # A request that sets no max_tokens gets the default (1024) within the context and the pool:
    # 29 tokens here (the last of them never cached), not a 400 telling it to lower a max_tokens it never set.
    small.validate(Request([5] * 100))
    assert small.limits.max_tokens_for(Request([5] * 100)) == 29
    small.validate(Request([5] * 100, max_tokens=29))
    # All n choices must fit at once (6 shared prompt blocks + 2 of its own each): else one would
    # be preempted over and over, and the requests behind it starve.
    with pytest.raises(
        ValueError, match=r"this request's 16 choices need 38 blocks of 16 tokens at once .* lower n or max_tokens"
    ):
        small.validate(Request([5] * 100, max_tokens=28, n=16))
    small.validate(Request([5] * 100, max_tokens=13, n=2))  # 6 + 2 x 1 = 8 blocks
    assert small.limits.max_tokens_for(Request([5] * 100, n=2)) == 13  # the default, for two choices


def test_a_requests_last_token_takes_no_room_in_the_pool(tiny):
    # Generation ends at the last token, so its K and V are never computed: 12 prompt tokens and 1
    # to generate cache 12, three blocks of 4. Counted as 13, the request was refused as needing 4
    # blocks (and n choices, up to n blocks more), though it ran in 3.
    # blocks: the shared prompt blocks (before the prompt's last token) + n x each choice's own
    for n_prompt, max_tokens, n, need in ((12, 1, 1, 3), (1, 4, 3, 3), (4, 1, 3, 3), (7, 6, 2, 1 + 2 * 2)):

        def req():
            return Request(list(range(300, 300 + n_prompt)), GREEDY, max_tokens=max_tokens, n=n, ignore_eos=True)

        assert limited(tiny, num_blocks=64, block_size=4).limits.pool_blocks_for(req()) == need
        exact = limited(tiny, num_blocks=need, block_size=4)
        assert all(len(ids) == max_tokens for _, ids, _ in run(exact, req()))
        assert exact.scheduler.n_preemptions == 0 and exact.stats()["kv_blocks_used"] == 0, (n_prompt, need)
        with pytest.raises(ValueError, match="lower"):  # the count is exact: a block less is refused
            limited(tiny, num_blocks=need - 1, block_size=4).validate(req())



def test_the_choices_of_a_prompt_that_fills_its_last_block_fit_the_pool_they_were_counted_for(tiny):
    # The choices fork before the prompt's last token, so its block is each one's own. Counted as
    # shared, a prompt of 8 tokens in blocks of 4 was let into a pool a block short of its two
    # choices, and one was preempted (with 8 choices, 3 times) inside a request the check accepted.
    for n_prompt in (8, 9):

        def req():
            return Request(list(range(300, 300 + n_prompt)), GREEDY, max_tokens=16 - n_prompt, n=2, ignore_eos=True)

        need = limited(tiny, num_blocks=64, block_size=4).limits.pool_blocks_for(req())
        exact = limited(tiny, num_blocks=need, block_size=4)
        assert len(run(exact, req())[1][1]) == 16 - n_prompt
        assert exact.scheduler.n_preemptions == 0, (n_prompt, need)

@pytest.mark.skipif(not Path("/proc/meminfo").is_file(), reason="reads MemAvailable (Linux)")
def test_the_default_pool_counts_memory_the_kernel_would_give_back():
    from memory import DEFAULT_KV_SHARE, default_kv_bytes, free_memory

    cpu = torch.device("cpu")
    free_pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    # free pages alone leave out the page cache: on a machine that has read many files, most of it
    assert free_memory(cpu) >= 0.9 * free_pages
    assert default_kv_bytes(cpu) == pytest.approx(DEFAULT_KV_SHARE * free_memory(cpu), rel=0.1)


def test_copy_block_copies_a_block_in_every_layer(engine):
    """Copy-on-write for the n choices of a request: a fork copies the partly filled last block of
    choice 0's prompt, K and V, in every layer, and touches no other block."""
    from paged_cache import PagedKVCache

    cfg = engine.model.config
    cache = PagedKVCache(cfg, 6, 4, "cpu", torch.float32)
    for t in cache.k + cache.v:
        t.normal_()
    before = [t.clone() for t in cache.k + cache.v]
    cache.copy_block(2, 5)
    assert len(cache.k) == len(cache.v) == cfg.num_hidden_layers
    for old, new in zip(before, cache.k + cache.v):
        assert new.shape == (6, 4, cfg.num_key_value_heads, cfg.head_dim)
        assert torch.equal(new[5], old[2]) and torch.equal(new[:5], old[:5])


@pytest.mark.parametrize("how", ["NaN logits", "a penalty takes the last finite logit"])
def test_a_request_whose_row_has_no_token_fails_alone_and_the_others_go_on(tiny, monkeypatch, how):
    # A row with no finite logit (an overflow: float16's on a GPU, say) made sample() raise for the
    # whole step, and every request in it failed. Now that request alone ends, with its error.
    from sampling import NoTokenError

    seeded = SamplingParams(temperature=0.8, seed=7)
    penalized = SamplingParams(temperature=0, repetition_penalty=100)  # (prompts hold token 1)
    params = [GREEDY, penalized if how.startswith("a penalty") else GREEDY, seeded]
    reqs = [Request([1, 300 + i, 500 + i, 700 + i], params[i], max_tokens=8, ignore_eos=True) for i in range(3)]
    alone = [tiny.generate([r])[0][0].token_ids for r in reqs]
    added = []
    real_add, real_run = tiny.add, tiny.runner.run
    monkeypatch.setattr(tiny, "add", lambda *a, **k: added.append(real_add(*a, **k)) or added[-1])

    def run(work):  # the rows of the first sequence of the second request added go bad at its 4th token
        logits = real_run(work)
        state = tiny.requests.get(added[min(1, len(added) - 1)])
        for row, w in enumerate(work):
            if state is not None and w.block_table is state.seqs[0].block_table and len(state.seqs[0].output) >= 3:
                if how == "NaN logits":
                    logits[row] = float("nan")
                else:  # finite, until the penalty scales token 1 (in the prompt) past float32's range
                    logits[row] = float("-inf")
                    logits[row, 1] = -1e37
        return logits

    monkeypatch.setattr(tiny.runner, "run", run)
    ids = {tiny.add(r): i for i, r in enumerate(reqs)}
    got, errors = {}, {}
    while tiny.has_work():
        for rid, events, _ in tiny.step():
            if isinstance(events, Exception):
                errors[ids[rid]] = events
            else:
                got.setdefault(ids[rid], []).extend(t for e in events for t in e.token_ids)
    assert list(errors) == [1] and isinstance(errors[1], NoTokenError) and "no finite logit" in str(errors[1])
    assert got[1] == alone[1][:3]  # its tokens up to the bad row, then nothing
    assert got[0] == alone[0] and got[2] == alone[2]  # the others as alone: the seeded one's draws untouched
    assert not tiny.requests and tiny.blocks.num_used == 0
    added.clear()
    with pytest.raises(NoTokenError, match="no finite logit"):
        tiny.generate([reqs[0], reqs[1], reqs[2]])  # the second fails: the call raises ...
    assert not tiny.requests and tiny.blocks.num_used == 0  # ... and takes the others out of the engine


def test_a_broken_generation_config_is_refused_when_the_model_is_read(tmp_path):
    # a server started on it, then failed every request with the model's error as the client's
    from common.config import ConfigError

    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2, "temperature": "hot"}')
    with pytest.raises(ConfigError, match="generation_config.json: temperature must be a number, got 'hot'"):
        Engine.read_generation_config(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2, "temperature": 0.5}')
    assert Engine.read_generation_config(tmp_path)["temperature"] == 0.5
