"""The engine runs one generation at a time on a worker thread; the event loop never blocks on it.

Requests queue (bounded: a full queue is a 503) until the worker takes them. Each job streams
its committed tokens back to the event loop through an asyncio queue. A job is cancelled
(client gone, timeout) through a flag the engine checks between decode steps, so the engine
stops at the next step boundary, releases its KV cache and returns partial stats.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Job", "Worker"]


class Job:
    """One generation: ``make`` builds the engine's step iterator on the worker thread."""

    def __init__(self, make: Callable[[Callable[[], bool]], Iterator[list[int]]], *, deadline: float,
                 loop: asyncio.AbstractEventLoop, on_start: Callable[[], None] | None = None,
                 on_finish: Callable[["Job", str, Any], None] | None = None) -> None:
        self.make = make
        self.deadline = deadline              # time.monotonic() after which the job stops
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.timed_out = False
        self.on_start = on_start
        self.on_finish = on_finish            # (job, kind, value) on the worker thread, once
        self.started_at: float | None = None  # monotonic times
        self.first_token_at: float | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def should_stop(self) -> bool:
        if self.cancelled.is_set():
            return True
        if time.monotonic() > self.deadline:
            self.timed_out = True
            return True
        return False

    def _emit(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed (server shutting down)
            pass


class Worker:
    def __init__(self, *, max_queue: int) -> None:
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.running = 0  # jobs generating now (0 or 1)
        self._thread = threading.Thread(target=self._loop, name="agentspec-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full."""
        try:
            self._queue.put_nowait(job)
            return True
        except queue.Full:
            return False

    def close(self, timeout: float = 10.0) -> None:
        while True:  # cancel what is still waiting
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job._emit("error", RuntimeError("server shutting down"))
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self.running = 1
            try:
                self._run(job)
            finally:
                self.running = 0

    @staticmethod
    def _run(job: Job) -> None:
        kind, value = "error", None
        if job.should_stop():  # cancelled or expired while queued
            kind = "cancelled"
        else:
            job.started_at = time.monotonic()
            try:
                if job.on_start is not None:
                    job.on_start()
                steps = job.make(job.should_stop)
                while True:
                    try:
                        new = next(steps)
                    except StopIteration as done:
                        kind, value = "done", done.value
                        break
                    if job.first_token_at is None:
                        job.first_token_at = time.monotonic()
                    job._emit("tokens", new)
            except Exception as e:  # noqa: BLE001 - reported to the request; the worker lives on
                kind, value = "error", e
        if job.on_finish is not None:
            try:
                job.on_finish(job, kind, value)
            except Exception as e:  # noqa: BLE001 - a failed log write must not kill the worker
                import sys

                print(f"[agentspec] request bookkeeping failed: {e!r}", file=sys.stderr, flush=True)
        job._emit(kind, value)
