#!/usr/bin/env python
"""The repositories the recorded traffic came from, as workspaces to index.

The recorded rewrites are commits of Aider-AI/aider; the recorded agent turns solve SWE-bench tasks
in django, sympy, matplotlib and the rest. Their exact commits cannot be fetched here (PyPI only),
so each repository's workspace is the released source of its PyPI package at one pinned version
from the middle of the recorded tasks' span: the same files the agent read and the editor had
open, give or take the changes between that release and the task's commit. Each source
distribution is downloaded from PyPI's simple index, checked against the sha256 pinned here (a
changed file is refused), and unpacked to ``DIR/<repository>`` (its top folder stripped).

    python -m benchmarks.workspaces DIR [--repos django,sympy]   # prints DIR

``bench_gguf --workspace DIR`` serves each repository's folder as its own tenant's workspace.
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

# repository (as the record ids name it) -> (PyPI project, version, sdist file name, sha256)
SOURCES: dict[str, tuple[str, str, str, str]] = {
    "aider": ("aider-chat", "0.86.1", "aider_chat-0.86.1.tar.gz",
              "48e489d20a4dfdd90ac4acc781f0170f688aaa5c5f2017d035e2d947fb801bbb"),
    "django": ("django", "4.0", "Django-4.0.tar.gz",
               "d5a8a14da819a8b9237ee4d8c78dfe056ff6e8a7511987be627192225113ee75"),
    "sympy": ("sympy", "1.9", "sympy-1.9.tar.gz",
              "c7a880e229df96759f955d4f3970d4cabce79f60f5b18830c08b90ce77cd5fdc"),
    "matplotlib": ("matplotlib", "3.6.0", "matplotlib-3.6.0.tar.gz",
                   "c5108ebe67da60a9204497d8d403316228deb52b550388190c53a57394d41531"),
    "flask": ("flask", "2.3.0", "Flask-2.3.0.tar.gz",
              "4088b4986f13cae23e02081e67df7e4e434ec6f85a5238bce5e6db6d1de61e06"),
    "pylint": ("pylint", "2.15.0", "pylint-2.15.0.tar.gz",
               "4f3f7e869646b0bd63b3dfb79f3c0f28fc3d2d923ea220d52620fd625aed92b0"),
    "pytest": ("pytest", "7.2.0", "pytest-7.2.0.tar.gz",
               "c4014eb40e10f11f355ad4e3c2fb2c6c6d1919c73f3b5a433de4708202cade59"),
    "sphinx": ("sphinx", "5.3.0", "Sphinx-5.3.0.tar.gz",
               "51026de0a9ff9fc13c05d74913ad66047e104f56a129ff73e174eb5c3ee794b5"),
    "xarray": ("xarray", "2022.11.0", "xarray-2022.11.0.tar.gz",
               "3008a302877f87a0f9043b1f01a4ad4e85b668bbdd38d488764098624632f527"),
    "astropy": ("astropy", "5.1", "astropy-5.1.tar.gz",
                "1db1b2c7eddfc773ca66fa33bd07b25d5b9c3b5eee2b934e0ca277fa5b1b7b7e"),
    "requests": ("requests", "2.28.1", "requests-2.28.1.tar.gz",
                 "7c5599b102feddaa661c826c56ab4fee28bfd17f5abca1ebbe3e7f19d7c97983"),
    "scikit-learn": ("scikit-learn", "1.1.3", "scikit-learn-1.1.3.tar.gz",
                     "bef51978a51ec19977700fe7b86aecea49c825884f3811756b74a3b152bb4e35"),
    "seaborn": ("seaborn", "0.12.1", "seaborn-0.12.1.tar.gz",
                "bb1eb1d51d3097368c187c3ef089c0288ec1fe8aa1c69fb324c68aa1d02df4c1"),
}


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
        project, version, filename, sha = sources[repo]
        out[repo] = {"project": project, "version": version, "sdist": filename, "sha256": sha}
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
