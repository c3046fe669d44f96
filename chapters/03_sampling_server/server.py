"""An OpenAI-compatible HTTP server around the engine.

    python chapters/03_sampling_server/server.py --model smollm2-135m --host 127.0.0.1 --port 8000

GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with
"stream": true as server-sent events ending in `data: [DONE]`). Errors come back as OpenAI
error objects with the matching HTTP status, and never take the server down.

The request lifecycle: parse and validate the body (400 before anything is queued) -> turn it
into an engine Request -> queue it on the worker (one generation at a time, FIFO) -> stream the
worker's per-step events to the client as they come; if the client goes away, cancel the job so
the worker moves on to the next one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from engine import Engine, Event
from protocol import ChatRequest, CompletionRequest, chat_request, completion_request
from worker import Worker


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def create_app(engine: Engine, model_name: str) -> FastAPI:
    app = FastAPI(title="llm-from-scratch chapter 03")
    worker = Worker(engine)
    tokenizer = engine.tokenizer
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_req, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_req, e: RequestValidationError):
        # FastAPI says 422; OpenAI clients expect 400 and an error object. Malformed JSON lands here too.
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            loc = ""  # pydantic's loc is then a byte offset, not a parameter
            message = f"malformed JSON body: {first.get('msg')}"
        else:
            message = f"{loc}: {first.get('msg')}" if loc else str(first.get("msg"))
        return JSONResponse(APIError(400, message, param=loc or None).body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_req, e: Exception):
        return JSONResponse(APIError(500, f"internal error: {e}", "server_error").body(), status_code=500)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")

    def engine_request(build, body):
        try:
            req = build(body, tokenizer, engine.default_params())
            engine.validate(req)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return req

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "busy": worker.busy, "queued": worker.queued}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "llm-from-scratch", "max_model_len": engine.context}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        check_model(body.model)
        req = engine_request(completion_request, body)
        return await respond(req, body, http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HTTPRequest):
        check_model(body.model)
        req = engine_request(chat_request, body)
        return await respond(req, body, http, chat=True)

    async def respond(req, body, http: HTTPRequest, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        job = worker.submit(req)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream(job, rid, chat, include_usage), media_type="text/event-stream")
        choices = [{"text": "", "tokens": [], "logprobs": [], "finish_reason": None} for _ in range(req.n)]
        try:
            async for events in job.results():
                for ev in events:
                    c = choices[ev.index]
                    c["text"] += ev.text
                    c["tokens"] += ev.token_ids
                    c["logprobs"] += ev.logprobs
                    c["finish_reason"] = ev.finish_reason or c["finish_reason"]
        finally:
            job.cancel()  # no-op when finished; stops the work if this handler was cancelled
        usage = usage_of(req, sum(len(c["tokens"]) for c in choices))
        if chat:
            out = [{"index": i, "message": {"role": "assistant", "content": c["text"]},
                    "logprobs": chat_logprobs(c["logprobs"]) if req.params.logprobs is not None else None,
                    "finish_reason": c["finish_reason"]} for i, c in enumerate(choices)]
            return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                    "choices": out, "usage": usage}
        out = [{"index": i, "text": c["text"],
                "logprobs": completion_logprobs(c["logprobs"]) if req.params.logprobs is not None else None,
                "finish_reason": c["finish_reason"]} for i, c in enumerate(choices)]
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": out, "usage": usage}

    async def stream(job, rid: str, chat: bool, include_usage: bool):
        req = job.request
        now = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        n_tokens = 0

        def chunk(choices, usage=None) -> str:
            body = {"id": rid, "object": kind, "created": now, "model": model_name, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            if chat:  # OpenAI's first chunk of each choice announces the role
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(req.n)])
            async for events in job.results():
                choices = []
                for ev in events:
                    n_tokens += len(ev.token_ids)
                    # A token that ends inside a character adds no text yet: nothing to send.
                    if ev.text or ev.finish_reason or req.params.logprobs is not None:
                        choices.append(stream_choice(ev, chat, req.params.logprobs is not None))
                if choices:
                    yield chunk(choices)
            if include_usage:
                yield chunk([], usage_of(req, n_tokens))
        except Exception as e:  # the status line is gone already: report in-band, then end the stream
            yield f"data: {json.dumps(APIError(500, f'internal error: {e}', 'server_error').body())}\n\n"
        finally:
            job.cancel()  # the client disconnected (or we finished): free the worker
        yield "data: [DONE]\n\n"

    def stream_choice(ev: Event, chat: bool, logprobs: bool) -> dict:
        if chat:
            delta = {"content": ev.text} if ev.text or not ev.finish_reason else {}
            lp = chat_logprobs(ev.logprobs) if logprobs else None
            return {"index": ev.index, "delta": delta, "logprobs": lp, "finish_reason": ev.finish_reason}
        lp = completion_logprobs(ev.logprobs) if logprobs else None
        return {"index": ev.index, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish_reason}

    def usage_of(req, completion_tokens: int) -> dict:
        prompt = len(req.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}

    def piece(token_id: int) -> str:
        return tokenizer.decode([token_id])

    def chat_logprobs(lps) -> dict:
        from detokenizer import token_bytes

        def entry(tid, lp):
            return {"token": piece(tid), "logprob": lp, "bytes": list(token_bytes(tokenizer, tid))}

        return {"content": [entry(t.token_id, t.logprob) | {"top_logprobs": [entry(i, v) for i, v in t.top]}
                            for t in lps]}

    def completion_logprobs(lps) -> dict:
        tokens = [piece(t.token_id) for t in lps]
        ids = [t.token_id for t in lps]
        # Offsets from decoding each prefix: a character split over several tokens counts once.
        offsets = [len(tokenizer.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids))]
        return {"tokens": tokens, "token_logprobs": [t.logprob for t in lps],
                "top_logprobs": [{piece(i): v for i, v in t.top} for t in lps], "text_offset": offsets}

    return app


def build_engine(model: str, device: str, dtype: str) -> tuple[Engine, str]:
    from common.device import pick_device, pick_dtype
    from common.models import resolve_model
    from common.tokenizer import Tokenizer
    from model import load_model

    model_dir = resolve_model(model)
    dev = pick_device(device)
    engine = Engine(load_model(model_dir, dev, pick_dtype(dtype, dev)), Tokenizer(model_dir),
                    Engine.read_generation_config(model_dir))
    return engine, model_dir.name if model in (None, "") or Path(model).is_dir() else model


def main() -> int:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--served-model-name", default=None, help="the id clients send as `model` (default: --model)")
    args = ap.parse_args()
    engine, name = build_engine(args.model, args.device, args.dtype)
    app = create_app(engine, args.served_model_name or name)
    print(f"serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    from common.cli import run_main

    run_main(main)
