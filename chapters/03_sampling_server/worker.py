"""One generation at a time, in arrival order, off the event loop.

The engine is synchronous PyTorch code; running it inside an async handler would freeze every
other connection (health checks, new requests, other streams) for the whole generation. So the
server puts each request on a queue, one thread takes them in order (FIFO: fair), and each
step's events travel back to the waiting handler through an asyncio.Queue.

A job whose client left is cancelled: the worker stops it at its next step, or drops it
unstarted, and /health stops counting it as queued at once.

The server builds the engine on this thread too (Worker(build)), so that it is the only thread
of the process that computes with torch. Each thread that runs an OpenMP parallel region gets a
team of its own, kept for the life of the thread; once a process holds more OpenMP threads than
it has cores, libgomp stops letting idle team members spin and puts them to sleep after each
region, and waking them costs every one of a decode step's few hundred parallel regions.
Measured on 2 cores (chapter 06, int4 SmolLM2): a decode step took 11-13 ms on the thread that
loaded the model, 29-40 ms on another thread (both teams alive), and 11.9 ms loaded and stepped
on one thread that is not the main one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from engine import Engine, Event, Request

log = logging.getLogger(__name__)
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

    async def next_events(self) -> list[Event] | None:
        """The engine's next step of events; None once the job is done. Raises what the engine raised."""
        item = await self.events.get()
        if item is _DONE:
            self.events.put_nowait(_DONE)  # done stays done, however often it is asked
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def put(self, item) -> None:
        """From the worker thread: hands `item` to the waiting handler on its event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed (the server is shutting down): nobody waits
            self.cancel()


class Worker:
    def __init__(self, build: Callable[[], Engine]):
        """build: makes the engine, called on the engine thread (see above; a test hands in
        `lambda: engine`). Raises what it raises."""
        self._jobs: deque[Job] = deque()
        self._arrived = threading.Condition()
        self.busy = False
        built: Future = Future()
        threading.Thread(target=self._run, args=(build, built), name="engine-worker", daemon=True).start()
        self.engine: Engine = built.result()

    def submit(self, request: Request) -> Job:
        job = Job(request, asyncio.get_running_loop())
        with self._arrived:
            self._jobs.append(job)
            self._arrived.notify()
        return job

    @property
    def queued(self) -> int:
        """Jobs waiting whose clients are still there."""
        with self._arrived:
            return sum(not job.cancelled.is_set() for job in self._jobs)

    def _next_job(self) -> Job:
        """The oldest job not cancelled; cancelled ones are dropped on the way."""
        with self._arrived:
            while True:
                while not self._jobs:
                    self._arrived.wait()
                job = self._jobs.popleft()
                if not job.cancelled.is_set():
                    self.busy = True
                    return job

    def _run(self, build: Callable[[], Engine], built: Future) -> None:
        try:
            built.set_result(build())
        except BaseException as e:  # noqa: BLE001  (handed to the thread that waits for the engine)
            built.set_exception(e)
            return
        while True:
            job = self._next_job()
            try:
                for events in self.engine.stream(job.request, job.cancelled.is_set):
                    job.put(events)
                job.put(_DONE)
            except Exception as e:  # one bad request must not stop the worker for everyone else
                log.exception("the engine failed on a request")
                job.put(e)
            finally:
                self.busy = False
