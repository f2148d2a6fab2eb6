"""The drafter registry: the one place drafter names are defined.

A route (``[[routes]] drafters = [...]`` in the server config) names its drafters here:

- ``"suffix"``: the suffix index (request context, tenant outputs, tenant workspace); in the
  default. It drafts from the index the server shares between requests (tenants stay isolated).
- ``"lookahead"``: the lookahead n-gram pool alone (the request's and its tenant's outputs).
- ``"prompt_lookup"``: prompt lookup over the request's own context alone.
- ``"json_copy"``: escape-aware copying into the JSON string a tool call is writing
  (``json_copy``): the prompt's text, a ``Read`` result, the call's ``old_string``, unescaped for
  the lookup and escaped back; with ``"suffix"``, the default.
- ``"eagle3"``: the EAGLE-3 draft head (``eagle3_drafter``), gated per request by its
  break-even; beside other drafters it is their fallback (see ``build_drafter``).
- ``"draft_model"``: a smaller model of the target's family (``draft_model``; ``serve
  --draft-model FILE``), gated the same way, a fallback like ``"eagle3"``; in the default list
  when the server loads one.

A list of several entries means those drafters merged into one tree (``MergedDrafter``):
``["suffix", "lookahead"]`` is suffix + lookahead. An entry ``"A>B"`` is drafter A backed by
drafter B (``FallbackDrafter``, mode "switch": B's draft replaces A's when B expects more accepted
tokens); ``"A>B>C"`` is A backed by (B backed by C). Each drafter may appear once per route.

``build_drafter(names, index=..., engine=...)`` builds what a route names; ``register`` adds a
drafter.
Importing this module loads no drafter: the factories import their modules when called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .draft import Drafter

__all__ = ["DEFAULT_DRAFTERS", "FALLBACK_MIN_EXPECTED", "FALLBACK_SEP", "DrafterEntry", "build_drafter", "drafter_names", "get_entry",
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
    needs_engine: bool = False   # make(engine=...) reads the target model (a draft head)
    fallback: bool = False       # in a list with others, it backs them (FallbackDrafter, merge)


_REGISTRY: dict[str, DrafterEntry] = {}


def register(name: str, description: str, make: Callable[..., Drafter], *, uses_index: bool = False,
             needs_engine: bool = False, fallback: bool = False, replace: bool = False) -> DrafterEntry:
    """Add a drafter under ``name`` (letters, digits, ``_``, ``-``, ``.``; no ``>`` or ``+``)."""
    if not name or not all(c.isalnum() or c in "_-." for c in name):
        raise ValueError(f"drafter name must be letters, digits, '_', '-' or '.', got {name!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"drafter {name!r} is already registered")
    entry = DrafterEntry(name, description, make, uses_index, needs_engine, fallback)
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


def build_drafter(names: Sequence[str] | str, *, index: Any = None, engine: Any = None,
                  makers: Mapping[str, Callable[[], Drafter]] | None = None,
                  head_expected: float | None = None) -> Drafter:
    """The drafter a route names (see the module docstring): one name -> that drafter; several
    -> ``MergedDrafter`` of them; ``"a>b"`` -> ``FallbackDrafter(a, b)``. A draft head (an entry
    registered with ``fallback=True``, e.g. ``"eagle3"``) backing other drafters is asked only when
    their draft is unsure: listed beside them, ``["suffix", "eagle3"]`` -> ``FallbackDrafter(suffix,
    eagle3, mode="merge", min_expected=FALLBACK_MIN_EXPECTED)`` (both trees siblings under the
    root when it is asked); as the fallback of a chain, ``"suffix>eagle3"`` ->
    ``FallbackDrafter(suffix, eagle3, mode="switch", min_expected=max(head_expected,
    FALLBACK_MIN_EXPECTED))`` (the larger expected draft wins; ``head_expected``: what the head
    has been giving this request, where the caller tracks it).

    ``index``: the shared ``SuffixIndex`` for drafters that use one (None: they build their
    own); ``engine``: the embedded engine, for drafters that read the target (a draft head).
    ``makers``: name -> a function making that drafter, in place of the registered factories
    (SGLang's workers compose the drafters of their own step this way); a name it lacks is a
    ValueError. Every backend composes drafters here and nowhere else."""
    from .combine import FallbackDrafter, MergedDrafter

    def make(name: str) -> Drafter:
        if makers is not None:
            if name not in makers:
                raise ValueError(f"drafter {name!r} does not run here (available: {sorted(makers)})")
            return makers[name]()
        entry = _REGISTRY[name]
        if entry.needs_engine:
            if engine is None:
                raise ValueError(f"drafter {name!r} reads the target model: build it with engine=...")
            return entry.make(index=index, engine=engine)
        return entry.make(index=index)

    def chain(parts: tuple[str, ...]) -> Drafter:
        d = make(parts[-1])
        for i in range(len(parts) - 2, -1, -1):
            head_backs = i == len(parts) - 2 and _REGISTRY[parts[-1]].fallback and not _REGISTRY[parts[i]].fallback
            d = FallbackDrafter(make(parts[i]), d, mode="switch",
                                min_expected=max(head_expected or 0.0, FALLBACK_MIN_EXPECTED) if head_backs else None)
        return d

    chains = parse_drafters(names)
    heads = [c for c in chains if len(c) == 1 and _REGISTRY[c[0]].fallback]
    rest = [c for c in chains if c not in heads]
    if heads and rest:
        primary = [chain(c) for c in rest]
        backing = [chain(c) for c in heads]
        p = primary[0] if len(primary) == 1 else MergedDrafter(*primary)
        b = backing[0] if len(backing) == 1 else MergedDrafter(*backing)
        return FallbackDrafter(p, b, mode="merge", min_expected=FALLBACK_MIN_EXPECTED)
    parts = [chain(c) for c in chains]
    return parts[0] if len(parts) == 1 else MergedDrafter(*parts)


# A draft head backing index drafters is asked when their draft expects fewer accepted tokens
# than this (``FallbackDrafter.min_expected``): a strong suffix match is verified alone.
FALLBACK_MIN_EXPECTED = 3.0


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


def _json_copy(index: Any = None, engine: Any = None, **options: Any) -> Drafter:
    from .json_copy import JsonCopyDrafter

    return JsonCopyDrafter(engine.tokenizer, index=index, **options)


def _draft_model(index: Any = None, engine: Any = None, **options: Any) -> Drafter:
    from .draft_model import for_engine

    return for_engine(engine, **options)


def _eagle3(index: Any = None, engine: Any = None, **options: Any) -> Drafter:
    from .eagle3_drafter import for_engine

    return for_engine(engine, **options)


register("suffix", "suffix index over the request's context, its tenant's outputs and workspace (default)",
         _suffix, uses_index=True)
register("lookahead", "lookahead n-gram pool of the request's and its tenant's generated text", _lookahead)
register("prompt_lookup", "prompt lookup: copies what followed the recent tokens in the request's own context",
         _prompt_lookup)

register("json_copy", "text the server holds (the prompt, a Read result, the old_string just written) copied into "
         "the tool-call argument string being written, JSON-escaped (requests with tools or a response schema)",
         _json_copy, uses_index=True, needs_engine=True)
register("eagle3", "EAGLE-3 draft head over the target's hidden states (the fallback for text no index holds)",
         _eagle3, needs_engine=True, fallback=True)
register("draft_model", "a smaller model of the target's family (--draft-model FILE) drafting what it would write "
         "(the fallback for text no index holds; default when one is loaded)", _draft_model, needs_engine=True,
         fallback=True)

# json_copy drafts only inside a tool call's (or a JSON answer's) strings: for free text it proposes nothing
DEFAULT_DRAFTERS: tuple[str, ...] = ("suffix", "json_copy")
