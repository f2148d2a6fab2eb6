"""``agentspec lsp`` end to end: the real server process over stdio, driven by pytest-lsp's
client, with the bundled model in-process, and in remote mode against a real ``agentspec serve``.

Covers: initialize (commands, code actions, incremental sync), both commands ending in one
``workspace/applyEdit`` of the changed lines, progress reports, cancellation (progress cancel and
``$/cancelRequest``), a buffer edited during generation (refused, nothing applied), bad URIs
(LSP errors, the server lives on), buffer overlays reaching the index, and shutdown/exit. The
text an apply writes is checked against ``POST /v1/apply``'s ``merged_code`` for the same input.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Union

import httpx
import pytest
import pytest_lsp
from lsprotocol import types
from pygls.exceptions import JsonRpcException
from pytest_lsp import ClientServerConfig, LanguageClient, client_capabilities

from agentspec.lsp import apply_edits, line_edits

from helpers.serve import Server

# extended tier: the language server end to end (make test keeps its TCP transport and edit tests)
pytestmark = [pytest.mark.extended, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

UTIL = '''def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def mul(a, b):
    return a * b
'''

UPDATE = '''def sub(a, b):
    """Return a minus b."""
    return a - b
'''


def big_module(n: int = 25) -> str:
    """A file long enough that a rewrite runs for seconds (for cancelling mid-way)."""
    return "".join(f"def f{i}(x):\n    y = x * {i} + {i + 1}\n    return y - {i % 7}\n\n\n" for i in range(n))


@pytest.fixture(scope="module")
def lsp_workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lsp-ws")
    (root / "util.py").write_text(UTIL)
    (root / "big.py").write_text(big_module())
    (root / "notes.md").write_text("# notes\n")
    (root / ".gitignore").write_text(".env\n")
    (root / ".env").write_text("TOKEN = 'gitignored-secret'\n")
    (root / "env_link.py").symlink_to(root / ".env")   # a link to a gitignored file
    (root / "lsp.toml").write_text("[server]\nmax_queue = 64\n")   # the server's config: no command's
    return root.resolve()


class Editor:
    """What the test client plays of an editor: buffers with versions, and applying edits the
    way editors do (refused when the edit names another version)."""

    def __init__(self, client: LanguageClient) -> None:
        self.client = client
        self.docs: dict[str, tuple[str, int]] = {}
        self.applied: list[types.ApplyWorkspaceEditParams] = []

        @client.feature(types.WORKSPACE_APPLY_EDIT)
        def apply_edit(params: types.ApplyWorkspaceEditParams) -> types.ApplyWorkspaceEditResult:
            self.applied.append(params)
            for change in params.edit.document_changes or []:
                uri, version = change.text_document.uri, change.text_document.version
                text, have = self.docs[uri]
                if version is not None and version != have:
                    return types.ApplyWorkspaceEditResult(applied=False, failure_reason="version mismatch")
                edits = [client.protocol._converter.unstructure(e) for e in change.edits]
                self.docs[uri] = (apply_edits(text, edits), have + 1)
            return types.ApplyWorkspaceEditResult(applied=True)

        self.indexed: list = []   # agentspec/indexed notifications, all of them (two can arrive in one read)

        @client.feature("agentspec/indexed")
        def indexed(params) -> None:
            self.indexed.append(params)

    def open(self, path: Path, language: str = "python") -> str:
        uri = path.as_uri()
        text = path.read_text()
        self.docs[uri] = (text, 1)
        self.client.text_document_did_open(types.DidOpenTextDocumentParams(
            text_document=types.TextDocumentItem(uri=uri, language_id=language, version=1, text=text)))
        return uri

    def type_at_end(self, uri: str, s: str) -> int:
        text, v = self.docs[uri]
        lines = text.split("\n")
        pos = types.Position(line=len(lines) - 1, character=len(lines[-1]))
        self.docs[uri] = (text + s, v + 1)
        self.client.text_document_did_change(types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=v + 1),
            content_changes=[types.TextDocumentContentChangePartial(range=types.Range(start=pos, end=pos), text=s)]))
        return v + 1

    def close(self, uri: str) -> None:
        self.client.text_document_did_close(types.DidCloseTextDocumentParams(
            text_document=types.TextDocumentIdentifier(uri=uri)))
        self.docs.pop(uri, None)


async def start(client: LanguageClient, root: Path, options: dict) -> types.InitializeResult:
    client.editor = Editor(client)  # type: ignore[attr-defined]
    return await client.initialize_session(types.InitializeParams(
        capabilities=client_capabilities("neovim"), root_uri=root.as_uri(),
        workspace_folders=[types.WorkspaceFolder(uri=root.as_uri(), name=root.name)],
        initialization_options=options))


SERVER = [sys.executable, "-m", "agentspec", "lsp"]


@pytest_lsp.fixture(scope="module", config=ClientServerConfig(server_command=SERVER))
async def lsp(lsp_client: LanguageClient, request):
    root = request.getfixturevalue("lsp_workspace")
    lsp_client.init_result = await start(lsp_client, root, {"notifyIndexed": True,  # type: ignore[attr-defined]
                                                             "config": str(root / "lsp.toml")})
    yield
    await lsp_client.shutdown_session()


async def command(client: LanguageClient, name: str, arg: dict, **kw) -> dict:
    return await client.workspace_execute_command_async(types.ExecuteCommandParams(command=name, arguments=[arg]),
                                                        **kw)


async def status(client: LanguageClient) -> dict:
    """``agentspec/status`` (pygls hands a custom method's result over as a namedtuple)."""
    return (await client.protocol.send_request_async("agentspec/status", {}))._asdict()


async def first_report(client: LanguageClient, seen: set, timeout: float = 120) -> object:
    """The token of the first progress that is not in ``seen`` and has reported generation."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        for token, reports in client.progress_reports.items():
            if token not in seen and any(isinstance(r, types.WorkDoneProgressReport) for r in reports):
                return token
        await asyncio.sleep(0.02)
    raise AssertionError("no progress report")


async def test_initialize_advertises_commands_code_actions_and_incremental_sync(lsp):
    caps = lsp.init_result.capabilities
    assert set(caps.execute_command_provider.commands) >= {"agentspec.rewrite", "agentspec.apply"}
    assert caps.code_action_provider
    sync = caps.text_document_sync
    kind = sync.change if isinstance(sync, types.TextDocumentSyncOptions) else sync
    assert kind == types.TextDocumentSyncKind.Incremental
    assert lsp.init_result.server_info.name == "agentspec"


async def test_apply_writes_what_v1_apply_merges_with_minimal_edits_and_progress(lsp, lsp_workspace, tmp_path):
    ed: Editor = lsp.editor
    uri = ed.open(lsp_workspace / "util.py")
    before = set(lsp.progress_reports)
    result = await command(lsp, "agentspec.apply", {"uri": uri, "update": UPDATE})
    assert result["applied"] is True, result
    assert len(ed.applied) == 1
    text, _ = ed.docs[uri]

    # one edit of the changed lines only, against the version the command started from
    change = ed.applied[0].edit.document_changes[0]
    assert change.text_document.version == 1
    edits = [lsp.protocol._converter.unstructure(e) for e in change.edits]
    assert edits == line_edits(UTIL, text)
    assert result["edits"] == len(edits) and result["completion_tokens"] > 0 and result["mat"] >= 1

    # progress: begin, end (and reports while generating, if it ran long enough to send one)
    tokens = [t for t in lsp.progress_reports if t not in before]
    gen = [lsp.progress_reports[t] for t in tokens if isinstance(lsp.progress_reports[t][0], types.WorkDoneProgressBegin)
           and lsp.progress_reports[t][0].title == "agentspec: apply"]
    assert gen and isinstance(gen[-1][-1], types.WorkDoneProgressEnd) and gen[-1][0].cancellable

    # exactness: the same input through a real server's POST /v1/apply merges to the same text
    server = Server(tmp_path, config=None, name="apply-server")
    try:
        r = httpx.post(server.base + "/v1/apply", json={"code": UTIL, "update": UPDATE, "temperature": 0},
                       timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["merged_code"] == text
    finally:
        server.stop()
    ed.close(uri)


async def test_rewrite_a_selection_changes_only_inside_it(lsp, lsp_workspace):
    ed: Editor = lsp.editor
    uri = ed.open(lsp_workspace / "util.py")
    rng = {"start": {"line": 8, "character": 0}, "end": {"line": 10, "character": 0}}   # mul
    result = await command(lsp, "agentspec.rewrite", {"uri": uri, "range": rng,
                                                       "instruction": "Add a docstring to this function."})
    assert result["applied"] is True, result
    text, _ = ed.docs[uri]
    assert text.startswith(UTIL.split("def mul")[0]), text   # everything above the selection untouched
    ed.close(uri)


async def test_progress_cancel_stops_generation_and_applies_nothing(lsp, lsp_workspace):
    ed: Editor = lsp.editor
    uri = ed.open(lsp_workspace / "big.py")
    n_applied = len(ed.applied)
    seen = set(lsp.progress_reports)
    task = asyncio.ensure_future(command(lsp, "agentspec.rewrite", {
        "uri": uri, "instruction": "Rename every function f<i> to g<i>."}))
    token = await first_report(lsp, seen)
    t0 = asyncio.get_running_loop().time()
    lsp.window_work_done_progress_cancel(types.WorkDoneProgressCancelParams(token=token))
    result = await asyncio.wait_for(task, 60)
    assert result["applied"] is False and result["reason"] == "cancelled", result
    assert asyncio.get_running_loop().time() - t0 < 10
    assert len(ed.applied) == n_applied
    ed.close(uri)


async def test_cancel_request_stops_the_command(lsp, lsp_workspace):
    ed: Editor = lsp.editor
    uri = ed.open(lsp_workspace / "big.py")
    n_applied = len(ed.applied)
    seen = set(lsp.progress_reports)
    fut = asyncio.ensure_future(lsp.protocol.send_request_async(types.WORKSPACE_EXECUTE_COMMAND, types.ExecuteCommandParams(
        command="agentspec.rewrite", arguments=[{"uri": uri, "instruction": "Rename every function f<i> to h<i>."}]),
        msg_id="cancel-me"))
    await first_report(lsp, seen)
    lsp.cancel_request(types.CancelParams(id="cancel-me"))
    with pytest.raises(JsonRpcException, match="cancel"):
        await asyncio.wait_for(fut, 60)
    assert len(ed.applied) == n_applied
    # the server is still there, and idle again
    assert (await status(lsp))["ready"] is True
    ed.close(uri)


async def test_typing_during_generation_refuses_the_edit(lsp, lsp_workspace):
    ed: Editor = lsp.editor
    uri = ed.open(lsp_workspace / "big.py")
    n_applied = len(ed.applied)
    seen = set(lsp.progress_reports)
    task = asyncio.ensure_future(command(lsp, "agentspec.apply", {
        "uri": uri, "update": "def f0(x):\n    \"\"\"The first.\"\"\"\n    y = x * 0 + 1\n    return y - 0\n"}))
    await first_report(lsp, seen)
    ed.type_at_end(uri, "# typed meanwhile\n")
    result = await asyncio.wait_for(task, 300)
    assert result["applied"] is False and "changed" in result["reason"], result
    assert len(ed.applied) == n_applied        # no edit ever reached the editor
    assert ed.docs[uri][0].endswith("# typed meanwhile\n")
    assert any("changed" in m.message for m in lsp.messages)
    ed.close(uri)


@pytest.mark.parametrize("arg,match", [
    ({"uri": "NOWHERE", "update": "x"}, "only file: URIs"),
    ({"update": "x"}, "uri"),
    ({"uri": "file:///etc/hostname", "update": "x"}, "outside the workspace"),
    ({"uri": "MISSING", "update": "x"}, "no such file"),
    ({"uri": "ENV", "update": "x"}, "ignored by the workspace"),
    ({"uri": "ENVLINK", "update": "x"}, "ignored by the workspace"),
    ({"uri": "CONFIG", "update": "x"}, "one of the server's own files \\(config file\\)"),
    ({"uri": "UTIL", "update": ""}, "update"),
    ({"uri": "UTIL", "instruction": "x", "range": {"start": {"line": 99, "character": 0},
                                                   "end": {"line": 100, "character": 0}}}, "outside the document"),
])
async def test_bad_arguments_are_lsp_errors_and_the_server_lives_on(lsp, lsp_workspace, arg, match):
    subst = {"MISSING": (lsp_workspace / "missing.py").as_uri(), "UTIL": (lsp_workspace / "util.py").as_uri(),
             "ENV": (lsp_workspace / ".env").as_uri(), "ENVLINK": (lsp_workspace / "env_link.py").as_uri(),
             "CONFIG": (lsp_workspace / "lsp.toml").as_uri()}
    arg = {k: subst.get(v, v) if isinstance(v, str) else v for k, v in arg.items()}
    name = "agentspec.rewrite" if "instruction" in arg else "agentspec.apply"
    with pytest.raises(JsonRpcException, match=match):
        await command(lsp, name, arg)
    assert (await status(lsp))["ready"] is True


async def test_code_action_on_a_selection_runs_rewrite_with_its_range(lsp, lsp_workspace):
    ed: Editor = lsp.editor
    uri = ed.open(lsp_workspace / "util.py")
    rng = types.Range(start=types.Position(line=0, character=0), end=types.Position(line=2, character=0))
    # lsprotocol's client-side hook reads any object with a "command" key as a Command, so a
    # CodeAction (whose "command" is a Command object) would come out garbled: tell them apart
    # by the type of "command", as editors do
    conv = lsp.protocol._converter
    conv.register_structure_hook(
        Union[types.Command, types.CodeAction],
        lambda o, _: conv.structure(o, types.Command if isinstance(o.get("command"), str) else types.CodeAction))
    actions = await lsp.text_document_code_action_async(types.CodeActionParams(
        text_document=types.TextDocumentIdentifier(uri=uri), range=rng, context=types.CodeActionContext(diagnostics=[])))
    (action,) = actions
    assert action.command.command == "agentspec.rewrite"
    assert action.command.arguments[0]["range"]["end"]["line"] == 2
    ed.close(uri)


async def test_buffer_text_reaches_the_index_and_close_drops_it(lsp, lsp_workspace):
    ed: Editor = lsp.editor
    uri = ed.open(lsp_workspace / "util.py")
    version = ed.type_at_end(uri, "\n\ndef canary_zq(x):\n    return x\n")
    for _ in range(1200):   # agentspec/indexed per overlay update; the newest version must come
        got = next((n for n in ed.indexed if n.uri == uri and n.version == version), None)
        if got is not None:
            break
        await asyncio.sleep(0.05)
    assert got is not None, ed.indexed
    assert got.uri.endswith("/util.py") and got.ms >= 0
    st = await status(lsp)
    assert "util.py" in st["overlays"] and st["mode"] == "in-process"
    ed.close(uri)
    for _ in range(200):
        st = await status(lsp)
        if "util.py" not in st["overlays"]:
            break
        await asyncio.sleep(0.05)
    assert "util.py" not in st["overlays"]


async def test_shutdown_and_exit(lsp_workspace):
    client = await ClientServerConfig(server_command=SERVER).start()
    try:
        await start(client, lsp_workspace, {"url": "http://127.0.0.1:9"})   # remote mode: nothing loads
        assert (await status(client))["mode"] == "remote"
        await client.shutdown_session()
        assert client._server.returncode == 0
    finally:
        await client.stop()


async def test_remote_mode_applies_through_a_server(lsp_workspace, tmp_path):
    server = Server(tmp_path, config=None, name="remote")
    client = await ClientServerConfig(server_command=SERVER).start()
    try:
        await start(client, lsp_workspace, {"url": server.base})
        ed: Editor = client.editor
        uri = ed.open(lsp_workspace / "util.py")
        result = await command(client, "agentspec.apply", {"uri": uri, "update": UPDATE})
        assert result["applied"] is True, result
        r = httpx.post(server.base + "/v1/apply", json={"code": UTIL, "update": UPDATE, "temperature": 0}, timeout=300)
        assert ed.docs[uri][0] == r.json()["merged_code"]
        await client.shutdown_session()
    finally:
        await client.stop()
        server.stop()


async def end(client: LanguageClient) -> None:
    """Shut the server down and stop the client, also after a failed assertion (a client stopped
    without ``shutdown``/``exit`` waits for a server that is still reading its stdin)."""
    try:
        await asyncio.wait_for(client.shutdown_session(), 60)
    except Exception:  # noqa: BLE001 - the test's own failure is the one to report
        client._server.kill()
    await client.stop()


ROUTES_TOML = '''
[[routes]]
name = "plain"          # never matched by its `when` for apply: only a request that names it gets it
when = { endpoint = "completions" }
speculation = false

[[routes]]
name = "narrow"
budget = 4
'''


async def test_route_setting_reaches_requests_in_process_and_changes_live(lsp_workspace, tmp_path):
    cfg = tmp_path / "routes.toml"
    cfg.write_text(ROUTES_TOML)
    client = await ClientServerConfig(server_command=SERVER).start()
    try:
        await start(client, lsp_workspace, {"config": str(cfg), "route": "plain"})
        assert (await status(client))["route"] == "plain"
        ed: Editor = client.editor
        uri = ed.open(lsp_workspace / "util.py")
        result = await command(client, "agentspec.apply", {"uri": uri, "update": UPDATE})
        # the named route decided (its `when` names another endpoint), so speculation was off
        assert result["route"] == "plain" and result["mat"] == 1.0, result

        # workspace/didChangeConfiguration (what VS Code sends): the next command uses the new route
        client.workspace_did_change_configuration(types.DidChangeConfigurationParams(
            settings={"agentspec": {"route": "nosuch"}}))
        result = await command(client, "agentspec.apply", {"uri": uri, "update": UPDATE})
        assert result["applied"] is False and "'nosuch'" in result["reason"], result
        assert "plain" in result["reason"] and "narrow" in result["reason"], result   # the routes it has

        client.workspace_did_change_configuration(types.DidChangeConfigurationParams(
            settings={"agentspec": {"route": None}}))   # cleared: the first route whose `when` matches
        result = await command(client, "agentspec.apply", {"uri": uri, "update": UPDATE})
        assert result["route"] == "narrow", result
        ed.close(uri)
    finally:
        await end(client)


async def test_route_setting_reaches_a_remote_server(lsp_workspace, tmp_path):
    server = Server(tmp_path, config=ROUTES_TOML, name="routes")
    client = await ClientServerConfig(server_command=SERVER).start()
    try:
        await start(client, lsp_workspace, {"url": server.base, "route": "plain"})
        ed: Editor = client.editor
        uri = ed.open(lsp_workspace / "util.py")
        result = await command(client, "agentspec.apply", {"uri": uri, "update": UPDATE})
        assert result["route"] == "plain" and result["mat"] == 1.0, result
        # the same body without the route: the server's own rule decides
        r = httpx.post(server.base + "/v1/apply", json={"code": UTIL, "update": UPDATE}, timeout=300)
        assert r.status_code == 200 and r.json()["spec"]["route"] == "narrow", r.text
        r = httpx.post(server.base + "/v1/apply", json={"code": UTIL, "update": UPDATE, "route": "nosuch"}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and (err["param"], err["code"]) == ("route", "invalid_value"), r.text
        assert "plain" in err["message"] and "narrow" in err["message"]
    finally:
        await end(client)
        server.stop()
