"""The drafter registry: the one place drafter names are defined.

A route (``[[routes]] drafters = [...]`` in the server config) names its drafters here:

- ``"suffix"``: the suffix index (request context, tenant outputs, tenant workspace); the
  default. It drafts from the index the server shares between requests (tenants stay isolated).
- ``"lookahead"``: the lookahead n-gram pool alone (the request's and its tenant's outputs).
- ``"prompt_lookup"``: prompt lookup over the request's own context alone.

A list of several entries means those drafters merged into one tree (``MergedDrafter``):
``["suffix", "lookahead"]`` is suffix + lookahead. An entry ``"A>B"`` is drafter A backed by
drafter B (``FallbackDrafter``, mode "switch": B's draft replaces A's when B expects more accepted
tokens); ``"A>B>C"`` is A backed by (B backed by C). Each drafter may appear once per route.

``build_drafter(names, index=...)`` builds what a route names; ``register`` adds a drafter (a
draft model such as EAGLE-3 will register here, then be named e.g. ``"suffix>eagle3"``).
Importing this module loads no drafter: the factories import their modules when called.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .draft import Drafter

__all__ = ["DEFAULT_DRAFTERS", "FALLBACK_SEP", "DrafterEntry", "build_drafter", "drafter_names", "get_entry",
           "parse_drafters", "register", "registered"]

FALLBACK_SEP = ">"


@dataclass(frozen=True)
class DrafterEntry:
    """A registered drafter: its ``name``, a one-line ``description`` and ``make(index=None,
    **options) -> Drafter``. ``uses_index``: ``make`` drafts from ``index`` (a shared
    ``SuffixIndex``) when given one; the others ignore it."""

    name: str
    description: str
    make: Callable[..., Drafter]
    uses_index: bool = False


_REGISTRY: dict[str, DrafterEntry] = {}


def register(name: str, description: str, make: Callable[..., Drafter], *, uses_index: bool = False,
             replace: bool = False) -> DrafterEntry:
    """Add a drafter under ``name`` (letters, digits, ``_``, ``-``, ``.``; no ``>`` or ``+``)."""
    if not name or not all(c.isalnum() or c in "_-." for c in name):
        raise ValueError(f"drafter name must be letters, digits, '_', '-' or '.', got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"drafter {name!r} is already registered")
    entry = DrafterEntry(name, description, make, uses_index)
    _REGISTRY[name] = entry
    return entry


def registered() -> tuple[DrafterEntry, ...]:
    """Every registered drafter, in registration order."""
    return tuple(_REGISTRY.values())


def drafter_names() -> tuple[str, ...]:
    """The registered drafter names, in registration order."""
    return tuple(_REGISTRY)


def get_entry(name: str) -> DrafterEntry:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown drafter {name!r} (known: {list(_REGISTRY)})") from None


def parse_drafters(names: Sequence[str] | str) -> tuple[tuple[str, ...], ...]:
    """Validate a route's drafter list; each entry becomes its fallback chain (``"a>b"`` ->
    ``("a", "b")``). Raises ValueError naming the bad value (unknown names list the known ones)."""
    if isinstance(names, str):
        names = [names]
    if not names:
        raise ValueError("drafters must not be empty")
    chains: list[tuple[str, ...]] = []
    seen: set[str] = set()
    for entry in names:
        if not isinstance(entry, str):
            raise ValueError(f"drafter names are strings, got {entry!r}")
        parts = tuple(p.strip() for p in entry.split(FALLBACK_SEP))
        for p in parts:
            if not p:
                raise ValueError(f"drafter {entry!r}: empty name (write 'primary{FALLBACK_SEP}fallback')")
            get_entry(p)
            if p in seen:
                raise ValueError(f"drafter {p!r} is named more than once in {list(names)!r}")
            seen.add(p)
        chains.append(parts)
    return tuple(chains)


def build_drafter(names: Sequence[str] | str, *, index: Any = None) -> Drafter:
    """The drafter a route names (see the module docstring): one name -> that drafter; several
    -> ``MergedDrafter`` of them; ``"a>b"`` -> ``FallbackDrafter(a, b)``. ``index``: the shared
    ``SuffixIndex`` for drafters that use one (None: they build their own)."""
    from .combine import FallbackDrafter, MergedDrafter

    def chain(parts: tuple[str, ...]) -> Drafter:
        d = _REGISTRY[parts[-1]].make(index=index)
        for name in reversed(parts[:-1]):
            d = FallbackDrafter(_REGISTRY[name].make(index=index), d)
        return d

    parts = [chain(c) for c in parse_drafters(names)]
    return parts[0] if len(parts) == 1 else MergedDrafter(*parts)


# ---- the built-in drafters ------------------------------------------------------------------

def _suffix(index: Any = None, **options: Any) -> Drafter:
    from .suffix import SuffixDrafter

    return SuffixDrafter(index, **options)


def _lookahead(index: Any = None, **options: Any) -> Drafter:
    from .lookahead import LookaheadDrafter

    return LookaheadDrafter(**options)


def _prompt_lookup(index: Any = None, **options: Any) -> Drafter:
    from .prompt_lookup import PromptLookupDrafter

    return PromptLookupDrafter(**options)


register("suffix", "suffix index over the request's context, its tenant's outputs and workspace (default)",
         _suffix, uses_index=True)
register("lookahead", "lookahead n-gram pool of the request's and its tenant's generated text", _lookahead)
register("prompt_lookup", "prompt lookup: copies what followed the recent tokens in the request's own context",
         _prompt_lookup)

DEFAULT_DRAFTERS: tuple[str, ...] = ("suffix",)
