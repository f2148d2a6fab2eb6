"""The batch scheduler's waiting queue gives up requests that were cancelled or expired while
they waited (``FairQueue.take_if``, swept every scheduler step), keeping everyone else's order
and turn. The end-to-end behaviour (a 504 at the deadline, a freed queue place while the batch
is full) is in tests/integration/test_server.py."""

from __future__ import annotations

import types

from agentspec.backends.embedded.batch import FairQueue, _Request


def _req(tenant: str, i: int, stop: bool = False):
    return types.SimpleNamespace(seq=types.SimpleNamespace(tenant=tenant), i=i, stop=stop)


def test_take_if_removes_only_the_stopped_and_keeps_the_turns():
    q = FairQueue()
    for tenant, i, stop in [("a", 0, False), ("a", 1, True), ("b", 0, True), ("c", 0, False), ("a", 2, False),
                            ("c", 1, True)]:
        q.append(_req(tenant, i, stop))
    taken = q.take_if(lambda r: r.stop)
    assert [(r.seq.tenant, r.i) for r in taken] == [("a", 1), ("b", 0), ("c", 1)]
    assert len(q) == 3 and q.tenants() == 2 and q.waiting("b") == 0 and q.waiting("a") == 2
    order = [(r.seq.tenant, r.i) for r in (q.pop({}), q.pop({}), q.pop({}))]
    assert order == [("a", 0), ("c", 0), ("a", 2)]   # a's turn first, as before the sweep
    assert not q and q.take_if(lambda r: True) == []


def test_a_request_whose_stop_check_fails_is_left_to_admission():
    def boom() -> bool:
        raise RuntimeError("consumer bug")

    r = _Request(seq=None, on_tokens=lambda t: None, on_done=lambda g, e: None, should_stop=boom)
    assert r.stopping() is False   # not swept: admission runs it under its guard (and fails it there)
    assert _Request(seq=None, on_tokens=None, on_done=None, should_stop=None).stopping() is False
    assert _Request(seq=None, on_tokens=None, on_done=None, should_stop=lambda: True).stopping() is True
