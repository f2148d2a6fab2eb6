"""agentspec: model-free speculative decoding for coding agents.

Importing the package is cheap: it loads neither torch nor the native kernels. The public names
below resolve on first use (PEP 562), so ``from agentspec import EmbeddedEngine`` loads the
engine (and torch) then, and ``from agentspec import Draft`` does not.
"""

from . import _cpu_env

_cpu_env.apply()  # before anything imports torch (it only sets environment variables)

from ._lazy import lazy_exports  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

from .errors import AgentSpecError, ConfigError, ContextLengthError, InvalidRequestError, ModelLoadError  # noqa: E402

if TYPE_CHECKING:
    from .config import SpecConfig
    from .sdk import AsyncClient, Client
    from .drafting import Draft, Drafter, PromptLookupDrafter, SuffixDrafter, default_drafter
    from .backends import Engine, Generation, GenerationStats
    from .workspace import Workspace

__version__ = "0.1.0"

__all__ = [
    "AgentSpecError",
    "AsyncClient",
    "Client",
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

# public name -> the submodule that defines it, imported on first access
_LAZY = {
    "SpecConfig": ".config",
    "Draft": ".drafting",
    "Drafter": ".drafting",
    "PromptLookupDrafter": ".drafting",
    "SuffixDrafter": ".drafting",
    "default_drafter": ".drafting",
    "EmbeddedEngine": ".backends",
    "Engine": ".backends",
    "Generation": ".backends",
    "GenerationStats": ".backends",
    "Workspace": ".workspace",
    "Client": ".sdk",            # the SDK (httpx; torch only once it runs the engine in-process)
    "AsyncClient": ".sdk",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)
