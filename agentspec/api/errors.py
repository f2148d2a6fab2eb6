"""Error envelopes, one per wire protocol: an ``APIError`` as the body its client expects.

OpenAI (Chat Completions, Completions, Responses): ``{"error": {message, type, param, code}}``.
Anthropic (Messages): ``{"type": "error", "error": {"type", "message"}}``, its error types by status.
"""

from __future__ import annotations

from .protocol import APIError

__all__ = ["anthropic_error_type", "error_envelope"]

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "api_error")


def error_envelope(e: APIError, wire: str = "openai") -> dict:
    if wire == "anthropic":
        return {"type": "error", "error": {"type": anthropic_error_type(e.status), "message": e.message}}
    return e.body()
