"""Per-tenant admission limits: requests in flight and requests per minute.

``[[tenants]] max_concurrent`` caps a tenant's generation requests running or queued at once;
``requests_per_minute`` caps how many it may start in any 60-second window. Over either, the
request is refused before it is queued with 429 ``rate_limit_exceeded`` and a ``Retry-After``
header (seconds until the window has room; 1 for the concurrency cap, when a slot frees is not
known). One tenant at its limit never delays another's requests.
"""

from __future__ import annotations

import collections
import math
import threading
import time

WINDOW_S = 60.0


class LimitExceeded(Exception):
    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TenantLimits:
    def __init__(self, limits: dict[str, tuple[int | None, int | None]], *, clock=time.monotonic) -> None:
        """``limits``: tenant -> (max_concurrent or None, requests_per_minute or None)."""
        self._limits = {t: lim for t, lim in limits.items() if lim != (None, None)}
        self._running: collections.Counter[str] = collections.Counter()
        self._starts: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self._lock = threading.Lock()
        self._clock = clock

    def check(self, tenant: str) -> None:
        """Raise ``LimitExceeded`` when ``tenant`` could not be admitted now, taking nothing: the
        server asks before it reads and tokenizes a request, so a tenant at its limit costs the
        others nothing (``acquire`` decides)."""
        lim = self._limits.get(tenant)
        if lim is not None:
            with self._lock:
                self._test(tenant, lim, self._clock())

    def acquire(self, tenant: str) -> bool:
        """Admit one request of ``tenant`` (then ``release`` it when it ends) or raise
        ``LimitExceeded``. Returns whether a slot was taken (False: the tenant has no limits)."""
        lim = self._limits.get(tenant)
        if lim is None:
            return False
        now = self._clock()
        with self._lock:
            self._test(tenant, lim, now)
            self._starts[tenant].append(now)
            self._running[tenant] += 1
            return True

    def _test(self, tenant: str, lim: tuple[int | None, int | None], now: float) -> None:
        max_concurrent, per_minute = lim
        if max_concurrent is not None and self._running[tenant] >= max_concurrent:
            raise LimitExceeded(f"tenant {tenant!r} has {self._running[tenant]} requests in flight, its limit "
                                f"(max_concurrent = {max_concurrent}); retry when one finishes", 1)
        starts = self._starts[tenant]
        while starts and now - starts[0] >= WINDOW_S:
            starts.popleft()
        if per_minute is not None and len(starts) >= per_minute:
            wait = max(1, math.ceil(WINDOW_S - (now - starts[0])))
            raise LimitExceeded(f"tenant {tenant!r} started {len(starts)} requests in the last minute, its limit "
                                f"(requests_per_minute = {per_minute}); retry in {wait} s", wait)

    def release(self, tenant: str) -> None:
        with self._lock:
            if self._running[tenant] > 0:
                self._running[tenant] -= 1
