"""The engine loop: one thread steps the engine for every request at once, off the event loop.

Chapter 04's worker ran one request at a time. This one runs `engine.step()` as long as any
request has work: new requests join the running batch at the next step, finished ones leave,
and each step's events travel back to their waiting handlers through asyncio.Queues. Between
steps the loop takes in what arrived (engine.add) and what was cancelled (engine.abort: blocks
freed at once). When nothing is left, it sleeps until a request arrives.

The engine is touched by this thread only: handlers never call it, they only put work in the
inbox under a lock. A request the engine refuses (validate) gets its error through its queue.

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
import itertools
import logging
import threading
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
    request_id: str = ""
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    worker: Worker | None = None

    def cancel(self) -> None:
        """The client is gone: the engine drops this request before its next step."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            if self.worker is not None:
                self.worker.wake()

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
        """From the engine thread: hands `item` to the waiting handler on its event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed (the server is shutting down): nobody waits
            self.cancelled.set()


def _deliver(batch: list) -> None:
    """On the event loop: a step's events to the handlers that wait for them."""
    for job, events, done in batch:
        job.events.put_nowait(events)
        if done:
            job.events.put_nowait(_DONE)


class Worker:
    def __init__(self, build: Callable[[], Engine]):
        """build: makes the engine, called on the engine thread (see above; a test hands in
        `lambda: engine`). Raises what it raises."""
        self._inbox: list[Job] = []  # submitted, not yet added to the engine
        self._jobs: dict[str, Job] = {}  # in the engine, by request id
        self._wake = threading.Condition()
        self._ids = itertools.count()
        built: Future = Future()
        threading.Thread(target=self._run, args=(build, built), name="engine-loop", daemon=True).start()
        self.engine: Engine = built.result()
        self.stats = self.engine.stats()  # refreshed after every step, read by /health without the engine

    def submit(self, request: Request) -> Job:
        job = Job(request, asyncio.get_running_loop(), f"req-{next(self._ids)}", worker=self)
        with self._wake:
            self._inbox.append(job)
            self._wake.notify()
        return job

    def wake(self) -> None:
        with self._wake:
            self._wake.notify()

    @property
    def busy(self) -> bool:
        return bool(self.stats["running"])

    @property
    def queued(self) -> int:
        """Requests waiting for their first step whose clients are still there."""
        with self._wake:
            inbox = sum(not job.cancelled.is_set() for job in self._inbox)
        return inbox + self.stats["waiting"]

    def _take_in(self) -> None:
        """Between steps: new requests into the engine, cancelled ones out of it."""
        with self._wake:
            while not self._inbox and not self._jobs:
                self._wake.wait()  # nothing to do until a request arrives
            arrived, self._inbox = self._inbox, []
        for job in arrived:
            if job.cancelled.is_set():
                continue
            try:
                self.engine.add(job.request, job.request_id)
                self._jobs[job.request_id] = job
            except Exception as e:  # refused: the handler answers with the error
                job.put(e)
        for rid in [rid for rid, job in self._jobs.items() if job.cancelled.is_set()]:
            self.engine.abort(rid)
            del self._jobs[rid]

    def _run(self, build: Callable[[], Engine], built: Future) -> None:
        try:
            built.set_result(build())
        except BaseException as e:  # noqa: BLE001  (handed to the thread that waits for the engine)
            built.set_exception(e)
            return
        while True:
            self._take_in()
            self.stats = self.engine.stats()  # arrivals count as waiting while the step runs
            try:
                results = self.engine.step()
            except Exception as e:  # the step failed: fail its requests, keep serving the others
                from errors import APIError  # here, not above: errors.py needs fastapi, an engine loop does not

                if isinstance(e, APIError):  # made for the clients (a lost rank): its sentence is the whole story
                    log.error("an engine step failed: %s", e.message)
                else:
                    log.exception("an engine step failed")
                for rid, job in self._jobs.items():
                    self.engine.abort(rid)
                    job.put(e)
                self._jobs.clear()
                results = []
            deliveries: dict[asyncio.AbstractEventLoop, list] = {}
            for rid, events, done in results:
                job = self._jobs.get(rid)
                if job is None:
                    continue
                deliveries.setdefault(job.loop, []).append((job, events, done))
                if done:
                    del self._jobs[rid]
            # Before the deliveries: a client that reads /health as its reply ends sees the step that ended it.
            self.stats = self.engine.stats()
            # One wake-up of the event loop per step, not one per request: with 32 streams, 32
            # cross-thread calls per step would each write to the loop's wake-up pipe.
            for loop, batch in deliveries.items():
                try:
                    loop.call_soon_threadsafe(_deliver, batch)
                except RuntimeError:  # the loop is closed (the server is shutting down): nobody waits
                    for job, _, _ in batch:
                        job.cancelled.set()
