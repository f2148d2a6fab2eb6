"""Start-up: a port in use fails fast (before the model loads), and the step-cost profile
(``agentspec.backends.embedded.step_profile``) is cached on disk per machine, build and model
(``agentspec.backends.embedded.profile_cache``)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from agentspec.backends.embedded import profile_cache, step_profile
from agentspec.backends.embedded.batch import BatchEngine, lower_convex_hull, select_slots
from agentspec.backends.embedded.step_profile import StepProfile

REPO = Path(__file__).resolve().parents[2]


def number(value):
    """The value the cache tests store: a finite number in [0, 1] (else a miss)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value) if 0.0 <= value <= 1.0 else None


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    """A private, enabled profile cache under tmp_path."""
    monkeypatch.setenv("AGENTSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AGENTSPEC_NO_PROFILE_CACHE", raising=False)
    return tmp_path / "cache" / "profiles"


@pytest.fixture
def fake_engine(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    return types.SimpleNamespace(
        model_path=str(model), dtype=torch.bfloat16, kv_dtype=torch.float32, device=torch.device("cpu"),
        deterministic=False, row_cost=0.05, max_context=8192,
        args=types.SimpleNamespace(head_dim=64, n_heads=9, n_kv_heads=3, vocab_size=1000))


# ---- port in use --------------------------------------------------------------------------------


@pytest.mark.slow
def test_port_in_use_fails_fast_before_loading_the_model(tmp_path):
    assert (REPO / "agentspec" / "__main__.py").is_file()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "agentspec", "serve", "--port", str(port)], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONUNBUFFERED": "1", "AGENTSPEC_NO_PROFILE_CACHE": "1"})
    # "fast" means before the model loads: nothing of the load (or of serving) happened
    assert r.returncode != 0, r.stderr
    assert f"127.0.0.1:{port}" in r.stderr
    assert "in use" in r.stderr.lower()
    assert "loaded" not in r.stderr and "model ready" not in r.stderr and "serving" not in r.stderr
    assert "Traceback" not in r.stderr


def test_bind_socket_names_the_address():
    from agentspec.server import bind_socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SystemExit) as exc:
            bind_socket("127.0.0.1", port)
    assert f"127.0.0.1:{port}" in str(exc.value.code)
    sock = bind_socket("127.0.0.1", 0)  # a free port binds, and stays held until closed
    try:
        port = sock.getsockname()[1]
        assert port > 0
        # a second server started at the same time (SO_REUSEADDR too) fails at once, not later
        with pytest.raises(SystemExit) as exc:
            bind_socket("127.0.0.1", port)
        assert f"127.0.0.1:{port}" in str(exc.value.code)
    finally:
        sock.close()


# ---- the cache itself ---------------------------------------------------------------------------


def test_store_and_load_back(cache_env, fake_engine):
    key = profile_cache.engine_key("test", fake_engine, context=1024, rows=33, repeat=5)
    assert profile_cache.load(key, number) is None
    path = profile_cache.store(key, 0.0425)
    assert path is not None and path.parent == cache_env and path.is_file()
    assert profile_cache.load(key, number) == 0.0425
    assert [p.name for p in cache_env.iterdir()] == [path.name]  # no temporary file left behind
    stored = json.loads(path.read_text())
    for field in ("machine", "threads", "native", "model", "dtype", "kv_dtype", "device", "params"):
        assert field in stored["key"], field
    assert stored["key"]["model"]["path"] == str(Path(fake_engine.model_path).resolve())
    assert stored["key"]["dtype"] == "bfloat16" and stored["key"]["threads"] == torch.get_num_threads()


def test_key_changes_are_misses(cache_env, fake_engine, monkeypatch):
    key = profile_cache.engine_key("test", fake_engine, context=1024, rows=33, repeat=5)
    profile_cache.store(key, 0.05)

    def miss(**changes):
        eng = types.SimpleNamespace(**{**vars(fake_engine), **changes})
        k = profile_cache.engine_key("test", eng, context=1024, rows=33, repeat=5)
        assert k != key
        return profile_cache.load(k, number) is None

    assert miss(dtype=torch.float32)
    assert miss(kv_dtype=torch.bfloat16)
    assert miss(device=torch.device("meta"))
    assert profile_cache.load(profile_cache.engine_key("test", fake_engine, context=512, rows=33, repeat=5)) is None
    assert profile_cache.load(profile_cache.engine_key("step_costs", fake_engine, context=1024, rows=33,
                                                       repeat=5)) is None
    # the model file changes (size and mtime)
    Path(fake_engine.model_path).write_bytes(b"GGUF" + bytes(200))
    assert profile_cache.load(profile_cache.engine_key("test", fake_engine, context=1024, rows=33,
                                                       repeat=5)) is None
    Path(fake_engine.model_path).write_bytes(b"GGUF" + bytes(100))
    # another machine / thread count / kernel ISA
    from agentspec.kernels import cpu_isa

    info = cpu_isa.machine_info()
    monkeypatch.setattr(cpu_isa, "machine_info", lambda: {**info, "cpus_usable": 64})
    assert profile_cache.load(profile_cache.engine_key("test", fake_engine, context=1024, rows=33,
                                                       repeat=5)) is None
    monkeypatch.setattr(cpu_isa, "machine_info", lambda: info)
    active = cpu_isa.active
    monkeypatch.setattr(cpu_isa, "active", lambda: "some-other-isa")
    assert profile_cache.load(profile_cache.engine_key("test", fake_engine, context=1024, rows=33,
                                                       repeat=5)) is None
    monkeypatch.setattr(cpu_isa, "active", active)
    assert profile_cache.load(key, number) == 0.05  # all back: a hit again
    monkeypatch.setenv("AGENTSPEC_CPU_LINEAR", "0")  # a kernel switch
    assert profile_cache.load(profile_cache.engine_key("test", fake_engine, context=1024, rows=33,
                                                       repeat=5)) is None


def test_same_file_name_other_key_is_a_miss(cache_env, fake_engine):
    key = profile_cache.engine_key("test", fake_engine, context=1024, rows=33, repeat=5)
    path = profile_cache.store(key, 0.05)
    data = json.loads(path.read_text())
    data["key"]["threads"] += 1  # as if another key hashed to this name
    path.write_text(json.dumps(data))
    assert profile_cache.load(key, number) is None


@pytest.mark.parametrize("content", ["", "{", "not json", "[]", "null", '{"format": 1}',
                                     '{"format": 1, "key": {}, "value": 0.1}'])
def test_corrupt_file_is_a_miss_and_is_replaced(cache_env, fake_engine, content):
    key = profile_cache.engine_key("test", fake_engine, context=1024, rows=33, repeat=5)
    path = profile_cache.path_for(key)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    assert profile_cache.load(key, number) is None
    path.write_bytes(b"\xff\xfe\x00garbage")
    assert profile_cache.load(key, number) is None
    assert profile_cache.store(key, 0.07) == path
    assert profile_cache.load(key, number) == 0.07


def test_bad_values_are_misses(cache_env, fake_engine):
    key = profile_cache.engine_key("test", fake_engine, context=1024, rows=33, repeat=5)
    for bad in (5.0, -0.1, "0.05", None, True, [0.05]):
        profile_cache.store(key, bad)
        assert profile_cache.load(key, number) is None, bad
    skey = profile_cache.engine_key("step_costs", fake_engine, grid=[2, 8], context=1024, repeat=2)
    for bad in ([[2, 0.01]], [[2, 0.01], [2, 0.02]], [[2, -1.0], [8, 0.02]], [[0, 0.01], [8, 0.02]],
                {"2": 0.01, "8": 0.02}, [[2, 0.01], [8, "x"]], [[2.5, 0.01], [8, 0.02]]):
        profile_cache.store(skey, bad)
        assert profile_cache.load(skey, profile_cache.valid_step_costs) is None, bad
    profile_cache.store(skey, [[2, 0.01], [8, 0.02]])
    assert profile_cache.load(skey, profile_cache.valid_step_costs) == {2: 0.01, 8: 0.02}


def test_disabled_by_env(cache_env, fake_engine, monkeypatch):
    key = profile_cache.engine_key("test", fake_engine, context=1024, rows=33, repeat=5)
    profile_cache.store(key, 0.05)
    monkeypatch.setenv("AGENTSPEC_NO_PROFILE_CACHE", "1")
    assert not profile_cache.enabled()
    assert profile_cache.load(key, number) is None
    assert profile_cache.store(key, 0.06) is None
    monkeypatch.setenv("AGENTSPEC_NO_PROFILE_CACHE", "0")
    assert profile_cache.load(key, number) == 0.05


def test_unwritable_cache_dir_does_not_fail(tmp_path, fake_engine, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("AGENTSPEC_CACHE_DIR", str(blocker))  # profiles/ cannot be created under a file
    monkeypatch.delenv("AGENTSPEC_NO_PROFILE_CACHE", raising=False)
    key = profile_cache.engine_key("test", fake_engine, context=1024, rows=33, repeat=5)
    assert profile_cache.store(key, 0.05) is None
    assert profile_cache.load(key, number) is None


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("AGENTSPEC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert profile_cache.cache_dir() == tmp_path / "xdg" / "agentspec" / "profiles"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert profile_cache.cache_dir() == tmp_path / "home" / ".cache" / "agentspec" / "profiles"


# ---- the engines use it ---------------------------------------------------------------------------


def test_row_cost_measured_once_then_cached(cache_env, fake_engine, fake_profile):
    """At an engine's start, on a miss, the row cost's two points are measured and stored (a
    partial profile); on a hit, the same forwards run once over a short context (a warm-up,
    result dropped)."""
    p = StepProfile(fake_engine, base=1)
    assert p.row_cost() is None and p.source == "none"
    expected = (MEASURED[33] - MEASURED[1]) / (32 * MEASURED[1])
    assert p.start() == pytest.approx(expected)
    assert fake_profile == [((1, 33), 1024, step_profile.REPEAT)]
    assert profile_cache.load(p.key, profile_cache.valid_step_costs) == {1: MEASURED[1], 33: MEASURED[33]}
    hit = StepProfile(fake_engine, base=1)
    assert hit.source == "cached" and not hit.complete and hit.start() == pytest.approx(expected)
    assert fake_profile[1:] == [((1, 33), 64, 1)]
    # a row_cost of 2 rows for engines whose rows are not invariant
    assert StepProfile(fake_engine, base=2).row_cost() is None


MEASURED = {1: 0.019, 2: 0.020, 8: 0.025, 16: 0.040, 33: 0.050, 66: 0.090, 132: 0.180, 264: 0.400}


@pytest.fixture
def fake_profile(monkeypatch):
    """step_profile.measure without a model: yields per 'forward', returns MEASURED."""
    runs = []

    def measure(engine, grid, context, repeat):
        runs.append((tuple(grid), context, repeat))
        for _ in range(5):
            yield
        return {n: MEASURED[n] for n in grid}

    monkeypatch.setattr(step_profile, "measure", measure)
    return runs


def test_step_costs_miss_then_cached(cache_env, fake_engine, fake_profile):
    be = BatchEngine(fake_engine, background=False)
    assert be.step_costs_source == "stand-in" and fake_profile == []  # not measured yet
    assert be.step_cost(2) > 0
    assert be.step_costs == lower_convex_hull(MEASURED)  # read with no scheduler: measured now
    # then what a row's attention adds per token of context: a row and 33 at two contexts
    assert be.step_costs_source == "measured"
    assert fake_profile == [(step_profile.GRID, 1024, step_profile.REPEAT),
                            ((2, 33), 256, step_profile.REPEAT), ((2, 33), 4096, step_profile.REPEAT)]
    assert be.profile.row_context_cost == 0.0 and be.costs.row_context_cost == 0.0   # the same at both here
    be.close()
    be2 = BatchEngine(fake_engine, background=False)
    assert be2.step_costs_source == "cached" and len(fake_profile) == 3
    assert be2.step_costs == lower_convex_hull(MEASURED)
    # reading it ran the check: two points timed again, in agreement, so the cached one stands
    assert fake_profile[3:] == [(step_profile.CHECK, 1024, step_profile.REPEAT)] and be2.step_costs_source == "cached"
    be2.close()
    given = BatchEngine(fake_engine, background=False, step_costs={2: 1.0, 264: 2.0})
    assert given.step_costs_source == "given" and given.step_costs == {2: 1.0, 264: 2.0}
    given.close()


def test_the_batch_measures_only_what_the_engine_start_left(cache_env, fake_engine, fake_profile):
    """One profile: the points the engine's start measured for its row cost are not measured
    again; the scheduler measures the rest of the grid and stores the whole."""
    start = StepProfile(fake_engine, base=1)
    start.start()
    eng = types.SimpleNamespace(**vars(fake_engine), step_profile=start)
    be = BatchEngine(eng, background=False)
    assert be.profile is start and be.step_costs_source == "stand-in"
    assert be.step_costs == lower_convex_hull(MEASURED) and be.step_costs_source == "measured"
    rest = tuple(n for n in step_profile.GRID if n not in (1, 33))
    assert fake_profile == [((1, 33), 1024, step_profile.REPEAT), (rest, 1024, step_profile.REPEAT),
                            ((1, 33), 256, step_profile.REPEAT), ((1, 33), 4096, step_profile.REPEAT)]
    assert profile_cache.load(start.key, profile_cache.valid_step_costs) == MEASURED
    be.close()


def test_a_cached_profile_that_the_machine_no_longer_matches_is_measured_again(cache_env, fake_engine,
                                                                                fake_profile):
    """A profile cached while other work shared the cores (every point ~18x slow, the small row
    counts worst) is found out by the start-up check and replaced, on disk too."""
    be = BatchEngine(fake_engine, background=False)
    key = be.profile.key
    be.close()
    stale = {1: 0.470, 2: 0.482, 8: 0.461, 16: 0.434, 33: 2.34, 66: 2.74, 132: 2.89, 264: 6.57}
    profile_cache.store(key, [[n, c] for n, c in sorted(stale.items())])
    be = BatchEngine(fake_engine, background=False)
    assert be.step_costs_source == "cached" and be._step_costs == lower_convex_hull(stale)
    assert be.step_costs == lower_convex_hull(MEASURED) and be.step_costs_source == "measured"
    assert fake_profile == [(step_profile.CHECK, 1024, step_profile.REPEAT), (step_profile.GRID, 1024, step_profile.REPEAT),
                            ((2, 33), 256, step_profile.REPEAT), ((2, 33), 4096, step_profile.REPEAT)]
    assert profile_cache.load(key, profile_cache.valid_step_costs) == MEASURED
    be.close()


def test_draft_rows_cost_what_the_profile_says_on_top_of_the_observed_step(fake_engine):
    """At high batch a step costs ~3x its profiled rows (each request's KV read, which a profile
    over one cache does not pay); a verified row still costs only its compute. The slots' cost
    is the observed step plus the profile's rows, not the profile scaled by the correction."""
    prior = {2: 0.010, 16: 0.018, 33: 0.027, 66: 0.045}
    be = BatchEngine(fake_engine, background=False, step_costs=prior)
    for _ in range(60):
        be.costs.observe(16, 900, 0.054)       # 16 requests, no drafts: 54 ms where 18 was profiled
    assert be.step_cost(16, 900) > 0.045                                  # learnt: ~3x the profile
    cost = be.slot_costs(16, 900)
    assert cost(16) == pytest.approx(0.054, rel=1e-3)                   # the observed step
    assert cost(33) == pytest.approx(0.054 + 0.009, rel=1e-3)           # + the profile's 17 rows
    assert be.step_cost(33, 900) > cost(33) + 0.010                    # the scaled curve: dearer
    # a draft row expected to survive with 0.3 pays against the observed step, not the scaled one
    surv = [[0.3] * 2 for _ in range(16)]
    assert sum(select_slots(surv, 16, 16.0, cost)) == 32
    assert sum(select_slots(surv, 16, 16.0, lambda rows: be.step_cost(rows, 900))) < 32
    be.close()


def test_a_batch_that_always_drafts_still_knows_its_draft_free_step(fake_engine):
    """16 requests whose steps all carry ~30 draft rows (46 rows, 65 ms where the profile says
    ~35): the draft-free step is never observed. The excess is added to every row count (the
    requests' KV read does not depend on the rows), so the 16-row step is priced at what the
    batch pays (~48 ms), not at the hulled per-cell curve's guess between the uncorrected small
    row counts and the corrected large ones (which made the budget draft about half as much)."""
    prior = {2: 0.0144, 8: 0.0166, 16: 0.0194, 33: 0.0298, 66: 0.0500}
    be = BatchEngine(fake_engine, background=False, step_costs=prior)
    for _ in range(80):
        be.costs.observe(46, 900, 0.065)
    p46 = 0.0298 + (0.0500 - 0.0298) * 13 / 33
    cost = be.slot_costs(16, 900)
    assert cost(46) == pytest.approx(0.065, rel=1e-3)
    assert cost(16) == pytest.approx(0.0194 + 0.065 - p46, rel=1e-3)
    assert be.step_cost(16, 900) < 0.8 * cost(16)                      # the per-cell curve: too cheap
    be.close()


def test_the_stand_in_prices_draft_rows_in_seconds_too(cache_env, fake_engine, fake_profile):
    """Until the profile is measured (a cache miss) the stand-in curve is in units of a one-row
    step while the observed steps are seconds: its rows are scaled to the observed step, so
    likely drafts are still verified (unscaled, one extra row would cost ~'0.1 s' and the
    budget never drafted on a fresh machine's first requests)."""
    be = BatchEngine(fake_engine, background=False)
    assert be.step_costs_source == "stand-in"
    for _ in range(60):
        be.costs.observe(8, 900, 0.040)        # 8 requests, no drafts: 40 ms
    cost = be.slot_costs(8, 900)
    assert cost(8) == pytest.approx(be.step_cost(8, 900))
    marginal = (be.costs.cost(16) - be.costs.cost(8)) / be.costs.cost(8)
    assert cost(16) == pytest.approx(cost(8) * (1 + marginal))
    surv = [[0.9, 0.8] for _ in range(8)]
    assert sum(select_slots(surv, 8, 8.0, cost)) > 0
    be.close()


def test_step_costs_measured_by_the_idle_scheduler(cache_env, fake_engine, fake_profile):
    with BatchEngine(fake_engine) as be:  # background scheduler: measures while idle
        deadline = time.monotonic() + 30
        while be.step_costs_source != "measured" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert be.step_costs_source == "measured" and fake_profile[0] == (step_profile.GRID, 1024, step_profile.REPEAT)
        assert be.step_costs == lower_convex_hull(MEASURED)
    assert profile_cache.load(be.profile.key, profile_cache.valid_step_costs) == MEASURED


def test_stand_in_costs_are_increasing_and_conservative():
    for rc in (0.0, 0.04, 0.3, 1.0, 7.0):
        c = step_profile.stand_in(rc)
        ns = sorted(c)
        assert all(c[a] <= c[b] for a, b in zip(ns, ns[1:]))
        assert lower_convex_hull(c) == pytest.approx(c)  # already convex
        # past 33 rows no cheaper per row than a 33-row step
        assert all(c[n] / n >= c[33] / 33 - 1e-12 for n in ns if n > 33)


@pytest.mark.slow
def test_real_profile_runs_one_forward_at_a_time(engine, cache_env, monkeypatch):
    """The measurement behind the profile on the real model: the numbers, and that a pending
    profile lets requests through (the background scheduler measures only while idle)."""
    costs = step_profile.profile(engine, grid=(2, 8), context=300, repeat=1)
    assert sorted(costs) == [2, 8] and all(v > 0 and math.isfinite(v) for v in costs.values())
    monkeypatch.setattr(step_profile, "GRID", (2, 8))
    monkeypatch.setattr(engine, "step_profile", StepProfile(engine))   # in this test's cache folder
    with BatchEngine(engine) as be:
        assert be.step_costs_source == "stand-in"
        [g] = be.generate_many(["Say hi."], max_tokens=4)
        assert len(g.token_ids) >= 1
        deadline = time.monotonic() + 300
        while be.step_costs_source != "measured" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert be.step_costs_source == "measured" and sorted(be.step_costs) == [2, 8]
    monkeypatch.setattr(engine, "step_profile", StepProfile(engine))   # a new start: read from disk
    with BatchEngine(engine, background=False) as be:
        assert be.step_costs_source == "cached"


# ---- serve(): "serving" once /health answers; a failed HTTP start exits non-zero -------------------


def _fake_state(fake_engine):
    from agentspec.server import build_state

    eng = types.SimpleNamespace(**vars(fake_engine), vocab_size=1000, drafter=None)
    return build_state(None, engine=eng, quiet=True)


def test_serving_line_only_once_health_answers(cache_env, fake_engine, fake_profile, tmp_path, monkeypatch, capfd):
    import signal
    import threading
    import urllib.request

    from agentspec.server import bind_socket, serve

    monkeypatch.chdir(tmp_path)
    state = _fake_state(fake_engine)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    seen = {}

    def probe_then_stop():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    seen["health"] = r.status
                    break
            except OSError:
                time.sleep(0.05)
        announced.wait(10)  # the "serving" line is printed after /health answered
        # call serve()'s SIGTERM handler, not a real signal: one that came after serve() returned
        # (and restored the default handler) would end the whole test run
        handler = signal.getsignal(signal.SIGTERM)
        if callable(handler):
            handler(signal.SIGTERM, None)

    announced = threading.Event()
    real_print = print

    def spy_print(*args, **kw):
        real_print(*args, **kw)
        if args and str(args[0]).startswith("[agentspec] try:"):
            announced.set()

    monkeypatch.setattr("builtins.print", spy_print)
    t = threading.Thread(target=probe_then_stop, daemon=True)
    t.start()
    serve(state, host="127.0.0.1", port=port, sock=sock, started=time.perf_counter() - 1.0)
    t.join(15)
    err = capfd.readouterr().err
    assert seen.get("health") == 200
    lines = [ln for ln in err.splitlines() if ln.startswith("[agentspec] serving")]
    assert len(lines) == 1, err
    assert f"http://127.0.0.1:{port}" in lines[0] and "ready in " in lines[0], lines[0]
    assert "[agentspec] try:" in err


def test_http_server_failing_to_start_exits_nonzero(cache_env, fake_engine, fake_profile, tmp_path, monkeypatch):
    from agentspec.server import bind_socket, serve

    monkeypatch.chdir(tmp_path)
    state = _fake_state(fake_engine)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()  # uvicorn cannot serve on a closed socket
    with pytest.raises(SystemExit) as exc:
        serve(state, host="127.0.0.1", port=port, sock=sock)
    assert exc.value.code not in (0, None)
    assert f"127.0.0.1:{port}" in str(exc.value.code) and "failed to start" in str(exc.value.code)


def test_old_profiles_are_pruned(cache_env, fake_engine, monkeypatch):
    monkeypatch.setattr(profile_cache, "KEEP", 3)
    paths = []
    for i in range(5):
        key = profile_cache.engine_key("test", fake_engine, context=1024, rows=33, repeat=i)
        paths.append(profile_cache.store(key, 0.01 * (i + 1)))
        os.utime(paths[-1], ns=(i * 10**9, i * 10**9))  # distinct ages
    profile_cache.store(profile_cache.engine_key("test", fake_engine, context=1024, rows=33, repeat=9), 0.5)
    left = sorted(p.name for p in cache_env.iterdir())
    assert len(left) == 3 and paths[0].name not in left and paths[4].name in left


def test_a_profile_that_no_idle_machine_gives_is_measured_again_and_never_kept(cache_env, fake_engine,
                                                                              monkeypatch):
    """Other work on the cores made the measurement non-monotone (2 rows 317 ms, 8 rows 230): it is
    measured again; kept from disk, it counts as a miss; measured so every time, it is used for
    this process but not stored."""
    bad = {1: 0.300, 2: 0.317, 8: 0.230, 16: 0.235, 33: 0.375, 66: 0.351, 132: 0.411, 264: 0.337}
    seq = [bad, MEASURED]
    runs = []

    def measure(engine, grid, context, repeat):
        runs.append(tuple(grid))
        yield
        got = seq.pop(0) if seq else bad
        return {n: got[n] for n in grid}

    monkeypatch.setattr(step_profile, "measure", measure)
    assert not step_profile.plausible(bad) and step_profile.plausible(MEASURED)
    be = BatchEngine(fake_engine, background=False)
    assert be.step_costs == lower_convex_hull(MEASURED) and runs[:2] == [step_profile.GRID] * 2  # the bad one again
    key = be.profile.key
    be.close()
    profile_cache.store(key, [[n, c] for n, c in sorted(bad.items())])     # an older start kept a bad one
    runs.clear()
    be = BatchEngine(fake_engine, background=False)
    assert be.step_costs_source == "stand-in"                               # not trusted: a miss
    assert be.step_costs == lower_convex_hull(bad)                          # every attempt bad: used ...
    assert len(runs) == step_profile.ATTEMPTS
    assert profile_cache.load(key, profile_cache.valid_step_costs) == bad   # ... and not stored over
    be.close()


def test_row_context_cost_from_two_contexts():
    """The marginal row at two contexts, its growth per token, clamped to what is plausible."""
    short = {2: 0.030, 33: 0.030 + 31 * 0.005}      # 5 ms a row at 256 tokens
    long = {2: 0.035, 33: 0.035 + 31 * 0.007}       # 7 ms a row at 1024
    assert step_profile.row_context_cost_of(short, long, 2, 256, 1024) == pytest.approx(0.002 / 768)
    assert step_profile.row_context_cost_of(long, short, 2, 256, 1024) == 0.0          # never negative
    huge = {2: 0.035, 33: 0.035 + 31 * 0.5}
    assert step_profile.row_context_cost_of(short, huge, 2, 256, 1024) == pytest.approx(0.5 / 1024)
    assert step_profile.row_context_cost_of(short, {2: 0.035}, 2, 256, 1024) == 0.0   # a point missing
