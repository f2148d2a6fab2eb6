"""Reading the acceptance logs back: ``read_records`` (current and rotated files, merged by time)
and ``parse_since`` for the ``--since`` option."""

from __future__ import annotations

import heapq
import os
import re
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import msgspec

from .records import TENANT_PATTERN, AcceptanceRecord, validate_tenant


class ReadReport(msgspec.Struct, kw_only=True):
    """What ``read_records`` read; pass one in to have it filled."""

    files: int = 0
    records: int = 0
    skipped: int = 0   # unparseable lines (a torn last line after a crash, hand edits)
    skipped_at: list[str] = []  # "path:line" of each skipped line (first 100)


_ROTATED = re.compile(r"(?P<tenant>.+)\.jsonl(?:\.(?P<n>\d+))?")


def _tenant_files(log_dir: Path) -> dict[str, list[Path]]:
    """tenant -> its log files, oldest first."""
    found: dict[str, list[tuple[int, Path]]] = {}
    for p in log_dir.iterdir():
        m = _ROTATED.fullmatch(p.name)
        if not m or not p.is_file() or not TENANT_PATTERN.fullmatch(m["tenant"]):
            continue
        found.setdefault(m["tenant"], []).append((int(m["n"] or 0), p))
    return {t: [p for _, p in sorted(files, reverse=True)] for t, files in sorted(found.items())}


def _read_files(files: list[Path], since: float | None, report: ReadReport) -> Iterator[AcceptanceRecord]:
    decoder = msgspec.json.Decoder(AcceptanceRecord)
    for path in files:
        try:
            f = open(path, "rb")
        except FileNotFoundError:  # rotated away between listing and reading
            continue
        report.files += 1
        with f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = decoder.decode(line)
                except msgspec.DecodeError:
                    report.skipped += 1
                    if len(report.skipped_at) < 100:
                        report.skipped_at.append(f"{path}:{n}")
                    continue
                if since is None or rec.ts >= since:
                    report.records += 1
                    yield rec


def read_records(
    log_dir: str | os.PathLike,
    *,
    tenant: str | None = None,
    since: float | datetime | None = None,
    report: ReadReport | None = None,
) -> Iterator[AcceptanceRecord]:
    """Records from ``log_dir`` (current and rotated files), oldest first, merged across tenants
    by ``ts``. ``since``: unix time or datetime (naive = local time). Unparseable lines are
    skipped and counted in ``report``. A missing ``log_dir`` raises FileNotFoundError."""
    log_dir = Path(log_dir)
    if not log_dir.is_dir():
        raise FileNotFoundError(f"log directory not found: {str(log_dir)!r}")
    if tenant is not None:
        validate_tenant(tenant)
    if isinstance(since, datetime):
        since = since.timestamp()
    report = report if report is not None else ReadReport()
    files = _tenant_files(log_dir)
    if tenant is not None:
        files = {tenant: files.get(tenant, [])}
    streams = [_read_files(fs, since, report) for fs in files.values()]
    return heapq.merge(*streams, key=lambda r: r.ts)


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str, *, now: float | None = None) -> float:
    """Unix time from an ISO date/time ("2026-11-29", "2026-11-29T10:00", naive = local time) or
    a duration back from now ("90s", "15m", "2h", "7d", "1w"); ValueError naming ``text``."""
    s = text.strip()
    m = _DURATION.fullmatch(s)
    if m:
        return (time.time() if now is None else now) - float(m[1]) * _UNIT_SECONDS[m[2]]
    try:
        return datetime.fromisoformat(s).timestamp()
    except ValueError:
        raise ValueError(f"invalid time {text!r}: give an ISO date/time (2026-11-29, 2026-11-29T10:00) "
                         f"or a duration (15m, 2h, 7d)") from None
