"""``agentspec serve``: the OpenAI-compatible server on the embedded engine or SGLang, HTTP only.

``build_state`` (``agentspec.api.state``) loads the backend, the tenants' workspaces, the logs
and metrics; ``create_app`` turns that into a Starlette app over ``agentspec.api.handling``;
``serve`` runs it under uvicorn.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import time
from pathlib import Path

from ..api.state import ServerState, Tenant, build_state, model_id_for
from .app import create_app

__all__ = ["ServerState", "Tenant", "bind_socket", "build_state", "create_app", "model_id_for", "serve"]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_hosts(host: str) -> frozenset:
    """The ``Host`` names a keyless server bound to the loopback address ``host`` answers (the
    port is not part of the name): localhost, 127.0.0.1, [::1] and ``host`` itself."""
    names = {"localhost", "127.0.0.1", "[::1]"}
    h = host.strip().lower()
    names.add(f"[{h}]" if ":" in h and not h.startswith("[") else h)
    return frozenset(names)


def bind_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The server's listening socket, bound and listening now (as uvicorn binds it: SO_REUSEADDR,
    IPv6 when the host has a colon), so that ``agentspec serve`` finds a port in use before it
    loads the model; ``serve`` hands it to uvicorn (no window in which another process can take
    the port). It listens at once because Linux lets two SO_REUSEADDR sockets bind one port while
    neither listens: two servers started together would both bind, and one fail only at uvicorn's
    listen, after loading the model. Connections made while the model loads wait in the backlog
    and are answered once the server is up. Raises SystemExit naming host:port on failure."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        why = e.strerror or str(e)
        hint = " (another server running there? choose another --port)" if e.errno in (98, 48, 10048) else ""
        raise SystemExit(f"agentspec serve: cannot listen on {where}: {why}{hint}") from None
    sock.set_inheritable(True)
    return sock


def process_age() -> float | None:
    """Seconds since this process started (Linux ``/proc``), or None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


def _health_answers(host: str, port: int, deadline: float) -> bool:
    """One real ``GET /health`` on the address just bound (loopback for a wildcard), retried
    until it answers 200 or ``deadline`` (monotonic) passes."""
    import http.client

    target = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    while True:
        conn = http.client.HTTPConnection(target, port, timeout=5)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return True
        except OSError:
            pass
        finally:
            conn.close()
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def try_hint(base: str, model_id: str, *, require_key: bool, log_dir: str | os.PathLike) -> str:
    """The "try:" lines ``serve`` prints once it answers: commands to paste into a POSIX shell.
    With API keys they read the key from ``$AGENTSPEC_API_KEY``: curl's header is in double
    quotes, so the shell expands it (in single quotes the server got the literal text: 401)."""
    if require_key:
        auth, api_key = '"Authorization: Bearer $AGENTSPEC_API_KEY"', "os.environ['AGENTSPEC_API_KEY']"
    else:
        auth, api_key = "'Authorization: Bearer none'", "'none'"
    return f"""[agentspec] try:
  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' -H {auth} \\
    -d '{{"model": "{model_id}", "temperature": 0, "messages": [{{"role": "user", "content": "Write hello world in Python."}}]}}'
  python -c "import openai, os; c = openai.OpenAI(base_url='{base}/v1', api_key={api_key}); print(c.chat.completions.create(model='{model_id}', temperature=0, messages=[{{'role': 'user', 'content': 'Hi'}}]).choices[0].message.content)"
  agentspec stats --log-dir {log_dir}"""


def serve(state: ServerState, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
          sock: socket.socket | None = None, started: float | None = None) -> None:
    """Run the server until SIGINT/SIGTERM. The batch scheduler runs on this (the main) thread and
    uvicorn's event loop on another: on CPU, torch's OpenMP kernels are ~1.5x faster when the
    process's main thread issues them (see ``BatchEngine``).

    ``sock``: the listening socket from ``bind_socket`` (default: bound here). ``started``: the
    ``time.perf_counter()`` the start-up began at, for the start-up time in the "serving" line,
    which is printed once ``GET /health`` answers. Raises SystemExit (non-zero) when the HTTP
    server fails to start or stops without being asked to."""
    import signal
    import threading

    import uvicorn

    if sock is None:
        sock = bind_socket(host, port)
    backend = state.backend
    if not state.require_key and is_loopback(host):
        state.allowed_hosts = loopback_hosts(host)
    app = create_app(state)
    base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def announce():  # once the HTTP server is up and /health answers
        while not server.started:
            if not http.is_alive() or stopping.is_set():
                return
            time.sleep(0.05)
        if not _health_answers(host, port, time.monotonic() + 30):
            if not stopping.is_set():
                print(f"[agentspec] warning: {base}/health does not answer", file=sys.stderr, flush=True)
            return
        ready = "" if started is None else f"; ready in {time.perf_counter() - started:.1f}s"
        age = process_age()
        ready += "" if age is None else f", {age:.1f}s after process start"
        tenants = ", ".join(state.tenants)
        costs = backend.stats().get("step_costs_source")
        costs = "" if costs is None else f"; step costs: {costs}" + (
            ", measuring between requests" if costs == "stand-in" else "")
        print(f"[agentspec] serving {state.model_id!r} on {base}  (tenants: {tenants}; "
              f"logs: {Path(state.config.server.log_dir).resolve()}{costs}{ready})", file=sys.stderr, flush=True)
        print(try_hint(base, state.model_id, require_key=state.require_key, log_dir=state.config.server.log_dir),
              file=sys.stderr, flush=True)
    grace = state.config.server.shutdown_grace_s
    # uvicorn's own limit only backs ours up: by `grace` the jobs are cancelled and their
    # responses end within a decode step; what still runs 5 s later uvicorn cancels
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=grace + 5))
    failure: list[BaseException] = []
    stopping = threading.Event()
    cutoff: list[threading.Timer] = []

    def run_http():
        try:
            server.run(sockets=[sock])
        except BaseException as e:  # noqa: BLE001 - uvicorn ends a failed start with sys.exit(3)
            failure.append(e)
        finally:  # uvicorn stopped (or failed to start): stop the scheduler too
            backend.close()

    http = threading.Thread(target=run_http, name="agentspec-http", daemon=True)
    herald = threading.Thread(target=announce, name="agentspec-announce", daemon=True)

    def cut_off():   # the grace period is over (a thread of its own: it may print)
        n = state.cancel_jobs()
        if n:
            print(f"[agentspec] shutdown grace period of {grace:g} s is over: cancelling {n} request(s)",
                  file=sys.stderr, flush=True)

    def stop(signum, frame):
        """SIGTERM / SIGINT: drain. uvicorn closes the listening socket at once (new connections
        are refused) and waits for the responses in flight; a request that still reaches a handler
        gets 503 (``state.draining``); the running ones go on for up to ``shutdown_grace_s``,
        then are cancelled (their clients get a 503 ``shutting_down`` error). Once uvicorn is
        done, ``run_http`` closes the backend, which ends ``backend.run()`` on this thread. A
        second signal cancels at once and exits without waiting for the responses (uvicorn's
        force exit; the acceptance records are still written)."""
        state.draining = True
        if stopping.is_set() or grace <= 0:
            state.cancel_jobs()
            server.force_exit = stopping.is_set()
        elif not cutoff:
            timer = threading.Timer(grace, cut_off)
            timer.name, timer.daemon = "agentspec-shutdown-grace", True
            cutoff.append(timer)
            timer.start()
        stopping.set()
        server.should_exit = True
        if not http.is_alive():   # no HTTP server to wait for (not started, or already gone)
            backend.close()

    def start_threads():  # once the scheduler takes requests on this thread
        http.start()
        herald.start()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        backend.run(on_ready=start_threads)   # returns once the backend is closed
    finally:
        server.should_exit = True
        if http.is_alive():
            http.join(grace + 15)
        for timer in cutoff:
            timer.cancel()
            timer.join()
        for s, h in previous.items():
            signal.signal(s, h)
        state.close()   # the backend is closed already; the workspaces, then the acceptance logs
        sock.close()
    if not stopping.is_set():  # the HTTP server ended on its own: a failed start or a crash
        what = "failed to start" if not server.started else "stopped unexpectedly"
        why = f": {failure[0]!r}" if failure and not isinstance(failure[0], SystemExit) else ""
        raise SystemExit(f"agentspec serve: the HTTP server on {base} {what}{why} (see the log above)")
