"""One error hierarchy for everything agentspec raises on purpose.

``AgentSpecError`` is the base. Errors caused by what the caller passed also derive from
``ValueError`` so that ordinary ``except ValueError`` code keeps working.
"""

from __future__ import annotations

__all__ = [
    "AgentSpecError",
    "BackendClosedError",
    "ConfigError",
    "ContextLengthError",
    "InvalidRequestError",
    "ModelLoadError",
    "QueueFullError",
]


class AgentSpecError(Exception):
    """Base class of every error agentspec raises deliberately."""


class ConfigError(AgentSpecError, ValueError):
    """A configuration value is invalid (names the field and the value)."""


class ModelLoadError(AgentSpecError):
    """A model checkpoint could not be found, read or understood."""


class InvalidRequestError(AgentSpecError, ValueError):
    """A generation request is malformed: empty prompt, bad token ids, bad sampling values..."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """The prompt (plus the requested new tokens) does not fit the model's context window."""


class BackendClosedError(AgentSpecError, RuntimeError):
    """The backend is shutting down or closed: the request was not taken (a server answers 503)."""


class QueueFullError(AgentSpecError):
    """A backend's queue is full: the request was not taken (a server answers 503; retry later)."""
