"""How many CPU threads a decode step should use right now: the cores nobody else is using.

A decode step on CPU is ~150 short OpenMP parallel regions, each of which waits for every thread
of its team. When another process takes one of the cores (an editor, a build, a second server),
a team as wide as the machine waits, region after region, for a thread the kernel has
descheduled: plain decoding fell from 76 to 20 tok/s here with one busy-loop process (and to 0.4
on the AVX2 machine of issue 13). Passive OpenMP waiting avoids the collapse but costs every
region a futex wake-up: 45 instead of 76 tok/s on a quiet machine (benchmarks/bench_contention.py).

``ThreadGovernor`` keeps libgomp's fast spin-waiting and sizes the team instead: every
``interval`` seconds it reads the busy time of the CPUs this process may use (``/proc/stat``,
steal included: a VM's neighbours count too) minus this process's own CPU time; what remains is
the load of everything else, in cores, and the team gets the cores left over (at least 1, at most
``max_threads``). It shrinks at once and grows back only after two samples agree, so a brief
burst of other work does not make it oscillate. Elsewhere than Linux it keeps ``max_threads``.
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import torch

__all__ = ["ThreadGovernor"]

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_seconds(cpus: set[int]) -> float | None:
    """Busy (non-idle) seconds summed over ``cpus`` since boot, or None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *vals = line.split()
        try:
            if int(name[3:]) not in cpus:
                continue
            v = [int(x) for x in vals]
        except ValueError:
            continue
        # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
        total += v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
    return total / _HZ


class ThreadGovernor:
    """``update()`` before a forward: sets torch's (and so the native kernels') thread count to
    the cores other work leaves free. ``threads`` is the current count."""

    def __init__(self, max_threads: int, *, interval: float = 0.25, enabled: bool = True):
        self.max_threads = max(1, int(max_threads))
        self.threads = self.max_threads
        self.interval = interval
        self.others = 0.0  # the last sample: other work's load on our cores, in cores
        try:
            self._cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self._cpus = set()
        self.enabled = enabled and self.max_threads > 1 and _busy_seconds(self._cpus) is not None
        self._last: tuple[float, float, float] | None = None
        self._grow = 0

    def _sample(self) -> tuple[float, float, float] | None:
        busy = _busy_seconds(self._cpus)
        if busy is None:
            return None
        return time.monotonic(), busy, time.process_time()

    def update(self) -> int:
        """Re-sample when ``interval`` has passed; apply the count to this thread. Cheap otherwise."""
        if not self.enabled:
            return self.threads
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.interval:
            return self.threads
        s = self._sample()
        if s is None:
            return self.threads
        if self._last is not None:
            wall = s[0] - self._last[0]
            others = ((s[1] - self._last[1]) - (s[2] - self._last[2])) / wall
            self.others = max(0.0, others)
            want = max(1, min(self.max_threads, math.floor(self.max_threads - self.others + 0.5)))
            if want < self.threads:
                self._grow = 0
                self._set(want)
            elif want > self.threads:
                self._grow += 1
                if self._grow >= 2:
                    self._grow = 0
                    self._set(want)
            else:
                self._grow = 0
        self._last = s
        return self.threads

    def _set(self, n: int) -> None:
        self.threads = n
        torch.set_num_threads(n)

    def apply(self) -> None:
        """Set the current count on the calling thread (OpenMP counts are per thread)."""
        torch.set_num_threads(self.threads)

    @contextlib.contextmanager
    def full_team(self):
        """Run the block on ``max_threads`` whatever the load, then go back to the current count.
        For prompt prefill: on some CPUs a GEMM's bits depend on the thread count (oneDNN's
        bfloat16 GEMM with AMX splits K=1536 differently on 1, 2 and 3 threads), and the
        exactness of the prefix cache and of speculation rests on every prefill chunk computing
        the same bits every time."""
        torch.set_num_threads(self.max_threads)
        try:
            yield
        finally:
            torch.set_num_threads(self.threads)
