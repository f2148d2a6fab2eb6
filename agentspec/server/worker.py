"""Requests reach the engine through a continuous-batching scheduler; the event loop never blocks.

``Worker`` wraps an ``agentspec.engine.batch.BatchEngine``: up to ``max_batch`` requests run
together (more wait; a full queue is a 503). Each job streams its committed tokens back to the
event loop through an asyncio queue. A job is cancelled (client gone, timeout) through a flag
the scheduler checks between steps, so it stops at the next step boundary, frees its KV cache
and still reports partial stats.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Job", "Worker"]


class Job:
    """One generation: ``params`` are ``BatchEngine.submit``'s keyword arguments."""

    def __init__(self, params: dict[str, Any], *, deadline: float, loop: asyncio.AbstractEventLoop,
                 on_start: Callable[[], None] | None = None,
                 on_finish: Callable[["Job", str, Any], None] | None = None) -> None:
        self.params = params
        self.deadline = deadline              # time.monotonic() after which the job stops
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.timed_out = False
        self.on_start = on_start
        self.on_finish = on_finish            # (job, kind, value) on the scheduler thread, once
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

    def _tokens(self, new: list[int]) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self._emit("tokens", new)

    def _done(self, generation: Any, error: Any) -> None:
        kind, value = ("error", error) if error is not None else ("done", generation)
        if self.on_finish is not None:
            try:
                self.on_finish(self, kind, value)
            except Exception as e:  # noqa: BLE001 - a failed log write must not kill the scheduler
                import sys

                print(f"[agentspec] request bookkeeping failed: {e!r}", file=sys.stderr, flush=True)
        self._emit(kind, value)


class Worker:
    def __init__(self, engine: Any, *, max_queue: int, max_batch: int = 16, budget: str = "load_aware",
                 background: bool = True) -> None:
        from ..engine.batch import BatchEngine

        self.max_queue = max_queue
        self.batch = BatchEngine(engine, max_batch=max_batch, budget=budget, background=background)
        self._lock = threading.Lock()

    @property
    def running(self) -> int:
        return self.batch.num_running

    @property
    def waiting(self) -> int:
        return self.batch.num_waiting

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full. Bad input raises (InvalidRequestError)."""
        with self._lock:
            if self.batch.num_waiting >= self.max_queue:
                return False
            job.started_at = time.monotonic()
            if job.on_start is not None:
                job.on_start()
            try:
                self.batch.submit(**job.params, on_tokens=job._tokens, on_done=job._done,
                                  should_stop=job.should_stop)
            except BaseException:
                job.started_at = None
                if job.on_finish is not None:  # undo on_start's bookkeeping, log nothing
                    job.on_finish(job, "rejected", None)
                raise
            return True

    def close(self, timeout: float = 30.0) -> None:
        self.batch.close(timeout)
