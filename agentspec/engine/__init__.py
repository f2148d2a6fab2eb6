"""Engines: the embedded torch engine (here) and SGLang (integrations/sglang)."""

from .base import DEFAULT_SPEC, Engine, Generation, GenerationStats
from .embedded import EmbeddedEngine

__all__ = ["DEFAULT_SPEC", "EmbeddedEngine", "Engine", "Generation", "GenerationStats"]
