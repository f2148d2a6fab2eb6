"""deploy/sglang-router/launch.sh: every worker gets the paths the user meant, made absolute
before the script enters the worker's own folder (DRY_RUN=1 prints each worker's command)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

LAUNCH = Path(__file__).resolve().parents[2] / "deploy" / "sglang-router" / "launch.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="launch.sh needs bash")


def dry_run(cwd: Path, **env: str | None) -> subprocess.CompletedProcess[str]:
    """``launch.sh workers`` with DRY_RUN=1 in ``cwd``; ``env`` on top (None: unset, the script's default)."""
    full = {k: v for k, v in os.environ.items()
            if k not in {"MODEL", "CONFIG", "REPO", "RUN_DIR", "AGENTSPEC", "BACKEND_ARGS", "WORKER_ARGS"}}
    full.update({"DRY_RUN": "1", "WORKERS": "2", "BACKEND_ARGS": "", "WORKER_ARGS": ""})
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    return subprocess.run(["bash", str(LAUNCH), "workers"], cwd=cwd, env=full, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)


def workers(out: str) -> list[tuple[Path, list[str]]]:
    """(folder, argv) per ``worker i: cd DIR && CUDA_VISIBLE_DEVICES=... ARGV`` line."""
    got = []
    for line in out.splitlines():
        words = shlex.split(line.split(": ", 1)[1])
        assert words[0] == "cd" and words[2] == "&&" and words[3].startswith("CUDA_VISIBLE_DEVICES="), line
        got.append((Path(words[1]), words[4:]))
    return got


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_default_repo_is_the_folder_it_runs_from_not_each_workers_run_folder(tmp_path):
    repo = tmp_path / "repo"
    (repo / "bin").mkdir(parents=True)
    (repo / "server.toml").write_text("")
    r = dry_run(repo, AGENTSPEC="bin/agentspec")   # defaults: REPO=., CONFIG=./server.toml, RUN_DIR=./run
    assert r.returncode == 0, r.stderr
    got = workers(r.stdout)
    assert len(got) == 2
    for i, (folder, argv) in enumerate(got):
        assert folder == repo / "run" / f"worker-{i}"
        assert flag(argv, "--repo") == str(repo)            # not ".", which the worker would read in its folder
        assert flag(argv, "--config") == str(repo / "server.toml")
        assert argv[0] == str(repo / "bin" / "agentspec") and argv[1] == "serve"
        assert flag(argv, "--port") == str(8001 + i)
    assert not (repo / "run" / "worker-0").exists()           # a dry run starts nothing


def test_relative_paths_are_from_where_it_runs(tmp_path):
    (tmp_path / "src" / "app").mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "agentspec.toml").write_text("")
    (tmp_path / "models" / "m").mkdir(parents=True)
    r = dry_run(tmp_path, REPO="src/app", CONFIG="etc/agentspec.toml", RUN_DIR="state")
    assert r.returncode == 0, r.stderr
    for folder, argv in workers(r.stdout):
        assert folder.parent == tmp_path / "state"
        assert flag(argv, "--repo") == str(tmp_path / "src" / "app")
        assert flag(argv, "--config") == str(tmp_path / "etc" / "agentspec.toml")
        assert argv[0] == "agentspec"                          # a name stays a name (found on PATH)
    # the default BACKEND_ARGS carry MODEL: a local folder becomes absolute too
    (tmp_path / "server.toml").write_text("")
    r = dry_run(tmp_path, WORKERS="1", MODEL="models/m", BACKEND_ARGS=None)
    assert r.returncode == 0, r.stderr
    ((_, argv),) = workers(r.stdout)
    assert flag(argv, "--model") == str(tmp_path / "models" / "m") and flag(argv, "--tp") == "1"


def test_a_repo_that_is_not_a_folder_is_refused_naming_it(tmp_path):
    (tmp_path / "server.toml").write_text("")
    r = dry_run(tmp_path, REPO="nope")
    assert r.returncode == 2 and "REPO is not a directory" in r.stderr and "nope" in r.stderr, r
    assert r.stdout == ""
