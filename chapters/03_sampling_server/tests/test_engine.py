"""The request loop: sampling, stop rules and streaming text around the cached model."""

import pytest
import torch

from common.testing import load_neighbour
from common.models import resolve_model
from common.tokenizer import Tokenizer
from engine import Engine, Request
from model import load_model
from sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def engine():
    d = resolve_model("smollm2-135m")
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


def test_greedy_equals_chapter_02(engine):
    ch02 = load_neighbour(2, "model", "generate")
    d = resolve_model("smollm2-135m")
    prompts = [chat(engine, "Write a haiku about the sea."), chat(engine, "What is 2 + 2?")]
    expected = ch02.generate.generate_all(ch02.model.load_model(d), prompts, 24)
    for prompt, ids in zip(prompts, expected):
        text, tokens, _ = run(engine, Request(prompt, GREEDY, max_tokens=24))[0]
        assert [t for t in tokens if t not in engine.eos_ids] == ids
        assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_finish_reasons_stop_and_length(engine):
    text, tokens, finish = run(engine, Request(chat(engine, "What is the capital of France?"), GREEDY, max_tokens=40))[0]
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


def test_stop_token_ids(engine):
    prompt = chat(engine, "Write a haiku about the sea.")
    _, tokens, _ = run(engine, Request(prompt, GREEDY, max_tokens=20))[0]
    text, stopped, finish = run(engine, Request(prompt, GREEDY, max_tokens=20, stop_token_ids=[tokens[5]]))[0]
    assert finish == "stop" and stopped == tokens[: tokens.index(tokens[5]) + 1]
    assert text == engine.tokenizer.decode(stopped[:-1], skip_special_tokens=True)


def test_stop_string_across_token_boundaries(engine):
    prompt = chat(engine, "Write a haiku about the sea.")
    full, tokens, _ = run(engine, Request(prompt, GREEDY, max_tokens=30))[0]
    # a stop string that starts inside one token and ends inside a later one
    pieces = [engine.tokenizer.decode(tokens[: i + 1], skip_special_tokens=True) for i in range(len(tokens))]
    start = len(pieces[3]) - 2
    stop = full[start : len(pieces[6]) - 1]
    assert len(stop) > 4
    text, _, finish = run(engine, Request(prompt, GREEDY, max_tokens=30, stop=[stop]))[0]
    assert finish == "stop" and text == full[: full.index(stop)]
    text, _, _ = run(engine, Request(prompt, GREEDY, max_tokens=30, stop=[stop], include_stop_str_in_output=True))[0]
    assert text == full[: full.index(stop) + len(stop)]


def test_streamed_text_equals_one_shot_decode_with_sampling(engine):
    params = SamplingParams(temperature=1.0, seed=3)
    text, tokens, _ = run(engine, Request(chat(engine, "Say something in Chinese and use emoji."), params, max_tokens=40))[0]
    assert text == engine.tokenizer.decode([t for t in tokens if t not in engine.eos_ids], skip_special_tokens=True)


def test_seeded_n_choices(engine):
    req = Request(chat(engine, "Tell me a story."), SamplingParams(temperature=1.0, seed=11), max_tokens=12, n=3)
    a, b = run(engine, req), run(engine, req)
    assert a == b
    assert len({text for text, _, _ in a}) > 1


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
