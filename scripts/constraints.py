"""Write the pip constraints file: every distribution installed in this interpreter, at its version.

    .venv-latest/bin/python -P scripts/constraints.py --write scripts/constraints.txt

``make test-latest`` runs it after the test suite passed against the newest releases, so
``scripts/constraints.txt`` holds the versions the suite last passed with; ``scripts/setup.sh``
installs every stage under it. Left out: this project itself, pip, setuptools and wheel. Local
version labels (``torch==2.13.0+cpu``) are dropped: a constraint ``==2.13.0`` accepts the CPU and
CUDA builds alike, and where torch comes from is scripts/torch_index.py's choice.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import sys
import tempfile
from pathlib import Path

SKIP = {"agentspec-serve", "pip", "setuptools", "wheel"}
HEADER = """\
# The versions the test suite last passed with: scripts/setup.sh installs every stage under these
# constraints (pip -c), so a new release of a dependency cannot change what a clean clone gets.
# Written by `make test-latest` (scripts/constraints.py) after the suite passed against the newest
# releases with Python {python} on {platform}; move it forward only that way. Packages a stage does not
# install are ignored by pip.
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> list[str]:
    seen: dict[str, str] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if not name:
            continue
        key = canonical(name)
        if key in SKIP:
            continue
        seen[key] = dist.version.split("+", 1)[0]
    return [f"{k}=={v}" for k, v in sorted(seen.items())]


def render() -> str:
    head = HEADER.format(python=".".join(map(str, sys.version_info[:3])), platform=sys.platform)
    return head + "".join(line + "\n" for line in pins())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", metavar="FILE", type=Path, help="write here (atomically) instead of printing")
    args = ap.parse_args(argv)
    text = render()
    if args.write is None:
        sys.stdout.write(text)
        return 0
    fd, tmp = tempfile.mkstemp(prefix=args.write.name + ".", dir=args.write.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, args.write)
    print(f"[constraints] {len(pins())} pins -> {args.write}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
