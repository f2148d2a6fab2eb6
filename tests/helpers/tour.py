"""README.md's tour, run as written against a real `agentspec serve` of this repository.

The tour's code blocks are read from README.md itself (so the page cannot drift from what runs):
the shell lines with bash, the Python block with this interpreter, each against a server on a free
loopback port where the README says 127.0.0.1:8000. The tour names no model (the curl lines leave
``model`` out, the Python asks ``/v1/models``), so it runs as written whatever the server serves:
``tests/integration/test_readme_tour.py`` runs it on the bundled model, ``tests/models`` on the
real coder model ``make run`` serves. Two lines cannot run here and are named below (the language
server waits on stdin for an editor; SGLang needs a GPU and a 7B model); any other line added to
the tour is run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from helpers.serve import Server

__all__ = ["NOT_RUN", "ROOT", "check_curl_lines", "check_last_block", "check_python_block", "tour_blocks"]

ROOT = Path(__file__).resolve().parents[2]
NOT_RUN = {  # the tour's lines that need what a test cannot give them, and why
    "agentspec lsp": "the language server: it serves an editor over stdin (tests/integration/test_lsp.py)",
    "agentspec serve --backend sglang": "SGLang on a GPU with a 7B model (tests/sglang on CPU)",
}


def tour_blocks() -> list[tuple[str, str]]:
    """The fenced blocks of README.md's "A tour" section, as (language, text), in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## A tour"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"^```(\w+)\n(.*?)^```$", section, re.M | re.S)


def _on_port(text: str, server: Server) -> str:
    assert "127.0.0.1:8000" in text, text
    return text.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")


def check_curl_lines(server: Server) -> None:
    block = tour_blocks()[0][1]
    assert block.startswith(". .venv/bin/activate"), block
    # activate the venv the tests run in (the README's is .venv of the clone, the same one under `make test`)
    script = block.replace(". .venv/bin/activate", f". {Path(sys.executable).parent / 'activate'}", 1)
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", _on_port(script, server)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    bodies = [json.loads(doc) for doc in re.findall(r"^\{.*?\}$", out.stdout.replace("}{", "}\n{"), re.M)]
    assert len(bodies) == 2, out.stdout
    chat, apply = bodies
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"], chat
    assert apply["merged_code"] and apply["usage"]["completion_tokens"] > 0, apply


def check_python_block(server: Server) -> None:
    code = _on_port(tour_blocks()[1][1], server)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONWARNINGS": "error::ResourceWarning"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    mat = float(lines[0])
    assert mat > 1.0, lines   # the Predicted Output (the file itself) drafts the copied lines
    cached, session_mat = lines[1].split()
    assert int(cached) > 0, lines   # the session's second turn starts with the first turn's prompt
    assert float(session_mat) >= 1.0, lines
    assert "--- " in out.stdout or lines[2:] == [""], lines   # a unified diff, or none if nothing changed
    assert subprocess.run(["git", "diff", "--quiet", "--", "agentspec/text.py"], cwd=ROOT).returncode == 0


def check_last_block(server: Server) -> None:
    lines = [line.split("#")[0].strip() for line in tour_blocks()[2][1].splitlines()]
    run = [line for line in lines if line and not any(line.startswith(skip) for skip in NOT_RUN)]
    skipped = {skip for skip in NOT_RUN if any(line.startswith(skip) for line in lines)}
    assert skipped == set(NOT_RUN), skipped   # a skip that no longer matches a line is stale
    assert run == ["agentspec stats"], run
    client = server.client()
    client.completions.create(model=client.models.list().data[0].id, prompt="def add(a, b):", max_tokens=8,
                              temperature=0)   # a record in logs/ whatever ran before
    # the server's logs/ is in its working folder, where `make run` would have written it
    agentspec = Path(sys.executable).parent / "agentspec"
    out = subprocess.run([str(agentspec), *run[0].split()[1:]], cwd=server.cwd, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "default" in out.stdout and "MAT" in out.stdout, out.stdout
