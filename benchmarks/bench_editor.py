"""The editor path: ``agentspec lsp`` driven as an editor drives it, over stdio.

1. Rewrites: for each held-in file-rewrite prompt (``tests/fixtures/file_rewrites_sample.jsonl``,
   the ones whose prompt holds the old file), the old file is written into a workspace, opened
   as a buffer, and ``agentspec.rewrite {uri, instruction}`` runs; timed from sending the command
   to the editor receiving ``workspace/applyEdit`` (what a user waits for), with speculation on
   and off (two language server processes, the bundled model in-process), greedy. Reported per
   prompt and in total, with MAT and whether the applied text is identical on and off.
2. Overlays: a 5,000-line file open in the editor; one character typed (``didChange``,
   incremental) at a random line, ``--edits`` times; the time until the server has indexed that
   version (its ``agentspec/indexed`` notification, i.e. drafts see it): p50 / p99.

    .venv/bin/python -m benchmarks.bench_editor --out benchmarks/results/editor.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lsprotocol import types
from pygls.lsp.client import LanguageClient

if not __package__:  # run as a file, not with -m: the repository root, for `benchmarks.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import FIXTURE, emit_report, logger, machine_record  # noqa: E402

PROMPT = re.compile(r"Apply this change to `(?P<path>[^`]+)`:\n\n(?P<instruction>.*?)\n\nCurrent contents of "
                    r"`[^`]+`:\n```[^\n]*\n(?P<code>.*)\n```", re.S)


log = logger("bench_editor")


def rewrites(limit: int) -> list[dict]:
    out = []
    for line in FIXTURE.read_text().splitlines():
        rec = json.loads(line)
        m = PROMPT.search(rec["prompt"])
        if m:
            out.append({"id": rec["id"], "name": Path(m["path"]).name, "instruction": m["instruction"].strip(),
                        "code": m["code"] + "\n"})
    return out[:limit]


class Editor:
    def __init__(self, root: Path, options: dict) -> None:
        self.root, self.options = root, options
        self.client = LanguageClient("bench-editor", "1")
        self.docs: dict[str, list] = {}            # uri -> [text, version]
        self.applied_at: dict[str, float] = {}     # uri -> when the last edit arrived
        self.indexed: dict[tuple[str, int], float] = {}
        self.indexed_event = asyncio.Event()

        @self.client.feature(types.WORKSPACE_APPLY_EDIT)
        def apply_edit(params: types.ApplyWorkspaceEditParams) -> types.ApplyWorkspaceEditResult:
            from agentspec.lsp import apply_edits

            now = time.perf_counter()
            for change in params.edit.document_changes or []:
                uri = change.text_document.uri
                doc = self.docs[uri]
                doc[0] = apply_edits(doc[0], [self.client.protocol._converter.unstructure(e) for e in change.edits])
                doc[1] += 1
                self.applied_at[uri] = now
            return types.ApplyWorkspaceEditResult(applied=True)

        @self.client.feature("agentspec/indexed")
        def indexed(params) -> None:
            self.indexed[(params.uri, params.version)] = time.perf_counter()
            self.indexed_event.set()

        for method in (types.WINDOW_LOG_MESSAGE, types.WINDOW_SHOW_MESSAGE, types.PROGRESS):
            self.client.feature(method)(lambda params: None)

        @self.client.feature(types.WINDOW_WORK_DONE_PROGRESS_CREATE)
        def create(params) -> None:
            return None

    async def start(self) -> float:
        t0 = time.perf_counter()
        await self.client.start_io(sys.executable, "-m", "agentspec", "lsp")
        caps = types.ClientCapabilities(window=types.WindowClientCapabilities(work_done_progress=True),
                                        workspace=types.WorkspaceClientCapabilities(apply_edit=True))
        await self.client.initialize_async(types.InitializeParams(
            capabilities=caps, root_uri=self.root.as_uri(), initialization_options=self.options,
            workspace_folders=[types.WorkspaceFolder(uri=self.root.as_uri(), name=self.root.name)]))
        self.client.initialized(types.InitializedParams())
        while not (await self.status())["ready"]:
            await asyncio.sleep(0.1)
        return time.perf_counter() - t0

    async def status(self) -> dict:
        return (await self.client.protocol.send_request_async("agentspec/status", {}))._asdict()

    def open(self, path: Path) -> str:
        uri = path.as_uri()
        text = path.read_text()
        self.docs[uri] = [text, 1]
        self.client.text_document_did_open(types.DidOpenTextDocumentParams(
            text_document=types.TextDocumentItem(uri=uri, language_id="text", version=1, text=text)))
        return uri

    def close(self, uri: str) -> None:
        self.client.text_document_did_close(types.DidCloseTextDocumentParams(
            text_document=types.TextDocumentIdentifier(uri=uri)))

    def type_char(self, uri: str, line: int, ch: str) -> int:
        doc = self.docs[uri]
        lines = doc[0].split("\n")
        lines[line] = ch + lines[line]
        doc[0] = "\n".join(lines)
        doc[1] += 1
        pos = types.Position(line=line, character=0)
        self.client.text_document_did_change(types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=doc[1]),
            content_changes=[types.TextDocumentContentChangePartial(range=types.Range(start=pos, end=pos), text=ch)]))
        return doc[1]

    async def rewrite(self, uri: str, instruction: str) -> dict:
        t0 = time.perf_counter()
        res = await self.client.workspace_execute_command_async(types.ExecuteCommandParams(
            command="agentspec.rewrite", arguments=[{"uri": uri, "instruction": instruction}]))
        res = dict(res) if not hasattr(res, "_asdict") else res._asdict()
        end = self.applied_at.get(uri, time.perf_counter())
        res["command_to_edit_s"] = round((end if res.get("applied") and res.get("edits") else time.perf_counter()) - t0, 3)
        return res

    async def stop(self) -> None:
        await self.client.shutdown_async(None)
        self.client.exit(None)
        await self.client.stop()


async def run_rewrites(root: Path, recs: list[dict], spec: bool) -> dict:
    ed = Editor(root, {"speculation": spec})
    startup = await ed.start()
    log(f"speculation {'on' if spec else 'off'}: server ready in {startup:.1f} s")
    rows = []
    try:
        for rec in recs:
            uri = ed.open(root / rec["name"])
            r = await ed.rewrite(uri, rec["instruction"])
            rows.append({"id": rec["id"], **{k: r.get(k) for k in ("applied", "reason", "edits", "completion_tokens",
                                                                   "mat", "seconds", "command_to_edit_s")},
                         "text": ed.docs[uri][0]})
            log(f"  {rec['id']}: {r.get('command_to_edit_s')} s, {r.get('completion_tokens')} tokens, "
                f"MAT {r.get('mat')}, applied {r.get('applied')} {r.get('reason') or ''}")
            ed.close(uri)
            (root / rec["name"]).write_text(rec["code"])   # the next run starts from the same file
    finally:
        await ed.stop()
    return {"startup_s": round(startup, 2), "rows": rows}


async def run_overlays(root: Path, lines: int, edits: int, seed: int) -> dict:
    big = root / "big_module.py"
    big.write_text("".join(f"def function_{i}(value):\n    return value * {i} + {i % 13}\n\n" for i in range(lines // 3)))
    ed = Editor(root, {"notifyIndexed": True})
    await ed.start()
    rng = random.Random(seed)
    waits = []
    try:
        uri = ed.open(big)
        await asyncio.sleep(1.0)
        for _ in range(edits):
            line = rng.randrange(lines // 3 * 3 - 1)
            t0 = time.perf_counter()
            v = ed.type_char(uri, line, rng.choice("abcxyz"))
            while (uri, v) not in ed.indexed:
                ed.indexed_event.clear()
                await asyncio.wait_for(ed.indexed_event.wait(), 30)
            waits.append(ed.indexed[(uri, v)] - t0)
            await asyncio.sleep(0.02)
        ed.close(uri)
    finally:
        await ed.stop()
    waits.sort()
    q = statistics.quantiles(waits, n=100, method="inclusive")
    return {"file_lines": lines // 3 * 3, "edits": edits, "p50_ms": round(q[49] * 1e3, 2),
            "p99_ms": round(q[98] * 1e3, 2), "max_ms": round(waits[-1] * 1e3, 2)}


async def main_async(args) -> dict:
    recs = rewrites(args.prompts)
    out: dict = {"benchmark": "bench_editor", "machine": {}, "prompts": [r["id"] for r in recs]}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp).resolve()
        for rec in recs:
            (root / rec["name"]).write_text(rec["code"])
        runs = {}
        for spec in (True, False):
            runs["on" if spec else "off"] = await run_rewrites(root, recs, spec)
        on, off = runs["on"]["rows"], runs["off"]["rows"]
        same = sum(a["text"] == b["text"] for a, b in zip(on, off))
        t_on = sum(r["command_to_edit_s"] for r in on)
        t_off = sum(r["command_to_edit_s"] for r in off)
        ratios = [b["command_to_edit_s"] / a["command_to_edit_s"] for a, b in zip(on, off) if a["command_to_edit_s"]]
        for rows in (on, off):
            for r in rows:
                r.pop("text")
        out["rewrites"] = {
            "speculation_on": runs["on"], "speculation_off": runs["off"],
            "total_s": {"on": round(t_on, 2), "off": round(t_off, 2)},
            "speedup_total": round(t_off / t_on, 2) if t_on else None,
            "speedup_median_per_prompt": round(statistics.median(ratios), 2) if ratios else None,
            "mat_mean": round(statistics.mean(r["mat"] for r in on), 2),
            "identical_text_on_off": f"{same}/{len(on)}",
            "applied": f"{sum(bool(r['applied']) for r in on)}/{len(on)} on, {sum(bool(r['applied']) for r in off)}/{len(off)} off"}
        out["overlays"] = await run_overlays(root, args.lines, args.edits, args.seed)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=10, help="held-in rewrite prompts to run (those with a file)")
    ap.add_argument("--lines", type=int, default=5000, help="lines of the file typed into")
    ap.add_argument("--edits", type=int, default=100, help="one-character edits to time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = asyncio.run(main_async(args))
    from agentspec import Engine

    # the language server ran the bundled model in its own process, on this machine, in this
    # environment: the same kernel plan as an engine here (loaded after the run, not during it)
    out["machine"] = machine_record(Engine.embedded(quiet=True))
    emit_report(out, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
