"""``agentspec lsp --tcp`` with ``$AGENTSPEC_LSP_TOKEN``: the real server process, real sockets on
loopback, the LSP's JSON-RPC framing written by hand (no client library between the test and
the bytes), and a recording HTTP backend as the editor's ``url`` (remote mode: no model loads, and
the backend sees every command that runs, with the buffer and settings it ran with).

Each connection is its own session: a second peer that never sent ``initialize`` gets nothing
done (no command reaches the backend, no status, its buffers and settings never reach the first
peer's session, ``shutdown``/``exit`` end nothing of the first), and the first peer is still
answered on its own socket; a peer with a wrong token is hung up on and locks nobody out; one
editor at a time, and the listener ends with its session. Before ``initialize``, stdio refuses
requests too.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Callable

import pytest
from helpers.serve import free_port

pytestmark = pytest.mark.slow

TOKEN = "lsp-tcp-token-5170"
NOT_INITIALIZED = -32002   # ServerNotInitialized
READ_TIMEOUT_S = 60        # any one read: a hang fails the test instead of stalling it
UTIL = "def add(a, b):\n    return a + b\n"
UPDATE = 'def add(a, b):\n    """Sum."""\n    return a + b\n'


class _Recorder(BaseHTTPRequestHandler):
    """``GET /health`` is fine; every POST (``/v1/apply``) is recorded and refused with a 400."""

    def do_GET(self) -> None:   # noqa: N802 - http.server's name
        self._reply(200, {"status": "ok"})

    def do_POST(self) -> None:   # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.posts.append((self.path, json.loads(body or b"null")))  # type: ignore[attr-defined]
        self._reply(400, {"error": {"message": "recording backend: nothing generated here",
                                    "type": "invalid_request_error"}})

    def _reply(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def backend():
    """The editor's ``url``: an HTTP/1.0 server on loopback (one connection per request, one thread)."""
    http = HTTPServer(("127.0.0.1", 0), _Recorder)
    http.posts = []  # type: ignore[attr-defined]
    http.base = f"http://127.0.0.1:{http.server_address[1]}"  # type: ignore[attr-defined]
    t = threading.Thread(target=http.serve_forever, name="recording-backend", daemon=True)
    t.start()
    yield http
    http.shutdown()
    http.server_close()
    t.join()


@pytest.fixture
def root(tmp_path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "util.py").write_text(UTIL)
    return ws.resolve()


@pytest.fixture
def lsp(tmp_path):
    """``agentspec lsp --tcp 127.0.0.1:PORT`` with a token: (process, port)."""
    port = free_port()
    with open(tmp_path / "lsp.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "agentspec", "lsp", "--tcp", f"127.0.0.1:{port}"],
                                env={**os.environ, "AGENTSPEC_LSP_TOKEN": TOKEN}, cwd=tmp_path,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=30)


class Peer:
    """One LSP connection: messages framed with ``Content-Length``, read with a timeout."""

    def __init__(self, read: Callable[[], bytes], write: Callable[[bytes], None], close: Callable[[], None]) -> None:
        self._read, self._write, self.close = read, write, close
        self.buf = b""
        self.notes: list[dict] = []   # what the server sent that was no reply
        self._ids = 0

    @classmethod
    def connect(cls, port: int, proc: subprocess.Popen) -> Peer:
        """Once the listener accepts (polled: the process is still starting)."""
        deadline = time.monotonic() + 120
        while True:
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        return cls(lambda: sock.recv(65536), sock.sendall, sock.close)

    def send(self, msg: dict) -> None:
        data = json.dumps({"jsonrpc": "2.0", **msg}).encode()
        self._write(b"Content-Length: %d\r\n\r\n" % len(data) + data)

    def notify(self, method: str, params: dict | None = None) -> None:
        self.send({"method": method, **({"params": params} if params is not None else {})})

    def request(self, method: str, params: dict | None = None) -> dict:
        """The reply (``result`` or ``error``) to one request."""
        self._ids += 1
        rid = self._ids
        self.send({"id": rid, "method": method, **({"params": params} if params is not None else {})})
        while True:
            msg = self.receive()
            if msg.get("id") == rid and "method" not in msg:
                return msg
            self.notes.append(msg)

    def receive(self) -> dict:
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, rest = self.buf.split(b"\r\n\r\n", 1)
        n = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        self.buf = rest
        while len(self.buf) < n:
            self._more()
        msg, self.buf = json.loads(self.buf[:n]), self.buf[n:]
        return msg

    def _more(self) -> None:
        chunk = self._read()
        if not chunk:
            raise ConnectionError("the language server closed the connection")
        self.buf += chunk

    def hung_up(self) -> bool:
        """Whether the server closes this connection (True) rather than keep it open (False:
        nothing within the read timeout); anything it sent first is skipped."""
        try:
            while self._read():
                pass
        except (socket.timeout, TimeoutError):
            return False
        except ConnectionError:
            pass
        return True

    def initialize(self, root: Path, **options) -> dict:
        reply = self.request("initialize", {
            "processId": None, "rootUri": root.as_uri(), "capabilities": {},
            "workspaceFolders": [{"uri": root.as_uri(), "name": root.name}], "initializationOptions": options})
        if "result" in reply:
            self.notify("initialized", {})
        return reply


def apply_args(root: Path) -> dict:
    return {"command": "agentspec.apply", "arguments": [{"uri": (root / "util.py").as_uri(), "update": UPDATE}]}


def applies(backend) -> list[dict]:
    return [body for path, body in backend.posts if path.endswith("/apply")]


def test_a_second_peer_that_never_initialized_gets_nothing_done(lsp, backend, root):
    proc, port = lsp
    editor = Peer.connect(port, proc)
    intruder = None
    try:
        assert "result" in editor.initialize(root, token=TOKEN, url=backend.base)
        intruder = Peer.connect(port, proc)
        uri = (root / "util.py").as_uri()
        intruder.notify("textDocument/didOpen", {"textDocument": {   # would shadow the file in commands
            "uri": uri, "languageId": "python", "version": 1, "text": "def add(a, b):\n    return 'POISON'\n"}})
        intruder.notify("workspace/didChangeConfiguration", {"settings": {"agentspec": {"route": "evil",
                                                                                         "maxTokens": 3}}})
        for method, params in [("agentspec/status", {}),
                               ("workspace/executeCommand", {"command": "agentspec.rewrite", "arguments": [
                                   {"uri": uri, "instruction": "Print it back."}]}),
                               ("shutdown", None)]:
            reply = intruder.request(method, params)
            assert "result" not in reply and reply["error"]["code"] == NOT_INITIALIZED, (method, reply)
        assert intruder.notes == []   # not a progress report, not a message
        intruder.notify("exit")
        assert intruder.hung_up()
        assert backend.posts == [], backend.posts   # no command ran

        # the editor's session: still served, on its own socket, with its own buffers and settings
        st = editor.request("agentspec/status", {})["result"]
        assert st["root"] == str(root) and st["mode"] == "remote" and st["route"] is None, st
        result = editor.request("workspace/executeCommand", apply_args(root))["result"]
        assert result["applied"] is False and "recording backend" in result["reason"], result
        [body] = applies(backend)
        assert body["code"] == UTIL and "route" not in body and "max_tokens" not in body, body
        assert proc.poll() is None
        assert "error" not in editor.request("shutdown")
        editor.notify("exit")
        assert proc.wait(timeout=30) == 0
    finally:
        editor.close()
        if intruder is not None:
            intruder.close()


def test_a_wrong_token_is_hung_up_on_and_locks_nobody_out(lsp, backend, root):
    proc, port = lsp
    peers = []
    try:
        for options in ({"token": "wrong"}, {}, {"token": TOKEN[:-1]}, {"token": "\ud800"}):
            peer = Peer.connect(port, proc)
            peers.append(peer)
            reply = peer.initialize(root, url=backend.base, **options)
            assert "result" not in reply and "token" in reply["error"]["message"], (options, reply)
            assert peer.hung_up(), options
        assert backend.posts == []   # nothing started: not even the health check
        editor = Peer.connect(port, proc)
        peers.append(editor)
        reply = editor.initialize(root, token=TOKEN, url=backend.base)
        assert reply["result"]["capabilities"]["executeCommandProvider"]["commands"], reply
        result = editor.request("workspace/executeCommand", apply_args(root))["result"]
        assert "recording backend" in result["reason"], result
        assert [b["code"] for b in applies(backend)] == [UTIL]
    finally:
        for peer in peers:
            peer.close()


def test_idle_peers_are_capped_and_the_editor_gets_in_once_one_leaves(lsp, backend, root):
    """Peers that connect and never initialize hold a language server each: at most
    MAX_PENDING (8) at a time; one more is hung up on at once, and once an idle one leaves the
    editor is let in."""
    proc, port = lsp
    idle = [Peer.connect(port, proc) for _ in range(8)]
    peers = list(idle)
    try:
        for peer in idle:   # each is a pending connection: it answers before initialize
            assert peer.request("agentspec/status", {})["error"]["code"] == NOT_INITIALIZED
        extra = Peer.connect(port, proc)
        peers.append(extra)
        assert extra.hung_up()
        idle[0].close()
        deadline = time.monotonic() + READ_TIMEOUT_S
        while True:   # the server sees the closed socket on its own schedule: until a peer is answered
            editor = Peer.connect(port, proc)
            peers.append(editor)
            try:
                assert editor.request("agentspec/status", {})["error"]["code"] == NOT_INITIALIZED
                break
            except ConnectionError:
                assert time.monotonic() < deadline, "the editor never got in after an idle peer left"
        assert "result" in editor.initialize(root, token=TOKEN, url=backend.base)
        assert editor.request("agentspec/status", {})["result"]["root"] == str(root)
    finally:
        for peer in peers:
            peer.close()


def test_one_editor_at_a_time_and_the_listener_ends_with_its_session(lsp, backend, root):
    proc, port = lsp
    editor = Peer.connect(port, proc)
    other = None
    try:
        assert "result" in editor.initialize(root, token=TOKEN, url=backend.base)
        other = Peer.connect(port, proc)
        reply = other.initialize(root, token=TOKEN, url=backend.base)
        assert "result" not in reply and "another editor" in reply["error"]["message"], reply
        assert other.hung_up()
        assert editor.request("agentspec/status", {})["result"]["root"] == str(root)
    finally:
        editor.close()   # no shutdown, no exit: the editor went away
        if other is not None:
            other.close()
    assert proc.wait(timeout=30) == 0


def test_stdio_refuses_requests_before_initialize(root):
    proc = subprocess.Popen([sys.executable, "-m", "agentspec", "lsp"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def read() -> bytes:
        ready, _, _ = select.select([proc.stdout], [], [], READ_TIMEOUT_S)
        if not ready:
            raise TimeoutError("no reply from the language server")
        return os.read(proc.stdout.fileno(), 65536)

    def write(data: bytes) -> None:
        proc.stdin.write(data)
        proc.stdin.flush()

    peer = Peer(read, write, lambda: None)
    try:
        reply = peer.request("agentspec/status", {})
        assert "result" not in reply and reply["error"]["code"] == NOT_INITIALIZED, reply
        assert "result" in peer.initialize(root, url="http://127.0.0.1:9")   # remote mode: nothing loads
        assert peer.request("agentspec/status", {})["result"]["root"] == str(root)
        assert "error" not in peer.request("shutdown")
        peer.notify("exit")
        proc.stdin.close()   # as an editor does: the server's reader thread sees the end
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        proc.stdin.close()
        proc.stdout.close()
