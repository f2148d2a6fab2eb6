"""``Client`` and ``AsyncClient``: chat, complete, apply and rewrite for code that drives an agent loop.

With ``base_url`` (or ``$AGENTSPEC_BASE_URL``) they talk to a running ``agentspec serve``; without,
they run the embedded engine in this process (loaded on the first call). Both modes take the same
arguments and return the same Structs (``agentspec.sdk.types``); errors are the same exceptions
(``agentspec.sdk.errors``). Conventions follow the ``openai`` client: ``base_url`` with or
without ``/v1``, ``api_key``, ``timeout``, ``max_retries``, ``stream=True`` returns an iterator,
``with`` closes.
"""

from __future__ import annotations

import difflib
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from suffix_index.atomic import write_atomic

from ._events import AsyncEventStream, EventStream
from .errors import FileChangedError
from .types import ApplyResult, ChatResult, CompletionResult, RewriteResult, result_from_body

__all__ = ["AsyncClient", "AsyncSession", "AsyncStream", "Client", "Session", "Stream"]

R = TypeVar("R")
Messages = Sequence[dict[str, Any]] | str
_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "apply": "/v1/apply"}
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_MAX_RETRIES = 2


def new_session_id() -> str:
    return f"sess-{secrets.token_hex(8)}"


# ---- request bodies (what the server's protocol structs accept) ---------------------------------------------

def _messages(messages: Messages) -> list[dict[str, Any]]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    return [dict(m) for m in messages]


def _sampling(*, model: str | None, max_tokens: int | None, temperature: float | None, top_p: float | None,
              top_k: int | None, seed: int | None, stop: str | list[str] | None, prediction: str | None,
              session_id: str | None, speculation: bool | None, stream: bool, extra_body: dict | None) -> dict:
    body: dict[str, Any] = {"spec_stats": True}
    for k, v in (("model", model), ("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                 ("top_k", top_k), ("seed", seed), ("stop", stop), ("prompt_cache_key", session_id),
                 ("speculation", speculation)):
        if v is not None:
            body[k] = v
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return {**body, **(extra_body or {})}


def _apply_body(*, code: str | None, path: str | None, update: str | None, instruction: str | None, model: str | None,
                max_tokens: int | None, temperature: float | None, seed: int | None, speculation: bool | None,
                session_id: str | None, stream: bool, extra_body: dict | None) -> dict:
    body: dict[str, Any] = {}
    for k, v in (("code", code), ("path", path), ("update", update), ("instruction", instruction), ("model", model),
                 ("max_tokens", max_tokens), ("temperature", temperature), ("seed", seed),
                 ("speculation", speculation), ("prompt_cache_key", session_id)):
        if v is not None:
            body[k] = v
    if stream:
        body["stream"] = True
    return {**body, **(extra_body or {})}


# ---- streams ---------------------------------------------------------------------------------------------------

class _Assembler:
    """Folds a stream's events into the body a non-streamed response would have had."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.parts: list[str] = []
        self.body: dict[str, Any] = {}
        self.finish_reason: str | None = None

    def feed(self, event: dict) -> str:
        for k in ("id", "model", "path", "merged_code"):
            if k in event:
                self.body[k] = event[k]
        for k in ("usage", "spec"):
            if event.get(k):
                self.body[k] = event[k]
        if self.kind == "apply":
            delta = event.get("delta") or ""
            if event.get("finish_reason"):
                self.finish_reason = event["finish_reason"]
        else:
            choices = event.get("choices") or [{}]
            c = choices[0]
            delta = ((c.get("delta") or {}).get("content") if self.kind == "chat" else c.get("text")) or ""
            if c.get("finish_reason"):
                self.finish_reason = c["finish_reason"]
        if delta:
            self.parts.append(delta)
        return delta

    def assembled(self) -> dict:
        text = "".join(self.parts)
        if self.kind == "apply":
            return {**self.body, "finish_reason": self.finish_reason}
        field = {"message": {"role": "assistant", "content": text}} if self.kind == "chat" else {"text": text}
        return {**self.body, "choices": [{"index": 0, **field, "finish_reason": self.finish_reason}]}


class _StreamBase(Generic[R]):
    def __init__(self, kind: str, t0: float, session_id: str | None,
                 on_done: Callable[[Any], None] | None, on_abandon: Callable[[], None] | None) -> None:
        self._asm = _Assembler(kind)
        self._t0 = t0
        self._session_id = session_id
        self._on_done = on_done
        self._on_abandon = on_abandon
        self.ttft_ms: float | None = None      # client-side: the call to the first text
        self.result: R | None = None           # set once the stream ended
        self.completion_tokens = 0             # apply streams: tokens committed so far
        self.steps = 0                         # apply streams: decode steps so far (MAT = tokens / steps)

    @property
    def text(self) -> str:
        """The text received so far."""
        return "".join(self._asm.parts)

    def _delta(self, event: dict) -> str:
        if "steps" in event:
            self.completion_tokens, self.steps = event.get("completion_tokens", 0), event["steps"]
        delta = self._asm.feed(event)
        if delta and self.ttft_ms is None:
            self.ttft_ms = (time.perf_counter() - self._t0) * 1e3
        return delta

    def _finish(self) -> None:
        latency = (time.perf_counter() - self._t0) * 1e3
        self.result = result_from_body(self._asm.kind, self._asm.assembled(), latency_ms=latency,
                                       ttft_ms=self.ttft_ms if self.ttft_ms is not None else latency,
                                       session_id=self._session_id)
        if self._on_done is not None:
            self._on_done(self.result)

    def _abandon(self) -> None:
        """The stream ended without a result (it failed, or was closed before its end): ``on_abandon``, once."""
        if self.result is None and self._on_abandon is not None:
            on_abandon, self._on_abandon = self._on_abandon, None
            on_abandon()


class Stream(_StreamBase[R]):
    """``stream=True``: iterate for the text as it comes (``str`` deltas; for ``apply``, of the
    model's raw answer). ``final()`` reads the rest and returns the result (``ttft_ms`` set);
    ``close()`` (or leaving ``with``) before the end cancels the request, whether or not
    iteration started. A stream cut off before its end raises ``APIConnectionError``."""

    def __init__(self, events: EventStream, kind: str, t0: float, session_id: str | None = None,
                 on_done: Callable[[Any], None] | None = None, on_abandon: Callable[[], None] | None = None) -> None:
        super().__init__(kind, t0, session_id, on_done, on_abandon)
        self._events = events

    def __iter__(self) -> Iterator[str]:
        try:
            for event in self._events:
                delta = self._delta(event)
                if delta:
                    yield delta
            if self.result is None:
                self._finish()
        except GeneratorExit:   # this iterator dropped (a ``break``): the stream may be read on
            raise
        except BaseException:
            self._abandon()
            raise

    def final(self) -> R:
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def close(self) -> None:
        try:
            self._events.close()
        finally:
            self._abandon()

    def __enter__(self) -> "Stream[R]":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncStream(_StreamBase[R]):
    """``Stream`` for ``AsyncClient``: ``async for delta in stream``; ``await stream.final()``;
    ``await stream.aclose()`` (or leaving ``async with``)."""

    def __init__(self, events: AsyncEventStream, kind: str, t0: float, session_id: str | None = None,
                 on_done: Callable[[Any], None] | None = None, on_abandon: Callable[[], None] | None = None) -> None:
        super().__init__(kind, t0, session_id, on_done, on_abandon)
        self._events = events

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            async for event in self._events:
                delta = self._delta(event)
                if delta:
                    yield delta
            if self.result is None:
                self._finish()
        except GeneratorExit:
            raise
        except BaseException:
            self._abandon()
            raise

    async def final(self) -> R:
        async for _ in self:
            pass
        assert self.result is not None
        return self.result

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            self._abandon()

    async def __aenter__(self) -> "AsyncStream[R]":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()


# ---- rewrite: the diff and the atomic write ------------------------------------------------------------------------

def _read_text(path: Path) -> str:
    with open(path, encoding="utf-8", newline="") as f:   # CRLF kept, as the server reads files
        return f.read()


def _diff(old: str, new: str, name: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                        fromfile=f"a/{name}", tofile=f"b/{name}"))


def _rewrite_result(path: Path, original: str, result: ApplyResult, write: bool) -> RewriteResult:
    diff = _diff(original, result.merged_code, path.name)
    written = False
    if write and diff and result.finish_reason == "stop":   # a merge cut off at max_tokens is not a file
        if _read_text(path) != original:
            raise FileChangedError(f"{str(path)!r} changed on disk while it was being rewritten; not written")
        write_atomic(path, result.merged_code)
        written = True
    return RewriteResult(path=str(path), merged_code=result.merged_code, diff=diff, written=written, result=result)


# ---- the clients ----------------------------------------------------------------------------------------------------

class _Options:
    """What both clients take. See ``Client``."""

    def __init__(self, base_url: str | None, api_key: str | None, model: str | None) -> None:
        self.base_url = base_url if base_url is not None else (os.environ.get("AGENTSPEC_BASE_URL") or None)
        self.api_key = api_key if api_key is not None else os.environ.get("AGENTSPEC_API_KEY")
        self.model = model

    @property
    def in_process(self) -> bool:
        return self.base_url is None


def _transport(opts: Any, *, asynchronous: bool, timeout: Any, max_retries: int, headers: dict | None,
               http_client: Any, engine: Any, engine_options: dict | None, repo: Any, config: Any, watch: bool) -> Any:
    """The transport ``Client`` / ``AsyncClient`` talk through: in process (the request layer
    over an embedded engine) or HTTP, sync or async."""
    if opts.in_process:
        from ._local import AsyncLocalTransport, LocalTransport

        return (AsyncLocalTransport if asynchronous else LocalTransport)(
            engine=engine, engine_options=engine_options, repo=repo, config=config, watch=watch)
    from ._http import AsyncHTTPTransport, HTTPTransport

    return (AsyncHTTPTransport if asynchronous else HTTPTransport)(
        opts.base_url, api_key=opts.api_key, timeout=timeout, max_retries=max_retries, headers=headers,
        http_client=http_client)


class Client:
    """A client of agentspec, for agent loops.

    ``base_url``: a server (``http://host:8000`` or ``.../v1``; default ``$AGENTSPEC_BASE_URL``);
    None runs the embedded engine in this process (``engine``: one already loaded, else it is
    loaded on the first call with ``engine_options``; ``repo``: a folder indexed for drafts and
    for ``apply(path=...)``; ``config``: a server config (TOML path or ``ServerConfig``) for its
    routes). ``api_key``: default ``$AGENTSPEC_API_KEY``. ``model``: sent with each request
    (None: the server's). ``timeout``: seconds (or an ``httpx.Timeout``) per request;
    ``max_retries``: retries on 429, 503 and connection errors, with exponential backoff
    (``Retry-After`` honoured). ``http_client``: an ``httpx.Client`` to use (not closed here)."""

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None, model: str | None = None,
                 timeout: Any = DEFAULT_TIMEOUT_S, max_retries: int = DEFAULT_MAX_RETRIES,
                 default_headers: dict[str, str] | None = None, http_client: Any = None, engine: Any = None,
                 engine_options: dict | None = None, repo: str | os.PathLike | None = None,
                 config: Any = None, watch: bool = False) -> None:
        opts = _Options(base_url, api_key, model)
        self.base_url, self.model, self.timeout = opts.base_url, model, timeout
        self._transport: Any = _transport(opts, asynchronous=False, timeout=timeout, max_retries=max_retries,
                                          headers=default_headers, http_client=http_client, engine=engine,
                                          engine_options=engine_options, repo=repo, config=config, watch=watch)

    @property
    def in_process(self) -> bool:
        return self.base_url is None

    @property
    def workspace(self) -> Any:
        """In-process with ``repo``: its ``agentspec.Workspace`` (the engine is loaded first if it
        was not yet), e.g. for ``overlay(path, text)``; None otherwise."""
        local = getattr(self._transport, "local", self._transport)
        return local.workspace if self.in_process else None

    def _timeout(self, timeout: Any) -> Any:
        t = self.timeout if timeout is None else timeout
        if self.in_process and t is not None and not isinstance(t, (int, float)):
            t = t.read   # an httpx.Timeout: in-process there is only the generation to time
        return t

    def _call(self, kind: str, body: dict, stream: bool, timeout: Any, session_id: str | None,
              on_done: Callable[[Any], None] | None = None,
              on_abandon: Callable[[], None] | None = None) -> Any:
        """One request; ``on_done(result)`` when it succeeded; for a stream, ``on_abandon()`` when it
        ends without a result (failed, or closed before its end)."""
        t0 = time.perf_counter()
        if stream:
            events = self._transport.stream(_PATHS[kind], body, timeout=self._timeout(timeout))
            return Stream(events, kind, t0, session_id, on_done, on_abandon)
        data = self._transport.request("POST", _PATHS[kind], body, timeout=self._timeout(timeout))
        result = result_from_body(kind, data, latency_ms=(time.perf_counter() - t0) * 1e3, session_id=session_id)
        if on_done is not None:
            on_done(result)
        return result

    def chat(self, messages: Messages, *, max_tokens: int | None = None, temperature: float | None = None,
             top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
             stop: str | list[str] | None = None, prediction: str | None = None, session_id: str | None = None,
             speculation: bool | None = None, stream: bool = False, model: str | None = None, timeout: Any = None,
             extra_body: dict | None = None) -> ChatResult | Stream[ChatResult]:
        """A chat completion. ``messages``: ``[{"role", "content"}, ...]`` or one user message as a
        string. ``prediction``: text the answer is expected to repeat (drafts come from it).
        ``session_id``: the agent loop's session (sent as ``prompt_cache_key``). ``speculation=False``:
        plain decoding. ``temperature``: None is the server's default (1.0, as OpenAI's)."""
        body = {"messages": _messages(messages),
                **_sampling(model=model or self.model, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed, stop=stop, prediction=prediction, session_id=session_id,
                            speculation=speculation, stream=stream, extra_body=extra_body)}
        return self._call("chat", body, stream, timeout, session_id)

    def complete(self, prompt: str | list[int], *, max_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                 stop: str | list[str] | None = None, prediction: str | None = None, session_id: str | None = None,
                 speculation: bool | None = None, stream: bool = False, model: str | None = None,
                 timeout: Any = None, extra_body: dict | None = None) -> CompletionResult | Stream[CompletionResult]:
        """A raw completion: ``prompt`` (text without a chat template, or token ids) continued.
        ``max_tokens``: None is the server's default (16, as OpenAI's)."""
        body = {"prompt": prompt,
                **_sampling(model=model or self.model, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed, stop=stop, prediction=prediction, session_id=session_id,
                            speculation=speculation, stream=stream, extra_body=extra_body)}
        return self._call("completion", body, stream, timeout, session_id)

    def apply(self, *, code: str | None = None, path: str | None = None, update: str | None = None,
              instruction: str | None = None, max_tokens: int | None = None, temperature: float | None = None,
              seed: int | None = None, speculation: bool | None = None, session_id: str | None = None,
              stream: bool = False, model: str | None = None, timeout: Any = None,
              extra_body: dict | None = None) -> ApplyResult | Stream[ApplyResult]:
        """Fast apply: merge ``update`` (an edit snippet) and/or ``instruction`` into ``code``, or
        into the workspace file at ``path`` (the server's workspace; in-process, ``repo``). The
        original is the draft source; ``merged_code`` is the file only. Nothing is written."""
        body = _apply_body(code=code, path=path, update=update, instruction=instruction, model=model or self.model,
                           max_tokens=max_tokens, temperature=temperature, seed=seed, speculation=speculation,
                           session_id=session_id, stream=stream, extra_body=extra_body)
        return self._call("apply", body, stream, timeout, session_id)

    def rewrite(self, path: str | os.PathLike, instruction: str | None = None, *, update: str | None = None,
                write: bool = False, **options: Any) -> RewriteResult:
        """Rewrite the local file at ``path`` as ``instruction`` (and/or ``update``) says: its text
        goes to ``apply(code=...)``. Returns the merged file and its unified diff; with
        ``write=True`` the file is replaced atomically (same mode) when the merge changed it and
        was not cut off at ``max_tokens``; ``FileChangedError`` if it changed on disk meanwhile.
        ``options``: ``apply``'s (``max_tokens``, ``temperature``, ``session_id``, ...)."""
        p = Path(path)
        original = _read_text(p)
        result = self.apply(code=original, update=update, instruction=instruction, **options)
        return _rewrite_result(p, original, result, write)

    def session(self, *, system: str | None = None, session_id: str | None = None,
                messages: Sequence[dict[str, Any]] = (), **defaults: Any) -> "Session":
        """A conversation that keeps its messages and session id: ``s.chat("...")`` sends the
        history plus the new message and appends the reply. ``defaults``: ``chat`` options for
        every turn (``temperature=0``, ``max_tokens=...``)."""
        return Session(self, system=system, session_id=session_id, messages=messages, **defaults)

    def models(self) -> list[dict[str, Any]]:
        """The served models (``/v1/models``' ``data``)."""
        return self._transport.request("GET", "/v1/models")["data"]

    def health(self) -> dict[str, Any]:
        return self._transport.request("GET", "/health")

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncClient:
    """``Client`` for asyncio: the same arguments (``http_client``: an ``httpx.AsyncClient``);
    every call is awaited; ``stream=True`` returns an ``AsyncStream``. In-process, the engine's
    calls run in worker threads."""

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None, model: str | None = None,
                 timeout: Any = DEFAULT_TIMEOUT_S, max_retries: int = DEFAULT_MAX_RETRIES,
                 default_headers: dict[str, str] | None = None, http_client: Any = None, engine: Any = None,
                 engine_options: dict | None = None, repo: str | os.PathLike | None = None,
                 config: Any = None, watch: bool = False) -> None:
        opts = _Options(base_url, api_key, model)
        self.base_url, self.model, self.timeout = opts.base_url, model, timeout
        self._transport: Any = _transport(opts, asynchronous=True, timeout=timeout, max_retries=max_retries,
                                          headers=default_headers, http_client=http_client, engine=engine,
                                          engine_options=engine_options, repo=repo, config=config, watch=watch)

    in_process = Client.in_process
    workspace = Client.workspace
    _timeout = Client._timeout

    async def _call(self, kind: str, body: dict, stream: bool, timeout: Any, session_id: str | None,
                    on_done: Callable[[Any], None] | None = None,
                    on_abandon: Callable[[], None] | None = None) -> Any:
        """``Client._call``."""
        t0 = time.perf_counter()
        if stream:
            events = await self._transport.stream(_PATHS[kind], body, timeout=self._timeout(timeout))
            return AsyncStream(events, kind, t0, session_id, on_done, on_abandon)
        data = await self._transport.request("POST", _PATHS[kind], body, timeout=self._timeout(timeout))
        result = result_from_body(kind, data, latency_ms=(time.perf_counter() - t0) * 1e3, session_id=session_id)
        if on_done is not None:
            on_done(result)
        return result

    async def chat(self, messages: Messages, *, max_tokens: int | None = None, temperature: float | None = None,
                   top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                   stop: str | list[str] | None = None, prediction: str | None = None, session_id: str | None = None,
                   speculation: bool | None = None, stream: bool = False, model: str | None = None,
                   timeout: Any = None, extra_body: dict | None = None) -> ChatResult | AsyncStream[ChatResult]:
        """``Client.chat``."""
        body = {"messages": _messages(messages),
                **_sampling(model=model or self.model, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed, stop=stop, prediction=prediction, session_id=session_id,
                            speculation=speculation, stream=stream, extra_body=extra_body)}
        return await self._call("chat", body, stream, timeout, session_id)

    async def complete(self, prompt: str | list[int], *, max_tokens: int | None = None,
                       temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                       seed: int | None = None, stop: str | list[str] | None = None, prediction: str | None = None,
                       session_id: str | None = None, speculation: bool | None = None, stream: bool = False,
                       model: str | None = None, timeout: Any = None,
                       extra_body: dict | None = None) -> CompletionResult | AsyncStream[CompletionResult]:
        """``Client.complete``."""
        body = {"prompt": prompt,
                **_sampling(model=model or self.model, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed, stop=stop, prediction=prediction, session_id=session_id,
                            speculation=speculation, stream=stream, extra_body=extra_body)}
        return await self._call("completion", body, stream, timeout, session_id)

    async def apply(self, *, code: str | None = None, path: str | None = None, update: str | None = None,
                    instruction: str | None = None, max_tokens: int | None = None, temperature: float | None = None,
                    seed: int | None = None, speculation: bool | None = None, session_id: str | None = None,
                    stream: bool = False, model: str | None = None, timeout: Any = None,
                    extra_body: dict | None = None) -> ApplyResult | AsyncStream[ApplyResult]:
        """``Client.apply``."""
        body = _apply_body(code=code, path=path, update=update, instruction=instruction, model=model or self.model,
                           max_tokens=max_tokens, temperature=temperature, seed=seed, speculation=speculation,
                           session_id=session_id, stream=stream, extra_body=extra_body)
        return await self._call("apply", body, stream, timeout, session_id)

    async def rewrite(self, path: str | os.PathLike, instruction: str | None = None, *, update: str | None = None,
                      write: bool = False, **options: Any) -> RewriteResult:
        """``Client.rewrite``."""
        p = Path(path)
        original = _read_text(p)
        result = await self.apply(code=original, update=update, instruction=instruction, **options)
        return _rewrite_result(p, original, result, write)

    def session(self, *, system: str | None = None, session_id: str | None = None,
                messages: Sequence[dict[str, Any]] = (), **defaults: Any) -> "AsyncSession":
        """``Client.session``; ``await s.chat(...)``."""
        return AsyncSession(self, system=system, session_id=session_id, messages=messages, **defaults)

    async def models(self) -> list[dict[str, Any]]:
        return (await self._transport.request("GET", "/v1/models"))["data"]

    async def health(self) -> dict[str, Any]:
        return await self._transport.request("GET", "/health")

    async def close(self) -> None:
        await self._transport.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


# ---- sessions ----------------------------------------------------------------------------------------------------------

_TURN_OPTIONS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "prediction", "speculation",
                           "model", "timeout", "extra_body"})


class _SessionBase:
    def __init__(self, client: Any, *, system: str | None, session_id: str | None,
                 messages: Sequence[dict[str, Any]], **defaults: Any) -> None:
        self.client = client
        self.id = session_id or new_session_id()
        self.messages: list[dict[str, Any]] = []
        if system is not None:
            self.messages.append({"role": "system", "content": system})
        self.messages.extend(dict(m) for m in messages)
        unknown = sorted(set(defaults) - _TURN_OPTIONS)
        if unknown:
            raise TypeError(f"unknown chat option(s) {unknown}; known: {sorted(_TURN_OPTIONS)}")
        self.defaults = defaults
        self.results: list[Any] = []     # every turn's result, in order

    def add(self, role: str, content: str) -> None:
        """Append a message without asking the model (e.g. an observation from a command)."""
        self.messages.append({"role": role, "content": content})

    def _begin(self, content: str | None, role: str) -> tuple[Callable[[], None], Callable[[Any], None]]:
        """Adds the turn's message; returns ``(rollback, on_done)``: ``rollback()`` takes the
        message out again (the turn failed), ``on_done(result)`` appends the reply."""
        added = [{"role": role, "content": content}] if content is not None else []
        self.messages.extend(added)

        def rollback() -> None:
            # by identity: messages ``add``ed meanwhile (a stream is read at leisure) stay
            self.messages[:] = [m for m in self.messages if not any(m is a for a in added)]

        def on_done(result: ChatResult) -> None:
            self.messages.append(result.message)
            self.results.append(result)

        return rollback, on_done

    def _options(self, options: dict) -> dict:
        unknown = sorted(set(options) - _TURN_OPTIONS)
        if unknown:
            raise TypeError(f"unknown chat option(s) {unknown}; known: {sorted(_TURN_OPTIONS)}")
        return {**self.defaults, **options, "session_id": self.id}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, messages={len(self.messages)})"


class Session(_SessionBase):
    """``Client.session``: a conversation with one session id. ``chat(content)`` appends
    ``content`` as a user message, sends the history, and appends the reply; a request that
    fails (e.g. the history outgrew the context window: ``BadRequestError`` with code
    "context_length_exceeded") leaves the history as it was, and so does a streamed turn that
    fails midway or is closed before its end. ``apply`` / ``rewrite`` run under the same
    session id and leave the history alone."""

    def chat(self, content: str | None = None, *, role: str = "user", stream: bool = False,
             **options: Any) -> ChatResult | Stream[ChatResult]:
        opts = self._options(options)
        rollback, on_done = self._begin(content, role)
        try:
            return self.client._call("chat", self._body(opts, stream=stream), stream, opts.get("timeout"), self.id,
                                     on_done, rollback)
        except BaseException:
            rollback()
            raise

    def _body(self, opts: dict, stream: bool = False) -> dict:
        opts = {k: v for k, v in opts.items() if k != "timeout"}
        model = opts.pop("model", None) or self.client.model
        return {"messages": [dict(m) for m in self.messages],
                **_sampling(model=model, stream=stream, **{k: opts.get(k) for k in (
                    "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "prediction", "session_id",
                    "speculation", "extra_body")})}

    def apply(self, **options: Any) -> ApplyResult | Stream[ApplyResult]:
        return self.client.apply(**{**options, "session_id": self.id})

    def rewrite(self, path: str | os.PathLike, instruction: str | None = None, **options: Any) -> RewriteResult:
        return self.client.rewrite(path, instruction, **{**options, "session_id": self.id})

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class AsyncSession(_SessionBase):
    """``Session`` for ``AsyncClient``."""

    _body = Session._body

    async def chat(self, content: str | None = None, *, role: str = "user", stream: bool = False,
                   **options: Any) -> ChatResult | AsyncStream[ChatResult]:
        opts = self._options(options)
        rollback, on_done = self._begin(content, role)
        try:
            return await self.client._call("chat", self._body(opts, stream=stream), stream, opts.get("timeout"),
                                           self.id, on_done, rollback)
        except BaseException:
            rollback()
            raise

    async def apply(self, **options: Any) -> ApplyResult | AsyncStream[ApplyResult]:
        return await self.client.apply(**{**options, "session_id": self.id})

    async def rewrite(self, path: str | os.PathLike, instruction: str | None = None, **options: Any) -> RewriteResult:
        return await self.client.rewrite(path, instruction, **{**options, "session_id": self.id})

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        pass
