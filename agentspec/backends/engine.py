"""The ``Engine`` role: what generates text for prompts (``Engine.embedded(...)`` builds the torch one)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..config import DEFAULT_SPEC, SpecConfig
from ..decode.results import Generation

if TYPE_CHECKING:
    from .embedded.engine import EmbeddedEngine

__all__ = ["DEFAULT_SPEC", "Engine"]


@runtime_checkable
class Engine(Protocol):
    """Generates text for prompts, speculating as ``spec`` says. ``EmbeddedEngine`` is one (it
    does not subclass this: a protocol knows no implementation); ``Engine.embedded(...)`` builds it."""

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        spec: SpecConfig | None = DEFAULT_SPEC,
        **options: Any,
    ) -> Generation: ...

    @staticmethod
    def embedded(**options: Any) -> "EmbeddedEngine":
        """The torch engine on CPU or one GPU; the bundled model unless ``model=PATH``."""
        from .embedded.engine import EmbeddedEngine

        return EmbeddedEngine(**options)
