"""The OpenAI-compatible server, live on localhost, driven by the official openai client."""

import json
import threading
import time

import pytest

from common.tools.testing import SERVER_STACK, require

require(*SERVER_STACK)  # before the imports that need them: without them, this module skips

import httpx
import openai

from live_server import http, serve

MODEL = "smollm2-135m"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
KV_CACHE_GB = 0.25


def pool_blocks() -> int:
    """The blocks of 16 tokens that --kv-cache-memory-gb KV_CACHE_GB buys for MODEL in float32."""
    from common.config import load_config
    from common.models import resolve_model

    return int(KV_CACHE_GB * 2**30) // (load_config(resolve_model(MODEL)).kv_bytes_per_token(4) * 16)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("server"), MODEL, "--kv-cache-memory-gb", str(KV_CACHE_GB)) as (
        url,
        _proc,
        _log,
    ):
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_models_and_health(client, base_url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = http.get(base_url + "/health").json()
    assert health["status"] == "ok"
    # the engine's figures: requests running and waiting, the KV block pool, the prefix cache
    assert {
        "running",
        "waiting",
        "kv_blocks_total",
        "kv_blocks_used",
        "kv_blocks_free",
        "kv_blocks_cached",
        "prefix_cache_hit_rate",
        "preemptions",
    } <= set(health), health
    assert health["kv_blocks_total"] == pool_blocks() == 364  # 0.25 GiB / (16 x 46080 bytes)
    assert health["kv_blocks_used"] + health["kv_blocks_free"] == health["kv_blocks_total"]


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=20)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == 37 and 0 < r.usage.completion_tokens <= 20
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_equals_non_streaming_and_reports_usage(client):
    kw = dict(
        model=MODEL, messages=[{"role": "user", "content": "Write a haiku about rain."}], temperature=0, max_tokens=24
    )
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_streaming_equals_non_streaming(client):
    kw = dict(model=MODEL, prompt="The three primary colors are", temperature=0, max_tokens=12)
    whole = client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert streamed == whole.choices[0].text and len(streamed) > 10
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12


def test_greedy_equals_chapter_04(client):
    from common.tools.testing import load_neighbour
    from common.models import resolve_model
    from common.tokenizer import Tokenizer

    ch04 = load_neighbour(4, "model", "generate")
    d = resolve_model(MODEL)
    tok = Tokenizer(d)
    prompt = [{"role": "user", "content": "Name three animals that live in the ocean."}]
    expected = ch04.generate.generate_all(ch04.model.load_model(d), [tok.encode_chat(prompt)], 30)[0]
    r = client.chat.completions.create(model=MODEL, messages=prompt, temperature=0, max_tokens=30)
    assert r.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story."}],
        temperature=1.0,
        top_p=0.95,
        max_tokens=8,  # at temperature 1 two seeds part within a few tokens; each token is a step of SmolLM2
    )
    a = client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    b = client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    c = client.chat.completions.create(**kw, seed=99).choices[0].message.content
    assert a == b and a != c


def test_n_choices_and_extras(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=PARIS,
        n=3,
        temperature=1.2,
        seed=7,
        max_tokens=8,
        extra_body={"top_k": 50, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1
    r = client.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=12, extra_body={"ignore_eos": True, "min_tokens": 12}
    )
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"


def test_stop_strings(client):
    r = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=20, stop=["Paris"])
    assert r.choices[0].finish_reason == "stop"
    assert "Paris" not in r.choices[0].message.content and r.choices[0].message.content.startswith("The capital")
    r = client.chat.completions.create(
        model=MODEL,
        messages=PARIS,
        temperature=0,
        max_tokens=20,
        stop=["Paris"],
        extra_body={"include_stop_str_in_output": True},
    )
    assert r.choices[0].message.content.endswith("Paris")


def test_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=PARIS, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 for c in content)
    for c in content:  # greedy: the chosen token is the most likely one
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert c.logprob <= 0
    r = client.completions.create(model=MODEL, prompt="One, two, three,", temperature=0, max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and all(len(t) == 2 for t in lp.top_logprobs) and "".join(lp.tokens) == r.choices[0].text


@pytest.mark.parametrize(
    "path, body, status, fragment",
    [
        ("/v1/chat/completions", b"{not json", 400, "malformed JSON"),
        ("/v1/completions", b"", 400, "the request has no body: a JSON object is expected"),  # was "Field required"
        ("/v1/chat/completions", {"model": "gpt-9", "messages": PARIS}, 404, "does not exist"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": PARIS, "temperature": -1}, 400, "temperature"),
        ("/v1/chat/completions", {"model": MODEL, "messages": PARIS, "top_p": 1.5}, 400, "top_p"),
        ("/v1/chat/completions", {"model": MODEL, "messages": PARIS, "top_k": -5}, 400, "top_k"),
        ("/v1/chat/completions", {"model": MODEL, "messages": PARIS, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": PARIS, "n": 0}, 400, "n must be"),
        ("/v1/chat/completions", {"model": MODEL, "messages": PARIS, "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "hello " * 9000}, 400, "context"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 9000}, 400, "lower max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "one prompt per request"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors(base_url, path, body, status, fragment):
    if isinstance(body, bytes):
        r = http.post(base_url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(base_url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"]
    if isinstance(body, bytes):
        assert error["param"] is None


def test_server_still_serves_after_errors(client, base_url):
    http.post(base_url + "/v1/chat/completions", content=b"][", headers={"content-type": "application/json"})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=PARIS, temperature=-3)
    r = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=10)
    assert "Paris" in r.choices[0].message.content


def test_eight_concurrent_streams_all_finish_correctly(client):
    prompts = ["Name a color.", "Name a fruit.", "Name a planet.", "Name a country."]
    expected = {
        p: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=10
        )
        .choices[0]
        .message.content
        for p in prompts
    }
    results, errors = {}, []

    def stream(i):
        p = prompts[i % 4]
        try:
            chunks = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=10, stream=True
            )
            results[i] = (p, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(results) == 8
    for p, text in results.values():
        assert text == expected[p]


def test_client_disconnect_stops_generation(client, base_url):
    body = {
        "model": MODEL,
        "prompt": "Count: 1, 2, 3,",
        "max_tokens": 4000,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    with http.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert got and "text" in json.loads(got[0][5:])["choices"][0]
    # 4000 tokens would take minutes on this CPU: the worker must notice the disconnect and stop.
    deadline = time.time() + 30
    while http.get(base_url + "/health").json()["busy"] and time.time() < deadline:
        time.sleep(0.2)
    health = http.get(base_url + "/health").json()
    assert not health["busy"] and health["kv_blocks_used"] == 0, health  # its blocks went back to the pool
    r = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=10)
    assert "Paris" in r.choices[0].message.content


def wait_until_idle(base_url, seconds: float) -> dict:
    """/health once the worker has nothing to do, or when `seconds` are up."""
    deadline = time.time() + seconds
    while True:
        health = http.get(base_url + "/health").json()
        if (not health["busy"] and health["queued"] == 0) or time.time() > deadline:
            return health
        time.sleep(0.2)


def test_abandoned_non_streaming_requests_free_the_worker(client, base_url):
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    for _ in range(3):  # they run together; every client gives up after 0.5 s
        with pytest.raises(httpx.TimeoutException):
            http.post(base_url + "/v1/completions", json=body, timeout=0.5)
    # 3 x 4000 tokens would hold the worker for many minutes on this CPU: all three must be dropped.
    health = wait_until_idle(base_url, 30)
    assert not health["busy"] and health["queued"] == 0 and health["kv_blocks_used"] == 0, health
    r = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=10)
    assert "Paris" in r.choices[0].message.content


def test_a_request_that_can_never_fit_the_kv_pool_is_refused_before_it_is_queued(base_url):
    # 2000 + 4000 tokens: within the 8192-token context, over the 5824 tokens of --kv-cache-memory-gb 0.25
    slots = pool_blocks() * 16
    body = {"model": MODEL, "prompt": [5] * 2000, "max_tokens": 4000, "temperature": 1}
    r = http.post(base_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message == (
        f"this request needs room for 5999 tokens (2000 in the prompt, 3999 of the 4000 to generate: the last is "
        f"never cached), but this server's KV cache holds {slots} tokens: lower max_tokens or the prompt's length"
    )
    health = http.get(base_url + "/health").json()
    assert health["busy"] is False and health["running"] == health["waiting"] == health["queued"] == 0, health


def test_the_default_body_limit_follows_the_context(base_url):
    # SmolLM2's 8192 tokens: 32 bytes each and 64 KiB, 327,680 bytes; a 400 KB body is refused from its
    # Content-Length (a fixed 1 MB let in 67x the context), and thousands of tokens of text still fit.
    words = "the quick brown fox jumps over lazy dogs " * 10000  # 410,000 characters
    r = http.post(base_url + "/v1/completions", json={"prompt": words, "max_tokens": 1}, timeout=60)
    assert r.status_code == 413, r.text
    assert "over this server's limit of 327680 bytes (--max-body-mb)" in r.json()["error"]["message"]
    # A body just under the limit is read whole: JSON whitespace pads a short prompt to 320,000 bytes
    # (the size of a long prompt without the seconds of prefilling 2,000 tokens here).
    body = json.dumps({"prompt": "the quick brown fox", "max_tokens": 1}).ljust(320_000)
    r = http.post(base_url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
