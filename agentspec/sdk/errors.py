"""The SDK's exceptions, named as the ``openai`` client names them.

``AgentSpecAPIError`` (an ``agentspec.AgentSpecError``) is the base. A server's error envelope
``{"error": {"message", "type", "param", "code"}}`` becomes the subclass for its HTTP status
(``error_for_status``); in-process mode raises the same classes with the statuses a server
would answer with, so ``except agentspec.sdk.BadRequestError`` works in both modes.
"""

from __future__ import annotations

from typing import Any

from ..errors import AgentSpecError

__all__ = [
    "APIConnectionError",
    "APITimeoutError",
    "AgentSpecAPIError",
    "AuthenticationError",
    "BadRequestError",
    "FileChangedError",
    "InternalServerError",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "RequestTooLargeError",
    "ServiceUnavailableError",
    "error_for_status",
]


class AgentSpecAPIError(AgentSpecError):
    """A request failed. ``status``: the HTTP status (None when no response came); ``type``,
    ``param``, ``code``: the server's error envelope (``code`` e.g. "context_length_exceeded")."""

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None,
                 param: str | None = None, code: str | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.body = body

    def __str__(self) -> str:
        head = f"{self.status} " if self.status is not None else ""
        tail = f" (code={self.code}, param={self.param})" if self.code or self.param else ""
        return f"{head}{self.message}{tail}"


class BadRequestError(AgentSpecAPIError):
    """400: the request is malformed, or the prompt does not fit the context window
    (``code == "context_length_exceeded"``; the message names the limit)."""


class AuthenticationError(AgentSpecAPIError):
    """401: missing or wrong API key."""


class PermissionDeniedError(AgentSpecAPIError):
    """403: e.g. a path outside the tenant's workspace, a session owned by another tenant."""


class NotFoundError(AgentSpecAPIError):
    """404: unknown model, file or session."""


class RequestTooLargeError(AgentSpecAPIError):
    """413: the body (or the file to apply to) is over the server's limit."""


class RateLimitError(AgentSpecAPIError):
    """429: retried with backoff; raised when the retries ran out."""


class InternalServerError(AgentSpecAPIError):
    """5xx: the server failed (500) or timed the request out (504)."""


class ServiceUnavailableError(InternalServerError):
    """503: the server's queue is full or it is shutting down; retried with backoff first."""


class APIConnectionError(AgentSpecAPIError):
    """No response: the server could not be reached or dropped the connection."""


class APITimeoutError(APIConnectionError):
    """The client's timeout passed before the response (or the next streamed event) came."""


_BY_STATUS: dict[int, type[AgentSpecAPIError]] = {
    400: BadRequestError, 401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError,
    413: RequestTooLargeError, 429: RateLimitError, 503: ServiceUnavailableError,
}

# a streamed error event has no HTTP status of its own: the status its code stands for
_STATUS_OF_CODE = {"timeout": 504, "cancelled": 499, "internal_error": 500, "invalid_value": 400,
                   "context_length_exceeded": 400, "overloaded": 503, "shutting_down": 503}


def error_for_status(status: int | None, body: Any) -> AgentSpecAPIError:
    """The exception for an error response: ``status`` and its decoded JSON ``body`` (the
    envelope, or anything else a proxy may have answered with)."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message") or "")
        type_, param, code = err.get("type"), err.get("param"), err.get("code")
    else:
        message, type_, param, code = (str(body)[:500] if body else ""), None, None, None
    if status is None:
        status = _STATUS_OF_CODE.get(code or "", 500)
    cls = _BY_STATUS.get(status) or (InternalServerError if status >= 500 else AgentSpecAPIError)
    return cls(message or f"HTTP {status}", status=status, type=type_, param=param, code=code, body=body)


class FileChangedError(AgentSpecError):
    """``rewrite(write=True)``: the file changed on disk while the model rewrote it; nothing was written."""
