"""A ``Job``: one request submitted to a ``Backend``, from its callbacks to whoever waits on it.

The backend (which batches, queues and refuses: a full queue is a 503) calls ``_tokens`` with
each decode step's committed token ids and ``_done`` once at the end, on its scheduler thread.
The job hands each event to ``emit(kind, value)``: the HTTP server puts it on its event loop's
queue (``loop.call_soon_threadsafe``), the in-process SDK on a thread-safe queue. A job is
cancelled (client gone, timeout) through ``should_stop``, which the backend polls between steps,
so it stops at the next step boundary, frees its KV cache and still reports partial stats.

The events are not bounded and the backend never waits on them: a client that reads slowly (or
not at all) must not hold up the scheduler, which steps every running request together. They
stay small anyway: one entry per decode step of this request (a list of the step's token ids),
so at most ``max_tokens`` entries (capped by the context window), a few hundred bytes each; the
text and SSE bytes are only made when the client reads, and uvicorn stops the response's writes
(flow control, 64 KiB) while the client's socket is full. A stalled reader costs its token ids
and one socket's buffers, never another request's time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Job"]


class Job:
    """One generation: ``request`` is the ``GenerationRequest`` submitted to the backend."""

    def __init__(self, request: Any, *, deadline: float, emit: Callable[[str, Any], None],
                 on_finish: Callable[["Job", str, Any], None] | None = None) -> None:
        self.request = request
        self.deadline = deadline              # time.monotonic() after which the job stops
        self.emit = emit                      # (kind, value): "tokens" / "done" / "error" / "cancelled"
        self.cancelled = threading.Event()
        self.timed_out = False
        self.shutdown = False                 # cancelled because the server is shutting down (a 503)
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
            self.emit(kind, value)
        except RuntimeError:  # the server's event loop is closed (shutting down): nobody listens
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

