"""The ``Engine`` role (``Engine.embedded(...)``) and the default speculation config."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any


from ..config import SpecConfig
from ..decode.results import Generation

if TYPE_CHECKING:
    from .embedded.engine import EmbeddedEngine

__all__ = ["DEFAULT_SPEC", "Engine"]

DEFAULT_SPEC = SpecConfig()


class Engine(abc.ABC):
    """Generates text for prompts, speculating as ``spec`` says."""

    @staticmethod
    def embedded(**options: Any) -> "EmbeddedEngine":
        """The torch engine on CPU or one GPU; the bundled model unless ``model=PATH``."""
        from .embedded.engine import EmbeddedEngine

        return EmbeddedEngine(**options)

    @abc.abstractmethod
    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        spec: SpecConfig | None = DEFAULT_SPEC,
        **options: Any,
    ) -> Generation: ...
