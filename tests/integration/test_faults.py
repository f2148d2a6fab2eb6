"""Faults, provoked for real: signals to a real `agentspec serve` process, a log file on a full
disk (/dev/full), a workspace deleted under its watcher, a file rewritten while it is indexed,
bad config files through the real CLI, damaged index snapshots, a client that stops reading."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from helpers.serve import Server
from helpers.workspace import continues, until

from agentspec import Workspace

pytestmark = [pytest.mark.slow, pytest.mark.extended]   # extended tier: signals, crashes and restarts

CODE = '''def fibonacci(n):
    """Return the n-th Fibonacci number: marmot-lighthouse."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
'''
COUNT = {"prompt": "1, 2, 3, 4, 5, 6, 7,", "temperature": 0, "speculation": False}


def _records(log_dir: Path, tenant: str = "default") -> list[dict]:
    path = log_dir / f"{tenant}.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _record(log_dir: Path, request_id: str, tenant: str = "default", timeout: float = 30) -> dict:
    found: list[dict] = []

    def seen() -> bool:
        found[:] = [r for r in _records(log_dir, tenant) if r["request_id"] == request_id]
        return bool(found)

    assert until(seen, timeout), f"no log record for {request_id} in {tenant}.jsonl"
    return found[0]


def _metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server for the faults that leave it running: no config (tenant "default", no key),
    the workspace ``repo``, logs in ``logs``."""
    root = tmp_path_factory.mktemp("faults")
    repo = root / "repo"
    repo.mkdir()
    (repo / "fib.py").write_text(CODE)
    s = Server(root, config=None, repo=repo, name="faults")
    yield s, repo
    s.stop()


# ---- 1. SIGTERM drains ------------------------------------------------------------------------------

def _stream_lines(base: str, body: dict, out: dict) -> None:
    """Read a streamed completion into ``out``: "lines" (every data line), "error" (what ended
    the read early, if anything)."""
    out["lines"] = []
    try:
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["lines"].append(line[6:])
    except httpx.HTTPError as e:
        out["error"] = repr(e)


def test_sigterm_drains_running_requests_then_exits_0(tmp_path):
    """SIGTERM mid-generation: the listening socket closes at once (new connections are
    refused), a request that fits the grace period finishes and is logged, one that does not is
    cut at the grace period with a 503 ``shutting_down`` error and logged too, and the process
    exits 0 soon after."""
    grace = 4.0
    s = Server(tmp_path, config=f"[server]\nshutdown_grace_s = {grace}\n", name="drain")
    try:
        short, long_ = {}, {}
        # a long one first, so it is surely running; then a short one that ends within the grace
        t_long = threading.Thread(target=_stream_lines, args=(s.base, {**COUNT, "max_tokens": 4000}, long_))
        t_short = threading.Thread(target=_stream_lines, args=(s.base, {**COUNT, "max_tokens": 40}, short))
        t_long.start()
        assert until(lambda: len(long_.get("lines", [])) >= 2, 60), long_
        t_short.start()
        assert until(lambda: len(short.get("lines", [])) >= 1, 60), short
        s.proc.send_signal(signal.SIGTERM)

        def refused() -> bool:
            """A new request during the drain: refused (the listening socket is closed) or a 503,
            never served, never hung (False while the signal is not handled yet: served)."""
            try:
                r = httpx.post(s.base + "/v1/completions", json={**COUNT, "max_tokens": 2}, timeout=10)
            except httpx.ConnectError:
                return True
            if r.status_code == 200:
                return False
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
            return True

        assert until(refused, 30)
        s.proc.wait(grace + 15)   # a hang guard: the grace period cut the long request
        t_short.join(30)
        t_long.join(30)
    finally:
        s.stop()
    assert s.proc.returncode == 0
    # the short request finished normally: every token, a finish reason, [DONE]
    assert "error" not in short and short["lines"][-1] == "[DONE]", short
    events = [json.loads(x) for x in short["lines"][:-1]]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    # the long one was cut at the grace period with a retryable error, not a dropped connection
    assert "error" not in long_ and long_["lines"][-1] == "[DONE]", long_
    last = json.loads(long_["lines"][-2])
    assert last["error"]["code"] == "shutting_down", last
    # both are in the log (flushed before the exit)
    records = {r["request_id"]: r for r in _records(tmp_path / "logs")}
    short_id, long_id = events[0]["id"], json.loads(long_["lines"][0])["id"]
    assert records[short_id]["finish_reason"] == "length" and records[short_id]["completion_tokens"] == 40
    assert records[long_id]["finish_reason"] == "cancelled" and records[long_id]["status_code"] == 503
    assert 0 < records[long_id]["completion_tokens"] < 4000
    err = (tmp_path / "drain.stderr").read_text()
    assert "Traceback" not in err and "generation failed" not in err, err[-3000:]
    assert "shutdown grace period of 4 s is over: cancelling 1 request" in err, err[-3000:]


# ---- 2. the log disk full -------------------------------------------------------------------------

def test_full_log_disk_is_counted_shown_in_health_and_logging_resumes(served):
    """The tenant's log file is a link to /dev/full (every write fails with ENOSPC, as root
    too): requests are still answered, the failures are counted in /metrics and shown in
    /health, and once the disk "recovers" (the link is removed) records are written again."""
    s, _ = served
    log_dir = s.cwd / "logs"
    r = httpx.post(s.base + "/v1/completions", json={**COUNT, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    _record(log_dir, r.json()["id"])
    assert httpx.get(s.base + "/health", timeout=30).json()["logs"] == "ok"
    errors_before = _metric(s.base, "agentspec:log_write_errors_total")
    log = log_dir / "default.jsonl"
    log.unlink()
    log.symlink_to("/dev/full")
    try:
        for _ in range(2):
            r = httpx.post(s.base + "/v1/completions", json={**COUNT, "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text
        assert until(lambda: _metric(s.base, "agentspec:log_write_errors_total") >= errors_before + 2, 30)
        h = httpx.get(s.base + "/health", timeout=30)
        assert h.status_code == 200
        assert h.json()["status"] == "ok" and h.json()["logs"] == "failing", h.json()
        assert h.json()["log_write_errors"] >= errors_before + 2
    finally:
        log.unlink()   # the disk recovers
    r = httpx.post(s.base + "/v1/completions", json={**COUNT, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    rec = _record(log_dir, r.json()["id"])
    assert rec["finish_reason"] == "length"
    assert not log.is_symlink() and log.is_file()
    assert httpx.get(s.base + "/health", timeout=30).json()["logs"] == "ok"
    assert "No space left on device" in (s.cwd / "faults.stderr").read_text()


# ---- 3. the workspace deleted or replaced under the watcher ----------------------------------------

def test_server_keeps_serving_when_its_workspace_is_deleted_and_replaced(served):
    s, repo = served

    def index_bytes() -> int:
        return httpx.get(s.base + "/health", timeout=30).json()["index_bytes"]

    before = index_bytes()
    shutil.rmtree(repo)
    assert until(lambda: index_bytes() < before, 60), "the watcher never dropped the deleted files"
    r = httpx.post(s.base + "/v1/completions", json={**COUNT, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    h = httpx.get(s.base + "/health", timeout=30)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    r = httpx.post(s.base + "/v1/apply", json={"path": "fib.py", "update": "# x", "max_tokens": 2}, timeout=60)
    assert r.status_code == 404, r.text    # the file is gone: a clean 404, not a 500
    emptied = index_bytes()
    repo.mkdir()
    (repo / "other.py").write_text("def other():\n    return 'heron'\n")
    assert until(lambda: index_bytes() > emptied, 60), "the watcher never indexed the new root's file"
    r = httpx.post(s.base + "/v1/apply", json={"path": "other.py", "update": "# y", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(s.base + "/health", timeout=30).json()["status"] == "ok"
    assert "Traceback" not in (s.cwd / "faults.stderr").read_text()


def test_workspace_root_deleted_then_recreated_or_replaced_is_indexed_again(tmp_path, tokenizer, watcher):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "a.py").write_text("def a():\n    return 'old-walrus-marker'\n")
    with Workspace(root, tokenizer=tokenizer, watch=True) as ws:
        assert continues(ws.index, tokenizer, "def a():\n    return", " 'old-walrus")
        shutil.rmtree(root)
        assert until(lambda: ws.files() == [], 30), ws.files()
        assert not continues(ws.index, tokenizer, "def a():\n    return", " 'old-walrus")
        # recreated in place, with other files (and a folder)
        root.mkdir()
        (root / "b.py").write_text("def b():\n    return 'new-heron-marker'\n")
        (root / "pkg").mkdir()
        (root / "pkg" / "c.py").write_text("def c():\n    return 'nested-otter-marker'\n")
        assert until(lambda: ws.files() == ["b.py", "pkg/c.py"], 30), ws.files()
        assert continues(ws.index, tokenizer, "def b():\n    return", " 'new-heron")
        assert continues(ws.index, tokenizer, "def c():\n    return", " 'nested-otter")
        # and the new tree is watched: an edit in it is followed
        (root / "pkg" / "c.py").write_text("def c():\n    return 'edited-badger-marker'\n")
        assert until(lambda: continues(ws.index, tokenizer, "def c():\n    return", " 'edited-badger"), 30)
        # replaced by a rename (a deploy tool's swap): the tree moved into place is indexed
        staged = tmp_path / "staged"
        staged.mkdir()
        (staged / "d.py").write_text("def d():\n    return 'swapped-lynx-marker'\n")
        shutil.rmtree(root)
        os.rename(staged, root)
        assert until(lambda: ws.files() == ["d.py"], 30), ws.files()
        assert continues(ws.index, tokenizer, "def d():\n    return", " 'swapped-lynx")
        assert not continues(ws.index, tokenizer, "def b():\n    return", " 'new-heron")


# ---- 4. a file that changes while it is indexed ----------------------------------------------------

def _big(version: int, funcs: int = 400) -> str:
    """A big file whose every version has the same size (so only its content tells them apart)."""
    return "".join(f"def f{j}():\n    return 'v{version:04d}-{j}'\n" for j in range(funcs))


def test_file_rewritten_while_it_is_indexed_ends_with_the_final_content(tmp_path, tokenizer):
    """The file is rewritten (same size) while the initial scan tokenizes it, and its mtime is
    set back to what the scan saw, as a coarse file-system clock (1-2 s on some file systems)
    would leave it: the index must still end with the final content. Then a writer rewrites it
    over and over while the watcher updates: again the final content wins."""
    root = tmp_path / "repo"
    root.mkdir()
    big = root / "big.py"
    big.write_text(_big(0))
    seen = big.stat()

    class Rewriting:   # the engine's tokenizer, rewriting big.py once, while its chunks are tokenized
        vocab_size = tokenizer.vocab_size
        done = False

        def encode(self, *a, **k):
            return tokenizer.encode(*a, **k)

        def encode_batch(self, texts):
            if not Rewriting.done and any("v0000-1'" in t for t in texts):
                Rewriting.done = True
                big.write_text(_big(1))
                os.utime(big, ns=(seen.st_atime_ns, seen.st_mtime_ns))
            return tokenizer.encode_batch(texts)

    def final(version: int) -> bool:
        sha = hashlib.sha1(_big(version).encode()).hexdigest()
        with ws._lock:
            return ws._files.get("big.py", {}).get("sha") == sha

    with Workspace(root, tokenizer=Rewriting(), watch=True) as ws:
        assert Rewriting.done
        assert until(lambda: final(1), 30)
        assert continues(ws.index, tokenizer, "def f7():\n    return", " 'v0001-7'")
        assert not continues(ws.index, tokenizer, "def f7():\n    return", " 'v0000-7'")

        last = 0
        for version in range(2, 40):   # as fast as it goes, while the watcher re-indexes
            big.write_text(_big(version))
            last = version
        assert until(lambda: final(last), 30)
        assert ws.wait_idle(30)
        assert final(last)
        assert continues(ws.index, tokenizer, "def f9():\n    return", f" 'v{last:04d}-9'")


# ---- 5. a config with an error at start ---------------------------------------------------------------

@pytest.mark.parametrize("text,names", [
    ("[server\nlog_dir = 'x'\n", ["not valid TOML", "line 1"]),
    ("[server]\nmax_queu = 3\n", ["unknown key `max_queu` in [server]", "did you mean `max_queue`?", "valid keys"]),
    ("[server]\nmax_queue = 'many'\n", ["$.server.max_queue", "Expected `int`"]),
    ("[server]\nshutdown_grace_s = -1\n", ["$.server.shutdown_grace_s"]),
    ('[[tenants]]\nname = "a"\napi_keys = ["sk-123456789"]\n'
     '[[tenants]]\nname = "b"\napi_keys = ["sk-000000000", "sk-123456789"]\n',
     ["tenants[1].api_keys[1]", "'b'", "'a'"]),
])
def test_bad_config_exits_2_naming_the_field(tmp_path, text, names):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    r = subprocess.run([sys.executable, "-m", "agentspec", "serve", "--port", "1", "--config", str(cfg)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr)
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("agentspec serve: config file"), r.stderr
    for name in names:
        assert name in line, (name, line)
    assert "sk-123456789" not in r.stderr    # a duplicated key is named by where it is, not shown
    assert "Traceback" not in r.stderr


# ---- 6. a damaged or foreign index snapshot ---------------------------------------------------------

def test_damaged_or_foreign_snapshots_are_refused_reported_and_rebuilt(tmp_path, tokenizer, capfd):
    repo, snap = tmp_path / "repo", tmp_path / "snap"
    repo.mkdir()
    (repo / "fib.py").write_text(CODE)
    with Workspace(repo, tokenizer=tokenizer, watch=False, snapshot=snap):
        pass
    good_index, good_manifest = (snap / "index.bin").read_bytes(), (snap / "manifest.json").read_text()
    manifest = json.loads(good_manifest)

    def consistent(index: bytes) -> str:   # a manifest that vouches for ``index``
        return json.dumps({**manifest, "index_sha256": hashlib.sha256(index).hexdigest()})

    cases = {
        "truncated index": (good_index[:len(good_index) // 2], good_manifest),
        "truncated index, manifest agreeing": (good_index[:-5], consistent(good_index[:-5])),
        "index from another version": (b"ASSIDX99" + good_index[8:], consistent(b"ASSIDX99" + good_index[8:])),
        "manifest from another version": (good_index, json.dumps({**manifest, "version": 99})),
        "truncated manifest": (good_index, good_manifest[:len(good_manifest) // 2]),
        "manifest not an object": (good_index, "[1, 2, 3]"),
        "manifest with bad file entries": (good_index, json.dumps({**manifest, "files": {"fib.py": 7}})),
        "empty files": (b"", ""),
    }
    capfd.readouterr()
    for what, (index, text) in cases.items():
        (snap / "index.bin").write_bytes(index)
        (snap / "manifest.json").write_text(text)
        with Workspace(repo, tokenizer=tokenizer, watch=False, snapshot=snap) as ws:
            summary = ws.summary()
            assert not summary["loaded_from_snapshot"], what
            assert summary["snapshot_refused"], what
            assert ws.files() == ["fib.py"], what
            assert continues(ws.index, tokenizer, "def fibonacci(n):\n    \"\"\"Return the n-th", " Fibonacci"), what
        err = capfd.readouterr().err
        assert "workspace snapshot" in err and "indexing from scratch" in err, (what, err)
        assert summary["snapshot_refused"] in err, (what, err)
        # close() wrote a good snapshot again: it loads
        with Workspace(repo, tokenizer=tokenizer, watch=False, snapshot=snap) as ws:
            assert ws.summary()["loaded_from_snapshot"] and ws.summary()["snapshot_refused"] is None, what
            assert continues(ws.index, tokenizer, "def fibonacci(n):\n    \"\"\"Return the n-th", " Fibonacci"), what


def test_suffix_index_load_of_any_truncation_or_corruption_is_a_clean_value_error(tmp_path):
    import random

    from suffix_index import SuffixIndex

    ix = SuffixIndex()
    ix.add_document("doc", list(range(1, 40)), tenant="a")
    ix.add_document("doc2", [5, 6, 7], tenant="b")
    ix.start("q", [1, 2], tenant="a")
    ix.extend("q", [3, 4])
    ix.stop("q")   # a history text too
    path = tmp_path / "ix.bin"
    ix.save(path)
    blob = path.read_bytes()
    bad = tmp_path / "bad.bin"
    rng = random.Random(7)
    cases = [blob[:n] for n in range(len(blob))]
    for _ in range(300):   # a flipped byte, or 8 bytes of garbage over a length
        b = bytearray(blob)
        at = rng.randrange(len(b))
        if rng.random() < 0.5:
            b[at] ^= 1 << rng.randrange(8)
        else:
            b[at:at + 8] = rng.randbytes(8)
        cases.append(bytes(b))
    for data in cases:
        bad.write_bytes(data)
        other = SuffixIndex()
        other.add_document("keep", [9, 8, 7], tenant="a")
        try:
            other.load(bad)
        except ValueError as e:
            assert str(bad) in str(e)
            other.start("p", [9, 8], tenant="a")   # a refused load changed nothing
            assert other.propose("p", 1).token_ids == [7]
            other.stop("p")
        # (a corruption that still parses, e.g. inside a token id, may load: that is not a crash)


# ---- 7. a client that reads slowly -----------------------------------------------------------------

def test_stalled_reader_does_not_hold_up_the_engine_or_other_requests(served):
    """A raw socket asks for a long stream and does not read: its generation still runs at full
    speed (its log record is written while the client has read nothing), a normal request
    completes meanwhile, and when the client reads at last it gets the whole stream."""
    s, _ = served
    body = json.dumps({**COUNT, "max_tokens": 200, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # a small window: the server's writes back up
    slow.settimeout(60)
    try:
        slow.connect(("127.0.0.1", s.port))
        slow.sendall(head + body)
        before = {r["request_id"] for r in _records(s.cwd / "logs")}
        assert until(lambda: httpx.get(s.base + "/health", timeout=30).json()["running"] >= 1, 60)
        # a normal request completes while the stalled stream runs (the client's timeout: a hang guard)
        r = httpx.post(s.base + "/v1/completions", json={**COUNT, "max_tokens": 8}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        # the stalled stream's generation finished while its client read nothing
        new: list[dict] = []

        def finished() -> bool:
            new[:] = [x for x in _records(s.cwd / "logs") if x["request_id"] not in before
                      and x["completion_tokens"] == 200]
            return bool(new)

        assert until(finished, 120)
        assert new[0]["finish_reason"] == "length"
        assert httpx.get(s.base + "/health", timeout=30).json()["status"] == "ok"
        data = b""
        while chunk := slow.recv(65536):
            data += chunk
    finally:
        slow.close()
    text = data.decode()
    assert text.startswith("HTTP/1.1 200"), text[:200]
    assert "data: [DONE]" in text
    events = [json.loads(line.strip()[6:]) for line in text.split("\n") if line.startswith("data: {")]
    assert events[0]["id"] == new[0]["request_id"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
