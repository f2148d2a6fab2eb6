"""The session registry: (tenant, id) -> session, bound at first use, LRU-bounded per tenant,
thread-safe. Tenants never meet: the same id is two sessions, another tenant's is unknown."""

from __future__ import annotations

import threading

import pytest

from agentspec.api.sessions import (
    MAX_SESSION_ID,
    SessionNotFoundError,
    SessionRegistry,
)


def test_bind_at_first_use_and_tenants_never_meet():
    reg = SessionRegistry()
    s = reg.bind("acme", "loop-1")
    assert (s.id, s.tenant) == ("loop-1", "acme") and s.created > 0
    assert reg.bind("acme", "loop-1") is s and reg.get("acme", "loop-1") is s
    with pytest.raises(SessionNotFoundError):   # another tenant's id is unknown, as one never made
        reg.get("beta", "loop-1")
    theirs = reg.bind("beta", "loop-1")          # and binding it makes beta's own: no squatting
    assert theirs is not s and theirs.tenant == "beta" and reg.create("beta", "loop-1") is theirs
    assert reg.get("acme", "loop-1") is s and len(reg) == 2


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


def test_lru_bound_drops_the_least_recently_used_per_tenant():
    reg = SessionRegistry(max_sessions=3)
    for sid in ("a", "b", "c"):
        reg.bind("acme", sid)
    reg.get("acme", "a")        # a is now the most recently used
    reg.bind("acme", "d")       # drops b
    assert len(reg) == 3
    with pytest.raises(SessionNotFoundError):
        reg.get("acme", "b")
    reg.bind("acme", "b")       # a forgotten id binds afresh (and drops c, the least recently used)
    with pytest.raises(SessionNotFoundError):
        reg.get("acme", "c")


def test_a_tenant_creating_sessions_in_a_loop_drops_only_its_own():
    reg = SessionRegistry(max_sessions=5)
    mine = reg.create("acme", "keep-me")
    for _ in range(100):
        reg.create("flood")
    assert reg.get("acme", "keep-me") is mine and len(reg) == 6


def test_concurrent_binds_give_each_tenant_its_own_session():
    reg = SessionRegistry(max_sessions=1000)
    got: dict[tuple[str, str], set] = {}
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def worker(tenant: str):
        barrier.wait()
        for i in range(200):
            s = reg.bind(tenant, f"s{i}")
            with lock:
                got.setdefault((tenant, f"s{i}"), set()).add(id(s))

    threads = [threading.Thread(target=worker, args=(f"t{k % 4}",)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reg) == 800 and len(got) == 800
    assert all(len(ids) == 1 for ids in got.values())   # two threads of one tenant got the same session
    for (tenant, sid) in got:
        assert reg.get(tenant, sid).tenant == tenant
