"""protocol.py: the OpenAI request bodies, checked as strictly as their JSON types, and their
translation into engine Requests, with the real tokenizer. A few requests go through the HTTP app
(in-process, on the tiny model) to see the OpenAI error object a client gets."""

import json

import pytest

from common.tools.testing import require

require("pydantic")  # before the imports that need them: without them, this module skips

from pydantic import ValidationError

from common.models import resolve_model
from common.tokenizer import Tokenizer
from engine import Request
from protocol import ChatRequest, CompletionRequest, RequestError, chat_request, completion_request, sampling_params
from sampling import SamplingParams

TINY = resolve_model("tiny-llama3")
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(TINY)


def chat(**body) -> ChatRequest:
    return ChatRequest.model_validate({"messages": HI} | body)


def completion(**body) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi"} | body)


def rejected(model, body: dict) -> dict:
    """The first pydantic error for `body`, which must not validate."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return info.value.errors()[0]


# --- chat messages ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [123, None, ["a"], {"t": "a"}, True])
def test_a_text_part_must_hold_a_string(text):
    error = rejected(ChatRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]})
    assert error["loc"] == ("messages", 0, "content", 0, "text")


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
        {"text": "no type"},
        "just a string",
    ],
)
def test_content_parts_other_than_text_are_rejected_not_dropped(part):
    content = [{"type": "text", "text": "look:"}, part]
    error = rejected(ChatRequest, {"messages": [{"role": "user", "content": content}]})
    assert error["loc"][:4] == ("messages", 0, "content", 1)
    if isinstance(part, dict) and "type" in part:
        assert part["type"] in error["msg"] and "text" in error["msg"]


@pytest.mark.parametrize("content", [123, True, {"type": "text", "text": "hi"}])
def test_content_is_a_string_or_a_list_of_parts(content):
    error = rejected(ChatRequest, {"messages": [{"role": "user", "content": content}]})
    assert error["loc"] == ("messages", 0, "content") and "content parts" in error["msg"]


def test_text_parts_read_one_per_line(tokenizer):
    # vLLM joins them with "\n"; joined with nothing, "Hello" and "world" read as "Helloworld".
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the capital of France?"}]
    as_parts = chat_request(chat(messages=[{"role": "user", "content": parts}]), tokenizer, SamplingParams())
    as_text = chat_request(
        chat(messages=[{"role": "user", "content": "What is\nthe capital of France?"}]), tokenizer, SamplingParams()
    )
    assert as_parts.prompt_ids == as_text.prompt_ids


@pytest.mark.parametrize("role", ["robot", "tool", "function", "", "User", 7, None])
def test_unknown_roles_are_rejected(role):
    error = rejected(ChatRequest, {"messages": [{"role": role, "content": "hi"}]})
    assert error["loc"] == ("messages", 0, "role")


def test_developer_is_openais_name_for_system(tokenizer):
    def ids(role):
        messages = [{"role": role, "content": "Be brief."}] + HI
        return chat_request(chat(messages=messages), tokenizer, SamplingParams()).prompt_ids

    assert ids("developer") == ids("system")
    assert ids("developer") != ids("user")


# --- exact JSON types -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", True),
        ("max_tokens", 1.0),
        ("max_tokens", "16"),
        ("max_completion_tokens", False),
        ("n", True),
        ("stream", "yes"),
        ("stream", 1),
        ("stream_options", {"include_usage": "true"}),
        ("temperature", True),
        ("temperature", "0.5"),
        ("top_k", 1.5),
        ("seed", "1"),
        ("seed", True),
        ("stop", 5),
        ("stop", ["a", 1]),
        ("stop_token_ids", [True]),
        ("ignore_eos", "false"),
        ("min_tokens", False),
        ("logprobs", 1),
        ("top_logprobs", True),
        ("logit_bias", {"5": "1"}),
        ("logit_bias", {"5": True}),
        ("model", 1),
    ],
)
def test_chat_fields_take_their_json_type_only(field, value):
    error = rejected(ChatRequest, {"messages": HI, field: value})
    assert error["loc"][0] == field


@pytest.mark.parametrize("field, value", [("logprobs", True), ("echo", "no"), ("best_of", 1.0), ("max_tokens", True)])
def test_completion_fields_take_their_json_type_only(field, value):
    assert rejected(CompletionRequest, {"prompt": "hi", field: value})["loc"][0] == field


def test_json_integers_are_numbers_too():
    body = chat(temperature=1, top_p=1, min_p=0, presence_penalty=-2, repetition_penalty=2, logit_bias={"5": -100})
    assert (body.temperature, body.top_p, body.repetition_penalty) == (1.0, 1.0, 2.0)
    assert isinstance(body.temperature, float)
    assert sampling_params(body, SamplingParams(), None).logit_bias == {5: -100.0}


@pytest.mark.parametrize("key", ["1_000", " 5", "5 ", "+5", "-1", "5.0", "0x10", "\u0661", "", "1e3", "1" * 5000])
def test_logit_bias_keys_are_plain_decimal_token_ids(key):
    error = rejected(ChatRequest, {"messages": HI, "logit_bias": {key: 1}})
    assert error["loc"] == ("logit_bias",) and "token id" in error["msg"] and len(error["msg"]) < 200
    assert "set_int_max_str_digits" not in error["msg"]  # Python's own words about 4,300 digits


def test_a_token_id_given_twice_in_logit_bias_is_refused():
    error = rejected(ChatRequest, {"messages": HI, "logit_bias": {"1": 5, "0001": -5}})
    assert error["loc"] == ("logit_bias",) and "token id 1 is given twice" in error["msg"]


def test_logit_bias_keys_read_as_token_ids(tokenizer):
    req = chat_request(chat(logit_bias={"1000": 5, "0042": -1.5}), tokenizer, SamplingParams())
    assert req.params.logit_bias == {1000: 5.0, 42: -1.5}


@pytest.mark.parametrize(
    "prompt", [[[False]], [False], [True, 2], [1.5], [[1, "a"]], [["a"]], ["a", 1], {"x": 1}, 5, None]
)
def test_a_prompt_is_text_or_token_ids_nothing_else(prompt):
    assert rejected(CompletionRequest, {"prompt": prompt})["loc"] == ("prompt",)


def test_prompt_shapes(tokenizer):
    def ids(prompt):
        return completion_request(completion(prompt=prompt), tokenizer, SamplingParams()).prompt_ids

    text = ids("Hello there")
    assert ids(["Hello there"]) == text
    assert ids(text) == text
    assert ids([text]) == text


# --- text must be Unicode -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, body, loc",
    [
        (ChatRequest, {"messages": [{"role": "user", "content": "\ud800"}]}, ("messages", 0, "content")),
        (
            ChatRequest,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udc80"}]}]},
            ("messages", 0, "content", 0, "text"),
        ),
        (ChatRequest, {"messages": HI, "stop": ["ok", "\udfff"]}, ("stop",)),
        (ChatRequest, {"messages": HI, "model": "\ud83d"}, ("model",)),
        (CompletionRequest, {"prompt": "a\udc80b"}, ("prompt",)),
        (CompletionRequest, {"prompt": ["a\udc80b"]}, ("prompt",)),
        (CompletionRequest, {"prompt": "hi", "stop": "\ud800"}, ("stop",)),
    ],
)
def test_lone_surrogates_are_rejected_naming_the_field(model, body, loc):
    error = rejected(model, body)
    assert error["loc"] == loc and "Unicode" in error["msg"]


def test_characters_beyond_the_bmp_are_fine(tokenizer):
    messages = [{"role": "user", "content": "caf\u00e9 \U0001f600"}]
    req = chat_request(chat(messages=messages), tokenizer, SamplingParams())
    assert "\U0001f600" in tokenizer.decode(req.prompt_ids)


@pytest.mark.parametrize(
    "build, body, param",
    [
        (completion_request, {"prompt": "hi", "echo": True}, "echo"),
        (completion_request, {"prompt": "hi", "suffix": "!"}, "suffix"),
        (completion_request, {"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
        (completion_request, {"prompt": ["a", "b"]}, "prompt"),
        (completion_request, {"prompt": [1, 10**9]}, "prompt"),
        (completion_request, {"prompt": "hi", "logprobs": 21}, "logprobs"),
        (chat_request, {"messages": HI, "tools": [{"type": "function"}]}, "tools"),
        (chat_request, {"messages": HI, "top_logprobs": 2}, "top_logprobs"),
        (chat_request, {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_requests_the_server_cannot_serve_name_the_field(tokenizer, build, body, param):
    model = CompletionRequest if build is completion_request else ChatRequest
    with pytest.raises(RequestError) as info:
        build(model.model_validate(body), tokenizer, SamplingParams())
    assert info.value.param == param and isinstance(info.value, ValueError)


# --- request values over the model's defaults -----------------------------------------------------


def test_request_values_override_the_defaults_and_only_those(tokenizer):
    defaults = SamplingParams(temperature=0.6, top_p=0.9, top_k=50, repetition_penalty=1.1, seed=3)
    req = chat_request(chat(temperature=0, top_k=0, seed=0), tokenizer, defaults)
    # 0 is a value, not an absence: temperature 0 (greedy) must not fall back to 0.6.
    assert req.params == SamplingParams(temperature=0.0, top_p=0.9, top_k=0, repetition_penalty=1.1, seed=0)
    assert defaults == SamplingParams(temperature=0.6, top_p=0.9, top_k=50, repetition_penalty=1.1, seed=3)
    assert chat_request(chat(logprobs=True, top_logprobs=2), tokenizer, defaults).params.logprobs == 2
    assert chat_request(chat(), tokenizer, defaults).params == defaults


# --- over HTTP: the OpenAI error object -------------------------------------------------------------


@pytest.fixture(scope="module")
def http():
    require("fastapi")
    from fastapi.testclient import TestClient

    import engine
    import model
    import server

    # A pool of 64 blocks: the default, a quarter of free memory (tiny-llama3's context is 131072),
    # takes seconds to zero, and these requests never hold more than a few blocks.
    eng = engine.Engine(model.load_model(TINY), Tokenizer(TINY), {}, num_blocks=64)
    with TestClient(server.create_app(server.Worker(lambda: eng), "tiny"), raise_server_exceptions=False) as client:
        yield client


def post(client, path: str, body: dict):
    # json.dumps writes a lone surrogate as the escape \udXXX, as a client would; raw, it is no UTF-8.
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


BAD = [
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}]},
        "messages.0.content.0.text",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
                }
            ]
        },
        "messages.0.content.0.type",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": HI, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": HI, "logit_bias": {"1_000": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": HI, "repetition_penalty": 1e-40}, None),
    ("/v1/chat/completions", {"messages": HI, "repetition_penalty": 1e-300, "stream": True}, None),
    ("/v1/chat/completions", {"messages": HI, "temperature": 1e300}, None),
    # accepted and ignored before: a client that sets them expects what the server cannot do
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": HI, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ("/v1/completions", {"prompt": "a\udc80b"}, "prompt"),
    ("/v1/completions", {"prompt": [[False]]}, "prompt"),
    # the engine's refusal named max_tokens; stream_options without a stream was ignored
    ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": HI, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    # ignored before: a typo, another server's extra, or an OpenAI field that would change the reply
    ("/v1/completions", {"prompt": "hi", "max_token": 5}, "max_token"),
    ("/v1/chat/completions", {"messages": HI, "guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/chat/completions", {"messages": HI, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"messages": HI, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"messages": HI, "prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"messages": HI, "reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content"),
]


@pytest.mark.parametrize("path, body, param", BAD)
def test_bad_requests_are_400_with_an_openai_error(http, path, body, param):
    # max_tokens keeps a request that is wrongly accepted short (this model's context is 131072)
    r = post(http, path, {"max_tokens": 2} | body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param and error["message"].startswith(param + ": ")


def test_null_is_a_field_left_out_and_fields_that_change_nothing_are_taken(http):
    # the openai client sends stop=None, n=None as null: they were refused ("stop: must be a string")
    nulls = {"stop": None, "n": None, "stream": None, "seed": None, "temperature": 0, "ignore_eos": True}
    r = post(http, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "echo": None, "store": True} | nulls)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    body = {"messages": HI, "max_tokens": 3, "logprobs": None, "metadata": {"a": "b"}, "user": None} | nulls
    r = post(http, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_an_unknown_field_is_named_as_unrecognized(http):
    error = post(http, "/v1/completions", {"prompt": "hi", "max_token": 5}).json()["error"]
    assert error["message"].startswith("max_token: unrecognized request argument"), error


@pytest.mark.parametrize(
    "path, body, param, code",
    [
        ("/v1/completions", {"prompt": "hi", "n": 17}, "n", None),
        ("/v1/completions", {"prompt": [1, 10**6]}, "prompt", None),
        ("/v1/chat/completions", {"messages": HI, "stop": ""}, "stop", None),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 10**7}, "max_tokens", "context_length_exceeded"),
    ],
)
def test_the_engines_refusals_name_the_field(http, path, body, param, code):
    # the engine's checks gave "param": null, and no code for a request past the context
    r = post(http, path, {"max_tokens": 2} | body)
    error = r.json()["error"]
    assert r.status_code == 400 and (error["param"], error["code"]) == (param, code), r.text


def test_completion_top_logprobs_hold_the_chosen_token_and_one_entry_per_text(http):
    # OpenAI: "the logprob of the sampled token ... up to logprobs+1 elements"; it was missing, and
    # two byte tokens decoding to one text kept the smaller value under the larger one's place
    for k in (0, 2, 5):
        body = {"prompt": "hi", "max_tokens": 8, "logprobs": k, "temperature": 1.0, "seed": 1}
        logprobs = post(http, "/v1/completions", body).json()["choices"][0]["logprobs"]
        for token, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
            assert token in top and top[token] >= lp and 1 <= len(top) <= k + 1, (token, lp, top)
            assert list(top.values()) == sorted(top.values(), reverse=True), top


def test_a_body_not_sent_as_json_says_so(http):
    # curl -d sends application/x-www-form-urlencoded: FastAPI then said "Input should be a valid dictionary".
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    for headers, said in (
        ({"content-type": "application/x-www-form-urlencoded"}, "not Content-Type 'application/x-www-form-urlencoded'"),
        ({}, "not no Content-Type"),
    ):
        r = http.post("/v1/completions", content=body, headers=headers)
        assert r.status_code == 400 and "the body must be JSON sent with Content-Type: application/json" in r.text
        assert said in r.json()["error"]["message"], r.text


def test_the_largest_seed_serves_every_choice_reproducibly(http):
    body = {"prompt": "Once upon a time", "max_tokens": 4, "n": 16, "seed": 2**64 - 1, "temperature": 1.0}
    first = post(http, "/v1/completions", body)
    assert first.status_code == 200, first.text
    again = post(http, "/v1/completions", body)
    assert [c["text"] for c in first.json()["choices"]] == [c["text"] for c in again.json()["choices"]]


def test_a_body_that_is_not_utf8_is_refused(http):
    # Python's json would read UTF-16 and UTF-32 (it guesses from the NUL bytes): JSON is UTF-8.
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    for encoded in (body.encode("utf-16"), body.encode("utf-16-le"), body.encode("utf-32"), b'{"prompt": "caf\xe9"}'):
        r = http.post("/v1/completions", content=encoded, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_encoding", r.text
    r = http.post(
        "/v1/completions",
        content=json.dumps({"prompt": "café", "max_tokens": 2}, ensure_ascii=False).encode(),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 200, r.text
    assert (
        post(
            http, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "response_format": {"type": "text"}}
        ).status_code
        == 200
    )


# --- bounded work before a refusal -------------------------------------------------------------------------


class NoTokenizing:
    """A tokenizer that must not be asked to tokenize anything."""

    max_token_chars = 4

    def encode(self, *args, **kwargs):
        raise AssertionError("tokenized a prompt that its length alone rules out")

    encode_chat = encode


def test_a_prompt_too_long_for_the_context_by_its_length_is_refused_before_tokenizing():
    require("fastapi")
    from types import SimpleNamespace

    import server
    from errors import APIError

    engine = SimpleNamespace(
        context=16, tokenizer=NoTokenizing(), default_params=lambda: None, validate=lambda req: None
    )  # at most 16 x 4 characters fit
    for body, field in (
        (CompletionRequest(prompt="a" * 65), "prompt"),
        (
            ChatRequest(messages=[{"role": "user", "content": "a" * 30}, {"role": "user", "content": "b" * 35}]),
            "messages",
        ),
    ):
        with pytest.raises(APIError) as e:
            server.engine_request(engine, None, body)
        assert e.value.status == 400 and e.value.param == field
        assert str(e.value).startswith(f"{field}: 65 characters cannot fit in this model's context of 16 tokens")
    built = []  # 64 characters may fit: on to templating and tokenizing
    server.engine_request(engine, lambda *args: built.append(args), CompletionRequest(prompt="a" * 64))
    assert len(built) == 1


def test_tokenizations_run_a_few_at_a_time(http, monkeypatch):
    import asyncio
    import threading
    import time

    import server
    from errors import APIError

    running, most, lock = [0], [0], threading.Lock()

    def slow_refusal(*args):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        raise APIError(400, "prompt: refused", param="prompt")

    monkeypatch.setattr(server, "engine_request", slow_refusal)
    monkeypatch.setattr(http.app.state.server, "tokenizing", asyncio.Semaphore(2))
    threads = [threading.Thread(target=post, args=(http, "/v1/completions", {"prompt": "hi"})) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 2


# --- a reply's logprobs: one pass over the tokens, built off the event loop --------------------------------


class CountingTokenizer:
    """A tokenizer that counts the tokens it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_text_offsets_are_each_tokens_place_in_the_text_found_in_one_pass():
    require("fastapi")
    import server
    from sampling import TokenLogprob

    tokenizer = Tokenizer(resolve_model("smollm2-135m"))
    ids = tokenizer.encode("Hello, world! Ça va? 你好, über alles. " * 30)
    counting = CountingTokenizer(tokenizer)
    lps = [TokenLogprob(i, -1.0, []) for i in ids]
    offsets = server.completion_logprobs(counting, lps, server.TextOffsets(counting, Request([])))["text_offset"]
    # Linear in the tokens: decoding every prefix would decode len(ids)**2 / 2 of them.
    assert counting.decoded < 20 * len(ids), (counting.decoded, len(ids))
    # Each token starts where the text of the tokens before it ends; a character split over
    # several tokens counts where it completes (a prefix that ends inside one is not a place).
    assert len(offsets) == len(ids) and offsets[0] == 0
    for i in range(1, len(ids)):
        prefix = tokenizer.decode(ids[:i])
        if not prefix.endswith("\ufffd"):
            assert offsets[i] == len(prefix), i


def test_streamed_text_offsets_count_from_the_start_of_the_choice():
    """A stream's chunks (one token each, or several when speculation keeps drafts) carry the same
    text_offset as the whole reply: from the start of the choice's text, not of the chunk."""
    require("fastapi")
    import server
    from engine import Event
    from sampling import TokenLogprob

    tokenizer = Tokenizer(resolve_model("smollm2-135m"))
    ids = tokenizer.encode("Hello, world! Ça va? 你好, über alles. " * 3)
    lps = [TokenLogprob(i, -1.0, []) for i in ids]
    whole = server.completion_logprobs(tokenizer, lps, server.TextOffsets(tokenizer, Request([])))["text_offset"]
    offsets, streamed, start, size = server.TextOffsets(tokenizer, Request([])), [], 0, 1
    while start < len(ids):  # chunks of 1, 2, 3, 1, 2, 3, ... tokens
        chunk = lps[start : start + size]
        ev = Event(0, "", [t.token_id for t in chunk], chunk)
        streamed += server.stream_choice(tokenizer, ev, False, True, offsets)["logprobs"]["text_offset"]
        start, size = start + size, size % 3 + 1
    assert streamed == whole and whole[-1] > 0


def test_text_offsets_count_the_special_tokens_text_where_the_request_keeps_it():
    # The offsets' own detokenizer skipped special tokens whatever the request said: "<|im_start|>"
    # four times, with skip_special_tokens false, had the offsets [0, 0, 0, 0].
    require("fastapi")
    import server
    from sampling import TokenLogprob

    tokenizer = Tokenizer(resolve_model("smollm2-135m"))
    special = tokenizer.token_to_id("<|im_start|>")
    lps = [TokenLogprob(special, -1.0, [])] * 4
    for skip, expected in ((False, [0, 12, 24, 36]), (True, [0, 0, 0, 0])):
        offsets = server.TextOffsets(tokenizer, Request([], skip_special_tokens=skip))
        assert server.completion_logprobs(tokenizer, lps, offsets)["text_offset"] == expected, skip


def test_a_reply_is_built_off_the_event_loop(http, monkeypatch):
    import asyncio

    import server

    where = []
    build = server.reply_body

    def spy(*args):
        try:
            asyncio.get_running_loop()
            where.append("the event loop")
        except RuntimeError:
            where.append("a worker thread")
        return build(*args)

    monkeypatch.setattr(server, "reply_body", spy)
    # and serialised there: FastAPI's encoder (2 s for a large reply, on the loop) never sees it
    import fastapi.routing

    encoded = []
    encoder = fastapi.routing.jsonable_encoder
    monkeypatch.setattr(fastapi.routing, "jsonable_encoder", lambda obj, *a, **k: encoded.append(obj) or encoder(obj, *a, **k))
    r = post(http, "/v1/completions", {"prompt": "One, two,", "max_tokens": 3, "logprobs": 1})
    assert r.status_code == 200 and where == ["a worker thread"], r.text
    assert r.json()["choices"][0]["logprobs"]["tokens"] and encoded == []


def test_a_big_reply_is_encoded_in_small_pieces_that_make_exactly_its_json():
    """One json.dumps call holds the GIL from start to end, so a 4 MB reply would stop the event loop
    (every other client) for 100-300 ms: the reply goes out in pieces of a few kB."""
    require("fastapi")
    import server

    def entry(i):
        return {"token": f"tök {i}", "logprob": -i / 7, "bytes": [116, 195, 182, 107]}

    content = [entry(t) | {"top_logprobs": [entry(k) for k in range(20)]} for t in range(400)]
    reply = {"id": "x", "choices": [{"index": c, "logprobs": {"content": content}} for c in range(4)], "usage": {}}
    pieces = list(server.json_pieces(reply))
    assert "".join(pieces) == json.dumps(reply, ensure_ascii=False)
    assert max(map(len, pieces)) * 20 < sum(map(len, pieces)), "a piece holds a twentieth of the reply or more"
    # The edges of the walk: empty things, a list of exactly one slice and one item more, deep nesting.
    for obj in ([], {}, list(range(32)), list(range(33)), [[[[[[1, "é"]]]]]], {"a": [{"b": list(range(70))}]}, "s", None):
        assert "".join(server.json_pieces(obj)) == json.dumps(obj, ensure_ascii=False), obj
