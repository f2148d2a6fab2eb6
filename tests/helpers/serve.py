"""``agentspec serve`` in a subprocess on a free loopback port, for the integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``args``: extra ``serve`` options; ``env``: extra environment variables."""

    def __init__(self, tmp: Path, *, config: str | None, repo: Path | None = None, name: str = "server",
                 args: Sequence[str] = (), env: Mapping[str, str] | None = None, timeout: float = 120):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.cwd = tmp
        cmd = [sys.executable, "-m", "agentspec", "serve", "--port", str(self.port)]
        if config is not None:
            cfg = tmp / f"{name}.toml"
            cfg.write_text(config)
            cmd += ["--config", str(cfg)]
        if repo is not None:
            cmd += ["--repo", str(repo)]
        cmd += list(args)
        self._clients: dict[str, openai.OpenAI] = {}
        self.stderr = open(tmp / f"{name}.stderr", "w+")  # noqa: SIM115 - for the server's life; stop() closes it
        self.proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.DEVNULL, stderr=self.stderr,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()  # no process or log file left behind by a failed start
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=1) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    self.stderr.seek(0)
                    raise RuntimeError(f"server exited with {self.proc.returncode}: {self.stderr.read()[-3000:]}")
                try:
                    if http.get(self.base + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        raise RuntimeError(f"server did not become healthy in {timeout:.0f} s")

    def client(self, key: str = "unused") -> openai.OpenAI:
        """One OpenAI client per key for the server's life (thread-safe; closed by ``stop``:
        a client dropped unclosed leaves its pooled sockets to the garbage collector)."""
        if key not in self._clients:
            self._clients[key] = openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=120)
        return self._clients[key]

    def stop(self, sig=signal.SIGTERM) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


# the bundled model's served id, and a file rewrite the server tests ask for
MODEL = "SmolLM2-135M-Instruct"

CODE = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def factorial(n):
    """Return n!."""
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result
'''


def rewrite_messages() -> list[dict]:
    return [{"role": "user", "content": f"Add type hints to this code. Reply with the full code only.\n\n```python\n{CODE}```"}]
