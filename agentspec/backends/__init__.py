"""Backends: what runs a request once the request layer (``agentspec.api``) has resolved it.

``protocol``: the ``Backend`` protocol, ``GenerationRequest`` and the request checks every
backend shares; ``engine``: the ``Engine`` facade (``Engine.embedded(...)``); ``embedded/``: the
torch engine, its batch scheduler and ``EmbeddedBackend``. What a generation returns
(``Generation``, ``GenerationStats``) is the decode step's (``agentspec.decode.results``). The SGLang backend
lives with the rest of SGLang (``agentspec.integrations.sglang.backend``).

``EmbeddedEngine`` (torch) loads on first use, so that ``engine`` and ``protocol`` stay
importable without torch."""

from typing import TYPE_CHECKING, Any

from .protocol import Backend, GenerationRequest
from ..decode.results import Generation, GenerationStats
from .engine import DEFAULT_SPEC, Engine

if TYPE_CHECKING:
    from .embedded.engine import EmbeddedEngine

__all__ = ["DEFAULT_SPEC", "Backend", "EmbeddedEngine", "Engine", "Generation", "GenerationRequest", "GenerationStats"]


def __getattr__(name: str) -> Any:
    if name == "EmbeddedEngine":
        from .embedded.engine import EmbeddedEngine

        return EmbeddedEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
