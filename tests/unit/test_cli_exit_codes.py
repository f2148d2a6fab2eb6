"""Every command's exit codes, from the real CLI in a subprocess: bad input or usage exits 2 with
a message naming the value and the fix, a failure at run time exits 1; never a traceback. Each
case fails before a model loads (none does: "model ready" would say so)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def run(args: list[str], cwd: Path, stdin: str = "") -> subprocess.CompletedProcess[str]:
    # no GPU is visible, so a CUDA device is unavailable on any machine
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "agentspec", *args], cwd=cwd, env=env, input=stdin,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def files(tmp_path) -> Path:
    (tmp_path / "prompt.txt").write_text("def add(a, b):\n")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "data.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "typo.toml").write_text('[server]\nmax_queu = 4\n')
    return tmp_path


# (argv, stdin, substrings the message must hold)
USAGE = [
    # --device: a bad name, and a CUDA device where none is available (serve, generate, demo, train-eagle3)
    (["serve", "--device", "gpu"], "", ["'gpu'", "cpu, cuda or cuda:N", "--device cuda"]),
    (["serve", "--device", "cuda"], "", ["--device cuda", "CUDA is not available", "--device cpu"]),
    (["serve", "--device", "cuda:x"], "", ["'cuda:x'", "cpu, cuda or cuda:N"]),
    (["generate", "--device", "mps", "prompt.txt"], "", ["'mps'", "cpu, cuda or cuda:N"]),
    (["generate", "--device", "cuda:0", "prompt.txt"], "", ["cuda:0", "CUDA is not available", "--device cpu"]),
    (["demo", "--device", "gpu", "--file", "prompt.txt"], "", ["'gpu'", "--device cuda"]),
    (["demo", "--device", "gpu"], "", ["'gpu'"]),   # demo's default file exists: the device is what is wrong
    (["train-eagle3", "--device", "cuda", "--out", "head", "--data", "data.jsonl"], "",
     ["CUDA is not available", "--device cpu"]),
    # files and folders
    (["serve", "--repo", "nope"], "", ["--repo", "'nope'", "root folder"]),
    (["index", "nope"], "", ["not a directory", "'nope'"]),
    (["generate", "nope.txt"], "", ["prompt file not found", "'nope.txt'"]),
    (["generate", "empty.txt"], "", ["prompt in 'empty.txt' is empty"]),
    (["generate"], "   \n", ["prompt on stdin is empty"]),
    (["stats", "--log-dir", "nope"], "", ["log directory not found", "nope", "--log-dir"]),
    (["demo", "--file", "nope.py"], "", ["file not found", "nope.py", "--file"]),
    (["train-eagle3", "--out", "head"], "", ["--data"]),
    (["train-eagle3", "--out", "head", "--data", "nope.jsonl"], "", ["'nope.jsonl'"]),
    # flags and their combinations
    (["generate", "--drafters", "bogus", "prompt.txt"], "", ["'bogus'", "known"]),
    (["generate", "--top-p", "5", "prompt.txt"], "", ["--top-p", "[0, 1]", "5"]),
    (["generate", "--max-tokens", "0", "prompt.txt"], "", ["--max-tokens must be > 0, got 0"]),
    (["stats", "--plot", "p.png", "--by", "session"], "", ["--plot", "--by session"]),
    (["serve", "--host", "0.0.0.0"], "", ["'0.0.0.0'", "--insecure-no-auth"]),
    (["serve", "--tp", "2"], "", ["--tp", "--backend sglang"]),
    (["serve", "--port", "0"], "", ["--port must be in 1..65535"]),
    (["lsp", "--tcp", "x"], "", ["--tcp", "'x'"]),
    (["lsp", "--tcp", "0.0.0.0:9257"], "", ["--tcp 0.0.0.0:9257", "AGENTSPEC_LSP_TOKEN", "127.0.0.1"]),
    (["cache", "list", "extra"], "", ["takes no names", "agentspec cache clear"]),
    (["cache", "clear", "nope"], "", ["no model cache entry named 'nope'"]),
    (["serve", "--config", "typo.toml"], "", ["unknown key `max_queu` in [server]", "`max_queue`", "valid keys"]),
    (["serve", "--config", "nope.toml"], "", ["cannot read config file", "nope.toml"]),
    (["nosuchcommand"], "", ["invalid choice"]),
]


@pytest.mark.parametrize("args,stdin,want", USAGE, ids=[" ".join(a) for a, _, _ in USAGE])
def test_bad_input_exits_2_naming_the_value_and_the_fix(files, args, stdin, want):
    r = run(args, files, stdin)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "model ready" not in r.stderr, r.stderr[-2000:]
    for text in want:
        assert text in r.stderr, (text, r.stderr[-2000:])
    assert f"agentspec {args[0]}" in r.stderr or "usage: agentspec" in r.stderr


def test_a_runtime_failure_exits_1_naming_it(files):
    """A port in use is found before the model loads (the socket is bound first)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = run(["serve", "--port", str(port)], files)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert f"agentspec serve: cannot listen on 127.0.0.1:{port}" in r.stderr and "--port" in r.stderr
    assert "Traceback" not in r.stderr and "model ready" not in r.stderr
