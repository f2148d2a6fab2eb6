"""The Python SDK for agent loops: ``Client`` / ``AsyncClient`` over a running server or the
embedded engine in this process, typed results (``types``), one exception hierarchy
(``errors``), sessions, fast apply and file rewrites, and a mini-swe-agent ``Model``
(``agentspec.sdk.minisweagent``)."""

from .client import AsyncClient, AsyncSession, AsyncStream, Client, Session, Stream
from .errors import (
    AgentSpecAPIError,
    APIConnectionError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    FileChangedError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
    ServiceUnavailableError,
)
from .types import ApplyResult, ChatResult, CompletionResult, RewriteResult, SpecStats, Usage

__all__ = [
    "APIConnectionError",
    "APITimeoutError",
    "AgentSpecAPIError",
    "ApplyResult",
    "AsyncClient",
    "AsyncSession",
    "AsyncStream",
    "AuthenticationError",
    "BadRequestError",
    "ChatResult",
    "Client",
    "CompletionResult",
    "FileChangedError",
    "InternalServerError",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "RequestTooLargeError",
    "RewriteResult",
    "ServiceUnavailableError",
    "Session",
    "SpecStats",
    "Stream",
    "Usage",
]
