"""The parts behind SECURITY.md's rows, without a model or a server: server-owned paths in
``/v1/apply``'s resolver, config checks (tenant names, placeholder and operator keys), decoder
failures as 400s, per-tenant metrics, private log files, the fair queue, admission checks."""

from __future__ import annotations

import os
import stat
import types

import pytest

from agentspec.api.limits import LimitExceeded, TenantLimits
from agentspec.api.protocol import APIError, CompletionRequest, decode_body
from agentspec.apply import ApplyPathError, resolve_workspace_path
from agentspec.backends.embedded.batch import FairQueue
from agentspec.config import load_server_config
from agentspec.errors import ConfigError
from agentspec.telemetry import AcceptanceRecord, Metrics, TenantLogSink
from agentspec.workspace import OwnedPath


def test_apply_refuses_the_servers_own_files_by_rule(tmp_path):
    (tmp_path / "server.toml").write_text("api_keys = ['sk-secret']\n")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "a.jsonl").write_text("{}\n")
    (tmp_path / "ok.py").write_text("x = 1\n")
    (tmp_path / "link.py").symlink_to(tmp_path / "server.toml")
    owned = (OwnedPath.of("config file", tmp_path / "server.toml"), OwnedPath.of("log_dir", tmp_path / "logs"))
    for path, rule in (("server.toml", "config file"), ("link.py", "config file"), ("logs/a.jsonl", "log_dir"),
                       (str(tmp_path / "logs" / "a.jsonl"), "log_dir"), ("logs/../server.toml", "config file"),
                       ("logs/missing.jsonl", "log_dir")):
        with pytest.raises(ApplyPathError) as e:
            resolve_workspace_path(tmp_path, path, max_bytes=1 << 20, owned=owned)
        assert (e.value.status, e.value.code) == (403, "path_server_owned") and f"({rule})" in str(e.value)
    assert resolve_workspace_path(tmp_path, "ok.py", max_bytes=1 << 20, owned=owned)[1] == "x = 1\n"


def _config(tmp_path, text: str):
    p = tmp_path / "server.toml"
    p.write_text(text)
    return load_server_config(p)


@pytest.mark.parametrize("name", [".", ".."])
def test_tenant_names_that_cannot_name_a_log_file_are_refused(tmp_path, name):
    with pytest.raises(ConfigError, match="not allowed"):
        _config(tmp_path, f'[[tenants]]\nname = "{name}"\napi_keys = ["sk-0123456789"]\n')


@pytest.mark.parametrize("key", ["sk-acme-CHANGE-ME", "sk-changeme-0123456", "your-key-goes-here", "sk-replace-me-now"])
def test_placeholder_keys_are_refused_without_showing_them(tmp_path, key):
    with pytest.raises(ConfigError, match="placeholder") as e:
        _config(tmp_path, f'[[tenants]]\nname = "a"\napi_keys = ["{key}"]\n')
    assert key not in str(e.value)


def test_the_shipped_example_config_refuses_to_start_until_its_keys_are_replaced():
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "deploy" / "sglang-router" / "server.toml"
    with pytest.raises(ConfigError, match="placeholder"):
        load_server_config(example)


def test_operator_keys_are_checked_and_no_tenants(tmp_path):
    with pytest.raises(ConfigError, match="at least"):
        _config(tmp_path, '[server]\nmetrics_api_keys = ["short"]\n')
    with pytest.raises(ConfigError, match="repeats server.metrics_api_keys"):
        _config(tmp_path, '[server]\nmetrics_api_keys = ["sk-ops-0123456789"]\n\n'
                          '[[tenants]]\nname = "a"\napi_keys = ["sk-ops-0123456789"]\n')


@pytest.mark.parametrize("body", [b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                  b'{"prompt": ' + b"[" * 300_000 + b"1" + b"]" * 300_000 + b"}"])
def test_a_nested_body_is_a_400_not_a_crash(body):
    with pytest.raises(APIError) as e:
        decode_body(body, CompletionRequest)
    assert e.value.status == 400


def test_metrics_render_one_tenants_series():
    m = Metrics()
    m.request_started("acme")
    m.request_started("globex")
    acme = m.render(tenant="acme")[0].decode()
    assert 'tenant="acme"' in acme and 'tenant="globex"' not in acme
    assert 'tenant="' not in m.render(tenant="nobody")[0].decode()
    everything = m.render()[0].decode()
    assert 'tenant="acme"' in everything and 'tenant="globex"' in everything


def test_log_files_are_0600_in_a_0700_folder(tmp_path):
    old = os.umask(0o022)
    try:
        sink = TenantLogSink(tmp_path / "logs")
        try:
            sink.write(AcceptanceRecord(request_id="r1", tenant="acme"))
        finally:
            sink.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "logs").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "logs" / "acme.jsonl").stat().st_mode) == 0o600


def test_a_log_an_older_version_left_readable_is_made_private(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "acme.jsonl").write_text("")
    os.chmod(logs / "acme.jsonl", 0o644)
    sink = TenantLogSink(logs)
    try:
        sink.write(AcceptanceRecord(request_id="r1", tenant="acme"))
    finally:
        sink.close()
    assert stat.S_IMODE((logs / "acme.jsonl").stat().st_mode) == 0o600


def _req(tenant: str, i: int):
    return types.SimpleNamespace(seq=types.SimpleNamespace(tenant=tenant), i=i)


def test_the_fair_queue_serves_tenants_in_turn_fewest_running_first():
    q = FairQueue()
    for i in range(5):
        q.append(_req("flood", i))
    q.append(_req("quiet", 0))
    q.append(_req("other", 0))
    running: dict[str, int] = {}
    order = []
    while q:
        r = q.pop(running)
        running[r.seq.tenant] = running.get(r.seq.tenant, 0) + 1
        order.append((r.seq.tenant, r.i))
    assert order[:3] == [("flood", 0), ("quiet", 0), ("other", 0)]
    assert order[3:] == [("flood", 1), ("flood", 2), ("flood", 3), ("flood", 4)]   # its own order kept
    q.append(_req("flood", 9))
    q.append(_req("quiet", 1))
    assert q.pop({"flood": 2, "quiet": 0}).seq.tenant == "quiet"   # fewest in the batch first
    assert q.waiting("flood") == 1 and q.tenants() == 1 and len(q.drain()) == 1 and not q


def test_check_admits_nothing_and_acquire_decides():
    t = [0.0]
    lim = TenantLimits({"a": (1, 2)}, clock=lambda: t[0])
    lim.check("a")
    lim.check("a")          # asking twice takes nothing
    assert lim.acquire("a")
    with pytest.raises(LimitExceeded):
        lim.check("a")      # the one slot is taken
    lim.release("a")
    lim.check("a")
    assert lim.acquire("a")
    lim.release("a")
    with pytest.raises(LimitExceeded, match="requests_per_minute"):
        lim.check("a")      # two started within the minute
    lim.check("unlimited")
