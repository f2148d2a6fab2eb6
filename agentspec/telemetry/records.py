"""The acceptance record: what one request did, and how it is built from a generation's stats.

One ``AcceptanceRecord`` per request (DESIGN.md section 8). Terms as in section 4: a *step* is one
decode forward; *draft tokens* are proposed and verified, *accepted tokens* pass verification;
*acceptance length* of a step = accepted + 1; **MAT** = mean acceptance length over steps.

Per-position counts: draft position ``i`` (1-based depth in the verified draft tree, list index
``i - 1``) is *drafted* in a step whose verified draft reached depth >= i, and *accepted* in a step
that accepted >= i draft tokens. ``acceptance_per_pos[i - 1]`` = accepted / drafted at depth i.

Per-source counts (``by_source``): steps, draft tokens and accepted tokens by the drafter that
proposed each draft node (``Draft.source_of``), so a merged draft ("suffix+eagle3")
credits each of its drafters with its own tokens.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from ..decode.results import GenerationStats

TENANT_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")  # tenant names double as file names


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class AcceptanceRecord(msgspec.Struct, kw_only=True):
    """What one request did, as written to ``<log_dir>/<tenant>.jsonl`` (one JSON line)."""

    ts: float = msgspec.field(default_factory=time.time)  # unix time the request finished
    time: str = ""                 # ``ts`` as ISO 8601 UTC, for people reading the log
    request_id: str
    tenant: str
    route: str = "default"         # name of the matched route rule, or "default"
    endpoint: str = "chat.completions"  # "chat.completions" | "completions" | "apply" | "messages" | "responses"
    session: str | None = None
    model: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0         # prompt tokens served from the prefix cache (not prefilled)
    completion_tokens: int = 0
    ttft_ms: float = 0.0           # time to first token
    e2e_ms: float = 0.0            # request arrival to last token
    spec_enabled: bool = False
    spec_reason: str = ""          # why speculation is on or off
    steps: int = 0
    drafts: int = 0                # steps that verified a draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    mat: float = 0.0               # mean acceptance length over steps; 0 with no steps
    drafted_per_pos: list[int] = []     # index i-1: steps whose draft reached depth i
    accepted_per_pos: list[int] = []    # index i-1: steps that accepted >= i draft tokens
    acceptance_per_pos: list[float] = []  # accepted_per_pos / drafted_per_pos
    draft_sources: dict[str, int] = {}  # steps whose draft came from each source
    # node source -> [steps with its nodes, draft tokens, accepted tokens] (absent in older logs)
    by_source: dict[str, list[int]] = {}
    finish_reason: str = "stop"    # "stop" | "length" | "cancelled" | "error"
    status_code: int = 200
    error: str | None = None

    def __post_init__(self) -> None:
        if not self.time:
            self.time = _iso(self.ts)


def per_position_counts(acceptance_lengths: Iterable[int], draft_depths: Iterable[int]) -> tuple[list[int], list[int]]:
    """``(drafted_per_pos, accepted_per_pos)`` from per-step acceptance lengths and draft depths."""
    lengths, depths = list(acceptance_lengths), list(draft_depths)
    if len(lengths) != len(depths):
        raise ValueError(f"acceptance_lengths and draft_depths differ in length: {len(lengths)} != {len(depths)}")
    n = max(depths, default=0)
    drafted, accepted = [0] * n, [0] * n
    for length, depth in zip(lengths, depths):
        if length - 1 > depth:
            raise ValueError(f"a step accepted {length - 1} draft tokens from a draft of depth {depth}")
        for i in range(depth):
            drafted[i] += 1
        for i in range(length - 1):
            accepted[i] += 1
    return drafted, accepted


def _ratios(num: list[int], den: list[int]) -> list[float]:
    return [a / d if d else 0.0 for a, d in zip(num, den)]


def record_from_stats(stats: GenerationStats, **fields: Any) -> AcceptanceRecord:
    """An ``AcceptanceRecord`` from a generation's stats; ``fields`` (request_id, tenant, route,
    ttft_ms, e2e_ms, ...) are set as given and win over values derived from ``stats``.

    Per-position lists need ``stats.draft_depths`` (per step: depth of the verified draft tree, 0
    without a draft); engines that lack it give empty lists.
    """
    lengths = list(stats.acceptance_lengths)
    depths = getattr(stats, "draft_depths", None)
    if depths is not None and len(depths) == len(lengths):
        drafted, accepted = per_position_counts(lengths, depths)
        drafts = sum(1 for d in depths if d > 0)
    else:
        drafted, accepted = [], []
        drafts = sum(stats.draft_sources.values())
    derived: dict[str, Any] = dict(
        prompt_tokens=stats.prompt_tokens,
        cached_tokens=getattr(stats, "cached_tokens", 0),
        completion_tokens=stats.completion_tokens,
        ttft_ms=stats.prefill_seconds * 1e3,
        e2e_ms=stats.seconds * 1e3,
        spec_enabled=stats.spec_enabled,
        spec_reason=stats.spec_reason,
        steps=stats.steps,
        drafts=drafts,
        draft_tokens=stats.draft_tokens,
        accepted_tokens=stats.accepted_tokens,
        mat=sum(lengths) / len(lengths) if lengths else 0.0,
        drafted_per_pos=drafted,
        accepted_per_pos=accepted,
        acceptance_per_pos=_ratios(accepted, drafted),
        draft_sources=dict(stats.draft_sources),
        by_source={src: [stats.source_steps.get(src, 0), n, stats.source_accepted.get(src, 0)]
                   for src, n in stats.source_drafted.items()},
    )
    derived.update(fields)
    return AcceptanceRecord(**derived)


def validate_tenant(tenant: str) -> str:
    """``tenant`` if it is a valid tenant name ([A-Za-z0-9._-], 1-64 characters), else ValueError."""
    if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant) or tenant in (".", ".."):
        raise ValueError(f"invalid tenant name {tenant!r}: use 1-64 characters from [A-Za-z0-9._-]")
    return tenant
