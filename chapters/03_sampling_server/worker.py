"""One generation at a time, in arrival order, off the event loop.

The engine is synchronous PyTorch code; running it inside an async handler would freeze every
other connection (health checks, new requests, other streams) for the whole generation. So the
server puts each request on a queue, one thread takes them in order (FIFO: fair), and each
step's events travel back to the waiting handler through an asyncio.Queue.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from dataclasses import dataclass, field

from engine import Engine, Request

_DONE = object()


@dataclass
class Job:
    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """The client is gone: the worker stops this job at its next step (or skips it if queued)."""
        self.cancelled.set()

    async def results(self):
        """The engine's per-step event lists, as they come. Raises what the engine raised."""
        while True:
            item = await self.events.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class Worker:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.busy = False
        threading.Thread(target=self._run, name="engine-worker", daemon=True).start()

    def submit(self, request: Request) -> Job:
        job = Job(request, asyncio.get_running_loop())
        self.jobs.put(job)
        return job

    @property
    def queued(self) -> int:
        return self.jobs.qsize()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job.cancelled.is_set():
                continue
            self.busy = True
            try:
                for events in self.engine.stream(job.request, job.cancelled.is_set):
                    job.loop.call_soon_threadsafe(job.events.put_nowait, events)
                job.loop.call_soon_threadsafe(job.events.put_nowait, _DONE)
            except Exception as e:  # one bad request must not stop the worker for everyone else
                traceback.print_exc()
                job.loop.call_soon_threadsafe(job.events.put_nowait, e)
            finally:
                self.busy = False
