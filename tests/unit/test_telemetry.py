"""Acceptance records, the per-tenant JSONL sink, Prometheus metrics and ``agentspec stats``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from agentspec.decode.results import GenerationStats
from agentspec.telemetry.metrics import OVERFLOW_TENANT
from agentspec.telemetry import (
    AcceptanceRecord,
    Metrics,
    ReadReport,
    TenantLogSink,
    parse_since,
    per_position_counts,
    read_records,
    record_from_stats,
    summarize,
    summarize_sessions,
    validate_tenant,
)

REPO = Path(__file__).resolve().parents[2]


class _Stats(GenerationStats, kw_only=True):
    """GenerationStats with per-step draft depths, whether or not the engine's has them yet."""

    draft_depths: list[int] = []


def make_record(i: int = 0, *, tenant: str = "acme", route: str = "default", ts: float | None = None,
                **fields) -> AcceptanceRecord:
    stats = _Stats(prompt_tokens=100 + i, completion_tokens=20, spec_enabled=True, spec_reason="greedy",
                   steps=4, draft_tokens=9, accepted_tokens=5, acceptance_lengths=[4, 1, 3, 1],
                   draft_depths=[4, 0, 3, 2], draft_sources={"suffix:request": 2, "suffix:workspace": 1},
                   prefill_seconds=0.05, seconds=0.5 + i / 1000)
    if ts is not None:
        fields["ts"] = ts
    return record_from_stats(stats, request_id=f"req-{i}", tenant=tenant, route=route, **fields)


# ---- records ---------------------------------------------------------------------------------


def test_record_round_trips():
    rec = make_record(7, session="s1", model="smollm2", endpoint="apply", finish_reason="length")
    line = msgspec.json.encode(rec)
    assert b"\n" not in line
    back = msgspec.json.decode(line, type=AcceptanceRecord)
    assert back == rec
    assert back.time.endswith("Z") and back.time.startswith(time.strftime("%Y", time.gmtime(rec.ts)))
    bare = AcceptanceRecord(request_id="r", tenant="t")  # every default
    assert msgspec.json.decode(msgspec.json.encode(bare), type=AcceptanceRecord) == bare
    assert bare.route == "default" and bare.mat == 0.0 and bare.drafted_per_pos == [] and bare.ts > 0


def test_per_position_counts_from_stats():
    # steps: depth 4 accepted 3 | no draft | depth 3 accepted 2 | depth 2 accepted 0
    rec = make_record()
    assert rec.drafted_per_pos == [3, 3, 2, 1]
    assert rec.accepted_per_pos == [2, 2, 1, 0]
    assert rec.acceptance_per_pos == pytest.approx([2 / 3, 2 / 3, 0.5, 0.0])
    assert rec.mat == pytest.approx((4 + 1 + 3 + 1) / 4)
    assert rec.drafts == 3
    assert (rec.steps, rec.draft_tokens, rec.accepted_tokens) == (4, 9, 5)
    assert rec.ttft_ms == pytest.approx(50.0) and rec.e2e_ms == pytest.approx(500.0)
    assert rec.draft_sources == {"suffix:request": 2, "suffix:workspace": 1}
    # fields given by the caller win over values derived from the stats
    assert make_record(ttft_ms=12.5).ttft_ms == 12.5


def test_record_without_draft_depths_has_no_per_position_data():
    stats = GenerationStats(prompt_tokens=5, completion_tokens=3, steps=2, draft_tokens=4, accepted_tokens=1,
                            acceptance_lengths=[2, 1], draft_sources={"lookahead": 2})
    if hasattr(stats, "draft_depths"):
        stats.draft_depths = []  # an engine that did not fill them in
    rec = record_from_stats(stats, request_id="r", tenant="t")
    assert rec.drafted_per_pos == rec.accepted_per_pos == rec.acceptance_per_pos == []
    assert rec.drafts == 2 and rec.mat == 1.5
    empty = record_from_stats(GenerationStats(prompt_tokens=1), request_id="r", tenant="t")
    assert empty.mat == 0.0 and empty.steps == 0 and empty.drafts == 0


def test_per_position_counts_rejects_inconsistent_steps():
    with pytest.raises(ValueError, match="differ in length"):
        per_position_counts([1, 2], [0])
    with pytest.raises(ValueError, match="depth 1"):
        per_position_counts([3], [1])


def test_tenant_names_are_validated():
    assert validate_tenant("team-a.b_c9") == "team-a.b_c9"
    for bad in ["", "a/b", "..", "x" * 65, "tab\t", "ü"]:
        with pytest.raises(ValueError, match=repr(bad).replace("\\", "\\\\").replace(".", r"\.")):
            validate_tenant(bad)


# ---- sink and reader -------------------------------------------------------------------------


@pytest.mark.parametrize("background", [True, False])
def test_sink_writes_one_line_per_record_per_tenant(tmp_path, background):
    sink = TenantLogSink(tmp_path / "new" / "logs", background=background)  # created when missing
    recs = [make_record(i, tenant="a" if i % 2 else "b", ts=1000.0 + i) for i in range(6)]
    for r in recs:
        sink.write(r)
    assert sink.flush()
    assert sorted(p.name for p in sink.log_dir.iterdir()) == ["a.jsonl", "b.jsonl"]
    assert len(sink.path("a").read_bytes().splitlines()) == 3
    assert list(read_records(sink.log_dir)) == recs  # merged across tenants by ts
    assert [r.request_id for r in read_records(sink.log_dir, tenant="a")] == ["req-1", "req-3", "req-5"]
    assert list(read_records(sink.log_dir, tenant="nobody")) == []
    assert [r.request_id for r in read_records(sink.log_dir, since=1004.0)] == ["req-4", "req-5"]
    with pytest.raises(ValueError, match="'../x'"):
        sink.write(make_record(tenant="../x"))
    with pytest.raises(FileNotFoundError, match="missing"):
        read_records(tmp_path / "missing")
    sink.close()


def _check_rotation(tmp_path, recs, sink, small):
    files = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert len(files) == 10 and "acme.jsonl.9" in files
    assert all(p.stat().st_size <= sink.max_bytes for p in tmp_path.iterdir() if p.is_file())
    assert list(read_records(tmp_path)) == recs  # every line, in order across rotated files
    assert sorted(p.name for p in small.log_dir.iterdir()) == ["acme.jsonl", "acme.jsonl.1", "acme.jsonl.2"]
    kept = list(read_records(small.log_dir))
    assert kept == recs[-len(kept):] and len(kept) == 9  # the newest, contiguous; older files dropped


@pytest.mark.parametrize("background", [True, False])
def test_rotation_keeps_backups_and_loses_no_lines(tmp_path, background):
    line_bytes = len(msgspec.json.encode(make_record(0))) + 1
    sink = TenantLogSink(tmp_path, max_bytes=3 * line_bytes + 10, backups=20, background=background)
    small = TenantLogSink(tmp_path / "small", max_bytes=3 * line_bytes + 10, backups=2, background=background)
    recs = [make_record(i, ts=2000.0 + i) for i in range(30)]
    for r in recs:
        sink.write(r)
        small.write(r)
    sink.close()
    small.close()
    _check_rotation(tmp_path, recs, sink, small)


def test_rotation_within_one_group(tmp_path, monkeypatch):
    """30 records queued while the writer is busy reach it as one group that crosses rotations."""
    line_bytes = len(msgspec.json.encode(make_record(0))) + 1
    sink = TenantLogSink(tmp_path, max_bytes=3 * line_bytes + 10, backups=20)
    small = TenantLogSink(tmp_path / "small", max_bytes=3 * line_bytes + 10, backups=2)
    recs = [make_record(i, ts=2000.0 + i) for i in range(30)]
    fs = _BlockedFsync(monkeypatch)
    sink.write(make_record(-1, tenant="other"))  # the writer takes this one and stops in its fsync
    assert fs.entered.wait(30)
    for r in recs:
        sink.write(r)
        small.write(r)
    fs.release.set()
    sink.close()
    small.close()
    (tmp_path / "other.jsonl").unlink()
    _check_rotation(tmp_path, recs, sink, small)


def test_concurrent_writers_produce_whole_lines(tmp_path):
    line_bytes = len(msgspec.json.encode(make_record(0))) + 1
    sink = TenantLogSink(tmp_path, max_bytes=40 * line_bytes, backups=100)
    n_threads, per_thread = 8, 40

    def writer(k: int) -> None:
        for i in range(per_thread):
            sink.write(make_record(k * 1000 + i, tenant=f"t{k % 2}"))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sink.flush()
    sink.close()
    decoder = msgspec.json.Decoder(AcceptanceRecord)
    ids = []
    for p in tmp_path.iterdir():
        data = p.read_bytes()
        assert data.endswith(b"\n")
        ids += [decoder.decode(line).request_id for line in data.splitlines()]
    assert sorted(ids) == sorted(f"req-{k * 1000 + i}" for k in range(n_threads) for i in range(per_thread))
    report = ReadReport()
    assert len(list(read_records(tmp_path, report=report))) == n_threads * per_thread and report.skipped == 0


def test_torn_last_line_is_skipped_and_counted(tmp_path):
    sink = TenantLogSink(tmp_path)
    for i in range(3):
        sink.write(make_record(i, ts=3000.0 + i))
    sink.flush()
    whole = msgspec.json.encode(make_record(3))
    with open(sink.path("acme"), "ab") as f:
        f.write(whole[: len(whole) // 2])  # a write cut short by a crash
    report = ReadReport()
    assert [r.request_id for r in read_records(tmp_path, report=report)] == ["req-0", "req-1", "req-2"]
    assert report.skipped == 1 and report.skipped_at == [f"{sink.path('acme')}:4"] and report.files == 1
    sink.write(make_record(4, ts=3004.0))  # starts a fresh line after the torn one
    sink.close()
    report = ReadReport()
    assert [r.request_id for r in read_records(tmp_path, report=report)][-1] == "req-4"
    assert report.skipped == 1 and report.records == 4


class _BlockedFsync:
    """``os.fsync`` that counts calls and holds each one until ``release`` is set, so a test can
    know the writer thread is inside an fsync (``entered``) and what happened meanwhile."""

    def __init__(self, monkeypatch) -> None:
        self.entered, self.release, self.returned = threading.Event(), threading.Event(), threading.Event()
        self.calls = 0
        self._real = os.fsync
        monkeypatch.setattr(os, "fsync", self)

    def __call__(self, fd: int) -> None:
        self.calls += 1
        self.entered.set()
        self.release.wait(60)  # a safety net against a hang, not a timing assertion
        self._real(fd)
        self.returned.set()


def test_write_returns_while_the_writer_is_in_fsync(tmp_path, monkeypatch):
    sink = TenantLogSink(tmp_path)
    assert sink._thread is None  # started by the first write
    fs = _BlockedFsync(monkeypatch)
    sink.write(make_record(0, ts=1.0))
    writer = sink._thread
    assert writer is not None and writer.name == "agentspec-log-writer" and writer.daemon
    assert fs.entered.wait(60)  # the writer thread is inside the (slow) fsync
    for i in range(1, 6):
        sink.write(make_record(i, ts=1.0 + i))  # returns although that fsync has not
    assert not fs.returned.is_set() and fs.calls == 1
    fs.release.set()
    assert sink.flush()
    assert [r.request_id for r in read_records(tmp_path)] == [f"req-{i}" for i in range(6)]
    sink.close()


def test_a_burst_is_written_in_groups(tmp_path, monkeypatch):
    sink = TenantLogSink(tmp_path)
    fs = _BlockedFsync(monkeypatch)
    sink.write(make_record(0, tenant="a"))
    assert fs.entered.wait(60)
    burst = [make_record(i, tenant="ab"[i % 2], ts=100.0 + i) for i in range(1, 201)]
    threads = [threading.Thread(target=lambda k=k: [sink.write(r) for r in burst[k::4]]) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fs.release.set()
    assert sink.flush()
    # the first record's group, then one group of 200 records: one fsync per tenant file
    assert fs.calls == 1 + 2 < len(burst)
    got = sorted(r.request_id for r in read_records(tmp_path))
    assert got == sorted(["req-0"] + [r.request_id for r in burst])
    sink.close()


def test_close_drains_the_queue_and_later_writes_are_synchronous(tmp_path):
    sink = TenantLogSink(tmp_path)
    for i in range(100):
        sink.write(make_record(i, ts=10.0 + i))
    writer = sink._thread
    sink.close()
    assert not writer.is_alive() and not sink.background
    assert [r.request_id for r in read_records(tmp_path)] == [f"req-{i}" for i in range(100)]
    sink.close()  # idempotent
    sink.write(make_record(100, ts=200.0))  # after close: on disk when write returns, no flush needed
    assert list(read_records(tmp_path))[-1].request_id == "req-100"
    assert sink.flush(timeout=0)

    sync = TenantLogSink(tmp_path / "sync", background=False)
    assert sync._thread is None and not sync.background
    sync.write(make_record(1))
    assert [r.request_id for r in read_records(sync.log_dir)] == ["req-1"]
    sync.close()


def test_a_write_racing_close_lands_after_what_was_queued(tmp_path, monkeypatch):
    """close() while the writer is still busy, then a write: the late record is written
    synchronously, but only after everything queued before it (each log stays in write order)."""
    sink = TenantLogSink(tmp_path)
    fs = _BlockedFsync(monkeypatch)
    sink.write(make_record(0, tenant="b", ts=1.0))
    assert fs.entered.wait(60)                    # the writer is in tenant b's fsync
    for i in range(1, 4):
        sink.write(make_record(i, tenant="a", ts=1.0 + i))   # queued behind it, for tenant a
    closer = threading.Thread(target=sink.close)
    closer.start()                                # closed; joins the writer, which is still blocked
    late = threading.Thread(target=sink.write, args=(make_record(99, tenant="a", ts=99.0),))
    late.start()
    late.join(0.2)   # (time for a wrong implementation to append to a.jsonl now: the order check fails then)
    fs.release.set()
    closer.join(60)
    late.join(60)
    assert [r.request_id for r in read_records(tmp_path, tenant="a")] == ["req-1", "req-2", "req-3", "req-99"]


def test_a_full_queue_makes_writers_wait_and_loses_nothing(tmp_path, monkeypatch):
    sink = TenantLogSink(tmp_path, max_queue=2)
    fs = _BlockedFsync(monkeypatch)
    sink.write(make_record(0, ts=1.0))
    assert fs.entered.wait(60)   # the writer holds record 0; the queue is empty
    sink.write(make_record(1, ts=2.0))
    sink.write(make_record(2, ts=3.0))  # the queue is full now
    late = threading.Thread(target=sink.write, args=(make_record(3, ts=4.0),))
    late.start()
    guard = time.monotonic() + 60  # a hang guard, not a timing assertion
    while sink.waits == 0 and time.monotonic() < guard:  # the late writer waits for room
        time.sleep(0.005)
    assert sink.waits == 1
    assert late.is_alive() and not fs.returned.is_set()
    fs.release.set()
    late.join()
    assert sink.flush()
    assert [r.request_id for r in read_records(tmp_path)] == ["req-0", "req-1", "req-2", "req-3"]
    sink.close()


def test_a_failed_group_is_counted_and_the_writer_goes_on(tmp_path, capsys):
    sink = TenantLogSink(tmp_path)
    (tmp_path / "broken.jsonl").mkdir()  # os.open of the log file fails
    sink.write(make_record(0, tenant="broken"))
    sink.write(make_record(1, tenant="fine"))
    assert sink.flush()
    assert sink.failed == 1
    assert "could not write 1 acceptance-log records for tenant 'broken'" in capsys.readouterr().err
    sink.write(make_record(2, tenant="fine"))
    sink.close()
    assert [r.request_id for r in read_records(tmp_path, tenant="fine")] == ["req-1", "req-2"]


_KILLED_WRITER = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("agentspec_telemetry", sys.argv[1],
                                              submodule_search_locations=[os.path.dirname(sys.argv[1])])
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)
sink = mod.TenantLogSink(sys.argv[2], max_bytes=20000, backups=1000)
i = 0
while True:
    sink.write(mod.AcceptanceRecord(request_id=f"r{i}", tenant="k", drafted_per_pos=list(range(50))))
    i += 1
    if i == 50:
        sink.flush()  # 50 records on disk; the writer keeps writing groups until the kill
        print("ready", flush=True)
"""


def test_writer_killed_with_sigkill_leaves_a_parseable_log(tmp_path):
    # the package is loaded by path so the child does not import torch (agentspec/__init__)
    package = REPO / "agentspec" / "telemetry" / "__init__.py"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(package), str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    report = ReadReport()
    ids = [r.request_id for r in read_records(tmp_path, report=report)]
    assert len(ids) >= 50 and report.skipped <= 1
    assert ids == [f"r{i}" for i in range(len(ids))]  # nothing lost before the last line, across rotations


# ---- metrics ---------------------------------------------------------------------------------


def _samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in metrics.registry.collect() for s in fam.samples}


def test_metrics_names_and_values():
    m = Metrics()
    with m.running("acme"):
        assert _samples(m)[("agentspec:num_requests_running", (("tenant", "acme"),))] == 1
        m.observe(make_record())
    m.observe(make_record(finish_reason="length"))
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    text = body.decode()
    for name in ["agentspec:spec_decode_num_drafts_total", "agentspec:spec_decode_num_draft_tokens_total",
                 "agentspec:spec_decode_num_accepted_tokens_total",
                 "agentspec:spec_decode_num_accepted_tokens_per_pos_total",
                 "agentspec:spec_decode_num_draft_tokens_per_pos_total", "agentspec:request_success_total",
                 "agentspec:prompt_tokens_total", "agentspec:generation_tokens_total",
                 "agentspec:time_to_first_token_seconds_bucket", "agentspec:e2e_request_latency_seconds_sum",
                 "agentspec:num_requests_running"]:
        assert f"\n{name}{{" in text, name
    s = _samples(m)
    acme = (("tenant", "acme"),)
    assert s[("agentspec:spec_decode_num_drafts_total", acme)] == 6
    assert s[("agentspec:spec_decode_num_draft_tokens_total", acme)] == 18
    assert s[("agentspec:spec_decode_num_accepted_tokens_total", acme)] == 10
    per_pos = "agentspec:spec_decode_num_accepted_tokens_per_pos_total"
    assert [s[(per_pos, (("position", str(p)), ("tenant", "acme")))] for p in range(4)] == [4, 4, 2, 0]
    assert s[("agentspec:request_success_total", (("finish_reason", "length"), ("tenant", "acme")))] == 1
    assert s[("agentspec:prompt_tokens_total", acme)] == 200
    assert s[("agentspec:e2e_request_latency_seconds_count", acme)] == 2
    assert s[("agentspec:num_requests_running", acme)] == 0


def test_metrics_have_no_created_series():
    from prometheus_client import enable_created_metrics

    enable_created_metrics()   # prometheus_client's default (the switch is process-wide): Metrics turns it off
    m = Metrics()
    m.observe(make_record())
    text = m.render()[0].decode()
    assert "_created" not in text
    assert not any(s.name.endswith("_created") for fam in m.registry.collect() for s in fam.samples)
    # one tenant, four draft positions: counters, two histograms and a gauge, no twin per series
    assert len(text.splitlines()) < 120, len(text.splitlines())


def test_metrics_bound_tenants_and_positions():
    m = Metrics(max_tenants=3, max_positions=5)
    for k in range(10):
        m.observe(make_record(tenant=f"t{k}", drafted_per_pos=list(range(1, 20)), accepted_per_pos=[1] * 19))
    m.observe(make_record(tenant="t1"))  # a tenant seen early keeps its label
    tenants = {dict(labels)["tenant"] for (_, labels) in _samples(m)}
    assert tenants == {"t0", "t1", "t2", OVERFLOW_TENANT}
    s = _samples(m)
    assert s[("agentspec:request_success_total", (("finish_reason", "stop"), ("tenant", OVERFLOW_TENANT)))] == 7
    assert s[("agentspec:request_success_total", (("finish_reason", "stop"), ("tenant", "t1")))] == 2
    positions = {dict(labels).get("position") for (_, labels) in s} - {None}
    assert positions == {"0", "1", "2", "3", "4"}
    with pytest.raises(ValueError, match="max_tenants"):
        Metrics(max_tenants=0)


def test_a_tenant_named_other_keeps_its_own_series():
    """The overflow label is no tenant name, so a tenant called "other" never reads (or is read
    as) the tenants past max_tenants."""
    from agentspec.telemetry.records import validate_tenant

    with pytest.raises(ValueError):
        validate_tenant(OVERFLOW_TENANT)
    m = Metrics(max_tenants=1)
    m.observe(make_record(tenant="other"))
    for k in range(3):
        m.observe(make_record(tenant=f"late{k}"))
    s = _samples(m)
    assert s[("agentspec:request_success_total", (("finish_reason", "stop"), ("tenant", "other")))] == 1
    assert s[("agentspec:request_success_total", (("finish_reason", "stop"), ("tenant", OVERFLOW_TENANT)))] == 3
    own = m.render("other")[0].decode()
    assert 'tenant="other"' in own and OVERFLOW_TENANT not in own
    assert "late0" not in m.render()[0].decode()


# ---- summaries and the CLI -------------------------------------------------------------------


def test_parse_since():
    now = 1_000_000.0
    assert parse_since("15m", now=now) == now - 900
    assert parse_since("2h", now=now) == now - 7200
    assert parse_since("7d", now=now) == now - 7 * 86400
    assert parse_since("2026-11-29T10:00+00:00") == 1795946400.0
    assert parse_since("2026-11-29") == time.mktime((2026, 11, 29, 0, 0, 0, 0, 0, -1))  # naive: local time
    for bad in ["yesterday", "15x", "-2h", ""]:
        with pytest.raises(ValueError, match=repr(bad)):
            parse_since(bad)
    assert abs(parse_since("0s") - time.time()) < 5  # default now


def test_summarize_groups_by_tenant_and_route():
    recs = [make_record(i, tenant=t, route=r) for i, (t, r) in enumerate(
        [("a", "default"), ("a", "apply"), ("a", "apply"), ("b", "default")])]
    recs.append(make_record(9, tenant="b", spec_enabled=False, draft_tokens=0, accepted_tokens=0, steps=0,
                            mat=0.0, drafted_per_pos=[], accepted_per_pos=[]))
    s = summarize(recs)
    assert [(r["tenant"], r["route"], r["requests"]) for r in s["routes"]] == [
        ("a", "apply", 2), ("a", "default", 1), ("b", "default", 2)]
    b = s["tenants"][1]
    assert b["spec_on_pct"] == 50 and b["mat"] == pytest.approx(2.25) and b["acceptance_rate"] == pytest.approx(5 / 9)
    assert s["tenants"][0]["acceptance_per_pos"] == pytest.approx([2 / 3, 2 / 3, 0.5, 0.0])
    assert [r["route"] for r in s["by_route"]] == ["apply", "default"]
    assert summarize([]) == {"routes": [], "tenants": [], "by_route": []}


def test_summarize_sessions_totals_per_tenant_and_session():
    recs = [make_record(0, tenant="a", session="s1", cached_tokens=64, e2e_ms=500.0),
            make_record(1, tenant="a", session="s1", cached_tokens=96, e2e_ms=250.0),
            make_record(2, tenant="b", session="s1", e2e_ms=100.0),   # the same id, another tenant
            make_record(3, tenant="a", e2e_ms=1000.0,  # no session; no drafting
                        steps=0, draft_tokens=0, accepted_tokens=0, mat=0.0, drafted_per_pos=[], accepted_per_pos=[])]
    rows = summarize_sessions(recs)["sessions"]
    assert [(r["tenant"], r["session"], r["requests"]) for r in rows] == [("a", None, 1), ("a", "s1", 2), ("b", "s1", 1)]
    s1 = rows[1]
    assert (s1["prompt_tokens"], s1["cached_tokens"], s1["completion_tokens"]) == (201, 160, 40)
    assert (s1["accepted_tokens"], s1["draft_tokens"]) == (10, 18) and s1["acceptance_rate"] == pytest.approx(10 / 18)
    assert s1["mat"] == pytest.approx(2.25) and s1["e2e_s"] == pytest.approx(0.75)
    assert rows[0]["mat"] == 0.0 and rows[0]["acceptance_rate"] is None and rows[0]["e2e_s"] == pytest.approx(1.0)
    assert summarize_sessions([]) == {"sessions": []}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Runs ``agentspec stats`` a few ways on one generated log dir, in parallel."""
    root = tmp_path_factory.mktemp("stats")
    sink = TenantLogSink(root / "logs")
    now = time.time()
    for i in range(12):
        tenant, route = ("alpha", "apply" if i % 3 else "default") if i < 8 else ("beta", "chat")
        session = ("s1" if i < 4 else "s2") if i < 8 else None
        sink.write(make_record(i, tenant=tenant, route=route, ts=now - 60 * (12 - i), session=session,
                               cached_tokens=10))
    sink.write(make_record(99, tenant="beta", route="old", ts=now - 30 * 86400))
    sink.close()
    with open(sink.path("beta"), "ab") as f:
        f.write(b'{"ts": 1.0, "request_')  # torn last line
    runs = {
        "table": ["--log-dir", str(root / "logs")],
        "json": ["--log-dir", str(root / "logs"), "--json", "--since", "7d", "--plot", str(root / "plot.png")],
        "sessions": ["--log-dir", str(root / "logs"), "--by", "session"],
        "sessions_json": ["--log-dir", str(root / "logs"), "--by", "session", "--json", "--tenant", "alpha"],
        "bad_since": ["--log-dir", str(root / "logs"), "--since", "yesterdayish"],
        "missing": ["--log-dir", str(root / "nope")],
    }
    procs = {k: subprocess.Popen([sys.executable, "-m", "agentspec", "stats", *a], cwd=REPO, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for k, a in runs.items()}
    out = {}
    for k, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        out[k] = (p.returncode, stdout, stderr)
    out["root"] = root
    return out


def test_stats_cli_prints_rows_per_tenant_and_route(cli_runs):
    rc, stdout, stderr = cli_runs["table"]
    assert rc == 0, stderr
    lines = stdout.splitlines()
    assert lines[0].split()[:4] == ["tenant", "route", "requests", "spec%"]
    rows = {tuple(line.split()[:3]) for line in lines[1:]}
    assert {("alpha", "apply", "5"), ("alpha", "default", "3"), ("alpha", "*", "8"), ("beta", "chat", "4"),
            ("beta", "old", "1"), ("beta", "*", "5")} == rows
    assert "skipped 1 unparseable line" in stderr


def test_stats_cli_json_and_plot(cli_runs):
    rc, stdout, stderr = cli_runs["json"]
    assert rc == 0, stderr
    data = json.loads(stdout)
    assert data["records"] == 12 and data["skipped_lines"] == 1  # --since 7d drops the month-old record
    assert [(r["tenant"], r["route"], r["requests"]) for r in data["routes"]] == [
        ("alpha", "apply", 5), ("alpha", "default", 3), ("beta", "chat", 4)]
    assert data["tenants"][0]["mat"] == pytest.approx(2.25)
    png = cli_runs["root"] / "plot.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_stats_cli_errors(cli_runs):
    rc, stdout, stderr = cli_runs["bad_since"]
    assert rc == 2 and "'yesterdayish'" in stderr and "Traceback" not in stderr
    rc, stdout, stderr = cli_runs["missing"]
    assert rc != 0 and "log directory not found" in stderr and "nope" in stderr and "Traceback" not in stderr


def test_stats_cli_by_session(cli_runs):
    rc, stdout, stderr = cli_runs["sessions"]
    assert rc == 0, stderr
    lines = stdout.splitlines()
    assert lines[0].split() == ["tenant", "session", "requests", "prompt", "cached", "tokens", "MAT", "accepted",
                                "drafted", "accept", "e2e", "s"]
    rows = {tuple(line.split()[:5]) for line in lines[1:]}
    assert rows == {("alpha", "s1", "4", str(sum(100 + i for i in range(4))), "40"),
                    ("alpha", "s2", "4", str(sum(100 + i for i in range(4, 8))), "40"),
                    ("beta", "-", "5", str(sum(100 + i for i in (8, 9, 10, 11, 99))), "40")}  # 99: no cached_tokens
    rc, stdout, stderr = cli_runs["sessions_json"]
    assert rc == 0, stderr
    data = json.loads(stdout)
    assert data["by"] == "session" and data["records"] == 8
    assert [(r["tenant"], r["session"], r["requests"], r["completion_tokens"]) for r in data["sessions"]] == [
        ("alpha", "s1", 4, 80), ("alpha", "s2", 4, 80)]
    assert data["sessions"][0]["mat"] == pytest.approx(2.25) and data["sessions"][0]["e2e_s"] > 0


def test_plot_shows_n_per_point_and_mat_per_tenant_and_route(tmp_path):
    """The figure's data: per tenant a line of acceptance by depth with each point's n (steps that
    drafted that deep) written next to it, and MAT bars per (tenant, route) labelled n=requests."""
    pytest.importorskip("matplotlib")
    from agentspec.telemetry import plot_summary

    recs = [make_record(i, tenant="acme", route="apply") for i in range(3)]            # depths 4, 0, 3, 2
    recs += [make_record(10, tenant="acme", route="chat", mat=1.5, drafted_per_pos=[2], accepted_per_pos=[1],
                         steps=2)]
    recs += [make_record(20, tenant="beta", route="chat", mat=3.0, drafted_per_pos=[2, 2], accepted_per_pos=[2, 2],
                         steps=2)]   # depth 2 seen twice: 1.0, n=2
    summary = summarize(recs)
    png = tmp_path / "acc.png"
    fig = plot_summary(summary, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    acc, mat = fig.axes
    lines = {ln.get_label(): ln for ln in acc.lines}
    assert set(lines) == {"acme", "beta"}
    assert list(lines["beta"].get_xdata()) == [1, 2] and list(lines["beta"].get_ydata()) == [1.0, 1.0]
    acme = next(t for t in summary["tenants"] if t["tenant"] == "acme")
    assert acme["drafted_per_pos"] == [3 * 3 + 2, 3 * 3, 3 * 2, 3 * 1]   # 3 records' depths 4, 0, 3, 2, then [2]
    assert list(lines["acme"].get_ydata()) == pytest.approx(acme["acceptance_per_pos"])
    # n next to every point, in the tenant's colour
    labels = {}
    for text in acc.texts:
        labels.setdefault(text.get_color(), []).append((tuple(text.xy), text.get_text()))
    assert labels[lines["beta"].get_color()] == [((1, 1.0), "2"), ((2, 1.0), "2")]
    assert [n for _, n in labels[lines["acme"].get_color()]] == [str(n) for n in acme["drafted_per_pos"]]
    # MAT: one bar container per tenant; bars per route that tenant used; labels n=requests
    bars = {c.get_label(): c for c in mat.containers}
    assert set(bars) == {"acme", "beta"}
    assert [p.get_height() for p in bars["acme"].patches] == pytest.approx([2.25, 1.5])   # apply, chat
    assert [p.get_height() for p in bars["beta"].patches] == pytest.approx([3.0])         # chat
    ticks = [t.get_text() for t in mat.get_xticklabels()]
    assert ticks == ["apply", "chat"]
    chat_x = ticks.index("chat")
    for p in (bars["acme"].patches[1], *bars["beta"].patches):   # both tenants' chat bars sit at "chat"
        assert abs(p.get_x() + p.get_width() / 2 - chat_x) < 0.5
    bar_labels = sorted(t.get_text() for t in mat.texts)
    assert bar_labels == ["n=1", "n=1", "n=3"]
    assert plot_summary(summarize([]), None).axes[0].texts[0].get_text() == "no per-position data"


def _python_modules_imported(args: list[str], tmp_path) -> set[str]:
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "agentspec", *args], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}


def test_stats_and_help_do_not_import_torch(tmp_path):
    """``agentspec stats`` (table, JSON, plot) and ``--help`` start in well under a second: no torch."""
    sink = TenantLogSink(tmp_path / "logs")
    sink.write(make_record(0))
    sink.close()
    for args in (["--help"], ["stats", "--help"], ["stats", "--log-dir", str(tmp_path / "empty")],
                 ["stats", "--log-dir", str(tmp_path / "logs"), "--json", "--plot", str(tmp_path / "p.png")]):
        (tmp_path / "empty").mkdir(exist_ok=True)
        mods = _python_modules_imported(args, tmp_path)
        assert "agentspec.cli" in mods or "agentspec" in mods, args
        heavy = sorted(m for m in mods if m.split(".")[0] in ("torch", "transformers", "safetensors")
                       or m.startswith(("agentspec.backends", "agentspec.kernels")))
        assert heavy == [], (args, heavy[:5])


def test_stats_into_a_closed_pipe_exits_quietly(tmp_path):
    """``agentspec stats --json | head``: the reader goes away after a few bytes; no traceback, no
    "Exception ignored" at exit, exit status 141 (128 + SIGPIPE)."""
    sink = TenantLogSink(tmp_path / "logs")
    for i in range(1500):   # rows enough for several pipe buffers of output
        sink.write(make_record(i, route=f"route-{i}"))
    sink.close()
    for extra in ("--json", ""):
        cmd = (f"{sys.executable} -m agentspec stats --log-dir {tmp_path / 'logs'} {extra} | head -c 20 >/dev/null;"
               " echo rc=${PIPESTATUS[0]}")
        out = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr, out.stderr[-3000:]
        assert out.stderr == "" and out.stdout.strip() == "rc=141", (extra, out.stdout, out.stderr[-2000:])


def test_a_broken_pipe_that_is_not_stdout_is_not_hidden(monkeypatch):
    from agentspec import cli

    def broken(argv):
        raise BrokenPipeError(32, "Broken pipe")   # e.g. a socket; stdout is fine

    monkeypatch.setattr(cli, "_main", broken)
    with pytest.raises(BrokenPipeError):
        cli.main(["stats"])
