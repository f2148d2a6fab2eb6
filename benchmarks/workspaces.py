#!/usr/bin/env python
"""The repositories the recorded traffic came from, as workspaces to index.

The recorded rewrites are commits of Aider-AI/aider; the recorded agent turns solve SWE-bench tasks
in django, sympy, matplotlib, flask and others. Their exact commits cannot be fetched here (PyPI
only), so each repository's workspace is the released source of its PyPI package at one pinned
version from before the recorded work (``SOURCES``): the files the agent or the editor had, give
or take the changes between that release and the task's commit, and never the answer. Each
source distribution is downloaded from PyPI's simple index, checked against the sha256 pinned
here (a changed file is refused), and unpacked to ``DIR/<repository>`` (its top folder stripped).

    python -m benchmarks.workspaces DIR [--repos django,sympy]   # prints DIR

``bench_gguf --workspace DIR --methods ...,agentspec:workspace`` serves a copy of DIR as the workspace.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import logger  # noqa: E402

log = logger("workspaces")

INDEX = "https://pypi.org/simple"

# repository (as the record ids name it) -> (PyPI project, version, sdist file name, sha256): for the
# agent turns, a release published before every recorded task of that repository, so that no task's
# fix is in its workspace (SWE-bench tasks are fixed in later releases); for the rewrites, a release
# from before the recorded commits, into which bench_gguf writes each rewritten file as it was
# before its commit (the prompt's copy): the file the editor has open, and no later version of it.
SOURCES: dict[str, tuple[str, str, str, str]] = {
    "aider": ("aider-chat", "0.50.0", "aider_chat-0.50.0.tar.gz",
              "1e67dce40536c40ff14cc318d44e94eca8254d865f8b29d212c4fad5440945fd"),
    "django": ("django", "2.2", "Django-2.2.tar.gz",
               "7c3543e4fb070d14e10926189a7fcf42ba919263b7473dceaefce34d54e8a119"),
    "sympy": ("sympy", "1.1.1", "sympy-1.1.1.tar.gz",
              "ac5b57691bc43919dcc21167660a57cc51797c28a4301a6144eff07b751216a4"),
    "matplotlib": ("matplotlib", "3.5.0", "matplotlib-3.5.0.tar.gz",
                   "38892a254420d95594285077276162a5e9e9c30b6da08bdc2a4d53331ad9a6fa"),
    "flask": ("flask", "2.2.0", "Flask-2.2.0.tar.gz",
              "98b33b13ad76ee9c7a80d2f56a6c578780e55bf8281790c62d50d4b7fadec2b8"),
}


def source_info(repo: str, sources: dict = SOURCES) -> dict | None:
    """What ``repo``'s pinned source is (project, version, sdist, sha256), or None if it has none."""
    return dict(zip(("project", "version", "sdist", "sha256"), sources[repo])) if repo in sources else None


def repository_of(record_id: str) -> str:
    """The repository a recorded prompt came from: ``aider/<commit>/<path>`` -> ``aider``;
    ``<model>/<run>/<owner>__<repo>-<number>#t<turn>`` (a SWE-bench task) -> ``<repo>``."""
    first, _, rest = record_id.partition("/")
    if first == "aider":
        return "aider"
    m = re.search(r"/[^/_]+__(.+)-\d+#t\d+$", "/" + rest)
    if not m:
        raise ValueError(f"no repository in record id {record_id!r}")
    return m[1]


def _sdist_url(index: str, project: str, filename: str) -> tuple[str, str]:
    """(url, sha256) of ``filename`` in a simple index (PEP 691 JSON) for ``project``."""
    import httpx
    from urllib.parse import urljoin

    r = httpx.get(f"{index}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"},
                  timeout=60, follow_redirects=True)
    r.raise_for_status()
    for f in r.json()["files"]:
        if f["filename"] == filename:
            return urljoin(str(r.url), f["url"]), f["hashes"].get("sha256", "")
    raise SystemExit(f"{filename} is not in {index}/{project}/")


def fetch(root: Path, repos: list[str], *, index: str = INDEX, sources: dict = SOURCES) -> dict[str, dict]:
    """``root/<repo>`` for each of ``repos`` (kept when already there and its mark matches); what
    each one is. ``index`` / ``sources``: the simple index and the pins (tests serve their own)."""
    import httpx

    unknown = sorted(set(repos) - set(sources))
    if unknown:
        raise SystemExit(f"no pinned source for {', '.join(unknown)} (known: {', '.join(sorted(sources))})")
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for repo in repos:
        project, _, filename, sha = sources[repo]
        out[repo] = source_info(repo, sources)
        dest, mark = root / repo, root / f".{repo}.sha256"   # the mark: written once the folder is whole
        if dest.is_dir() and mark.is_file() and mark.read_text().strip() == sha:
            continue
        url, listed = _sdist_url(index, project, filename)
        if listed and listed != sha:
            raise SystemExit(f"{filename}: PyPI lists sha256 {listed}, pinned {sha}; refusing it")
        log(f"downloading {filename} for {repo}")
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            path = Path(tmp) / filename
            h = hashlib.sha256()
            with httpx.stream("GET", url, timeout=600, follow_redirects=True) as r, open(path, "wb") as fh:
                r.raise_for_status()
                for chunk in r.iter_bytes(1 << 20):
                    h.update(chunk)
                    fh.write(chunk)
            if h.hexdigest() != sha:
                raise SystemExit(f"{filename}: sha256 {h.hexdigest()}, pinned {sha}; refusing it")
            unpacked = Path(tmp) / "src"
            with tarfile.open(path) as tar:
                tar.extractall(unpacked, filter="data")
            tops = list(unpacked.iterdir())
            if len(tops) != 1 or not tops[0].is_dir():   # an sdist holds one folder, <name>-<version>/
                raise SystemExit(f"{filename}: not a source distribution (one top folder), refusing it")
            top = tops[0]
            mark.unlink(missing_ok=True)
            if dest.exists():
                shutil.rmtree(dest)
            top.rename(dest)
            mark.write_text(sha + "\n")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path, help="folder to hold one subfolder per repository")
    ap.add_argument("--repos", default=",".join(SOURCES), help="comma-separated repositories (default: all)")
    args = ap.parse_args()
    fetch(args.dir, [r for r in args.repos.split(",") if r])
    print(args.dir.resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
