"""agentspec: model-free speculative decoding for coding agents."""

from . import _cpu_env

_cpu_env.apply()  # before anything imports torch


from .config import SpecConfig
from .drafting import Draft, Drafter, PromptLookupDrafter, SuffixDrafter, default_drafter
from .engine import EmbeddedEngine, Engine, Generation, GenerationStats
from .errors import AgentSpecError, ConfigError, ContextLengthError, InvalidRequestError, ModelLoadError
from .workspace import Workspace

__version__ = "0.1.0"

__all__ = [
    "AgentSpecError",
    "ConfigError",
    "ContextLengthError",
    "Draft",
    "Drafter",
    "EmbeddedEngine",
    "Engine",
    "Generation",
    "GenerationStats",
    "InvalidRequestError",
    "ModelLoadError",
    "PromptLookupDrafter",
    "SpecConfig",
    "SuffixDrafter",
    "Workspace",
    "__version__",
    "default_drafter",
]
