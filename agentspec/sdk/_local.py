"""In-process mode: the server's request handling (``agentspec.api``) without HTTP.

``LocalTransport`` takes the body dicts a client would POST and returns the dicts (or, for a
stream, the events) a server would answer with, so the client parses both modes with one code
path and results have the same types and fields. The state is the server's own
(``agentspec.api.state.build_state``: the backend, the tenant's workspace, routes, sessions,
limits, the acceptance logs and metrics), built on the first request, and every request runs
through ``agentspec.api.handling`` as the server's do: the same validation and errors, the same
sessions, one acceptance record per request in the tenant's log. Errors are raised as the
exceptions the HTTP transport would raise for the same response.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec

from ._events import AsyncEventStream, EventStream
from .errors import APITimeoutError, error_for_status

__all__ = ["AsyncLocalTransport", "LocalTransport"]

_json = msgspec.json.Encoder()


def _closed_error():
    return error_for_status(503, {"error": {"message": "the client is closed", "type": "server_error",
                                            "code": "shutting_down"}})


class LocalTransport:
    """The embedded engine behind the server's JSON API, in this process.

    ``engine``: an ``EmbeddedEngine`` already loaded (else one is loaded on first use with
    ``engine_options``, e.g. ``{"model": "x.gguf"}``). ``repo``: a workspace folder, indexed as
    the server indexes ``--repo`` (drafts come from its files; ``apply(path=...)`` resolves in
    it; ``watch``: follow edits on disk). ``config``: a ``ServerConfig`` (or TOML path) for routes,
    defaults, limits and ``log_dir``. ``tenant``: whose requests these are (the config's tenant of
    that name, or the one tenant of a config without tenants)."""

    def __init__(self, *, engine: Any = None, engine_options: dict | None = None, repo: str | Path | None = None,
                 config: Any = None, max_batch: int = 8, tenant: str = "default", watch: bool = False) -> None:
        self._engine = engine
        self._engine_options = dict(engine_options or {})
        self._repo = repo
        self._config = config
        self._max_batch = max_batch
        self._tenant_name = tenant
        self._watch = watch
        self._lock = threading.Lock()
        self._state: Any = None
        self._tenant: Any = None
        self._closed = False

    # ---- lifecycle ----------------------------------------------------------------------------

    def _ready(self) -> Any:
        with self._lock:
            if self._closed:
                raise _closed_error()
            if self._state is None:
                self._load()
            return self._state

    def _load(self) -> None:
        from ..api.state import build_state
        from ..errors import ConfigError

        state = build_state(self._config, repo=self._repo, engine=self._engine, engine_options=self._engine_options,
                            watch=self._watch, quiet=True, default_tenant=self._tenant_name,
                            max_batch=self._max_batch)
        if self._tenant_name not in state.tenants:
            state.close()
            raise ConfigError(f"tenant {self._tenant_name!r} is not in the config; its tenants are "
                              f"{', '.join(map(repr, state.tenants))}")
        self._state, self._tenant = state, state.tenants[self._tenant_name]

    @property
    def state(self) -> Any:
        """The ``ServerState`` (loads the engine if needed)."""
        return self._ready()

    @property
    def workspace(self) -> Any:
        """The ``Workspace`` of ``repo`` (None without one); loads the engine if needed."""
        self._ready()
        return self._tenant.workspace

    def close(self) -> None:
        with self._lock:
            self._closed = True
            state, self._state = self._state, None
        if state is not None:
            state.close()

    # ---- the API ------------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: dict | None = None, *, timeout: float | None = None) -> dict:
        from ..api import handling
        from ..api.protocol import APIError

        state = self._ready()
        try:
            if method == "GET":
                return self._get(state, path)
            if path == "/v1/sessions":
                return handling.create_session(state, self._tenant, _json.encode(body) if body else b"")
            prepared = handling.prepare(state, path, self._tenant, _json.encode(body or {}), stream=False)
            job, events = self._submit(state, prepared, timeout)
            try:
                while True:
                    kind, value = events.get()
                    if kind != "tokens":
                        return prepared.respond(handling.outcome(job, kind, value))
            finally:
                job.cancel()   # done already, or the caller was interrupted: the engine may stop
        except APIError as e:
            raise self._error(e, timeout) from None

    def stream(self, path: str, body: dict, *, timeout: float | None = None) -> EventStream:
        """Submits now (bad input raises here); iterate for the events. ``close()`` cancels the
        request at its next decode step, whether or not iteration started."""
        from ..api import handling
        from ..api.protocol import APIError

        state = self._ready()
        try:
            prepared = handling.prepare(state, path, self._tenant, _json.encode(body), stream=True)
            job, events = self._submit(state, prepared, timeout)
        except APIError as e:
            raise self._error(e, timeout) from None
        return EventStream(self._events(state, prepared, job, events, timeout), job.cancel)

    def _submit(self, state: Any, prepared: Any, timeout: float | None):
        from ..api import handling

        events: queue.SimpleQueue = queue.SimpleQueue()
        call = prepared.call
        limit = state.config.server.request_timeout_s
        deadline = call.t0 + (limit if timeout is None else min(timeout, limit))
        job = handling.submit(state, call, lambda kind, value: events.put((kind, value)), deadline=deadline)
        return job, events

    def _events(self, state: Any, prepared: Any, job: Any, events: queue.SimpleQueue,
                timeout: float | None) -> Iterator[dict]:
        from ..api.handling import StreamShaper

        shaper = StreamShaper(prepared, state.backend.tokenizer)
        try:
            yield from prepared.opening
            while True:
                kind, value = events.get()
                chunks, err, done = shaper.events(job, kind, value)
                yield from chunks
                if err is not None:
                    raise self._error(err, timeout)
                if done:
                    return
        finally:
            job.cancel()

    def _error(self, e: Any, timeout: float | None) -> Exception:
        """The exception the HTTP transport raises for this error response; a timeout the
        caller's ``timeout`` set (not the server's ``request_timeout_s``) is ``APITimeoutError``."""
        if e.code == "timeout" and timeout is not None and self._state is not None \
                and timeout <= self._state.config.server.request_timeout_s:
            return APITimeoutError(f"request timed out after {timeout} s", code="timeout")
        return error_for_status(e.status, e.body())

    def _get(self, state: Any, path: str) -> dict:
        from ..api import handling
        from ..api.protocol import APIError

        if path == "/v1/models":
            return {"object": "list", "data": [handling.model_card(state)]}
        if path.startswith("/v1/models/"):
            handling.check_model(state, path.removeprefix("/v1/models/"))
            return handling.model_card(state)
        if path.startswith("/v1/sessions/"):
            return handling.session_detail(state, self._tenant, path.removeprefix("/v1/sessions/"))
        if path == "/health":
            return handling.health(state)
        raise APIError(404, f"no route GET {path}", type="not_found_error", code="not_found")


class AsyncLocalTransport:
    """``LocalTransport`` for ``AsyncClient``: the engine's calls run in worker threads."""

    def __init__(self, **options: Any) -> None:
        self.local = LocalTransport(**options)

    async def request(self, method: str, path: str, body: dict | None = None, *, timeout: float | None = None) -> dict:
        return await asyncio.to_thread(self.local.request, method, path, body, timeout=timeout)

    async def stream(self, path: str, body: dict, *, timeout: float | None = None) -> AsyncEventStream:
        """One thread per stream pumps the events into the loop; closing the stream (whether or
        not iteration started), or cancelling the task iterating it, cancels the request at its
        next decode step."""
        events = await asyncio.to_thread(self.local.stream, path, body, timeout=timeout)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        closing = threading.Event()

        def put(item: tuple) -> None:
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:   # the loop is gone: nobody is listening any more
                closing.set()

        def pump() -> None:
            try:
                for event in events:
                    if closing.is_set():
                        return
                    put((True, event))
                put((False, None))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
                put((False, e))
            finally:
                events.close()   # here, in the thread that ran it: cancels the request if unfinished

        threading.Thread(target=pump, name="agentspec-sdk-stream", daemon=True).start()

        async def run() -> AsyncIterator[dict]:
            try:
                while True:
                    ok, value = await q.get()
                    if ok:
                        yield value
                    elif value is None:
                        return
                    else:
                        raise value
            finally:
                closing.set()
                events.release()   # thread-safe: the pump then ends at the job's last event

        async def release() -> None:
            closing.set()
            events.release()

        return AsyncEventStream(run(), release)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.local.close)
