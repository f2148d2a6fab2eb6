"""Talking to a running server: httpx (sync and async) plus what httpx does not do for us:
retries with backoff on 429 / 503 / connection errors, the error envelope -> exceptions, and
server-sent events -> dicts.

A stream is retried only until its response starts; after that an error is raised as is.
Timeouts are httpx's (``timeout``: seconds, or an ``httpx.Timeout``); a read timeout is not
retried (the server may still be generating), it raises ``APITimeoutError``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from ._events import AsyncEventStream, EventStream
from .errors import AgentSpecAPIError, APIConnectionError, APITimeoutError, error_for_status

__all__ = ["AsyncHTTPTransport", "HTTPTransport", "api_root"]

RETRY_STATUSES = frozenset({429, 503})
INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0
MAX_RETRY_AFTER_S = 60.0


def api_root(base_url: str) -> str:
    """The server's root URL from a base URL given with or without the ``/v1`` suffix
    (``openai`` clients are configured with it)."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _headers(api_key: str | None, extra: dict[str, str] | None) -> dict[str, str]:
    h = {"User-Agent": "agentspec-sdk", **(extra or {})}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def _timeout(timeout: float | httpx.Timeout) -> httpx.Timeout:
    if isinstance(timeout, httpx.Timeout):
        return timeout
    return httpx.Timeout(timeout, connect=min(timeout, 10.0))


def backoff_delay(attempt: int, response: httpx.Response | None) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): the server's ``Retry-After`` when it
    sent one (capped), else exponential from ``INITIAL_BACKOFF_S`` with jitter."""
    if response is not None:
        ra = response.headers.get("retry-after")
        try:
            if ra is not None:
                return min(max(float(ra), 0.0), MAX_RETRY_AFTER_S)
        except ValueError:
            pass
    return min(INITIAL_BACKOFF_S * 2 ** attempt, MAX_BACKOFF_S) * random.uniform(0.75, 1.0)


def _error(response: httpx.Response, body: bytes) -> AgentSpecAPIError:
    try:
        decoded: Any = json.loads(body)
    except ValueError:
        decoded = body.decode("utf-8", "replace")
    return error_for_status(response.status_code, decoded)


def _transport_error(e: httpx.TransportError) -> APIConnectionError:
    if isinstance(e, httpx.TimeoutException):
        return APITimeoutError(f"request timed out: {type(e).__name__}: {e}")
    return APIConnectionError(f"connection error: {type(e).__name__}: {e}")


def _retryable(e: httpx.TransportError) -> bool:
    return not isinstance(e, (httpx.ReadTimeout, httpx.WriteTimeout))


_DONE: dict = {}   # what ``_event`` returns for ``data: [DONE]`` (compared by identity)


def _event(line: str) -> dict | None:
    """One server-sent event line: its JSON event, ``_DONE`` for ``data: [DONE]``, None for a
    line that is not data; an error event raises its exception."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return _DONE
    event = json.loads(data)
    if isinstance(event, dict) and "error" in event:
        raise error_for_status(None, event)
    return event


def _cut_off() -> APIConnectionError:
    return APIConnectionError("the stream was cut off: the response ended before data: [DONE]")


def _events(lines: Iterator[str]) -> Iterator[dict]:
    """The JSON events of a server-sent event stream up to ``data: [DONE]``; an error event
    raises its exception, and so does a stream that ends without ``[DONE]`` (the connection
    was cut: ``APIConnectionError``)."""
    for line in lines:
        event = _event(line)
        if event is _DONE:
            return
        if event is not None:
            yield event
    raise _cut_off()


class HTTPTransport:
    """Requests to a server, as JSON dicts, with retries."""

    def __init__(self, base_url: str, *, api_key: str | None, timeout: float | httpx.Timeout, max_retries: int,
                 headers: dict[str, str] | None = None, http_client: httpx.Client | None = None) -> None:
        self.root = api_root(base_url)
        self.max_retries = max_retries
        self._own = http_client is None
        self.http = http_client or httpx.Client(timeout=_timeout(timeout))
        self.headers = _headers(api_key, headers)

    def _send(self, method: str, path: str, body: dict | None, timeout: Any, stream: bool) -> httpx.Response:
        req = self.http.build_request(method, self.root + path, json=body, headers=self.headers,
                                      timeout=_timeout(timeout) if timeout is not None else httpx.USE_CLIENT_DEFAULT)
        attempt = 0
        while True:
            try:
                response = self.http.send(req, stream=stream)
            except httpx.TransportError as e:
                if attempt >= self.max_retries or not _retryable(e):
                    raise _transport_error(e) from e
                time.sleep(backoff_delay(attempt, None))
                attempt += 1
                continue
            if response.status_code < 400:
                return response
            data = response.read()
            response.close()
            if response.status_code in RETRY_STATUSES and attempt < self.max_retries:
                time.sleep(backoff_delay(attempt, response))
                attempt += 1
                continue
            raise _error(response, data)

    def request(self, method: str, path: str, body: dict | None = None, *, timeout: Any = None) -> dict:
        response = self._send(method, path, body, timeout, stream=False)
        return response.json()

    def stream(self, path: str, body: dict, *, timeout: Any = None) -> EventStream:
        """Sends now (errors before the stream raise here); iterate for the events. ``close()``
        closes the response (the server cancels the request), whether or not iteration started."""
        response = self._send("POST", path, body, timeout, stream=True)

        def events() -> Iterator[dict]:
            try:
                yield from _events(response.iter_lines())
            except httpx.TransportError as e:
                raise _transport_error(e) from e
            finally:
                response.close()

        return EventStream(events(), response.close)

    def close(self) -> None:
        if self._own:
            self.http.close()


class AsyncHTTPTransport:
    """``HTTPTransport`` on ``httpx.AsyncClient``."""

    def __init__(self, base_url: str, *, api_key: str | None, timeout: float | httpx.Timeout, max_retries: int,
                 headers: dict[str, str] | None = None, http_client: httpx.AsyncClient | None = None) -> None:
        self.root = api_root(base_url)
        self.max_retries = max_retries
        self._own = http_client is None
        self.http = http_client or httpx.AsyncClient(timeout=_timeout(timeout))
        self.headers = _headers(api_key, headers)

    async def _send(self, method: str, path: str, body: dict | None, timeout: Any, stream: bool) -> httpx.Response:
        req = self.http.build_request(method, self.root + path, json=body, headers=self.headers,
                                      timeout=_timeout(timeout) if timeout is not None else httpx.USE_CLIENT_DEFAULT)
        attempt = 0
        while True:
            try:
                response = await self.http.send(req, stream=stream)
            except httpx.TransportError as e:
                if attempt >= self.max_retries or not _retryable(e):
                    raise _transport_error(e) from e
                await asyncio.sleep(backoff_delay(attempt, None))
                attempt += 1
                continue
            if response.status_code < 400:
                return response
            data = await response.aread()
            await response.aclose()
            if response.status_code in RETRY_STATUSES and attempt < self.max_retries:
                await asyncio.sleep(backoff_delay(attempt, response))
                attempt += 1
                continue
            raise _error(response, data)

    async def request(self, method: str, path: str, body: dict | None = None, *, timeout: Any = None) -> dict:
        response = await self._send(method, path, body, timeout, stream=False)
        return response.json()

    async def stream(self, path: str, body: dict, *, timeout: Any = None) -> AsyncEventStream:
        """``HTTPTransport.stream``."""
        response = await self._send("POST", path, body, timeout, stream=True)

        async def events() -> AsyncIterator[dict]:
            try:
                async for line in response.aiter_lines():
                    event = _event(line)
                    if event is _DONE:
                        return
                    if event is not None:
                        yield event
                raise _cut_off()
            except httpx.TransportError as e:
                raise _transport_error(e) from e
            finally:
                await response.aclose()

        return AsyncEventStream(events(), response.aclose)

    async def aclose(self) -> None:
        if self._own:
            await self.http.aclose()
