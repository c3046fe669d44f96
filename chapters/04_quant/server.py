"""An OpenAI-compatible HTTP server around the engine.

Usage, from this chapter's folder:

    python server.py --model smollm2-135m --host 127.0.0.1 --port 8000

GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with
"stream": true as server-sent events ending in `data: [DONE]`). Errors come back as OpenAI
error objects with the matching HTTP status, and never take the server down.

The request lifecycle: read the body (limits.py: size and time limits) -> parse and validate it,
tokenizing in a thread (400 before anything is queued, the memory estimate included) -> queue
it on the worker (one generation at a time, FIFO) -> wait for its first events, watching the
client -> answer: one JSON body, or a stream of the worker's per-step events. If the client
goes away at any point, the job is cancelled and the worker moves on to the next one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, TypeVar

import uvicorn
from fastapi import APIRouter, FastAPI, Request as HTTPRequest
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from common.cli import listen_socket, non_empty, non_negative_int, port_number, positive_float, positive_int
from detokenizer import IncrementalDetokenizer, token_bytes
from engine import DEFAULT_MAX_TOKENS, Engine, Event, Request, build_engine
from errors import APIError, ErrorResponse, internal_error
from limits import BodyLimit, RequestLimit, filter_repeats, protocol_with_limits, raise_open_file_limit
from loading import add_quant_args, quant_spec
from memory import GiB, default_budget, size
from protocol import ChatRequest, CompletionRequest, chat_request, completion_request
from sampling import TokenLogprob
from worker import Job, Worker

T = TypeVar("T")
MAX_BODY_MB = 1.0  # create_app's default; server.py derives its own from the context (body_limit_for)
BODY_TIMEOUT_S = 30.0
CLIENT_GONE = 499  # nginx's "client closed request": logged, never seen by anyone
ERROR_RESPONSES = {
    400: {
        "model": ErrorResponse,
        "description": "Malformed JSON, a wrong type or value, or a request too long "
        "for the context or too large for the memory budget",
    },
    404: {"model": ErrorResponse, "description": "The model named is not the one served here"},
    413: {"model": ErrorResponse, "description": "The body is over the server's size limit"},
    500: {"model": ErrorResponse, "description": "The engine failed"},
}


log = logging.getLogger("server")

# Tokenizations at once (each in a thread): enough to keep the cores busy on a burst of prompts.
TOKENIZING_AT_ONCE = max(2, os.cpu_count() or 1)


@dataclass
class ServerState:
    """What the routes share: one per app, at app.state.server."""

    engine: Engine
    worker: Worker
    model_name: str
    created: int = field(default_factory=lambda: int(time.time()))
    # Templating and tokenizing run in threads, this many at a time: a burst of huge prompts
    # queues here instead of holding one tokenization's memory each at once.
    tokenizing: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(TOKENIZING_AT_ONCE))
    open_jobs: dict[int, Job] = field(default_factory=dict)  # requests being answered, by id() (event loop only)
    stopping: bool = False  # a shutdown has begun: new requests get a 503


def state_of(http: HTTPRequest) -> ServerState:
    return http.app.state.server


# --- errors: everything becomes an OpenAI error object -------------------------------------


async def on_api_error(_http, e: APIError):
    return e.response()


async def on_validation_error(http: HTTPRequest, e: RequestValidationError):
    # FastAPI says 422; OpenAI clients expect 400 and an error object. Malformed JSON lands here too.
    first = e.errors()[0]
    content_type = http.headers.get("content-type", "")
    if tuple(first.get("loc", ())) == ("body",) and "json" not in content_type.lower():
        # FastAPI reads a body of another type (curl -d sends a form's) as text: "not a valid dictionary"
        said = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        return APIError(400, f"the body must be JSON sent with Content-Type: application/json, not {said}").response()
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") == "missing":  # pydantic: "Field required"
        return APIError(400, "the request has no body: a JSON object is expected").response()
    if first.get("type") == "json_invalid":
        loc = ""  # pydantic's loc is then a byte offset, not a parameter
        message = f"malformed JSON body: {first.get('msg')}"
    else:
        said = first.get("msg")
        if first.get("type") == "extra_forbidden":  # pydantic: "Extra inputs are not permitted"
            said = "unrecognized request argument (neither an OpenAI API field nor an extra this server takes)"
        message = f"{loc}: {said}" if loc else str(said)
    return APIError(400, message, param=loc or None).response()


async def on_http_error(http: HTTPRequest, e: HTTPException):
    """Starlette's own errors (no such route, wrong method, an unparsable body)."""
    if e.status_code == 404:
        return APIError(404, f"Invalid URL ({http.method} {http.url.path})", code="not_found").response()
    if e.status_code == 405:
        allowed = (e.headers or {}).get("Allow", "")
        return APIError(
            405,
            f"{http.method} is not allowed on {http.url.path}; use {allowed}",
            code="method_not_allowed",
            headers=e.headers,
        ).response()
    if e.status_code == 400 and e.__cause__ is not None:
        return APIError(400, unparsable_body(e.__cause__)).response()
    return APIError(e.status_code, str(e.detail), headers=e.headers).response()


def unparsable_body(cause: BaseException) -> str:
    if isinstance(cause, RecursionError):
        return "malformed JSON body: nested too deeply"
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not valid UTF-8 ({cause.reason} at byte {cause.start})"
    return f"malformed JSON body: {type(cause).__name__}"


async def on_internal_error(_http, e: Exception):
    return internal_error(e).response()


def check_model(served: str, asked: str | None) -> None:
    if asked is not None and asked != served:
        raise APIError(
            404,
            f"The model '{asked}' does not exist; this server serves '{served}'",
            param="model",
            code="model_not_found",
        )


def prompt_chars(body) -> tuple[int, str]:
    """The characters of the body's prompt text (the chat's messages, or a completion's text
    prompt), and the field that holds them."""
    if isinstance(body, ChatRequest):
        return sum(len(m.text()) for m in body.messages), "messages"
    prompt = body.prompt
    texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
    return sum(map(len, texts)), "prompt"


def engine_request(engine: Engine, build, body) -> Request:
    """The body as an engine Request: templated, tokenized and validated (blocking: run in a thread).
    A prompt that cannot fit in the context by its length alone is refused before any of that."""
    chars, field_name = prompt_chars(body)
    most = engine.context * engine.tokenizer.max_token_chars
    if chars > most:
        raise APIError(
            400,
            f"{field_name}: {chars} characters cannot fit in this model's context of {engine.context} tokens "
            f"(a token is at most {engine.tokenizer.max_token_chars} characters)",
            param=field_name,
        )
    try:
        req = build(body, engine.tokenizer, engine.default_params())
        engine.validate(req)
    except ValueError as e:  # protocol's RequestError, sampling's SamplingError, the engine's FieldError name the field
        param = getattr(e, "param", None)
        param = field_name if param == "prompt" else param  # a chat's prompt is its messages
        raise APIError(400, str(e), param=param, code=getattr(e, "code", None)) from None
    return req


# --- waiting on the worker while watching the client ----------------------------------------


class ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


async def disconnected(http: HTTPRequest) -> None:
    """Returns once the client has disconnected. The body is read already, so the next message
    the server has for this request is the disconnect."""
    while (await http.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.1)  # not expected after the body; no busy loop if it comes


async def unless_client_leaves(http: HTTPRequest, work: Awaitable[T]) -> T:
    """Awaits `work`, raising ClientGone (with `work` cancelled) if the client leaves first.
    uvicorn does not cancel a handler whose client left: without this race, a request that
    nobody waits for any more stays queued and then runs to its end."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(http))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientGone


async def first_events(http: HTTPRequest, job: Job) -> list[Event] | None:
    """The job's first step (it has been queued, then prefilled): before it, nothing is sent,
    so an engine failure here is still a plain 500 and not a 200 with an error inside."""
    try:
        return await unless_client_leaves(http, job.next_events())
    except (ClientGone, APIError):  # an APIError is an answer already (a shutdown's 503)
        raise
    except Exception as e:  # the worker has logged it
        raise internal_error(e) from None


# --- response bodies -------------------------------------------------------------------------


@dataclass
class Choice:
    """One choice of a non-streaming reply, as its events arrive."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, ev: Event) -> None:
        self.text += ev.text
        self.tokens += ev.token_ids
        self.logprobs += ev.logprobs
        self.finish_reason = ev.finish_reason or self.finish_reason


async def collect(job: Job, first: list[Event] | None) -> list[Choice]:
    choices = [Choice() for _ in range(job.request.n)]
    events = first
    while events is not None:
        for ev in events:
            choices[ev.index].add(ev)
        events = await job.next_events()
    return choices


def usage_of(req: Request, completion_tokens: int) -> dict:
    prompt = len(req.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def chat_logprobs(tokenizer, lps: list[TokenLogprob]) -> dict:
    def entry(tid, lp):
        return {"token": tokenizer.decode([tid]), "logprob": lp, "bytes": list(token_bytes(tokenizer, tid))}

    return {"content": [entry(t.token_id, t.logprob) | {"top_logprobs": [entry(i, v) for i, v in t.top]} for t in lps]}


class TextOffsets:
    """Each token's offset in its choice's text: how much the streaming detokenizer had emitted
    before it, so a character split over several tokens counts once, where it completes. One pass
    over the tokens (decoding every prefix instead is quadratic: minutes at 16 x 8000), kept across
    the chunks of a stream, whose offsets count from the start of the choice as a whole reply's do."""

    def __init__(self, tokenizer, req: Request):
        # the engine's own detokenizer settings: the special tokens' text counts where it is kept
        self.detokenizer = IncrementalDetokenizer(tokenizer, req.skip_special_tokens, req.prompt_ids)
        self.emitted = 0

    def of(self, token_ids: list[int]) -> list[int]:
        offsets = []
        for token_id in token_ids:
            offsets.append(self.emitted)
            self.emitted += len(self.detokenizer.add(token_id))
        return offsets


def completion_logprobs(tokenizer, lps: list[TokenLogprob], offsets: TextOffsets) -> dict:
    """offsets: the choice's TextOffsets so far (a stream's, across its chunks)."""
    ids = [t.token_id for t in lps]
    return {
        "tokens": [tokenizer.decode([i]) for i in ids],
        "token_logprobs": [t.logprob for t in lps],
        "top_logprobs": [top_by_text(tokenizer, t) for t in lps],
        "text_offset": offsets.of(ids),
    }


def top_by_text(tokenizer, t: TokenLogprob) -> dict[str, float]:
    """A token's top alternatives keyed by their text, as the legacy completions API has them, the
    chosen token among them (OpenAI: up to logprobs + 1 entries). Tokens that decode to one text
    (byte pieces of a character, each "\ufffd" alone) share its key, with the larger value."""
    top: dict[str, float] = {}
    for i, v in [*t.top, (t.token_id, t.logprob)]:
        text = tokenizer.decode([i])
        top[text] = max(v, top.get(text, -math.inf))
    return dict(sorted(top.items(), key=lambda kv: -kv[1]))


def reply_json(state: ServerState, rid: str, req: Request, choices: list[Choice], chat: bool) -> bytes:
    return "".join(json_pieces(reply_body(state, rid, req, choices, chat))).encode()


def json_pieces(obj, depth: int = 0, items: int = 32):
    """json.dumps(obj, ensure_ascii=False), in pieces of a few kB. One json.dumps call holds the GIL
    from start to end: a reply of 16 x 400 tokens with their top 20 (4 MB) held it for 100-300 ms,
    and the event loop's thread, which answers every other client, waited that long. Between two
    pieces it can take the GIL. The reply's skeleton (its first levels) is walked; a list longer
    than `items` (a choice's tokens) is encoded `items` at a time; the rest whole."""
    if isinstance(obj, list) and len(obj) > items:
        yield "["
        for start in range(0, len(obj), items):
            yield (", " if start else "") + json.dumps(obj[start : start + items], ensure_ascii=False)[1:-1]
        yield "]"
    elif isinstance(obj, dict) and depth < 4:
        yield "{"
        for i, (key, value) in enumerate(obj.items()):
            yield (", " if i else "") + json.dumps(key, ensure_ascii=False) + ": "
            yield from json_pieces(value, depth + 1, items)
        yield "}"
    elif isinstance(obj, list) and depth < 4:
        yield "["
        for i, value in enumerate(obj):
            if i:
                yield ", "
            yield from json_pieces(value, depth + 1, items)
        yield "]"
    else:
        yield json.dumps(obj, ensure_ascii=False)


def reply_body(state: ServerState, rid: str, req: Request, choices: list[Choice], chat: bool) -> dict:
    tokenizer, with_logprobs = state.engine.tokenizer, req.params.logprobs is not None
    if chat:
        out = [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(tokenizer, c.logprobs) if with_logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ]
    else:
        out = [
            {
                "index": i,
                "text": c.text,
                "logprobs": (
                    completion_logprobs(tokenizer, c.logprobs, TextOffsets(tokenizer, req)) if with_logprobs else None
                ),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ]
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": out,
        "usage": usage_of(req, sum(len(c.tokens) for c in choices)),
    }


# --- server-sent events ----------------------------------------------------------------------


def sse(data) -> str:
    """One server-sent event: a `data:` line, then a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass
class ChunkFraming:
    """What every chunk of one streamed reply repeats: its id, kind, time and model."""

    rid: str
    model: str
    chat: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            body["usage"] = usage
        return sse(body)


def stream_choice(tokenizer, ev: Event, chat: bool, logprobs: bool, offsets: TextOffsets) -> dict:
    if chat:
        delta = {"content": ev.text} if ev.text or not ev.finish_reason else {}
        lp = chat_logprobs(tokenizer, ev.logprobs) if logprobs else None
        return {"index": ev.index, "delta": delta, "logprobs": lp, "finish_reason": ev.finish_reason}
    lp = completion_logprobs(tokenizer, ev.logprobs, offsets) if logprobs else None
    return {"index": ev.index, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish_reason}


async def event_stream(tokenizer, job: Job, first: list[Event] | None, framing: ChunkFraming, ended=lambda: None):
    """The SSE body: the role chunk (chat), one chunk per step, the usage chunk if asked, [DONE].
    `ended` is called when the stream ends, however it ends."""
    req = job.request
    logprobs = req.params.logprobs is not None
    offsets = [TextOffsets(tokenizer, req) for _ in range(req.n)]  # per choice, across its chunks
    n_tokens = 0
    try:
        if framing.chat:  # OpenAI's first chunk of each choice announces the role
            yield framing.chunk(
                [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    for i in range(req.n)
                ]
            )
        events = first
        while events is not None:
            n_tokens += sum(len(ev.token_ids) for ev in events)
            # A token that ends inside a character adds no text yet: nothing to send.
            choices = [
                stream_choice(tokenizer, ev, framing.chat, logprobs, offsets[ev.index])
                for ev in events
                if ev.text or ev.finish_reason or logprobs
            ]
            if choices:
                yield framing.chunk(choices)
            events = await job.next_events()
        if framing.include_usage:
            yield framing.chunk([], usage_of(req, n_tokens))
    except Exception as e:  # the status line is gone already: report in-band, then end the stream
        yield sse((e if isinstance(e, APIError) else internal_error(e)).body())
    finally:
        job.cancel()  # the client disconnected (or we finished): free the worker
        ended()
    yield sse("[DONE]")


# --- routes ----------------------------------------------------------------------------------

router = APIRouter()


@router.get("/health")
async def health(http: HTTPRequest):
    state = state_of(http)
    if state.stopping:  # a shutdown or a lost rank: a load balancer stops sending work here
        return JSONResponse({"status": "stopping", "model": state.model_name}, status_code=503)
    return {"status": "ok", "model": state.model_name, "busy": state.worker.busy, "queued": state.worker.queued}


@router.get("/v1/models")
async def models(http: HTTPRequest):
    state = state_of(http)
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": state.created,
                "owned_by": "llm-from-scratch",
                "max_model_len": state.engine.context,
            }
        ],
    }


@router.post("/v1/completions", responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, http: HTTPRequest):
    return await respond(http, body, completion_request, chat=False)


@router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
async def chat_completions(body: ChatRequest, http: HTTPRequest):
    return await respond(http, body, chat_request, chat=True)


async def respond(http: HTTPRequest, body, build, chat: bool):
    state = state_of(http)
    check_model(state.model_name, body.model)
    if state.stopping:
        raise shutting_down("the server is shutting down: no new requests")
    # Templating and tokenizing a long prompt take a while: in a thread, /health keeps answering.
    async with state.tokenizing:
        req = await run_in_threadpool(engine_request, state.engine, build, body)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    job = state.worker.submit(req)
    state.open_jobs[id(job)] = job
    streaming = False
    try:
        first = await first_events(http, job)
        if body.stream:  # from here on the stream owns the job, and cancels it when it ends
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            framing = ChunkFraming(rid, state.model_name, chat, include_usage)
            stream = event_stream(
                state.engine.tokenizer, job, first, framing, lambda: state.open_jobs.pop(id(job), None)
            )
            streaming = True
            return StreamingResponse(stream, media_type="text/event-stream")
        choices = await unless_client_leaves(http, collect(job, first))
    except ClientGone:
        job.cancel()
        return Response(status_code=CLIENT_GONE)
    except BaseException:
        job.cancel()
        raise
    finally:
        if not streaming:
            state.open_jobs.pop(id(job), None)
    # A reply with logprobs decodes every token of every choice, and its JSON runs to megabytes
    # (16 choices x 400 tokens x 20 alternatives: 2 s to encode): both off the event loop, like
    # templating, so /health and the other streams keep their pace. The bytes go out as they are.
    content = await run_in_threadpool(reply_json, state, rid, req, choices, chat)
    return Response(content, media_type="application/json")


# --- shutting down ---------------------------------------------------------------------------


def shutting_down(message: str) -> APIError:
    return APIError(503, message, "server_error", code="server_shutting_down", headers={"connection": "close"})


def end_open_requests(state: ServerState) -> None:
    """Ends every open request now, each with an error its client can read: a stream gets an
    error event and [DONE], a waiting request a 503 error object (through its job's queue)."""
    for job in list(state.open_jobs.values()):
        job.events.put_nowait(shutting_down("the server is shutting down: this request was ended before it finished"))
        job.cancel()


class GracefulServer(uvicorn.Server):
    """uvicorn's server, telling the app when a shutdown (SIGINT, SIGTERM) begins. uvicorn then
    waits --timeout-graceful-shutdown seconds for the open requests and cancels what is left where
    it stands: a stream would break off with no error and no [DONE], a non-streaming request get a
    plain-text 500 and a CancelledError traceback in the log. So shortly before that deadline,
    every open request is ended here, as end_open_requests says, and the shutdown logs one line."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:  # the first signal: a second one means "now" to uvicorn
            with contextlib.suppress(RuntimeError):  # no loop running: nothing open to end
                asyncio.get_running_loop().call_soon_threadsafe(self._begin)
        super().handle_exit(sig, frame)

    def _begin(self) -> None:
        self.state.stopping = True
        grace = self.config.timeout_graceful_shutdown
        open_now = len(self.state.open_jobs)
        if grace is None:
            log.warning("shutting down: waiting for %d open request(s) to finish", open_now)
            return
        # Ahead of uvicorn's deadline by a second (half the grace, if that is shorter): the error
        # events must be written before the connections are cut.
        ahead = min(1.0, grace / 2)
        log.warning(
            "shutting down: %d open request(s) get %.3g s to finish, then end with a 503 error", open_now, grace - ahead
        )
        asyncio.get_running_loop().call_later(grace - ahead, end_open_requests, self.state)


# --- the app ---------------------------------------------------------------------------------


def openapi_schema(app: FastAPI) -> dict:
    """FastAPI documents a 422 for every route with a body; this server answers those with a 400
    (OpenAI's status), which ERROR_RESPONSES documents with the error object."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for unused in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema


def body_limit_for(context: int) -> int:
    """The default body limit: 32 bytes per token of context, and 64 KiB for the rest of the JSON. A
    token of text is about 4 characters, or up to 12 bytes where JSON escapes it (\\uXXXX), so a
    prompt that fits the context fits this; a body many times larger is refused from its
    Content-Length alone, before the server reads it (a fixed 1 MB let in 67x SmolLM2's context)."""
    return 32 * context + 64 * 1024


def create_app(
    worker: Worker,
    model_name: str,
    max_body_bytes: int = int(MAX_BODY_MB * 2**20),
    body_timeout: float = BODY_TIMEOUT_S,
    max_requests: int = 128,
) -> FastAPI:
    app = FastAPI(title="llm-from-scratch chapter 04")
    app.state.server = ServerState(worker.engine, worker, model_name)
    app.include_router(router)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_internal_error)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout=body_timeout)
    app.add_middleware(RequestLimit, max_requests=max_requests)  # outermost: counted before a body is read
    app.openapi = lambda: openapi_schema(app)
    return app


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=port_number, default=8000)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--served-model-name", type=non_empty, default=None, help="the id clients send as `model` (default: --model)"
    )
    add_quant_args(ap)
    limits = ap.add_argument_group("limits")
    limits.add_argument("--max-model-len", type=int, default=None, help="the context in tokens (default: the model's)")
    limits.add_argument(
        "--max-tokens-default",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="max_tokens for a request that sets none (default: %(default)s)",
    )
    limits.add_argument(
        "--memory-budget-gb",
        type=positive_float,
        default=None,
        help="memory one request may use (KV cache x n and activations); over it, a 400 "
        "(default: a quarter of the memory free on the device after loading the model)",
    )
    limits.add_argument(
        "--max-body-mb",
        type=positive_float,
        default=None,
        help="request body size limit, over it a 413 (default: 32 bytes per token of context + 64 KiB)",
    )
    limits.add_argument(
        "--limit-concurrency",
        type=positive_int,
        default=128,
        help="requests in progress (/health aside); more get a 503 (default: %(default)s)",
    )
    limits.add_argument(
        "--max-connections",
        type=positive_int,
        default=1024,
        help="open connections; when full, the longest idle one is closed for a new one (default: %(default)s)",
    )
    limits.add_argument(
        "--max-connections-per-client",
        type=positive_int,
        default=64,
        help="open connections from one client address; more get a 503 (default: %(default)s)",
    )
    limits.add_argument(
        "--timeout-headers",
        type=positive_float,
        default=10.0,
        help="seconds for a request's headers to arrive (default: %(default)s)",
    )
    limits.add_argument(
        "--timeout-body",
        type=positive_float,
        default=BODY_TIMEOUT_S,
        help="seconds for a request's body to arrive, over it a 408 (default: %(default)s)",
    )
    limits.add_argument(
        "--timeout-keep-alive",
        type=non_negative_int,
        default=5,
        help="seconds an idle keep-alive connection stays open (default: %(default)s)",
    )
    limits.add_argument(
        "--timeout-graceful-shutdown",
        type=non_negative_int,
        default=10,
        help="seconds open requests get to finish on shutdown (default: %(default)s)",
    )
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args()
    raise_open_file_limit()  # each connection is a file
    listener = listen_socket(args.host, args.port)  # before the model loads: a port in use is one line at once
    named = {}

    def build() -> Engine:  # on the engine thread, the one thread that computes (worker.py)
        engine, named["name"] = build_engine(
            args.model,
            args.device,
            args.dtype,
            quant_spec(args),
            args.matmul,
            max_model_len=args.max_model_len,
            max_tokens_default=args.max_tokens_default,
        )
        return engine

    worker = Worker(build)
    engine, name = worker.engine, named["name"]
    engine.memory_budget = (
        int(args.memory_budget_gb * GiB) if args.memory_budget_gb is not None else default_budget(engine.model.device)
    )
    max_body = int(args.max_body_mb * 2**20) if args.max_body_mb is not None else body_limit_for(engine.context)
    app = create_app(worker, args.served_model_name or name, max_body, args.timeout_body, args.limit_concurrency)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        http=protocol_with_limits(args.timeout_headers, args.max_connections, args.max_connections_per_client),
        timeout_keep_alive=args.timeout_keep_alive,
        timeout_graceful_shutdown=args.timeout_graceful_shutdown,
    )
    filter_repeats(["", "uvicorn", "uvicorn.access"])  # after uvicorn.Config: it sets up its handlers
    budget = "none" if engine.memory_budget is None else size(engine.memory_budget)
    weights = engine.model.quant.name if engine.model.quant else "unquantized"
    url = f"http://{args.host}:{listener.getsockname()[1]}/v1"  # port 0: the one the system gave
    print(
        f"serving {name} ({weights} weights) on {url} (context {engine.context}, max_tokens default "
        f"{engine.max_tokens_default}, memory budget {budget} per request)",
        file=sys.stderr,
        flush=True,
    )
    GracefulServer(config, app.state.server).run(sockets=[listener])
    return 0


if __name__ == "__main__":
    from common.cli import run_main

    run_main(main)
