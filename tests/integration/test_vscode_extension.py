"""The VS Code extension (integrations/editor/vscode) installs from its lockfile, type-checks,
compiles and lints, in a copy of its folder (what a checkout has: no node_modules, no out)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.extended   # extended tier: the VS Code extension's build and lint

EXTENSION = Path(__file__).resolve().parents[2] / "integrations" / "editor" / "vscode"

INSTALL_TIMEOUT_S = 600
BUILD_TIMEOUT_S = 300

# `npm error code X` (npm >= 10; `npm ERR! code X` before) for a registry that cannot be reached
NETWORK_CODES = {
    "ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ECONNRESET", "ETIMEDOUT", "ESOCKETTIMEDOUT",
    "ERR_SOCKET_TIMEOUT", "ENETUNREACH", "EHOSTUNREACH", "ENETDOWN", "EPROXY",
    "E502", "E503", "E504",
}
NPM_ERROR_CODE = re.compile(r"^npm (?:ERR!|error) code (\S+)", re.MULTILINE)
NPM_NETWORK_LINE = re.compile(r"^npm (?:ERR!|error) network ", re.MULTILINE)


def _network_failure(output: str) -> bool:
    codes = set(NPM_ERROR_CODE.findall(output))
    return bool(codes & NETWORK_CODES) or (not codes and NPM_NETWORK_LINE.search(output) is not None)


def _run(npm: str, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NO_COLOR="1", FORCE_COLOR="0", npm_config_update_notifier="false")
    return subprocess.run([npm, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _shown(result: subprocess.CompletedProcess[str]) -> str:
    return (f"`{' '.join(result.args[1:])}` exited {result.returncode}\n"
            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}")


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT_S + 2 * BUILD_TIMEOUT_S + 60)
def test_vscode_extension_compiles_and_lints(tmp_path):
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not found on PATH: cannot build the VS Code extension")
    npm = shutil.which("npm")
    assert npm is not None

    work = tmp_path / "vscode"
    shutil.copytree(EXTENSION, work, ignore=shutil.ignore_patterns("node_modules", "out", "*.vsix"))
    assert (work / "package-lock.json").is_file(), "package-lock.json is not in the extension folder"

    install = _run(npm, ["ci", "--no-audit", "--no-fund"], work, INSTALL_TIMEOUT_S)
    if install.returncode != 0:
        if _network_failure(install.stdout + install.stderr):
            reason = f"npm registry not reachable (npm ci):\n{install.stderr[-2000:]}"
            print(reason)
            pytest.skip(reason)
        pytest.fail("npm ci failed\n" + _shown(install))

    compile_ = _run(npm, ["run", "compile"], work, BUILD_TIMEOUT_S)
    assert compile_.returncode == 0, "compile failed\n" + _shown(compile_)
    lint = _run(npm, ["run", "lint"], work, BUILD_TIMEOUT_S)
    assert lint.returncode == 0, "lint failed\n" + _shown(lint)

    manifest = json.loads((work / "package.json").read_text())
    main = work / manifest["main"]
    assert main == work / "out" / "extension.js", manifest["main"]
    assert main.is_file(), f"{main} was not produced by the compile"
    compiled = main.read_text()
    contributed = {c["command"] for c in manifest["contributes"]["commands"]}
    assert contributed == {"agentspec.editor.rewrite", "agentspec.editor.apply"}
    for command in sorted(contributed):
        assert f'"{command}"' in compiled, f"{command} is contributed but not registered in {main.name}"
    # the server's commands, called through workspace/executeCommand
    for command in ("agentspec.rewrite", "agentspec.apply"):
        assert f'"{command}"' in compiled, f"{main.name} never sends {command}"
