"""Per-tenant admission limits (``[[tenants]] max_concurrent`` / ``requests_per_minute``)."""

from __future__ import annotations

import pytest

from agentspec.config import load_server_config
from agentspec.api.limits import LimitExceeded, TenantLimits


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_concurrency_cap_and_release():
    lim = TenantLimits({"a": (2, None), "b": (None, None)})
    assert lim.acquire("a") and lim.acquire("a")
    with pytest.raises(LimitExceeded, match="max_concurrent = 2") as e:
        lim.acquire("a")
    assert e.value.retry_after == 1
    assert lim.acquire("b") is False and lim.acquire("nobody") is False   # no limits: never refused
    lim.release("a")
    assert lim.acquire("a")


def test_requests_per_minute_window_and_retry_after():
    clock = Clock()
    lim = TenantLimits({"a": (None, 3)}, clock=clock)
    for _ in range(3):
        lim.acquire("a")
        lim.release("a")
        clock.t += 10
    with pytest.raises(LimitExceeded, match="requests_per_minute = 3") as e:
        lim.acquire("a")
    assert e.value.retry_after == 30          # the first start (t=1000) leaves the window at t=1060
    clock.t = 1060.0
    lim.acquire("a")                          # room again


def test_config_fields_are_checked(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[[tenants]]\nname = "a"\napi_keys = ["sk-aaaaaaaa"]\nmax_concurrent = 2\nrequests_per_minute = 60\n')
    t = load_server_config(cfg).tenants[0]
    assert (t.max_concurrent, t.requests_per_minute) == (2, 60)
    cfg.write_text('[[tenants]]\nname = "a"\napi_keys = ["sk-aaaaaaaa"]\nmax_concurrent = 0\n')
    with pytest.raises(Exception, match="max_concurrent"):
        load_server_config(cfg)
