"""The server's defences at the HTTP edge: what a client may send, and for how long.

* `BodyLimit`: a request body is read in full before the app sees it, at most `max_bytes`
  (413, from the Content-Length header alone when it says so) within `timeout` seconds (408),
  and in UTF-8 (400): JSON travels as UTF-8 (RFC 8259), though Python's json reads UTF-16 too.
* `protocol_with_limits`: uvicorn's h11 protocol, with a deadline for each request's headers
  (uvicorn has none, so a socket that opens and says nothing holds its slot forever), a cap on
  connections per client address, and idle connections closed first when the server is full.
* `RequestLimit`: requests in progress, at most `max_requests` (503 error object over it).
* `RepeatFilter`: a log line that repeats is written once, then once a minute with a count.
* `raise_open_file_limit`: the soft limit on open files up to the hard one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from errors import APIError


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: buffers each HTTP request's body within a size and a time limit, then
    replays it to the app. Later receive() calls (disconnect detection) go to the server."""

    def __init__(self, app, max_bytes: int, timeout: float):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await self._refuse(scope, receive, send, self._too_large(declared))
        try:
            body = await read_body(receive, self.max_bytes, self.timeout)
        except BodyTooLarge:
            return await self._refuse(scope, receive, send, self._too_large(None))
        except TimeoutError:
            error = APIError(
                408,
                f"the request body did not arrive within {self.timeout:g} s",
                code="request_timeout",
                headers={"connection": "close"},
            )
            return await self._refuse(scope, receive, send, error)
        if body is None:  # the client left while sending
            return
        if not is_utf8_text(body):
            error = APIError(
                400, "the request body is not valid UTF-8 text (JSON requests must be UTF-8)", code="invalid_encoding"
            )
            return await self._refuse(scope, receive, send, error)
        await self.app(scope, replay(body, receive), send)

    def _too_large(self, declared: int | None) -> APIError:
        size = f" ({declared} bytes)" if declared is not None else ""
        return APIError(
            413,
            f"the request body{size} is over this server's limit of {self.max_bytes} bytes (--max-body-mb)",
            code="request_too_large",
            headers={"connection": "close"},
        )

    @staticmethod
    async def _refuse(scope, receive, send, error: APIError) -> None:
        # connection: close, as the rest of the body is never read
        await error.response()(scope, receive, send)


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def is_utf8_text(body: bytes) -> bool:
    """UTF-8 with no NUL byte: JSON writes a NUL as \u0000, while UTF-16 or UTF-32 text (which
    json.loads would detect and read) has one in every ASCII character."""
    if b"\x00" in body:
        return False
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


async def read_body(receive, max_bytes: int, timeout: float) -> bytes | None:
    """The whole body, or None if the client disconnected. Raises BodyTooLarge past max_bytes
    and TimeoutError when it takes longer than `timeout` seconds in all."""
    chunks, size = [], 0
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        message = await asyncio.wait_for(receive(), remaining)
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive):
    """A receive() that gives `body` first, in one message, then hands over to `receive`."""
    delivered = False

    async def receive_replayed():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_replayed


def protocol_with_limits(header_seconds: float, max_connections: int, per_client: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with limits on connections, which uvicorn counts with requests in
    its `limit_concurrency`: idle keep-alive sockets held open (and reopened as they close) then
    lock every client out, /health included, with a plain-text 503.

    * A connection whose next request's headers are not in within `header_seconds` of it opening
      (or of the last response) is closed. uvicorn's keep-alive timeout restarts on every byte, so
      a client trickling a header a byte at a time would outlive it.
    * One client address holds at most `per_client` connections; another gets a 503 error object
      and is closed.
    * At `max_connections`, a new connection closes the longest-open idle one (no request in
      progress) to make room; if none is idle, it gets the 503.
    """
    open_connections: dict[H11Protocol, str] = {}  # -> client address; oldest first (insertion order)

    class H11WithLimits(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            host = self.client[0] if self.client else "?"
            if sum(h == host for h in open_connections.values()) >= per_client:
                return self._refuse(f"this client has {per_client} connections open, the most this server allows one")
            if len(open_connections) >= max_connections and not self._close_an_idle_connection():
                return self._refuse(f"this server has {max_connections} connections open, all busy: retry shortly")
            open_connections[self] = host
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            open_connections.pop(self, None)
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(header_seconds, self._expire)

        def _idle(self) -> bool:
            # between requests: a new request's headers make a new cycle, its response not complete yet
            return self.cycle is None or self.cycle.response_complete

        def _close(self) -> None:
            open_connections.pop(self, None)
            if not self.transport.is_closing():
                try:
                    self.conn.send(h11.ConnectionClosed())
                except h11.LocalProtocolError:
                    pass
                self.transport.close()

        def _expire(self) -> None:
            if self._idle():
                self._close()

        def _close_an_idle_connection(self) -> bool:
            for other in list(open_connections):
                if other._idle():
                    other._close()
                    return True
            return False

        def _refuse(self, message: str) -> None:
            # Before any request of this connection: a response of our own, then close.
            body = json.dumps(APIError(503, message, "server_error", code="too_many_connections").body()).encode()
            head = (
                "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
            )
            self.transport.write(head.encode() + body)
            self.transport.close()

    return H11WithLimits


class RequestLimit:
    """ASGI middleware: at most `max_requests` requests in progress (the engine's admission counts
    requests, not the sockets they came on); one more gets a 503 error object. /health is always
    answered: it is how an operator sees the server is busy."""

    def __init__(self, app, max_requests: int):
        self.app, self.max_requests, self.running = app, max_requests, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        if self.running >= self.max_requests:
            error = APIError(
                503,
                f"this server is answering {self.max_requests} requests, its limit: retry shortly",
                "server_error",
                code="too_many_requests",
            )
            return await error.response()(scope, receive, send)
        self.running += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.running -= 1


class RepeatFilter(logging.Filter):
    """Passes the first record of a kind (logger, level, first line of the message before its
    arguments are filled in: one log statement), then at most one per `window` seconds, which
    carries how many were held back. A server out of file
    descriptors logs a failed accept() up to 2048 times per poll (asyncio's accept loop keeps
    going after EMFILE): hundreds of MB of identical lines within a minute, without this."""

    def __init__(self, window: float = 60.0, max_kinds: int = 1000):
        super().__init__()
        self.window, self.max_kinds = window, max_kinds
        self._kinds: dict[tuple, list] = {}  # kind -> [when last passed, held back since]
        self._lock = threading.Lock()  # the worker thread logs too

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, record.levelno, str(record.msg).split("\n", 1)[0])
        now = time.monotonic()
        with self._lock:
            seen = self._kinds.get(kind)
            if seen is not None and now - seen[0] < self.window:
                seen[1] += 1
                return False
            if len(self._kinds) >= self.max_kinds:
                self._kinds.clear()  # bounded: a flood of distinct lines cannot grow this
            self._kinds[kind] = [now, 0]
        if seen is not None and seen[1]:
            record.msg, record.args = f"{record.getMessage()} [{seen[1]} more like this held back]", None
        return True


def filter_repeats(logger_names: list[str], repeat_filter: RepeatFilter | None = None) -> RepeatFilter:
    """Puts one RepeatFilter on every handler of these loggers (and so on what they propagate)."""
    repeat_filter = repeat_filter or RepeatFilter()
    for name in logger_names:
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(repeat_filter)
    return repeat_filter


def raise_open_file_limit() -> int | None:
    """Lifts the soft limit on open files to the hard limit: every connection is a file, and the
    soft limit is often 1024. -> the new soft limit (None where unknown, e.g. Windows)."""
    try:
        import resource
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Linux refuses more than fs.nr_open, 1M by default, even under an unlimited hard limit.
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target
