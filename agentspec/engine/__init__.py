"""Engines: the embedded torch engine (here) and SGLang (integrations/sglang).

``EmbeddedEngine`` (torch) loads on first use, so that ``agentspec.engine.base`` (the structs a
generation returns) and ``agentspec.backend`` stay importable without torch."""

from typing import TYPE_CHECKING, Any

from .base import DEFAULT_SPEC, Engine, Generation, GenerationStats

if TYPE_CHECKING:
    from .embedded import EmbeddedEngine

__all__ = ["DEFAULT_SPEC", "EmbeddedEngine", "Engine", "Generation", "GenerationStats"]


def __getattr__(name: str) -> Any:
    if name == "EmbeddedEngine":
        from .embedded import EmbeddedEngine

        return EmbeddedEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
