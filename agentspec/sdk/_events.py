"""The events of one streamed request, as the transports hand them to ``Stream``.

The request is under way before the first event is read (the job is submitted, the response
is open), so ending it cannot be left to a generator's ``finally``: closing a generator that
never started runs nothing. ``close()`` here ends the request (``release``: cancel the job,
close the response) whether or not iteration started, then closes the generator.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

__all__ = ["AsyncEventStream", "EventStream"]


class EventStream:
    """``events``: the request's events; ``release``: ends the request (idempotent, and safe to
    call from another thread while ``events`` runs)."""

    def __init__(self, events: Iterator[dict], release: Callable[[], None]) -> None:
        self._events = events
        self.release = release

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> dict:
        return next(self._events)

    def close(self) -> None:
        try:
            self.release()
        finally:
            # closed from another thread while it is being read: released, it ends on its own
            close = None if getattr(self._events, "gi_running", False) else getattr(self._events, "close", None)
            if close is not None:
                close()


class AsyncEventStream:
    """``EventStream`` for asyncio: ``release`` is awaited."""

    def __init__(self, events: AsyncIterator[dict], release: Callable[[], Awaitable[None]]) -> None:
        self._events = events
        self.release = release

    def __aiter__(self) -> "AsyncEventStream":
        return self

    async def __anext__(self) -> dict:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        try:
            await self.release()
        finally:
            # closed from another task while it is being read: released, it ends on its own
            aclose = None if getattr(self._events, "ag_running", False) else getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
