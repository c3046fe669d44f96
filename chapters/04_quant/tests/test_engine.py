"""The request loop: sampling, stop rules and streaming text around the cached model."""

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


@pytest.fixture(scope="module")
def engine():
    """SmolLM2 in float32: for what needs a reply that makes sense and ends on its own."""
    d = resolve_model("smollm2-135m")
    return Engine(load_model(d), Tokenizer(d), Engine.read_generation_config(d))


@pytest.fixture(scope="module")
def tiny():
    """tiny-llama3 in float32 (random weights; SmolLM2's tokenizer): for what needs tokens and text,
    not sense. A step costs a seventh of SmolLM2's, whose float32 weights (540 MB) every decode
    step reads; its replies run to max_tokens."""
    d = resolve_model("tiny-llama3")
    return Engine(load_model(d), Tokenizer(d), Engine.read_generation_config(d))


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


def test_greedy_equals_chapter_02(tiny):
    # float32 on both sides: the same tokens (SmolLM2's are chained through every chapter in
    # tests/test_chapters.py)
    ch02 = load_neighbour(2, "model", "generate")
    d = resolve_model("tiny-llama3")
    prompts = [chat(tiny, "Write a haiku about the sea."), chat(tiny, "What is 2 + 2?")]
    expected = ch02.generate.generate_all(ch02.model.load_model(d), prompts, 24)
    for prompt, ids in zip(prompts, expected):
        text, tokens, _ = run(tiny, Request(prompt, GREEDY, max_tokens=24))[0]
        assert [t for t in tokens if t not in tiny.eos_ids] == ids
        assert text == tiny.tokenizer.decode(ids, skip_special_tokens=True)


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
    engine = Engine(load_model(d), Tokenizer(d), {"temperature": 0.6, "top_p": 0.9, "eos_token_id": [2, 7]})
    assert engine.default_params().temperature == 0.6 and engine.default_params().top_p == 0.9
    assert engine.eos_ids == {2, 7}


# --- limits and memory ----------------------------------------------------------------------


def limited(engine, **limits):
    """The fixture's model and tokenizer under other operator limits."""
    return Engine(engine.model, engine.tokenizer, engine.generation_config, **limits)


def record_caches(monkeypatch):
    """-> the list every KVCache the engine builds is appended to, as (its shape when built, it)."""
    import engine as engine_module

    built = []

    class Recorded(engine_module.KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append((self.shape, self))

    monkeypatch.setattr(engine_module, "KVCache", Recorded)
    return built


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


def test_cache_starts_small_and_grows_without_changing_the_tokens(tiny, monkeypatch):
    import memory

    prompt = chat(tiny, "Write a haiku about the sea.")
    req = Request(prompt, GREEDY, max_tokens=40, ignore_eos=True)
    expected = run(tiny, req)[0][1]
    built = record_caches(monkeypatch)
    monkeypatch.setattr(memory, "CACHE_CHUNK", 8)
    assert run(tiny, req)[0][1] == expected  # grown 3 times on the way: every copy kept its slots
    ((shape, cache),) = built
    assert shape[2] == len(prompt) + 8  # not the prompt + 40 max_tokens asked for
    assert cache.max_seq == len(prompt) + 40 and cache.length == len(prompt) + 39  # grown in place, capped


def test_the_prompt_runs_once_for_n_choices(tiny, monkeypatch):
    import engine as engine_module

    prompt = chat(tiny, "Name a colour.")
    one = run(tiny, Request(prompt, GREEDY, max_tokens=6, ignore_eos=True))[0][1]
    shapes = []
    real_forward = engine_module.forward
    monkeypatch.setattr(
        engine_module,
        "forward",
        lambda m, tokens, *a, **k: shapes.append(tuple(tokens.shape)) or real_forward(m, tokens, *a, **k),
    )
    out = run(tiny, Request(prompt, GREEDY, max_tokens=6, n=3, ignore_eos=True))
    assert shapes[0] == (1, len(prompt)) and shapes[1:] == [(3, 1)] * 5
    assert [tokens for _, tokens, _ in out] == [one] * 3


def test_memory_estimate_counts_n_max_tokens_and_the_prompt(engine):
    base = engine.memory_needed(Request([5] * 1000, max_tokens=100))
    per_token = engine.model.config.kv_bytes_per_token(engine.model.dtype.itemsize)
    assert base.kv_cache == per_token * 1100
    four = engine.memory_needed(Request([5] * 1000, max_tokens=100, n=4))
    assert four.kv_cache == 4 * base.kv_cache and four.prefill == base.prefill  # the prompt runs once
    assert engine.memory_needed(Request([5] * 4000, max_tokens=100)).prefill > 8 * base.prefill  # attention: P^2
    # None means the default, not the whole context
    assert engine.memory_needed(Request([5] * 1000)).kv_cache == per_token * (1000 + engine.max_tokens_default)


def test_the_estimate_covers_the_caches_a_request_builds(tiny, monkeypatch):
    import memory

    built = record_caches(monkeypatch)
    monkeypatch.setattr(memory, "CACHE_CHUNK", 8)  # so it grows to full size within 40 tokens
    req = Request(
        chat(tiny, "Tell me a story."), SamplingParams(temperature=1.0, seed=1), max_tokens=40, n=2, ignore_eos=True
    )
    run(tiny, req)
    ((shape, cache),) = built
    assert shape[0] == 1  # the prompt's pass
    assert cache.shape[0] == 2 and cache.max_seq == len(req.prompt_ids) + 40
    assert cache.nbytes <= tiny.memory_needed(req).kv_cache


def test_a_request_over_the_memory_budget_is_refused_before_it_runs(engine):
    budgeted = limited(engine, memory_budget=2 * 2**30)
    req = Request([5] * 5800, max_tokens=1000, n=16)  # the request: about 7 GiB
    with pytest.raises(ValueError, match=r"lower n \(16\), max_tokens \(1000\) or the prompt's length \(5800"):
        budgeted.validate(req)
    with pytest.raises(ValueError, match="GiB per request"):
        next(budgeted.stream(req))  # refused before any cache is built
    budgeted.validate(Request([5] * 100, max_tokens=100))
    # a budget or a need under a tenth of a GiB read "0.00 GiB"
    small = limited(engine, memory_budget=2**20)
    with pytest.raises(ValueError, match=r"need about [0-9.]+ MiB: KV cache [0-9.]+ MiB, .* allows 1\.0 MiB per request"):
        small.validate(Request([5] * 100, max_tokens=100))


@pytest.mark.skipif(not Path("/proc/meminfo").is_file(), reason="reads MemAvailable (Linux)")
def test_the_default_budget_counts_memory_the_kernel_would_give_back():
    from kv_cache import available_memory
    from memory import DEFAULT_BUDGET_SHARE, default_budget, free_memory

    cpu = torch.device("cpu")
    # free pages alone leave out the page cache: on a machine that has read many files, most of it
    assert free_memory(cpu) >= 0.9 * available_memory(cpu)
    assert default_budget(cpu) == pytest.approx(DEFAULT_BUDGET_SHARE * free_memory(cpu), rel=0.1)


def test_resize_copies_the_filled_slots_to_every_row(engine):
    from kv_cache import KVCache
    from memory import resize

    cfg = engine.model.config
    cache = KVCache(cfg, 1, 10, "cpu", torch.float32)
    for t in cache.k + cache.v:
        t.normal_()
    cache.length = 7
    before = [t[:, :, :7].clone() for t in cache.k + cache.v]
    resize(cache, 3, 25)
    assert cache.max_seq == 25 and cache.shape[0] == 3 and cache.length == 7
    for old, new in zip(before, cache.k + cache.v):
        assert new.shape == (3, cfg.num_key_value_heads, 25, cfg.head_dim)
        assert torch.equal(new[:, :, :7], old.expand(3, -1, -1, -1))


def test_a_broken_generation_config_is_refused_when_the_model_is_read(tmp_path):
    # a server started on it, then failed every request with the model's error as the client's
    from common.config import ConfigError

    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2, "temperature": "hot"}')
    with pytest.raises(ConfigError, match="generation_config.json: temperature must be a number, got 'hot'"):
        Engine.read_generation_config(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2, "temperature": 0.5}')
    assert Engine.read_generation_config(tmp_path)["temperature"] == 0.5
