"""The session registry: id -> owning tenant, bound at first use, LRU-bounded, thread-safe."""

from __future__ import annotations

import threading

import pytest

from agentspec.api.sessions import (
    MAX_SESSION_ID,
    SessionForbiddenError,
    SessionNotFoundError,
    SessionRegistry,
)


def test_bind_at_first_use_and_refuse_other_tenants():
    reg = SessionRegistry()
    s = reg.bind("acme", "loop-1")
    assert (s.id, s.tenant) == ("loop-1", "acme") and s.created > 0
    assert reg.bind("acme", "loop-1") is s and reg.get("acme", "loop-1") is s
    with pytest.raises(SessionForbiddenError):
        reg.bind("beta", "loop-1")
    with pytest.raises(SessionForbiddenError):
        reg.get("beta", "loop-1")
    with pytest.raises(SessionForbiddenError):
        reg.create("beta", "loop-1")
    assert reg.get("acme", "loop-1").tenant == "acme"  # a refused use changes nothing


def test_get_unknown_and_create():
    reg = SessionRegistry()
    with pytest.raises(SessionNotFoundError):
        reg.get("acme", "nope")
    a, b = reg.create("acme"), reg.create("acme")
    assert a.id != b.id and a.id.startswith("sess_")
    assert reg.get("acme", a.id) is a and a.body() == {"id": a.id, "object": "session", "created": a.created}
    assert reg.create("acme", "mine") is reg.create("acme", "mine")  # idempotent for its owner
    assert len(reg) == 3


def test_bad_ids_are_value_errors():
    reg = SessionRegistry()
    for bad in ("", "x" * (MAX_SESSION_ID + 1)):
        with pytest.raises(ValueError):
            reg.bind("acme", bad)
    reg.bind("acme", "x" * MAX_SESSION_ID)
    with pytest.raises(ValueError):
        SessionRegistry(0)


def test_lru_bound_drops_the_least_recently_used():
    reg = SessionRegistry(max_sessions=3)
    for sid in ("a", "b", "c"):
        reg.bind("acme", sid)
    reg.get("acme", "a")        # a is now the most recently used
    reg.bind("acme", "d")       # drops b
    assert len(reg) == 3
    with pytest.raises(SessionNotFoundError):
        reg.get("acme", "b")
    assert reg.bind("beta", "b").tenant == "beta"  # a forgotten id binds afresh
    with pytest.raises(SessionNotFoundError):
        reg.get("acme", "c")    # c was the least recently used then


def test_concurrent_binds_give_one_owner():
    reg = SessionRegistry(max_sessions=1000)
    owners: dict[str, list[str]] = {}
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def worker(tenant: str):
        barrier.wait()
        for i in range(200):
            try:
                reg.bind(tenant, f"s{i}")
            except SessionForbiddenError:
                continue
            with lock:
                owners.setdefault(f"s{i}", []).append(tenant)

    threads = [threading.Thread(target=worker, args=(f"t{k}",)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reg) == 200 and len(owners) == 200
    for sid, ts in owners.items():
        assert set(ts) == {reg.get(ts[0], sid).tenant}
