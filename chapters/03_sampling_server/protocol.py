"""The OpenAI request bodies this server accepts, and their translation into an engine Request.

Field names and meanings follow the OpenAI API; the extras (top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, min_tokens, skip_special_tokens, include_stop_str_in_output) are
the ones vLLM popularised. Unknown fields are ignored, as clients send many optional ones.
"""

from __future__ import annotations

import dataclasses

from pydantic import BaseModel, ConfigDict, Field

from engine import Request
from sampling import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    # extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # the OpenAI default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None


def sampling_params(body: _Common, defaults: SamplingParams, logprobs: int | None) -> SamplingParams:
    """The model's defaults, overridden by every sampling field the request sets."""
    overrides = {
        name: getattr(body, name)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "seed")
        if getattr(body, name) is not None
    }
    if body.logit_bias:
        try:
            overrides["logit_bias"] = {int(k): float(v) for k, v in body.logit_bias.items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids (integers as strings)") from None
    return dataclasses.replace(defaults, **overrides, logprobs=logprobs)


def _request(body: _Common, prompt_ids: list[int], params: SamplingParams, max_tokens: int | None) -> Request:
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
        raise ValueError("best_of is not supported (only best_of == n)")
    if body.suffix:
        raise ValueError("suffix is not supported")
    if body.echo:
        raise ValueError("echo is not supported")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise ValueError("one prompt per request: this server does not batch several prompts in one call")
        prompt = prompt[0]
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if any(not 0 <= t < tokenizer.vocab_size for t in prompt_ids):
        raise ValueError(f"prompt token ids must be in 0..{tokenizer.vocab_size - 1}")
    if body.logprobs is not None and not 0 <= body.logprobs <= 20:
        raise ValueError(f"logprobs must be between 0 and 20, got {body.logprobs}")
    return _request(body, prompt_ids, sampling_params(body, defaults, body.logprobs), body.max_tokens)


def chat_request(body: ChatRequest, tokenizer, defaults: SamplingParams) -> Request:
    if body.tools:
        raise ValueError("tools are not supported by this server")
    messages = []
    for m in body.messages:
        content = m.content
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
        messages.append({"role": m.role, "content": content or ""})
    if body.top_logprobs is not None and not body.logprobs:
        raise ValueError("top_logprobs requires logprobs: true")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise ValueError(f"top_logprobs must be between 0 and 20, got {logprobs}")
    prompt_ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _request(body, prompt_ids, sampling_params(body, defaults, logprobs), max_tokens)
