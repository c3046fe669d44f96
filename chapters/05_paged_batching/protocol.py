"""The OpenAI request bodies this server accepts, and their translation into an engine Request.

Field names and meanings follow the OpenAI API; the extras (top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, min_tokens, skip_special_tokens, include_stop_str_in_output) are
the ones vLLM popularised. A field this server does not know is refused (as OpenAI's API does):
ignored, a typo (`max_token`) or another server's extra (`guided_json`) would change the reply
silently. OpenAI's fields that change nothing here (store, metadata, service_tier, ...) are taken
and dropped; a null is a field left out (clients send `"stop": null` for "not set"), but for
`max_tokens`, where null means no cap.

Every field takes its JSON type and nothing else (pydantic's strict mode): `"max_tokens": true`
is not 1 and `"stream": "yes"` is not true, they are mistakes a client should hear about. The
one conversion left is JSON's: a number written without a fraction (`"temperature": 1`) is a
number. Text must be Unicode: JSON can spell a lone surrogate ("\\ud800"), which no encoder
can turn into bytes. A validation error names the field by its path ("messages.0.content.0.text"),
which the server returns as the error's `param`.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    TypeAdapter,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from engine import Request
from sampling import SamplingParams


class RequestError(ValueError):
    """A valid body asking for what this server cannot do; `param` names the field, for the
    OpenAI error object (SamplingError carries one too)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError(
            "invalid_unicode",
            "must be valid Unicode text, but character {index} is a lone surrogate ({char})",
            {"char": f"\\u{ord(text[e.start]):04x}", "index": e.start},
        ) from None
    return text


# A string that the tokenizer, the stop-string matcher and a JSON reply can all handle.
Text = Annotated[str, AfterValidator(_unicode)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


def _stop(value):
    """A string or a list of strings; the engine checks their number and that none is empty."""
    if isinstance(value, str):
        return _unicode(value)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [_unicode(s) for s in value]
    raise PydanticCustomError("stop_type", "must be a string or a list of strings")


# A plain decimal token id: int() would also read "1_000", " 5", "+5" and "١" (Arabic-Indic one).
_TOKEN_ID = re.compile(r"[0-9]{1,12}")  # more digits than any vocabulary needs (int() refuses 4,300)


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key):
            raise PydanticCustomError(
                "logit_bias_key",
                'keys must be token ids written as decimal digits (at most 12), like "1234"; got {key}',
                {"key": repr(key) if len(key) <= 40 else f"{key[:20]!r}... ({len(key)} characters)"},
            )
        if int(key) in out:  # "1" and "0001": one token, two biases, and one of them silently lost
            raise PydanticCustomError("logit_bias_key", "token id {id} is given twice", {"id": int(key)})
        out[int(key)] = value
    return out


# OpenAI fields that change nothing this server returns: taken, and dropped.
NO_EFFECT = frozenset(
    {"store", "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier"}
)


class _Common(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data):
        if isinstance(data, dict):
            # max_tokens: null is no cap (the context's end), as in vLLM, not the default of 16
            return {k: v for k, v in data.items() if (v is not None or k == "max_tokens") and k not in NO_EFFECT}
        return data

    model: Text | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str | list[str] | None, PlainValidator(_stop, json_schema_input_type=str | list[str] | None)] = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # JSON object keys are strings: token ids arrive as "1234" and leave validation as ints.
    logit_bias: Annotated[dict[str, float], AfterValidator(_logit_bias)] | None = None
    seed: int | None = None
    user: Text | None = None
    # extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


Prompt = str | list[str] | list[int] | list[list[int]]


def _token_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt(value) -> Prompt:
    """Text, texts, token ids, or lists of token ids. Checked by hand: pydantic would report a
    mismatch once per shape of the union, and the first of those reports ("prompt.str: Input
    should be a valid string") misleads when the client meant token ids."""
    if isinstance(value, str):
        return _unicode(value)
    if isinstance(value, list):
        if _token_ids(value) or all(_token_ids(p) for p in value):
            return value
        if all(isinstance(p, str) for p in value):
            return [_unicode(p) for p in value]
    raise PydanticCustomError(
        "prompt_type",
        "must be a string, a list of strings, a list of token ids or a list of lists of token ids "
        "(token ids are integers)",
    )


class CompletionRequest(_Common):
    prompt: Annotated[Prompt, PlainValidator(_prompt, json_schema_input_type=Prompt)]
    max_tokens: int | None = 16  # the OpenAI default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: Text | None = None


class TextPart(_Strict):
    """The one kind of content part this server reads. Images, audio and files are refused by
    name, not dropped: a reply to half of the message would look like a reply to all of it."""

    type: str
    text: Text

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind != "text":
            raise PydanticCustomError(
                "unsupported_content_part",
                "content parts of type {kind} are not supported: this server reads 'text' parts only",
                {"kind": repr(kind)},
            )
        return kind


_text_parts = TypeAdapter(list[TextPart])


def _content(value) -> str | list[TextPart] | None:
    # A plain validator, not a union: a bad part then reports its own path
    # ("messages.0.content.1.text") rather than one error per shape of the union.
    if value is None or isinstance(value, str):
        return value if value is None else _unicode(value)
    if isinstance(value, list):
        return _text_parts.validate_python(value, strict=True)
    raise PydanticCustomError("content_type", "must be a string or a list of content parts")


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for "system"; tool messages need tools, unsupported here.
    role: Literal["system", "user", "assistant", "developer"]
    content: Annotated[
        str | list[TextPart] | None, PlainValidator(_content, json_schema_input_type=str | list[TextPart] | None)
    ] = None

    def text(self) -> str:
        if isinstance(self.content, list):  # text parts, one per line (vLLM's join)
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Read only to refuse them by name: a client that sets them expects what this server cannot do.
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None
    modalities: list | None = None
    audio: dict | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None


def sampling_params(body: _Common, defaults: SamplingParams, logprobs: int | None) -> SamplingParams:
    """The model's defaults, overridden by every sampling field the request sets."""
    params = defaults.override(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        seed=body.seed,
        logit_bias=body.logit_bias or None,
    )
    params.logprobs = logprobs  # the request's alone: the model's defaults have no say (a copy)
    return params


def _request(body: _Common, prompt_ids: list[int], params: SamplingParams, max_tokens: int | None) -> Request:
    if body.stream_options is not None and not body.stream:  # ignored without a word before; vLLM refuses it
        raise RequestError("stream_options: only for a streamed reply (stream: true)", "stream_options")
    return Request(
        prompt_ids=prompt_ids,
        params=params,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        n=body.n,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
    )


def completion_request(body: CompletionRequest, tokenizer, defaults: SamplingParams) -> Request:
    if body.best_of not in (None, body.n):
        raise RequestError("best_of is not supported (only best_of == n)", "best_of")
    if body.suffix:
        raise RequestError("suffix is not supported", "suffix")
    if body.echo:
        raise RequestError("echo is not supported", "echo")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise RequestError(
                "one prompt per request: this server does not batch several prompts in one call", "prompt"
            )
        prompt = prompt[0]
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if any(not 0 <= t < tokenizer.vocab_size for t in prompt_ids):
        raise RequestError(f"prompt token ids must be in 0..{tokenizer.vocab_size - 1}", "prompt")
    if body.logprobs is not None and not 0 <= body.logprobs <= 20:
        raise RequestError(f"logprobs must be between 0 and 20, got {body.logprobs}", "logprobs")
    return _request(body, prompt_ids, sampling_params(body, defaults, body.logprobs), body.max_tokens)


def chat_request(body: ChatRequest, tokenizer, defaults: SamplingParams) -> Request:
    if body.tools:
        raise RequestError("tools are not supported by this server", "tools")
    if body.tool_choice not in (None, "none"):
        raise RequestError("tool_choice: not supported (this server takes no tools)", "tool_choice")
    if body.functions or body.function_call not in (None, "none"):
        param = "functions" if body.functions else "function_call"
        raise RequestError(f"{param}: not supported (this server takes no tools)", param)
    if body.response_format is not None and body.response_format.get("type") != "text":
        kind = body.response_format.get("type")
        raise RequestError(
            f"response_format: {kind!r} is not supported, this server generates free text only", "response_format"
        )
    if body.modalities not in (None, ["text"]):
        said = f"modalities: {body.modalities} is not supported, this server generates text only"
        raise RequestError(said, "modalities")
    for param in ("audio", "prediction", "web_search_options", "reasoning_effort", "verbosity"):
        if getattr(body, param) is not None:  # each would change the reply: not dropped without a word
            raise RequestError(f"{param}: not supported by this server", param)
    for i, m in enumerate(body.messages):
        if m.content is None:  # OpenAI allows it beside tool_calls, which this server does not take
            where = f"messages.{i}.content"
            if m.role != "assistant":
                raise RequestError(f"{where}: a {m.role} message needs its content", where)
            raise RequestError(
                f"{where}: null is not supported (it goes with tool calls, which this server does not take)", where
            )
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("top_logprobs requires logprobs: true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise RequestError(f"top_logprobs must be between 0 and 20, got {logprobs}", "top_logprobs")
    prompt_ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    if body.max_completion_tokens is not None and body.max_completion_tokens < 1:  # (the engine names max_tokens)
        raise RequestError(
            f"max_completion_tokens: must be at least 1, got {body.max_completion_tokens}", "max_completion_tokens"
        )
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _request(body, prompt_ids, sampling_params(body, defaults, logprobs), max_tokens)
