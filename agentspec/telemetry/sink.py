"""The per-tenant acceptance log writer: ``TenantLogSink`` and its size rotation.

Logs are off the hot path: ``TenantLogSink.write`` queues the record and returns; a writer
thread appends and fsyncs queued records in groups (one write and one fsync per tenant file per
group). What a SIGKILL can lose: the records not yet fsynced, i.e. those still queued and the
group being written (at most ``max_queue``, in practice the last few milliseconds); what is on
disk stays a parseable prefix (at most one torn last line, which readers skip). A clean shutdown
calls ``TenantLogSink.close()``, which writes everything queued first.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import threading
import time
from pathlib import Path

import msgspec

from suffix_index.atomic import fsync_dir

from .records import AcceptanceRecord, validate_tenant


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
        # the records are the tenants' own: the folder 0700 and each file 0600 (whatever the umask),
        # readable by the server's user alone
        self.log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
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
            fd = _open_log(path)
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
                        fd = _open_log(path)
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


def _open_log(path) -> int:
    """The tenant's log for appending, 0600 (a file an older version left readable to others is
    made private)."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o600)
    except OSError:
        pass
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
