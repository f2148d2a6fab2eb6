"""Acceptance records, the per-tenant JSONL sink and Prometheus metrics.

One ``AcceptanceRecord`` per request (DESIGN.md section 8). Terms as in section 4: a *step* is one
decode forward; *draft tokens* are proposed and verified, *accepted tokens* pass verification;
*acceptance length* of a step = accepted + 1; **MAT** = mean acceptance length over steps.

Per-position counts: draft position ``i`` (1-based depth in the verified draft tree, list index
``i - 1``) is *drafted* in a step whose verified draft reached depth >= i, and *accepted* in a step
that accepted >= i draft tokens. ``acceptance_per_pos[i - 1]`` = accepted / drafted at depth i.

Per-source counts (``by_source``): steps, draft tokens and accepted tokens by the drafter that
proposed each draft node (``Draft.source_of``), so a merged draft ("suffix:request+eagle3")
credits each of its drafters with its own tokens.

Counters and reporting stay apart (STYLE.md 11): ``record_from_stats`` builds a record,
``TenantLogSink`` writes it, ``Metrics`` counts it, ``read_records`` / ``summarize`` report.

Logs are off the hot path: ``TenantLogSink.write`` queues the record and returns; a writer
thread appends and fsyncs queued records in groups (one write and one fsync per tenant file per
group). What a SIGKILL can lose: the records not yet fsynced, i.e. those still queued and the
group being written (at most ``max_queue``, in practice the last few milliseconds); what is on
disk stays a parseable prefix (at most one torn last line, which readers skip). A clean shutdown
calls ``TenantLogSink.close()``, which writes everything queued first.
"""

from __future__ import annotations

import atexit
import heapq
import itertools
import math
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from suffix_index.atomic import fsync_dir

if TYPE_CHECKING:
    from .engine.base import GenerationStats

__all__ = [
    "AcceptanceRecord",
    "Metrics",
    "ReadReport",
    "TenantLogSink",
    "parse_since",
    "per_position_counts",
    "read_records",
    "record_from_stats",
    "summarize",
    "summarize_sessions",
    "validate_tenant",
]

TENANT_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")  # tenant names double as file names
MAX_POSITIONS = 64  # per-position Prometheus series per tenant (deeper positions are not exported)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class AcceptanceRecord(msgspec.Struct, kw_only=True):
    """What one request did, as written to ``<log_dir>/<tenant>.jsonl`` (one JSON line)."""

    ts: float = msgspec.field(default_factory=time.time)  # unix time the request finished
    time: str = ""                 # ``ts`` as ISO 8601 UTC, for people reading the log
    request_id: str
    tenant: str
    route: str = "default"         # name of the matched route rule, or "default"
    endpoint: str = "chat.completions"  # "chat.completions" | "completions" | "apply"
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


class TenantLogSink:
    """Appends each record as one JSON line to ``<log_dir>/<tenant>.jsonl``; thread-safe.

    **Off the hot path** (``background=True``, the default): ``write()`` validates and encodes
    the record, puts it on a bounded queue (``max_queue`` records) and returns; a daemon thread,
    ``agentspec-log-writer``, takes everything queued as one *group* and appends it with one
    ``write()`` per tenant file and one ``fsync`` per file per group (more only where the group
    crosses a rotation). When the queue is full (the disk is ``max_queue`` records behind),
    ``write()`` blocks until the writer has made room (counted in ``waits``, reported on stderr at
    most once a minute): records are never dropped. ``flush(timeout)`` waits until everything
    written so far is on disk; ``close()`` flushes and stops the thread (idempotent; it also runs
    at interpreter exit). After ``close()``, ``write()`` still works, synchronously, so a record
    that comes late (a request finishing during shutdown) is not lost. A write the writer thread
    cannot make (disk full, permissions) is reported on stderr and counted in ``failed``; those
    records are lost (kept nowhere, so a full disk cannot fill memory), the tenant is in
    ``failing`` (``status`` is ``"failing"``) until one of its writes succeeds again, and each
    later group is tried afresh, so logging resumes by itself once the disk has room. The
    thread starts with the first write (a sink never written to has none).
    ``background=False``: ``write()`` appends and fsyncs before it returns (tools, tests).

    Crash safety: a group's lines for one file are one ``write()`` on an ``O_APPEND`` descriptor
    followed by ``fsync``, so a killed process leaves at most one torn last line (``read_records``
    skips it, and the next write starts a fresh line) and never a gap: the lines on disk are a
    prefix of the records in write order. A SIGKILL (or power loss) loses what was not yet
    fsynced: the records still queued and the group being written (at most ``max_queue``
    records; in practice the last few milliseconds of records). Size rotation: ``t.jsonl ->
    t.jsonl.1 -> ... -> t.jsonl.<backups>`` (the oldest is dropped), by rename after the file's
    lines are fsynced, then the directory is fsynced.
    """

    def __init__(self, log_dir: str | os.PathLike, *, max_bytes: int = 64 << 20, backups: int = 5,
                 background: bool = True, max_queue: int = 10_000) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        if backups < 0:
            raise ValueError(f"backups must be >= 0, got {backups}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.log_dir = Path(log_dir)
        self.max_bytes = max_bytes
        self.backups = backups
        self.max_queue = max_queue
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.failed = 0                 # records that could not be written (reported on stderr): lost
        self.failing: dict[str, str] = {}   # tenant -> its last write error, until a write succeeds again
        self._lost: dict[str, int] = {}     # tenant -> records lost since its last good write
        self._error_warned: dict[str, float] = {}   # tenant -> monotonic time of its last error line
        self._encoder = msgspec.json.Encoder()
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self._cond = threading.Condition()
        self._queue: list[tuple[str, bytes]] = []   # (tenant, line), in write order
        self._queued = 0                # records ever queued
        self._done = 0                  # records the writer has finished with (written or failed)
        self.waits = 0                  # write() calls that waited for room in the queue
        self._warned = -math.inf        # monotonic time of the last queue-full warning (one a minute)
        self._closed = not background
        self._thread: threading.Thread | None = None  # started by the first write
        self._last_thread: threading.Thread | None = None  # the writer close() stopped (it may still drain)

    @property
    def background(self) -> bool:
        """True while writes go through the writer thread (``background=True``, until ``close()``)."""
        return not self._closed

    def path(self, tenant: str) -> Path:
        return self.log_dir / f"{validate_tenant(tenant)}.jsonl"

    def _lock(self, tenant: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(tenant, threading.Lock())

    def write(self, record: AcceptanceRecord) -> None:
        """Queue ``record`` for the writer thread (blocking while the queue is full), or write it
        now when the sink is synchronous or closed. A bad tenant name raises ValueError here."""
        validate_tenant(record.tenant)
        line = self._encoder.encode(record) + b"\n"
        with self._cond:
            if not self._closed and len(self._queue) >= self.max_queue:
                self.waits += 1
                now = time.monotonic()
                if now - self._warned >= 60:
                    self._warned = now
                    print(f"[agentspec] warning: the acceptance-log writer is {len(self._queue)} records behind; "
                          f"writers wait for it ({self.waits} waits so far)", file=sys.stderr, flush=True)
                while not self._closed and len(self._queue) >= self.max_queue:
                    self._cond.wait()
            if not self._closed:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="agentspec-log-writer", daemon=True)
                    self._thread.start()
                    atexit.register(self.close)
                self._queue.append((record.tenant, line))
                self._queued += 1
                self._cond.notify_all()
                return
            # closed: write now, but after what the writer is still draining (keep write order)
            while self._done < self._queued and self._draining():
                self._cond.wait(0.5)
        self._try_append(record.tenant, [line], raise_errors=True)

    @property
    def status(self) -> str:
        """``"failing"`` while some tenant's last write failed (disk full, permissions), else ``"ok"``."""
        return "failing" if self.failing else "ok"

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record written before this call is on disk (or has failed, see
        ``failed``); False if ``timeout`` (seconds) passed first."""
        with self._cond:
            target = self._queued
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    def _draining(self) -> bool:
        return self._last_thread is not None and self._last_thread.is_alive()

    def close(self) -> None:
        """Write what is queued, stop the writer thread; later writes are synchronous. Idempotent."""
        with self._cond:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._last_thread = thread
            self._closed = True
            self._cond.notify_all()
        if thread is not None:
            atexit.unregister(self.close)
            if thread is not threading.current_thread():
                thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:  # closed and drained
                    return
                group, self._queue = self._queue, []
                self._cond.notify_all()  # room for blocked writers
            by_tenant: dict[str, list[bytes]] = {}
            for tenant, line in group:
                by_tenant.setdefault(tenant, []).append(line)
            for tenant, lines in by_tenant.items():
                self._try_append(tenant, lines)   # a failure is counted and reported, the thread goes on
            with self._cond:
                self._done += len(group)
                self._cond.notify_all()

    def _try_append(self, tenant: str, lines: list[bytes], *, raise_errors: bool = False) -> None:
        """``_append``, keeping the books: a failure adds to ``failed`` and ``failing`` and is
        reported on stderr (the first, then at most once a minute per tenant); the first good write
        after failures says so and how many records were lost."""
        try:
            self._append(tenant, lines)
        except Exception as e:  # noqa: BLE001 -- counted here; the writer thread keeps going for later groups
            now = time.monotonic()
            with self._cond:
                self.failed += len(lines)
                self._lost[tenant] = self._lost.get(tenant, 0) + len(lines)
                loud = tenant not in self.failing or now - self._error_warned.get(tenant, -math.inf) >= 60
                self.failing[tenant] = f"{type(e).__name__}: {e}"
                if loud:
                    self._error_warned[tenant] = now
                lost = self._lost[tenant]
            if loud:
                print(f"[agentspec] error: could not write {len(lines)} acceptance-log records for tenant {tenant!r}: "
                      f"{type(e).__name__}: {e} ({lost} lost so far; requests are still served)",
                      file=sys.stderr, flush=True)
            if raise_errors:
                raise
            return
        if tenant in self.failing:
            with self._cond:
                self.failing.pop(tenant, None)
                lost = self._lost.pop(tenant, 0)
            print(f"[agentspec] the acceptance log of tenant {tenant!r} is written again ({lost} records were lost)",
                  file=sys.stderr, flush=True)

    def _append(self, tenant: str, lines: list[bytes]) -> None:
        """Append ``lines`` (each ending in a newline) to the tenant's file: one write and one
        fsync per file (rotating first whenever the next line would pass ``max_bytes``)."""
        path = self.path(tenant)
        with self._lock(tenant):
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                size = os.fstat(fd).st_size
                torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"  # a torn line from a crash: end it
                chunk: list[bytes] = [b"\n"] if torn else []
                size += torn
                for line in lines:
                    if size and size + len(line) > self.max_bytes:
                        if chunk:
                            _write_all(fd, b"".join(chunk))
                            os.fsync(fd)
                        os.close(fd)
                        fd = -1
                        self._rotate(path)
                        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
                        chunk, size = [], 0
                    chunk.append(line)
                    size += len(line)
                if chunk:
                    _write_all(fd, b"".join(chunk))
                    os.fsync(fd)
            finally:
                if fd >= 0:
                    os.close(fd)

    def _rotate(self, path: Path) -> None:
        if self.backups == 0:
            path.unlink(missing_ok=True)
        else:
            for i in range(self.backups - 1, 0, -1):
                older = path.with_name(f"{path.name}.{i}")
                if older.exists():
                    os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
            os.replace(path, path.with_name(f"{path.name}.1"))
        fsync_dir(self.log_dir)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


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


def plot_summary(summary: dict[str, list[dict[str, Any]]], path: str | os.PathLike | None) -> Any:
    """Draw ``summarize``'s output: acceptance rate by draft position (a line per tenant, each
    point labelled with its n: the steps whose draft reached that depth, so a depth seen twice
    does not pass for a measured 1.0) and MAT by route (a bar per tenant and route, labelled with
    its number of requests). Saves a PNG to ``path`` (None: no file) and returns the matplotlib
    ``Figure``: its axes hold the plotted series (lines and bar containers labelled by tenant)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ImportError("agentspec stats --plot needs matplotlib: pip install 'agentspec-serve[dev]'") from None

    tenants = sorted({t["tenant"] for t in summary["tenants"]} | {r["tenant"] for r in summary["routes"]})
    color = {t: f"C{i % 10}" for i, t in enumerate(tenants)}   # one colour per tenant in both panels
    fig = Figure(figsize=(12, 4.6), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    for t in summary["tenants"]:
        per = t["acceptance_per_pos"]
        counts = t.get("drafted_per_pos") or [None] * len(per)
        if not per:
            continue
        xs = list(range(1, len(per) + 1))
        ax1.plot(xs, per, marker="o", markersize=3, label=t["tenant"], color=color[t["tenant"]])
        for x, y, n in zip(xs, per, counts):
            if n is not None:
                ax1.annotate(str(n), (x, y), textcoords="offset points", ha="center", fontsize=6,
                             xytext=(0, 4 + 7 * (tenants.index(t["tenant"]) % 3)),   # tenants' labels apart
                             color=color[t["tenant"]])
    ax1.set(title="Acceptance rate by draft position (labels: n drafted)", xlabel="draft position (depth)",
            ylabel="accepted / drafted", ylim=(0, 1.1))
    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ax1.lines:
        ax1.legend(fontsize="small", title="tenant", title_fontsize="small")
    else:
        ax1.text(0.5, 0.5, "no per-position data", ha="center", va="center", transform=ax1.transAxes)
    rows = summary["routes"]   # per (tenant, route): one bar each, grouped by route
    routes = sorted({r["route"] for r in rows})
    width = 0.8 / max(len(tenants), 1)
    for k, tenant in enumerate(tenants):
        mine = [r for r in rows if r["tenant"] == tenant]
        if not mine:
            continue
        xs = [routes.index(r["route"]) - 0.4 + width * (k + 0.5) for r in mine]
        bars = ax2.bar(xs, [r["mat"] for r in mine], width, label=tenant, color=color[tenant])
        ax2.bar_label(bars, labels=[f"n={r['requests']}" for r in mine], fontsize=7, padding=2)
    ax2.set_xticks(range(len(routes)), routes)
    ax2.set(title="MAT by route and tenant (labels: n requests)", xlabel="route", ylabel="mean acceptance length")
    if ax2.containers:
        ax2.margins(y=0.12)   # room for the labels above the bars
        ax2.legend(fontsize="small", title="tenant", title_fontsize="small")
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


class Metrics:
    """Prometheus metrics on a private registry, named after vLLM's with an ``agentspec:`` prefix,
    without ``_created`` series.

    Every series has a ``tenant`` label; the first ``max_tenants`` tenants seen keep their name,
    later ones are counted as ``"other"``. ``..._per_pos`` series have a ``position`` label,
    0-based as in vLLM (position p = draft depth p + 1), for the first ``max_positions`` positions.
    """

    def __init__(self, *, max_tenants: int = 32, max_positions: int = MAX_POSITIONS) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        # no ``_created`` twin per series (a timestamp per counter and histogram: half the lines,
        # no information a scraper needs); prometheus_client's switch is process-wide, set here so
        # it holds whatever $PROMETHEUS_DISABLE_CREATED_SERIES says
        disable_created_metrics()

        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        if max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, got {max_positions}")
        self.max_tenants = max_tenants
        self.max_positions = max_positions
        self._tenants: set[str] = set()
        self._lock = threading.Lock()
        self.registry = CollectorRegistry()
        p, reg, t = "agentspec:", self.registry, ["tenant"]
        self.num_drafts = Counter(p + "spec_decode_num_drafts", "Steps that verified a draft.", t, registry=reg)
        self.num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens verified.", t, registry=reg)
        self.num_accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", t,
                                           registry=reg)
        self.num_draft_tokens_per_pos = Counter(
            p + "spec_decode_num_draft_tokens_per_pos", "Steps whose draft reached each position.",
            ["tenant", "position"], registry=reg)
        self.num_accepted_tokens_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens at each position.",
            ["tenant", "position"], registry=reg)
        self.request_success = Counter(p + "request_success", "Finished requests by finish reason.",
                                       ["tenant", "finish_reason"], registry=reg)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed.", t, registry=reg)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.", t, registry=reg)
        self.time_to_first_token = Histogram(
            p + "time_to_first_token_seconds", "Time to first token.", t, registry=reg,
            buckets=[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0])
        self.e2e_request_latency = Histogram(
            p + "e2e_request_latency_seconds", "Request arrival to last token.", t, registry=reg,
            buckets=[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                     240.0, 480.0, 960.0, 1920.0, 7680.0])
        self.num_requests_running = Gauge(p + "num_requests_running", "Requests in flight.", t, registry=reg)

    def tenant_label(self, tenant: str) -> str:
        """``tenant``, or ``"other"`` once ``max_tenants`` other tenants have been seen."""
        with self._lock:
            if tenant in self._tenants:
                return tenant
            if len(self._tenants) < self.max_tenants:
                self._tenants.add(tenant)
                return tenant
            return "other"

    def request_started(self, tenant: str) -> None:
        self.num_requests_running.labels(self.tenant_label(tenant)).inc()

    def request_finished(self, tenant: str) -> None:
        self.num_requests_running.labels(self.tenant_label(tenant)).dec()

    @contextmanager
    def running(self, tenant: str) -> Iterator[None]:
        """Counts a request in ``num_requests_running`` while the block runs."""
        self.request_started(tenant)
        try:
            yield
        finally:
            self.request_finished(tenant)

    def observe(self, record: AcceptanceRecord) -> None:
        """Counts one finished request (``record`` as written to the log)."""
        t = self.tenant_label(record.tenant)
        self.request_success.labels(t, record.finish_reason).inc()
        self.prompt_tokens.labels(t).inc(record.prompt_tokens)
        self.generation_tokens.labels(t).inc(record.completion_tokens)
        self.time_to_first_token.labels(t).observe(record.ttft_ms / 1e3)
        self.e2e_request_latency.labels(t).observe(record.e2e_ms / 1e3)
        self.num_drafts.labels(t).inc(record.drafts)
        self.num_draft_tokens.labels(t).inc(record.draft_tokens)
        self.num_accepted_tokens.labels(t).inc(record.accepted_tokens)
        for i, n in enumerate(record.drafted_per_pos[: self.max_positions]):
            self.num_draft_tokens_per_pos.labels(t, str(i)).inc(n)
        for i, n in enumerate(record.accepted_per_pos[: self.max_positions]):
            self.num_accepted_tokens_per_pos.labels(t, str(i)).inc(n)

    def watch_log_sink(self, sink: Any) -> None:
        """Export ``sink.failed`` (records the acceptance log could not write: disk full,
        permissions) as the counter ``agentspec:log_write_errors_total``; once per Metrics."""
        if getattr(self, "_log_sink", None) is not None:
            self._log_sink = sink
            return
        from prometheus_client.core import CounterMetricFamily

        self._log_sink = sink
        metrics = self

        class _LogErrors:
            def collect(self):
                yield CounterMetricFamily("agentspec:log_write_errors",
                                          "Acceptance-log records that could not be written (lost).",
                                          value=getattr(metrics._log_sink, "failed", 0))

        self.registry.register(_LogErrors())

    def render(self) -> tuple[bytes, str]:
        """``(body, content_type)`` for ``GET /metrics``."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
