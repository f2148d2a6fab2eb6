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
    (["generate", "--top-p", "5", "prompt.txt"], "", ["--top-p must be > 0 and <= 1, got 5"]),
    (["generate", "--top-p", "0", "prompt.txt"], "", ["--top-p must be > 0 and <= 1, got 0"]),
    (["generate", "--temperature", "2.5", "prompt.txt"], "", ["--temperature must be >= 0 and <= 2, got 2.5"]),
    (["generate", "--temperature", "nan", "prompt.txt"], "", ["--temperature", "got nan"]),
    (["generate", "--budget", "2000", "prompt.txt"], "", ["--budget must be >= 0 and <= 1024, got 2000"]),
    (["train-eagle3", "--out", "head", "--data", "data.jsonl", "--temperature", "9"], "",
     ["--temperature must be >= 0 and <= 2, got 9"]),
    (["stats", "--plot", "p.txt"], "", ["--plot 'p.txt'", ".png, .svg or .pdf"]),
    (["stats", "--plot", "p"], "", ["--plot 'p'", ".png"]),
    (["stats", "--plot", "nodir/p.png"], "", ["--plot 'nodir/p.png'", "'nodir' does not exist"]),
    (["generate", "--max-tokens", "0", "prompt.txt"], "", ["--max-tokens must be > 0, got 0"]),
    (["stats", "--plot", "p.png", "--by", "session"], "", ["--plot", "--by session"]),
    (["serve", "--host", "0.0.0.0"], "", ["'0.0.0.0'", "--insecure-no-auth"]),
    (["serve", "--tp", "2"], "", ["--tp", "--backend sglang"]),
    (["serve", "--max-context", "0"], "", ["--max-context must be > 0, got 0"]),
    (["serve", "--backend", "sglang", "--max-context", "4096"], "", ["--max-context is an option of the embedded"]),
    (["serve", "--port", "0"], "", ["--port must be in 1..65535"]),
    (["lsp", "--tcp", "x"], "", ["--tcp", "'x'"]),
    (["lsp", "--tcp", "0.0.0.0:9257"], "", ["--tcp 0.0.0.0:9257", "AGENTSPEC_LSP_TOKEN", "127.0.0.1"]),
    (["cache", "list", "extra"], "", ["takes no names", "agentspec cache clear"]),
    (["cache", "clear", "nope"], "", ["no model cache entry named 'nope'"]),
    (["serve", "--config", "typo.toml"], "", ["unknown key `max_queu` in [server]", "`max_queue`", "valid keys"]),
    (["serve", "--config", "nope.toml"], "", ["cannot read config file", "nope.toml"]),
    (["nosuchcommand"], "", ["invalid choice"]),
]


# one case per command and kind of mistake runs in `make test` (each is a process start, ~1.7 s);
# the rest in the extended tier
EVERY_RUN = {"serve --device gpu", "generate --device cuda:0 prompt.txt", "serve --repo nope", "generate nope.txt",
             "generate", "stats --log-dir nope", "demo --file nope.py", "train-eagle3 --out head",
             "generate --top-p 5 prompt.txt", "generate --budget 2000 prompt.txt", "stats --plot p.txt",
             "serve --host 0.0.0.0", "lsp --tcp x", "cache clear nope", "serve --config typo.toml", "nosuchcommand"}


@pytest.mark.parametrize("args,stdin,want", [
    pytest.param(a, i, w, id=" ".join(a), marks=() if " ".join(a) in EVERY_RUN else pytest.mark.extended)
    for a, i, w in USAGE])
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


def test_bad_budget_is_blamed_on_budget_not_drafters(files):
    r = run(["generate", "--budget", "2000", "--drafters", "suffix", "prompt.txt"], files)
    error = r.stderr.strip().splitlines()[-1]   # (the usage lines above it list every flag)
    assert r.returncode == 2 and "--budget" in error and "--drafters" not in error, r.stderr[-2000:]


def test_flag_ranges_agree_with_the_engine():
    """The CLI checks --temperature and --budget before the model loads: with the engine's own bounds."""
    from agentspec import cli
    from agentspec.api.protocol import GREEDY_BELOW
    from agentspec.backends.protocol import MAX_TEMPERATURE
    from agentspec.cli import SPEC_BUDGET_MAX, build_parser
    from agentspec.config import SpecConfig
    from agentspec.errors import ConfigError

    assert (cli.MAX_TEMPERATURE, cli.GREEDY_BELOW) == (MAX_TEMPERATURE, GREEDY_BELOW)
    SpecConfig(budget=SPEC_BUDGET_MAX)
    with pytest.raises(ConfigError):
        SpecConfig(budget=SPEC_BUDGET_MAX + 1)
    parse = build_parser().parse_args
    assert parse(["generate", "--temperature", str(MAX_TEMPERATURE), "x"]).temperature == MAX_TEMPERATURE
    with pytest.raises(SystemExit):
        parse(["generate", "--temperature", str(MAX_TEMPERATURE * 1.01), "x"])


@pytest.mark.parametrize("text,want", [("1e-320", 0.0), ("9.9e-6", 0.0), ("1e-5", 1e-5), ("0.7", 0.7), ("0", 0.0)])
def test_a_temperature_near_zero_is_greedy(text, want):
    """Logits divided by 1e-320 overflow to inf (NaN probabilities): under 1e-5 is 0, greedy."""
    from agentspec.cli import build_parser

    for argv in (["generate", "--temperature", text, "x"], ["train-eagle3", "--out", "o", "--temperature", text]):
        assert build_parser().parse_args(argv).temperature == want


def test_stats_plot_without_matplotlib_is_a_usage_error(files, tmp_path):
    """No matplotlib: exit 2 saying what to install, before the logs are read; no traceback."""
    stub = tmp_path / "no_matplotlib"
    (stub / "matplotlib").mkdir(parents=True)
    (stub / "matplotlib" / "__init__.py").write_text(
        'raise ImportError("No module named \'matplotlib\'", name="matplotlib")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "agentspec", "stats", "--log-dir", "nope", "--plot", "p.png"],
                       cwd=files, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    assert "agentspec stats: --plot needs matplotlib" in r.stderr and "pip install matplotlib" in r.stderr
