"""ThreadGovernor against real load: a real busy-loop process on one of the cores shrinks the
team to the cores left free; when it ends the team grows back."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from agentspec.backends.embedded.threads import ThreadGovernor, _busy_seconds
from agentspec.kernels import cpu_isa


def _poll(gov: ThreadGovernor, want: int, deadline_s: float) -> int:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        # keep this process about as busy as a decode loop would (one thread)
        t = time.monotonic()
        while time.monotonic() - t < 0.02:
            pass
        if gov.update() == want:
            return want
    return gov.threads


@pytest.mark.skipif(cpu_isa.usable_cpus() < 2 or _busy_seconds({0}) is None, reason="needs 2+ cores and /proc/stat")
def test_busy_process_shrinks_the_team_and_its_end_grows_it_back():
    before = torch.get_num_threads()
    n = cpu_isa.usable_cpus()
    gov = ThreadGovernor(n, interval=0.05)
    assert gov.enabled and gov.threads == n
    probe = ThreadGovernor(n, interval=0.2)
    _poll(probe, 0, 0.6)  # samples the load of everything else for ~0.6 s
    if probe.others > 0.3:
        pytest.skip(f"the machine is busy with other work ({probe.others:.2f} cores): no quiet baseline")
    torch.set_num_threads(n)
    gov = ThreadGovernor(n, interval=0.05)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n - 1)]
    try:
        assert _poll(gov, 1, 20.0) == 1, f"others {gov.others:.2f} cores"
        assert torch.get_num_threads() == 1
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    try:
        assert _poll(gov, n, 20.0) == n, f"others {gov.others:.2f} cores"
        assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)


def test_disabled_or_single_core_keeps_its_count():
    before = torch.get_num_threads()
    try:
        assert ThreadGovernor(4, enabled=False).update() == 4
        g = ThreadGovernor(1)
        assert not g.enabled and g.update() == 1
    finally:
        torch.set_num_threads(before)
