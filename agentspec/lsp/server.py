"""``agentspec lsp``: rewrites and fast apply for any LSP editor (pygls, stdio or TCP).

Two commands (``workspace/executeCommand``, also offered as code actions on a selection):

* ``agentspec.rewrite {uri, range?, instruction}``: rewrite the selection (or the whole file);
* ``agentspec.apply {uri, update}``: merge an edit snippet (``// ... existing code ...``) into
  the file, as ``POST /v1/apply`` does.

Each reports ``$/progress`` while it generates (tokens so far, MAT), stops at the next decode
step when cancelled (``$/cancelRequest`` or ``window/workDoneProgress/cancel``), and ends with
one ``workspace/applyEdit`` of the changed lines only, against the document version it started
from: if the buffer changed meanwhile, nothing is applied and the result says why. The result
is ``{applied, reason?, edits, completion_tokens, mat, seconds, version, route?}`` (``route``: the
route that decided how it speculated).

Nothing but ``initialize`` is served before it (a request is a ``ServerNotInitialized`` error, a
notification is dropped). Over TCP (``--tcp``) each connection is its own language server (its
own protocol, buffers and settings), let in by an ``initialize`` that carries
``initializationOptions.token`` when ``$AGENTSPEC_LSP_TOKEN`` is set: a peer without it is
answered with an error and hung up on, and never reaches another connection's session. One
editor at a time; the listener stops when that editor's session ends.

The open buffers are the workspace: ``didOpen`` / ``didChange`` text shadows the file on disk in
the tenant's index (``Workspace.overlay``; incremental sync), ``didClose`` drops it. This holds
in-process (no ``url``: the embedded engine and an index of the workspace folder live in this
process, the folder watched for changes on disk); against a remote server (``url``) the buffer
the command runs on travels in the request (it is the apply prompt, so it drafts the answer),
and the server's own workspace index is what it indexes from disk.

Configuration (``initializationOptions``, or ``workspace/configuration`` section ``agentspec``):
``url``, ``apiKey`` (default ``$AGENTSPEC_API_KEY``), ``model`` (remote: the served model's id;
in-process: a GGUF path, default the bundled model), ``config`` (in-process: a server TOML for
routes), ``route`` (a configured route, by name, for every command: the server's, or in-process
the ``config``'s; default: the first route whose ``when`` matches), ``maxTokens``,
``speculation`` (default on), ``instruction`` (used when a code action runs ``agentspec.rewrite``
without one), ``notifyIndexed`` (send ``agentspec/indexed`` after each overlay update; for
benchmarks and tests). ``workspace/didChangeConfiguration`` updates the per-command settings
(``route``, ``maxTokens``, ``speculation``, ``instruction``, ``notifyIndexed``) at once; ``url``,
``apiKey``, ``model`` and ``config`` are read at start-up (a change asks for a restart).
"""

from __future__ import annotations

import asyncio
import hmac
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from lsprotocol import types
from pygls.exceptions import (JsonRpcInternalError, JsonRpcInvalidParams, JsonRpcInvalidRequest,
                              JsonRpcServerNotInitialized)
from pygls.io_ import run_async
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol
from pygls.protocol.json_rpc import RPCRequest
from pygls.protocol.language_server import lsp_method
from pygls.uris import from_fs_path, to_fs_path

from .. import __version__
from .edits import line_edits

CMD_REWRITE = "agentspec.rewrite"
CMD_APPLY = "agentspec.apply"
INDEXED = "agentspec/indexed"
SETTINGS = ("url", "apiKey", "model", "config", "route", "maxTokens", "speculation", "instruction", "notifyIndexed")
LIVE_SETTINGS = ("route", "maxTokens", "speculation", "instruction", "notifyIndexed")   # read by each command
REPORT_EVERY_S = 0.1


class _Protocol(LanguageServerProtocol):
    """One peer's connection. Until an ``initialize`` is let in (``AgentSpecLanguageServer.admit``),
    nothing reaches a handler: pygls' own ``initialize`` (which replaces the workspace) runs only
    after the token was checked."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.authorized = False   # an initialize was let in on this connection
        self.hang_up: Callable[[], None] | None = None   # TCP: close this connection (None: stdio)
        self.hung_up = False      # refused and closed: nothing more is handled

    def handle_message(self, message: Any) -> None:
        if self.hung_up:   # refused: what the peer sent after it is read, never handled
            return
        if self.authorized:
            return super().handle_message(message)
        method = getattr(message, "method", None)
        request = isinstance(message, RPCRequest)
        if method == types.INITIALIZE and request:
            why = self._server.admit(message.params)
            if why is None:
                self.authorized = True
                return super().handle_message(message)
            self._send_response(message.id, error=JsonRpcInvalidRequest(why).to_response_error())
            return self._hang_up()
        if method == types.EXIT:   # stdio: the editor's process ends it (1: no shutdown); TCP: this peer only
            return super().handle_message(message) if self.hang_up is None else self._hang_up()
        if request:
            self._send_response(message.id, error=JsonRpcServerNotInitialized(
                f"{method}: the server is not initialized (send initialize first)").to_response_error())
        # a notification or a response before initialize: dropped

    def _hang_up(self) -> None:
        if self.hang_up is not None:
            self.hung_up = True
            self.hang_up()

    @lsp_method(types.WORKSPACE_EXECUTE_COMMAND)
    def lsp_workspace__execute_command(self, params: types.ExecuteCommandParams):
        """pygls hands a command its arguments only: a client's ``workDoneToken`` rides along
        in the argument object."""
        if params.work_done_token is not None and params.arguments and isinstance(params.arguments[0], dict):
            params.arguments[0].setdefault("workDoneToken", params.work_done_token)
        return (yield from super().lsp_workspace__execute_command(params))


class _Overlays:
    """Feeds buffer text to ``Workspace.overlay`` off the event loop: one thread (started with the
    workspace it feeds), the newest text per path wins (a burst of keystrokes is indexed once)."""

    def __init__(self, on_indexed) -> None:
        self.workspace: Any = None
        self._pending: dict[str, tuple[str | None, Any, float]] = {}   # path -> (text or None, version, t0)
        self._cv = threading.Condition()
        self._closed = False
        self._on_indexed = on_indexed
        self._thread = threading.Thread(target=self._run, name="agentspec-lsp-overlays", daemon=True)

    def put(self, path: str, text: str | None, version: Any) -> None:
        with self._cv:
            self._pending[path] = (text, version, time.perf_counter())
            self._cv.notify()

    def attach(self, workspace: Any) -> None:
        with self._cv:
            self.workspace = workspace
            self._cv.notify()
            if not self._closed and not self._thread.is_alive():
                self._thread.start()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (self.workspace is None or not self._pending):
                    self._cv.wait()
                if self._closed:
                    return
                work, self._pending = self._pending, {}
                ws = self.workspace
            for path, (text, version, t0) in work.items():
                try:
                    if text is None:
                        ws.drop_overlay(path)
                    else:
                        ws.overlay(path, text)
                except (ValueError, OSError) as e:
                    print(f"[agentspec lsp] overlay of {path}: {e}", file=sys.stderr, flush=True)
                    continue
                self._on_indexed(path, version, time.perf_counter() - t0)


class AgentSpecLanguageServer(LanguageServer):
    def __init__(self) -> None:
        super().__init__("agentspec", __version__, protocol_cls=_Protocol,
                         text_document_sync_kind=types.TextDocumentSyncKind.Incremental)
        self.settings: dict[str, Any] = {}
        self.root: Path | None = None
        self.client: Any = None               # agentspec.AsyncClient
        self.session_id = f"lsp-{uuid.uuid4().hex[:12]}"
        self.ready: asyncio.Future | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.overlays = _Overlays(self._indexed)
        self._ignored = None   # the root's ignore rules when there is no workspace (remote mode)
        self.token: str | None = None   # `--tcp` with $AGENTSPEC_LSP_TOKEN: what initialize must carry
        self.listener: _TcpListener | None = None   # `--tcp`: the listener this connection came in on
        self._progress_ok = False

    def admit(self, params: Any) -> str | None:
        """Why this connection's ``initialize`` is refused (None: let in, and it is the listener's
        session from now on)."""
        if self.token is not None:   # a TCP listener with a token: the peer proves it knows it first
            opts = params.initialization_options if isinstance(params.initialization_options, dict) else {}
            given = opts.get("token")
            # compared as bytes: a lone surrogate (JSON allows one) is a wrong token, not an error
            given = given.encode("utf-8", "surrogatepass") if isinstance(given, str) else b""
            if not hmac.compare_digest(given, self.token.encode()):
                return ("initializationOptions.token is missing or wrong: this agentspec language server "
                        "listens on TCP with $AGENTSPEC_LSP_TOKEN")
        if self.listener is not None:
            if self.listener.session is not None:
                return "another editor is connected to this agentspec language server (one at a time)"
            self.listener.session = self
            self.listener.let_in(self)
        return None

    def report_server_error(self, error: Exception, source: Any) -> None:
        if self.protocol.authorized:   # nothing, not even an error message, to a peer not let in
            super().report_server_error(error, source)

    async def stop(self) -> None:
        """Stop what the session started (the overlay thread, the client); again: nothing."""
        self.overlays.close()
        client, self.client = self.client, None
        if client is not None:
            await client.close()

    # ---- state ----------------------------------------------------------------------------------

    def _indexed(self, path: str, version: Any, seconds: float) -> None:
        if self.settings.get("notifyIndexed") and self.loop is not None:
            params = {"uri": from_fs_path(path), "version": version, "ms": round(seconds * 1e3, 3)}
            self.loop.call_soon_threadsafe(self.protocol.notify, INDEXED, params)

    def path_of(self, uri: Any) -> Path:
        """The file a command's ``uri`` names, checked: a ``file:`` URI inside the workspace."""
        if not isinstance(uri, str) or not uri:
            raise JsonRpcInvalidParams(f"`uri` must be a non-empty string, got {uri!r}")
        if not uri.startswith("file:"):
            raise JsonRpcInvalidParams(f"only file: URIs can be rewritten, got {uri!r}")
        fs = to_fs_path(uri)
        if not fs:
            raise JsonRpcInvalidParams(f"not a file path: {uri!r}")
        path = Path(os.path.normpath(fs))
        if self.root is None:
            raise JsonRpcInvalidParams("the editor opened no workspace folder: agentspec rewrites files in one")
        real = Path(os.path.realpath(path))
        if not (real == self.root or self.root in real.parents):
            raise JsonRpcInvalidParams(f"{uri} is outside the workspace {from_fs_path(str(self.root))}")
        refused = self._refusal(path, real)
        if refused:
            raise JsonRpcInvalidParams(f"{uri} is {refused}: agentspec rewrites only files the workspace indexes")
        return path

    def _refusal(self, path: Path, real: Path) -> str | None:
        """Why the file at ``path`` (resolving to ``real``) is no command's: one of the server's own
        files, or ignored by the workspace (as given or resolved; ``.git/``, a gitignored ``.env``)."""
        ws = self.overlays.workspace
        if ws is not None:
            rule = ws.owned_rule(path) or ws.owned_rule(real)
            if rule:
                return f"one of the server's own files ({rule})"
            ignored = ws.ignored
        else:
            if self._ignored is None:
                from ..workspace import ignore_checker

                self._ignored = ignore_checker(self.root)
            ignored = self._ignored
        for p in {path, real}:
            try:
                if p != self.root and ignored(p):
                    return "ignored by the workspace (.gitignore or the ignore list)"
            except ValueError:   # not under the root as spelled (a symlinked root): the resolved one decides
                continue
        return None

    def document(self, uri: str, path: Path) -> tuple[str, int | None]:
        """The text the user sees (the open buffer, else the file) and its version (None: not open)."""
        doc = self.workspace.text_documents.get(uri)
        if doc is None:
            for d in self.workspace.text_documents.values():   # the same file under another spelling
                if Path(os.path.normpath(to_fs_path(d.uri) or "")) == path:
                    doc = d
                    break
        if doc is not None:
            return doc.source, doc.version
        from ..workspace.scan import read_opened

        # opened once and read, then checked as opened: a folder on the way swapped for a symlink
        # since path_of checked it cannot bring in another file (the config)
        missing = JsonRpcInvalidParams(f"{uri}: no such file (and no open buffer)")
        real = Path(os.path.realpath(path))
        if not real.is_file():   # (a FIFO is never opened)
            raise missing
        try:
            opened, st, data = read_opened(real)
        except FileNotFoundError:
            raise missing from None
        except OSError as e:
            raise JsonRpcInvalidParams(f"{uri}: cannot read it as UTF-8 text ({e})") from None
        if data is None:
            raise missing
        if self.root not in opened.parents:
            raise JsonRpcInvalidParams(f"{uri} is outside the workspace {from_fs_path(str(self.root))}")
        ws = self.overlays.workspace
        rule = ws.owned_rule(opened, st=st) if ws is not None else None
        refused = f"one of the server's own files ({rule})" if rule else self._refusal(opened, opened)
        if refused:
            raise JsonRpcInvalidParams(f"{uri} is {refused}: agentspec rewrites only files the workspace indexes")
        try:
            return data.decode("utf-8"), None
        except UnicodeDecodeError as e:
            raise JsonRpcInvalidParams(f"{uri}: cannot read it as UTF-8 text ({e})") from None

    async def start_backend(self) -> None:
        """Connect to the server, or load the embedded engine and index the workspace."""
        from ..sdk import AsyncClient

        s = self.settings
        if s.get("url"):
            self.client = AsyncClient(s["url"], api_key=s.get("apiKey"), model=s.get("model"))
            try:
                await self.client.health()
            except Exception as e:  # noqa: BLE001 - reported, and every command will say it again
                self.window_show_message(types.ShowMessageParams(
                    type=types.MessageType.Warning, message=f"agentspec: server {s['url']} not reachable: {e}"))
            return
        options = {"model": s["model"]} if s.get("model") else {}
        self.client = AsyncClient(engine_options=options, repo=str(self.root) if self.root else None,
                                  config=s.get("config"), watch=True)
        token = str(uuid.uuid4())
        started = await self._begin(token, "agentspec: loading the model", cancellable=False,
                                    message=f"and indexing {self.root.name}" if self.root else None)
        t0 = time.perf_counter()
        try:
            ws = await asyncio.to_thread(lambda: self.client.workspace if self.root else self.client.models())
        finally:
            if started:
                self.work_done_progress.end(token, types.WorkDoneProgressEnd(
                    message=f"ready in {time.perf_counter() - t0:.1f} s"))
        if self.root is not None:
            self.overlays.attach(ws)

    async def _begin(self, token: str, title: str, *, cancellable: bool, message: str | None = None,
                     client_token: Any = None) -> bool:
        """Start a progress report (the client's token, else one created here); False when the
        client takes none."""
        if client_token is None:
            if not self._progress_ok:
                return False
            try:
                await self.work_done_progress.create_async(token)
            except Exception:  # noqa: BLE001 - a client may refuse; the command still runs
                return False
        self.work_done_progress.begin(client_token if client_token is not None else token, types.WorkDoneProgressBegin(
            title=title, cancellable=cancellable, message=message, percentage=0 if cancellable else None))
        return True

    # ---- commands -------------------------------------------------------------------------------

    async def run_command(self, kind: str, args: tuple) -> dict:
        if len(args) != 1 or not isinstance(args[0], dict):
            raise JsonRpcInvalidParams(f"{kind} takes one argument object, got {len(args)} argument(s)")
        arg = args[0]
        uri = arg.get("uri")
        path = self.path_of(uri)
        if kind == CMD_APPLY:
            update, instruction, rng = arg.get("update"), arg.get("instruction"), None
            if not isinstance(update, str) or not update.strip():
                raise JsonRpcInvalidParams("`update` must be a non-empty edit snippet")
        else:
            update, rng = None, arg.get("range")
            instruction = arg.get("instruction") or self.settings.get("instruction")
            if not isinstance(instruction, str) or not instruction.strip():
                raise JsonRpcInvalidParams("`instruction` must be a non-empty string (what to do with the code)")
        if instruction is not None and not isinstance(instruction, str):
            raise JsonRpcInvalidParams("`instruction` must be a string")
        text, version = self.document(uri, path)
        start, end = 0, len(text)
        if rng is not None:
            start, end = self._offsets(text, rng)
        code = text[start:end]
        if not code.strip():
            raise JsonRpcInvalidParams("nothing to rewrite: the selection (or file) is empty")

        if self.ready is not None:
            try:
                await self.ready
            except Exception as e:  # noqa: BLE001 - start-up failed: say so on every command
                raise JsonRpcInternalError(f"agentspec failed to start: {e}") from None
        t0 = time.perf_counter()
        token = arg.get("workDoneToken")
        progress = token if token is not None else str(uuid.uuid4())
        title = "agentspec: apply" if kind == CMD_APPLY else "agentspec: rewrite"
        shown = await self._begin(progress, title, cancellable=True, message=path.name, client_token=token)
        cancelled = self.work_done_progress.tokens.get(progress) if shown else None
        outcome: dict[str, Any] = {"applied": False, "edits": 0, "completion_tokens": 0, "mat": 0.0, "seconds": 0.0,
                                   "version": version}
        stream = None
        try:
            opts: dict[str, Any] = {"session_id": self.session_id}
            if self.settings.get("maxTokens"):
                opts["max_tokens"] = int(self.settings["maxTokens"])
            if self.settings.get("speculation") is not None:
                opts["speculation"] = bool(self.settings["speculation"])
            if self.settings.get("route"):   # a configured route by name (POST /v1/apply's `route`)
                opts["extra_body"] = {"route": str(self.settings["route"])}
            stream = await self.client.apply(code=code, update=update, instruction=instruction, stream=True,
                                             temperature=0.0, **opts)
            last = 0.0
            async for _ in stream:
                if cancelled is not None and cancelled.cancelled():
                    outcome["reason"] = "cancelled"
                    return outcome
                if version is not None and self._version(uri) != version:   # typed meanwhile: stop now
                    return self._stale(outcome, version, self._version(uri))
                now = time.perf_counter()
                if shown and now - last >= REPORT_EVERY_S:
                    last = now
                    mat = stream.completion_tokens / stream.steps if stream.steps else 0.0
                    pct = min(99, int(100 * len(stream.text) / max(1, len(code))))
                    self.work_done_progress.report(progress, types.WorkDoneProgressReport(
                        message=f"{stream.completion_tokens} tokens, MAT {mat:.2f}", percentage=pct))
            result = stream.result
            outcome["completion_tokens"] = result.usage.completion_tokens
            if result.spec is not None:
                outcome["route"] = result.spec.route
            outcome["mat"] = round(result.spec.mean_acceptance_length or 1.0, 3) if result.spec else 1.0
            outcome["seconds"] = round(time.perf_counter() - t0, 3)
            if result.finish_reason == "length":
                outcome["reason"] = (f"the model stopped at max_tokens ({outcome['completion_tokens']} tokens) "
                                     "before the end of the file: nothing applied")
                return outcome
            new_text = text[:start] + result.merged_code + text[end:]
            return await self._apply_edit(uri, path, text, version, new_text, outcome, title)
        except asyncio.CancelledError:
            outcome["reason"] = "cancelled"
            raise
        except JsonRpcInvalidParams:
            raise
        except Exception as e:  # noqa: BLE001 - an API error (server down, 4xx) is the command's result
            from ..sdk.errors import AgentSpecAPIError

            if not isinstance(e, AgentSpecAPIError):
                raise
            outcome["reason"] = f"agentspec: {e}"
            return outcome
        finally:
            if stream is not None:
                await stream.aclose()
            if shown:
                self.work_done_progress.end(progress, types.WorkDoneProgressEnd(
                    message=outcome.get("reason") or f"{outcome['edits']} edit(s), {outcome['completion_tokens']} "
                                                      f"tokens, MAT {outcome['mat']:.2f}"))
                self.work_done_progress.tokens.pop(progress, None)

    def _offsets(self, text: str, rng: Any) -> tuple[int, int]:
        try:
            r = self.protocol._converter.structure(rng, types.Range)
        except Exception as e:  # noqa: BLE001 - a malformed range is the caller's error
            raise JsonRpcInvalidParams(f"`range` is not an LSP Range: {e}") from None
        from pygls.workspace import TextDocument

        doc = TextDocument("file:///x", text, position_codec=self.workspace.position_codec)
        nlines = len(doc.lines)
        for p in (r.start, r.end):
            if p.line < 0 or p.character < 0 or p.line > nlines:
                raise JsonRpcInvalidParams(f"`range` {p.line}:{p.character} is outside the document ({nlines} lines)")
        a, b = doc.offset_at_position(r.start), doc.offset_at_position(r.end)
        if a > b:
            raise JsonRpcInvalidParams("`range` ends before it starts")
        return a, b

    def _version(self, uri: str) -> int | None:
        doc = self.workspace.text_documents.get(uri)
        return doc.version if doc is not None else None

    def _stale(self, outcome: dict, version: int, now: int | None) -> dict:
        outcome["reason"] = (f"the buffer changed while agentspec was generating (version {version} -> {now}); "
                             "nothing applied, run the command again")
        self.window_show_message(types.ShowMessageParams(type=types.MessageType.Warning, message=outcome["reason"]))
        return outcome

    async def _apply_edit(self, uri: str, path: Path, old: str, version: int | None, new: str,
                          outcome: dict, label: str) -> dict:
        codec = self.workspace.position_codec
        edits = line_edits(old, new, units=codec.client_num_units)
        outcome["edits"] = len(edits)
        if not edits:
            outcome["applied"] = True
            outcome["reason"] = "no change"
            return outcome
        now = self._version(uri)
        if version is not None and now != version:
            return self._stale(outcome, version, now)
        if version is None and path.read_text(encoding="utf-8") != old:
            outcome["reason"] = "the file changed on disk while agentspec was generating; nothing applied"
            return outcome
        edit = types.WorkspaceEdit(document_changes=[types.TextDocumentEdit(
            text_document=types.OptionalVersionedTextDocumentIdentifier(uri=uri, version=version),
            edits=[types.TextEdit(range=types.Range(start=types.Position(**e["range"]["start"]),
                                                    end=types.Position(**e["range"]["end"])),
                                  new_text=e["newText"]) for e in edits])])
        res = await self.workspace_apply_edit_async(types.ApplyWorkspaceEditParams(
            edit=edit, label=label))
        outcome["applied"] = bool(res.applied)
        if not res.applied:
            outcome["reason"] = f"the editor refused the edit: {res.failure_reason or 'no reason given'}"
        return outcome


def _settings(raw: Any) -> dict:
    out: dict[str, Any] = {}
    if isinstance(raw, dict):
        for k in SETTINGS:
            if raw.get(k) is not None:
                out[k] = raw[k]
    if not out.get("apiKey") and os.environ.get("AGENTSPEC_API_KEY"):
        out["apiKey"] = os.environ["AGENTSPEC_API_KEY"]
    return out


def _section(raw: Any) -> Any:
    """The ``agentspec`` settings in a ``didChangeConfiguration``'s ``settings`` (VS Code sends
    ``{"agentspec": {...}}``; some clients send the section itself)."""
    if isinstance(raw, dict) and isinstance(raw.get("agentspec"), dict):
        return raw["agentspec"]
    return raw


def build_server(defaults: dict | None = None) -> AgentSpecLanguageServer:
    server = AgentSpecLanguageServer()
    base = dict(defaults or {})

    @server.feature(types.INITIALIZE)
    def initialize(ls: AgentSpecLanguageServer, params: types.InitializeParams) -> None:
        ls.settings = {**base, **_settings(params.initialization_options)}
        folders = params.workspace_folders or []
        root_uri = folders[0].uri if folders else params.root_uri
        root = to_fs_path(root_uri) if root_uri else params.root_path
        ls.root = Path(os.path.realpath(root)) if root else None
        window = params.capabilities.window
        ls._progress_ok = bool(window and window.work_done_progress)
        ls.loop = asyncio.get_running_loop()
        ls.ready = ls.loop.create_future()

    @server.feature(types.INITIALIZED)
    async def initialized(ls: AgentSpecLanguageServer, params: types.InitializedParams) -> None:
        try:
            ws_caps = ls.client_capabilities.workspace
            if ws_caps and ws_caps.configuration:
                try:
                    got = await asyncio.wait_for(ls.workspace_configuration_async(types.ConfigurationParams(
                        items=[types.ConfigurationItem(section="agentspec")])), 5)
                    if got and isinstance(got[0], dict):
                        ls.settings = {**ls.settings, **_settings(got[0])}
                except Exception:  # noqa: BLE001 - a client without settings: initializationOptions stand
                    pass
            await ls.start_backend()
            for doc in list(ls.workspace.text_documents.values()):
                _overlay(ls, doc.uri)
            ls.ready.set_result(None)
        except Exception as e:  # noqa: BLE001 - every command then reports it
            ls.window_show_message(types.ShowMessageParams(type=types.MessageType.Error,
                                                           message=f"agentspec failed to start: {e}"))
            ls.ready.set_exception(e)
            ls.ready.exception()   # retrieved: no "never retrieved" warning when no command runs

    @server.feature(types.WORKSPACE_DID_CHANGE_CONFIGURATION)
    async def did_change_configuration(ls: AgentSpecLanguageServer, params: types.DidChangeConfigurationParams) -> None:
        raw = _section(params.settings)
        if not isinstance(raw, dict) or not raw:   # a pull-model client: ask for the section
            ws_caps = ls.client_capabilities.workspace
            if not (ws_caps and ws_caps.configuration):
                return
            try:
                got = await asyncio.wait_for(ls.workspace_configuration_async(types.ConfigurationParams(
                    items=[types.ConfigurationItem(section="agentspec")])), 5)
            except Exception:  # noqa: BLE001 - nothing to update from
                return
            raw = got[0] if got and isinstance(got[0], dict) else None
            if raw is None:
                return
        new = _settings(raw)
        for key in LIVE_SETTINGS:   # a setting cleared in the editor (null) falls back to its default
            if key in new:
                ls.settings[key] = new[key]
            elif key in raw:
                ls.settings.pop(key, None)
        changed = [k for k in SETTINGS if k not in LIVE_SETTINGS and k in raw
                   and new.get(k) != ls.settings.get(k) and not (k == "apiKey" and k not in new)]
        if changed:
            ls.window_show_message(types.ShowMessageParams(type=types.MessageType.Info, message=(
                f"agentspec: {', '.join(changed)} {'take' if len(changed) > 1 else 'takes'} effect when the "
                "language server restarts")))

    def _overlay(ls: AgentSpecLanguageServer, uri: str, close: bool = False) -> None:
        if ls.root is None or not uri.startswith("file:"):
            return
        fs = to_fs_path(uri)
        if not fs:
            return
        real = Path(os.path.realpath(fs))
        if not (ls.root in real.parents):
            return
        if close:
            ls.overlays.put(str(real), None, None)
        else:
            doc = ls.workspace.get_text_document(uri)
            ls.overlays.put(str(real), doc.source, doc.version)

    @server.feature(types.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: AgentSpecLanguageServer, params: types.DidOpenTextDocumentParams) -> None:
        _overlay(ls, params.text_document.uri)

    @server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls: AgentSpecLanguageServer, params: types.DidChangeTextDocumentParams) -> None:
        _overlay(ls, params.text_document.uri)

    @server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: AgentSpecLanguageServer, params: types.DidCloseTextDocumentParams) -> None:
        _overlay(ls, params.text_document.uri, close=True)

    @server.feature(types.TEXT_DOCUMENT_CODE_ACTION, types.CodeActionOptions(
        code_action_kinds=[types.CodeActionKind.RefactorRewrite]))
    def code_actions(ls: AgentSpecLanguageServer, params: types.CodeActionParams) -> list[types.CodeAction]:
        r = params.range
        uri = params.text_document.uri
        selected = (r.start.line, r.start.character) != (r.end.line, r.end.character)
        arg: dict[str, Any] = {"uri": uri}
        if selected:
            arg["range"] = ls.protocol._converter.unstructure(r)
        title = "agentspec: rewrite selection" if selected else "agentspec: rewrite file"
        return [types.CodeAction(title=title, kind=types.CodeActionKind.RefactorRewrite,
                                 command=types.Command(title=title, command=CMD_REWRITE, arguments=[arg]))]

    @server.command(CMD_REWRITE)
    async def rewrite(ls: AgentSpecLanguageServer, *args: Any) -> dict:
        return await ls.run_command(CMD_REWRITE, args)

    @server.command(CMD_APPLY)
    async def apply(ls: AgentSpecLanguageServer, *args: Any) -> dict:
        return await ls.run_command(CMD_APPLY, args)

    @server.feature(types.SHUTDOWN)
    async def shutdown(ls: AgentSpecLanguageServer, *args: Any) -> None:
        await ls.stop()

    @server.feature("agentspec/status")
    def status(ls: AgentSpecLanguageServer, *args: Any) -> dict:
        ws = ls.overlays.workspace
        return {"ready": bool(ls.ready and ls.ready.done() and not ls.ready.exception()),
                "mode": "remote" if ls.settings.get("url") else "in-process",
                "route": ls.settings.get("route"),
                "root": str(ls.root) if ls.root else None,
                "overlays": ws.overlays() if ws is not None else [],
                "files": len(ws.files()) if ws is not None else None}

    return server


class _TcpListener:
    """``--tcp``: a language server of its own for each connection (pygls' ``start_tcp`` shares one
    protocol among them all: replies go to the newest peer, and a peer that never initialized is
    served). The first connection let in is the session; the listener stops when it ends."""

    ADMIT_TIMEOUT_S = 30.0   # a peer not let in by then is hung up on
    MAX_PENDING = 8          # connections not let in yet, at most: more are hung up on at once

    def __init__(self, defaults: dict | None, token: str | None) -> None:
        self.defaults = defaults
        self.token = token
        self.session: AgentSpecLanguageServer | None = None
        self._ended: asyncio.Event | None = None
        self._waiting: set[int] = set()   # id() of the connections' servers not let in yet

    def let_in(self, ls: AgentSpecLanguageServer) -> None:
        """``ls``'s connection no longer counts as pending (let in, or gone)."""
        self._waiting.discard(id(ls))

    async def serve(self, host: str, port: int) -> None:
        self._ended = asyncio.Event()
        server = await asyncio.start_server(self._connection, host, port)
        try:
            await self._ended.wait()
        finally:   # not wait_closed(): a peer still connected (never let in) must not hold the exit
            server.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # a peer that connects and never initializes costs a language server: at most MAX_PENDING
        # such at a time, each for at most ADMIT_TIMEOUT_S, so idle peers cannot pile up
        if len(self._waiting) >= self.MAX_PENDING:
            writer.close()
            return
        ls = build_server(self.defaults)
        ls.token, ls.listener = self.token, self
        self._waiting.add(id(ls))
        ls.protocol.set_writer(writer)
        ls.protocol.hang_up = writer.close

        def admitted_or_hang_up() -> None:
            if not ls.protocol.authorized:
                writer.close()

        deadline = asyncio.get_running_loop().call_later(self.ADMIT_TIMEOUT_S, admitted_or_hang_up)
        try:
            await run_async(stop_event=threading.Event(), reader=reader, protocol=ls.protocol,
                            error_handler=ls.report_server_error)
        except (ConnectionError, asyncio.IncompleteReadError):   # the peer went away mid-message
            pass
        finally:
            deadline.cancel()
            self.let_in(ls)   # (pending no longer, either way)
            writer.close()
            await ls.stop()
            if self.session is ls:
                self._ended.set()


def main(*, tcp: str | None = None, defaults: dict | None = None, token: str | None = None) -> int:
    """Serve over stdio, or over TCP at ``tcp`` ("HOST:PORT"). ``token``: every TCP peer must send
    it as ``initializationOptions.token`` (the command line asks for one to listen beyond
    loopback)."""
    if tcp:
        host, _, port = tcp.rpartition(":")
        asyncio.run(_TcpListener(defaults, token or None).serve(host.strip("[]") or "127.0.0.1", int(port)))
    else:
        build_server(defaults).start_io()
    return 0
