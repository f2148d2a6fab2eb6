"""``agentspec stats``: per route, tenant and session summaries of acceptance records, as rows
and as text tables."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from typing import Any

from .records import AcceptanceRecord, _ratios


def _percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]) of ``values``; None when empty."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


class _Group:
    def __init__(self) -> None:
        self.requests = self.spec_on = self.completion_tokens = self.steps = 0
        self.prompt_tokens = self.cached_tokens = 0
        self.draft_tokens = self.accepted_tokens = 0
        self.length_sum = 0.0  # sum over steps of acceptance length
        self.e2e_s = 0.0
        self.ttft: list[float] = []
        self.e2e: list[float] = []
        self.drafted: list[int] = []
        self.accepted: list[int] = []
        self.sources: dict[str, list[int]] = {}  # source -> [steps, draft tokens, accepted tokens]

    def add(self, r: AcceptanceRecord) -> None:
        self.requests += 1
        self.spec_on += r.spec_enabled
        self.completion_tokens += r.completion_tokens
        self.prompt_tokens += r.prompt_tokens
        self.cached_tokens += r.cached_tokens
        self.steps += r.steps
        self.length_sum += r.mat * r.steps
        self.draft_tokens += r.draft_tokens
        self.accepted_tokens += r.accepted_tokens
        self.e2e_s += r.e2e_ms / 1e3
        self.ttft.append(r.ttft_ms)
        self.e2e.append(r.e2e_ms)
        for acc, per in ((self.drafted, r.drafted_per_pos), (self.accepted, r.accepted_per_pos)):
            acc.extend([0] * (len(per) - len(acc)))
            for i, n in enumerate(per):
                acc[i] += n
        for src, counts in _by_source(r).items():
            total = self.sources.setdefault(src, [0, 0, 0])
            for i, n in enumerate(counts[:3]):
                total[i] += n

    def row(self, **keys: str) -> dict[str, Any]:
        return {
            **keys,
            "requests": self.requests,
            "spec_on_pct": 100 * self.spec_on / self.requests if self.requests else 0.0,
            "completion_tokens": self.completion_tokens,
            "steps": self.steps,
            "mat": self.length_sum / self.steps if self.steps else 0.0,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
            "ttft_ms_p50": _percentile(self.ttft, 50),
            "ttft_ms_p95": _percentile(self.ttft, 95),
            "e2e_ms_p50": _percentile(self.e2e, 50),
            "e2e_ms_p95": _percentile(self.e2e, 95),
            "tokens_per_s": self.completion_tokens / self.e2e_s if self.e2e_s > 0 else None,
            "acceptance_per_pos": _ratios(self.accepted, self.drafted),
            "drafted_per_pos": list(self.drafted),    # the n behind each acceptance_per_pos ratio
            "accepted_per_pos": list(self.accepted),
            "by_source": [
                {"source": src, "steps": steps, "draft_tokens": drafted, "accepted_tokens": accepted,
                 "acceptance_rate": accepted / drafted if drafted else None}
                for src, (steps, drafted, accepted) in sorted(self.sources.items(), key=lambda kv: (-kv[1][1], kv[0]))
            ],
        }


def _by_source(r: AcceptanceRecord) -> dict[str, list[int]]:
    """``r.by_source``; for a record from before it existed, its one draft source (``draft_sources``)
    credited with all its draft and accepted tokens, or nothing when it had several."""
    if r.by_source or len(r.draft_sources) != 1:
        return r.by_source
    [(src, steps)] = r.draft_sources.items()
    return {src: [steps, r.draft_tokens, r.accepted_tokens]}


def summarize(records: Iterable[AcceptanceRecord]) -> dict[str, list[dict[str, Any]]]:
    """``{"routes": [row per (tenant, route)], "tenants": [row per tenant], "by_route": [row per
    route, all tenants]}``. A row: requests, spec_on_pct, completion_tokens, steps, mat,
    draft/accepted tokens, acceptance_rate (accepted / draft tokens), p50/p95 of ttft_ms and e2e_ms,
    tokens_per_s (completion tokens per second of request time), acceptance_per_pos (with its counts:
    drafted_per_pos, the steps whose draft reached each depth, and accepted_per_pos), and by_source:
    per draft node source (most draft tokens first) its steps, draft/accepted tokens and
    acceptance_rate."""
    routes: dict[tuple[str, str], _Group] = {}
    tenants: dict[str, _Group] = {}
    by_route: dict[str, _Group] = {}
    for r in records:
        routes.setdefault((r.tenant, r.route), _Group()).add(r)
        tenants.setdefault(r.tenant, _Group()).add(r)
        by_route.setdefault(r.route, _Group()).add(r)
    return {
        "routes": [g.row(tenant=t, route=rt) for (t, rt), g in sorted(routes.items())],
        "tenants": [g.row(tenant=t) for t, g in sorted(tenants.items())],
        "by_route": [g.row(route=rt) for rt, g in sorted(by_route.items())],
    }


def summarize_sessions(records: Iterable[AcceptanceRecord]) -> dict[str, list[dict[str, Any]]]:
    """``{"sessions": [row per (tenant, session)]}`` (``agentspec stats --by session``); records
    without a session are one row with session None. A row: tenant, session, requests,
    prompt_tokens, cached_tokens, completion_tokens, mat, draft/accepted tokens, acceptance_rate
    and e2e_s (total request time in seconds)."""
    groups: dict[tuple[str, str | None], _Group] = {}
    for r in records:
        groups.setdefault((r.tenant, r.session), _Group()).add(r)
    rows = []
    for (tenant, session), g in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] is not None, kv[0][1] or "")):
        row = g.row(tenant=tenant, session=session)
        rows.append({k: row[k] for k in ("tenant", "session", "requests")}
                    | {"prompt_tokens": g.prompt_tokens, "cached_tokens": g.cached_tokens,
                       "completion_tokens": g.completion_tokens, "mat": row["mat"], "draft_tokens": g.draft_tokens,
                       "accepted_tokens": g.accepted_tokens, "acceptance_rate": row["acceptance_rate"],
                       "e2e_s": g.e2e_s})
    return {"sessions": rows}


_SESSION_COLUMNS = [  # the --by session table: header, key, format
    ("tenant", "tenant", "{}"), ("session", "session", "{}"), ("requests", "requests", "{}"),
    ("prompt", "prompt_tokens", "{}"), ("cached", "cached_tokens", "{}"), ("tokens", "completion_tokens", "{}"),
    ("MAT", "mat", "{:.2f}"), ("accepted", "accepted_tokens", "{}"), ("drafted", "draft_tokens", "{}"),
    ("accept", "acceptance_rate", "{:.1%}"), ("e2e s", "e2e_s", "{:.2f}"),
]


def format_session_table(summary: dict[str, list[dict[str, Any]]]) -> str:
    """``summarize_sessions``' rows as a table, one per (tenant, session); ``-`` for no session."""
    return "\n".join(_aligned(_SESSION_COLUMNS, summary["sessions"], 2))


_COLUMNS = [  # header, key, format
    ("tenant", "tenant", "{}"), ("route", "route", "{}"), ("requests", "requests", "{}"),
    ("spec%", "spec_on_pct", "{:.0f}"), ("tokens", "completion_tokens", "{}"), ("MAT", "mat", "{:.2f}"),
    ("accept", "acceptance_rate", "{:.1%}"), ("ttft p50", "ttft_ms_p50", "{:.0f}"),
    ("ttft p95", "ttft_ms_p95", "{:.0f}"), ("e2e p50", "e2e_ms_p50", "{:.0f}"),
    ("e2e p95", "e2e_ms_p95", "{:.0f}"), ("tok/s", "tokens_per_s", "{:.1f}"),
]


_SOURCE_COLUMNS = [  # the by-source table: header, key, format
    ("tenant", "tenant", "{}"), ("route", "route", "{}"), ("source", "source", "{}"), ("steps", "steps", "{}"),
    ("drafted", "draft_tokens", "{}"), ("accepted", "accepted_tokens", "{}"), ("accept", "acceptance_rate", "{:.1%}"),
]


def _aligned(columns: list[tuple[str, str, str]], rows: list[dict[str, Any]], left: int) -> list[str]:
    """``rows`` as text lines under a header, the first ``left`` columns left-aligned."""
    cells = [[h for h, _, _ in columns]]
    for r in rows:
        cells.append(["-" if r[k] is None else fmt.format(r[k]) for _, k, fmt in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    return ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in cells]


def format_table(summary: dict[str, list[dict[str, Any]]]) -> str:
    """Rows per (tenant, route), plus a ``*`` row per tenant with more than one route; times in ms.
    Then, when any row has per-source counts, a second table after a blank line: the same rows
    broken down by draft source (steps, drafted and accepted tokens, acceptance rate)."""
    totals = {r["tenant"]: r for r in summary["tenants"]}
    rows: list[dict[str, Any]] = []
    for tenant, group in itertools.groupby(summary["routes"], key=lambda r: r["tenant"]):
        group = list(group)
        rows += group
        if len(group) > 1:
            rows.append({**totals[tenant], "route": "*"})
    lines = _aligned(_COLUMNS, rows, 2)
    by_source = [{"tenant": r["tenant"], "route": r["route"], **src} for r in rows for src in r["by_source"]]
    if by_source:
        lines += ["", *_aligned(_SOURCE_COLUMNS, by_source, 3)]
    return "\n".join(lines)
