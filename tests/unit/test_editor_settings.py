"""The VS Code client's settings reach the language server: every setting the extension
contributes and sends (``initializationOptions``, section ``agentspec``) is one the server reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

from agentspec.lsp.server import LIVE_SETTINGS, SETTINGS, _section, _settings

VSCODE = Path(__file__).resolve().parents[2] / "integrations" / "editor" / "vscode"
CLIENT_ONLY = {"command", "args"}   # how the extension starts the server; not sent to it


def contributed() -> set[str]:
    props = json.loads((VSCODE / "package.json").read_text())["contributes"]["configuration"]["properties"]
    return {key.removeprefix("agentspec.") for key in props}


def sent() -> set[str]:
    """The keys of ``serverSettings()``'s object literal in extension.ts."""
    src = (VSCODE / "src" / "extension.ts").read_text()
    body = re.search(r"function serverSettings\(\): ServerSettings \{(.*?)\n\}", src, re.S).group(1)
    pairs = re.findall(r"(\w+): text\(\"(\w+)\"\)", body[body.index("return {"):])
    assert all(key == setting for key, setting in pairs), pairs   # each sent under its setting's name
    return {key for key, _ in pairs}


def test_every_setting_the_extension_sends_is_read_by_the_server():
    keys = sent()
    assert keys >= {"url", "apiKey", "model", "route"}, keys
    assert keys == contributed() - CLIENT_ONLY           # what the user can set is what is sent
    assert keys <= set(SETTINGS), keys - set(SETTINGS)   # and the server reads each of them


def test_settings_keep_the_route_and_drop_unset_values():
    assert _settings({"url": None, "route": "editor", "model": None, "command": "agentspec"}) == {"route": "editor"}
    assert "route" in LIVE_SETTINGS   # a change applies to the next command without a restart


def test_did_change_configuration_section_shapes():
    assert _section({"agentspec": {"route": "a"}}) == {"route": "a"}   # VS Code: {section: settings}
    assert _section({"route": "a"}) == {"route": "a"}                   # a client sending the section itself
    assert _section(None) is None


def test_docs_settings_table_lists_what_the_server_reads():
    """docs/editors.md's table of settings names every key the language server reads, and no other."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "editors.md").read_text()
    table = page[page.index("| Key | Default |"):]
    table = table[:table.index("\n\n")]
    documented = set(re.findall(r"^\| `(\w+)` \|", table, re.M))
    assert documented == set(SETTINGS), (documented ^ set(SETTINGS))
