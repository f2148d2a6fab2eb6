"""benchmarks/workspaces.py: which repository a recorded prompt came from, and the fetch of a
repository's pinned source distribution (from a simple index served on loopback here): unpacked
without its top folder, refused when its sha256 is not the pinned one, kept when already there."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks.workspaces import SOURCES, fetch, repository_of


def test_repository_of_record_ids():
    assert repository_of("aider/82250db8afda/aider/analytics.py") == "aider"
    assert repository_of("gemini/20251118/django__django-14122#t002") == "django"
    assert repository_of("gemini/20251118/scikit-learn__scikit-learn-25747#t010") == "scikit-learn"
    assert repository_of("gemini/20251118/pallets__flask-5014#t002") == "flask"
    with pytest.raises(ValueError, match="no repository"):
        repository_of("gemini/20251118/no-task-here")
    assert {"aider", "django", "sympy", "matplotlib", "flask"} <= set(SOURCES)


def _sdist(files: dict[str, str], top: str = "demo-1.0") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def index():
    """A PEP 691 simple index on loopback serving ``blobs`` (file name -> bytes) for project "demo"."""
    blobs: dict[str, bytes] = {}
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            hits.append(self.path)
            if self.path == "/simple/demo/":
                body = json.dumps({"files": [{"filename": n, "url": f"/files/{n}",
                                              "hashes": {"sha256": hashlib.sha256(b).hexdigest()}}
                                             for n, b in blobs.items()]}).encode()
                ctype = "application/vnd.pypi.simple.v1+json"
            elif self.path.startswith("/files/") and self.path[7:] in blobs:
                body, ctype = blobs[self.path[7:]], "application/octet-stream"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/simple", blobs, hits
    srv.shutdown()
    srv.server_close()


def test_fetch_unpacks_checks_and_keeps(tmp_path, index):
    url, blobs, hits = index
    blob = _sdist({"demo/__init__.py": "x = 1\n", "README": "demo\n"})
    blobs["demo-1.0.tar.gz"] = blob
    pins = {"demo": ("demo", "1.0", "demo-1.0.tar.gz", hashlib.sha256(blob).hexdigest())}
    info = fetch(tmp_path, ["demo"], index=url, sources=pins)
    assert info["demo"]["version"] == "1.0"
    assert (tmp_path / "demo" / "demo" / "__init__.py").read_text() == "x = 1\n"   # top folder stripped
    assert sorted(p.name for p in tmp_path.iterdir()) == [".demo.sha256", "demo"]  # no download left
    n = len(hits)
    fetch(tmp_path, ["demo"], index=url, sources=pins)
    assert len(hits) == n   # already there: not fetched again


def test_fetch_refuses_a_changed_file(tmp_path, index):
    url, blobs, _ = index
    blobs["demo-1.0.tar.gz"] = _sdist({"a.py": "changed\n"})
    pins = {"demo": ("demo", "1.0", "demo-1.0.tar.gz", "0" * 64)}
    with pytest.raises(SystemExit, match="refusing it"):
        fetch(tmp_path, ["demo"], index=url, sources=pins)
    assert list(tmp_path.iterdir()) == []   # nothing half-made


def test_fetch_names_unknown_repositories(tmp_path):
    with pytest.raises(SystemExit, match="no pinned source for nope"):
        fetch(tmp_path, ["nope"])


def _rewrite(path: str, text: str) -> list[dict]:
    return [{"role": "user", "content": f"Apply this change to `{path}`:\n\nfix\n\nCurrent contents of `{path}`:\n"
                                        f"```python\n{text}```\n\nReply with the complete updated file and nothing else."}]


def test_workspace_copy_writes_each_rewritten_file_as_its_prompt_holds_it(tmp_path):
    from benchmarks.bench_gguf import workspace_copy

    root = tmp_path / "ws"
    (root / "aider" / "aider").mkdir(parents=True)
    (root / "aider" / "aider" / "a.py").write_text("a later version\n")
    (root / "aider" / "README").write_text("kept\n")
    prompts = [("aider/c1/aider/a.py", _rewrite("aider/a.py", "x = 1\n")),
               ("aider/c2/docker/Dockerfile", _rewrite("docker/Dockerfile", "FROM python  # no newline")),
               ("aider/c3/aider/a.py", _rewrite("aider/a.py", "x = 2\n"))]
    info = workspace_copy(root, prompts, tmp_path / "copy")
    assert (tmp_path / "copy" / "aider" / "aider" / "a.py").read_text() == "x = 1\n"   # the first prompt's copy
    assert (tmp_path / "copy" / "aider" / "docker" / "Dockerfile").read_text() == "FROM python  # no newline"
    assert (tmp_path / "copy" / "aider" / "README").read_text() == "kept\n"
    assert (root / "aider" / "aider" / "a.py").read_text() == "a later version\n"   # the source is untouched
    assert info["files_written"] == ["aider/aider/a.py", "aider/docker/Dockerfile"]
    assert info["prompts_with_an_earlier_copy"] == ["aider/c3/aider/a.py"]
    assert info["repositories"]["aider"]["project"] == "aider-chat"


def test_workspace_copy_names_a_missing_repository(tmp_path):
    from benchmarks.bench_gguf import workspace_copy

    (tmp_path / "ws").mkdir()
    with pytest.raises(SystemExit, match="no folder for django .*--repos django"):
        workspace_copy(tmp_path / "ws", [("gemini/r/django__django-1#t002", [])], tmp_path / "copy")


def test_elided_observations_keep_the_last_ones_and_say_what_was_cut():
    from benchmarks.bench_gguf import elide_observations

    msgs = [{"role": "system", "content": "s" * 500}, {"role": "user", "content": "task " * 100}]
    for k in range(4):
        msgs += [{"role": "assistant", "content": f"run {k} " * 80}, {"role": "user", "content": f"out {k} " * 80}]
    got = elide_observations(msgs, keep=2)
    assert got[:2] == msgs[:2] and [m["role"] for m in got] == [m["role"] for m in msgs]
    assert all(a == b for a, b in zip(got, msgs) if a["role"] == "assistant")   # the model's own turns stay
    cut = [i for i, (a, b) in enumerate(zip(got, msgs)) if a != b]
    assert cut == [3, 5]   # the first two observations; the last two whole
    assert got[3]["content"].startswith(msgs[3]["content"][:200]) and "elided" in got[3]["content"]
    assert elide_observations(msgs, keep=4) == msgs
