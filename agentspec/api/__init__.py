"""OpenAI-shaped request handling with no HTTP, shared by the server and the SDK's in-process mode.

``protocol``: the request structs and the error envelope; ``state``: ``ServerState`` and
``build_state``; ``handling``: parse, resolve (model, route, session, limits, prediction), submit
to a ``Backend``, shape responses and stream chunks, map errors; ``sessions`` and ``limits``: the
per-tenant session registry and rate limits; ``jobs``: a submitted request's events.
"""

from .protocol import APIError
from .state import ServerState, Tenant, build_state

__all__ = ["APIError", "ServerState", "Tenant", "build_state"]
