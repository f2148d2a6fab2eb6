"""Workspace: real folders, real file events (inotify and watchdog), real tokenizer and suffix index."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agentspec import Workspace
from agentspec.drafting import SuffixDrafter
from suffix_index import SuffixIndex

from helpers.workspace import continues, drafts_of, tree_accepts, until

MODULE = '''"""Accounting helpers."""

import decimal


def add_tax(amount, rate):
    """Return amount with tax applied."""
    return amount * (1 + rate)


def format_money(value, currency="EUR"):
    quantized = decimal.Decimal(value).quantize(decimal.Decimal("0.01"))
    return f"{quantized} {currency}"


class Ledger:
    """Keeps entries in order."""

    def __init__(self):
        self.entries = []

    def record(self, label, amount):
        self.entries.append((label, amount))
        return len(self.entries)

    def total(self):
        return sum(amount for _, amount in self.entries)
'''


@pytest.fixture(scope="module")
def tokenizer(engine):
    return engine.tokenizer


def replay_mat(index, tokenizer, prompt: str, response: str, tenant: str = "default") -> float:
    """Teacher-forced mean accepted tokens per step (bonus included) drafting ``response``."""
    d = SuffixDrafter(index)
    resp = tokenizer.encode(response)
    d.start("replay", tokenizer.encode(prompt), tenant=tenant)
    pos = steps = 0
    while pos < len(resp):
        depth = tree_accepts(d.propose("replay", 32), resp[pos:pos + 32])
        c = min(depth + 1, len(resp) - pos)
        d.extend("replay", resp[pos:pos + c])
        pos += c
        steps += 1
    d.stop("replay")
    return len(resp) / steps


def make_repo(root: Path) -> None:
    (root / "src").mkdir()
    (root / "src" / "ledger.py").write_text(MODULE)
    (root / "src" / "app.js").write_text("function hello(name) {\n  return `hello ${name}`;\n}\n")
    (root / "README.md").write_text("# demo\n\nSome notes about the ledger.\n")
    (root / ".gitignore").write_text("secret/\n*.log\n")
    (root / "secret").mkdir()
    (root / "secret" / "keys.py").write_text("API_KEY = 'zebra-canary-quokka-walrus-9931'\n")
    (root / "debug.log").write_text("LOG zebra-canary-quokka-walrus-9931\n")
    (root / "nested").mkdir()
    (root / "nested" / ".gitignore").write_text("private.txt\n")
    (root / "nested" / "private.txt").write_text("nested private zebra-canary-quokka-walrus-9931\n")
    (root / "nested" / "public.txt").write_text("nested public notes\n")
    (root / "blob.dat").write_bytes(b"\x00\x01\x02binary\x00" * 100)
    (root / "huge.txt").write_text("x" * 5000)
    os.mkfifo(root / "pipe")
    (root / "loop").symlink_to(root)                 # a symlink loop
    (root / "self").symlink_to(root / "self")        # a link to itself
    (root / "dangling").symlink_to(root / "missing.py")


def test_scan_respects_gitignore_and_skips_with_reasons(tmp_path, tokenizer):
    make_repo(tmp_path)
    with Workspace(tmp_path, tokenizer=tokenizer, watch=False, max_file_bytes=4096) as ws:
        files = ws.files()
        assert files == [".gitignore", "README.md", "nested/.gitignore", "nested/public.txt", "src/app.js",
                         "src/ledger.py"]
        reasons = ws.skipped_paths
        assert reasons["blob.dat"] == "binary"
        assert reasons["huge.txt"] == "over 4096 bytes"
        assert reasons["pipe"] == "not a regular file"
        assert reasons["loop"] == "symlink loop"
        assert reasons["self"] == "symlink loop"
        assert reasons["dangling"] == "broken symlink"
        summary = ws.summary()
        assert summary["files"] == 6 and summary["chunks"] >= 6 and summary["tokens"] > 100
        assert summary["skipped"]["binary"] == 1
        # indexed content is drafted; ignored content never is
        assert continues(ws.index, tokenizer, "def format_money(value, currency=\"EUR\"):\n    quantized =",
                         " decimal.Decimal(value).quantize")
        canary = set(tokenizer.encode("-canary-quokka-walrus-9931'"))
        for prefix in ("API_KEY = 'zebra", "LOG zebra", "nested private zebra"):
            assert not canary & set(drafts_of(ws.index, tokenizer, prefix))


SECRET = "SECRET_TOKEN = 'okapi-narwhal-canary-4410'\n"


def make_linked_repo(tmp: Path) -> Path:
    """A workspace whose links lead out of bounds: to a file and a folder outside the root, to a
    gitignored file and folder, to one of the server's own files, a loop; and one good link."""
    root, outside = tmp / "ws", tmp / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "secret.py").write_text(SECRET)
    (outside / "dir" / "a.py").write_text(SECRET)
    root.mkdir()
    (root / ".gitignore").write_text(".env\nprivate/\n")
    (root / ".env").write_text(SECRET)
    (root / "private").mkdir()
    (root / "private" / "k.py").write_text(SECRET)
    (root / "server.toml").write_text(f"# {SECRET}")
    (root / "src").mkdir()
    (root / "src" / "main.py").write_text("def main():\n    return 'kept-file-heron-22'\n")
    (root / "out.py").symlink_to(outside / "secret.py")         # a file outside the root
    (root / "outdir").symlink_to(outside / "dir")               # a folder outside the root
    (root / "env_link.py").symlink_to(root / ".env")            # a gitignored file
    (root / "visible").symlink_to(root / "private")             # a gitignored folder
    (root / "cfg_link.py").symlink_to(root / "server.toml")     # the server's config file
    (root / "again").symlink_to(root)                           # a loop
    (root / "good.py").symlink_to(root / "src" / "main.py")     # inside, kept: followed
    return root


def test_links_never_lead_out_of_the_workspace_or_to_what_it_ignores(tmp_path, tokenizer):
    from agentspec.workspace import OwnedPath

    root = make_linked_repo(tmp_path)
    owned = [OwnedPath.of("config file", root / "server.toml")]
    with Workspace(root, tokenizer=tokenizer, watch=False, exclude=owned) as ws:
        assert ws.files() == [".gitignore", "good.py", "src/main.py"], ws.files()
        reasons = ws.skipped_paths
        assert reasons["out.py"] == reasons["outdir"] == "symlink out of the workspace"
        assert reasons["env_link.py"] == reasons["visible"] == "symlink to an ignored path"
        assert reasons["cfg_link.py"] == "symlink to a server-owned path"
        assert reasons["again"] == "symlink loop"
        assert "server.toml" not in reasons   # the config itself is never even listed
        assert ws.owned_rule("cfg_link.py") == ws.owned_rule(root / "server.toml") == "config file"
        assert not continues(ws.index, tokenizer, "SECRET_TOKEN = 'okapi", "-narwhal-canary")
        assert continues(ws.index, tokenizer, "def main():\n    return", " 'kept-file-heron")


def test_a_link_made_later_is_refused_like_one_found_at_start(tmp_path, tokenizer):
    from agentspec.workspace import OwnedPath

    root = make_linked_repo(tmp_path)
    with Workspace(root, tokenizer=tokenizer, exclude=[OwnedPath.of("config file", root / "server.toml")]) as ws:
        (root / "late_out.py").symlink_to(tmp_path / "outside" / "secret.py")
        (root / "late_env.py").symlink_to(root / ".env")
        # folder links: inotify says "created", not a folder (a link is none), yet the path is a folder
        (root / "late_dir").symlink_to(tmp_path / "outside" / "dir")
        (root / "late_up").symlink_to(tmp_path)   # holds the root again, its config and outside/
        (root / "late_ok.py").write_text("marker = 'late-file-ibis-77'\n")
        assert until(lambda: "late_ok.py" in ws.files()), ws.files()
        assert "late_out.py" not in ws.files() and "late_env.py" not in ws.files()
        assert not [f for f in ws.files() if f.startswith(("late_dir/", "late_up/"))], ws.files()
        assert not continues(ws.index, tokenizer, "SECRET_TOKEN = 'okapi", "-narwhal-canary")


def test_a_symlinked_folder_never_leads_to_the_servers_files(tmp_path, tokenizer):
    """The server's config and log folder inside the workspace (``--config deploy/agentspec.toml
    --repo .``, ``log_dir = "var/logs"``): a link to a folder holding them is refused, at start and
    when made later; a file is read only when the file opened is inside the root, kept and none of
    the server's (by path, or by identity: a hard link)."""
    from agentspec.workspace import OwnedPath

    root, outside = tmp_path / "ws", tmp_path / "outside"
    (root / "deploy").mkdir(parents=True)
    (root / "deploy" / "agentspec.toml").write_text(f"# {SECRET}")
    (root / "deploy" / "notes.md").write_text("deploy notes\n")
    (root / "var" / "logs").mkdir(parents=True)
    (root / "var" / "logs" / "acme.jsonl").write_text(f'{{"prompt": "{SECRET.strip()}"}}\n')
    (root / "var" / "readme.md").write_text("var readme\n")
    outside.mkdir()
    (outside / "secret.py").write_text(SECRET)
    (root / "a-link").symlink_to(root / "deploy")   # sorts before the folder it leads to
    (root / "b-link").symlink_to(root / "var")
    os.link(root / "deploy" / "agentspec.toml", root / "copy.toml")
    owned = [OwnedPath.of("config file", root / "deploy" / "agentspec.toml"),
             OwnedPath.of("log_dir", root / "var" / "logs")]
    with Workspace(root, tokenizer=tokenizer, watch=False, exclude=owned) as ws:
        assert ws.files() == ["deploy/notes.md", "var/readme.md"], ws.files()
        reasons = ws.skipped_paths
        assert reasons["a-link"] == reasons["b-link"] == "symlink to a folder holding a server-owned path"
        assert reasons["copy.toml"] == "another name for a server-owned path"
        # made later, applied as the watcher would: a folder link (no walk under it) and a file
        # under it (read only as the file it opens, which is the config)
        (root / "late").symlink_to(root / "deploy")
        (root / "late_out").symlink_to(outside)
        ws._apply({str(root / "late"), str(root / "late_out"), str(root / "late" / "agentspec.toml"),
                   str(root / "late_out" / "secret.py"), str(root / "late") + os.sep})
        assert ws.files() == ["deploy/notes.md", "var/readme.md"], ws.files()
        assert ws.skipped_paths["late/agentspec.toml"] == "symlink to a server-owned path"
        assert ws.skipped_paths["late_out/secret.py"] == "symlink out of the workspace"
        assert not continues(ws.index, tokenizer, "SECRET_TOKEN = 'okapi", "-narwhal-canary")


def test_file_deleted_between_listing_and_reading(tmp_path, tokenizer, monkeypatch):
    from agentspec.workspace import scan, workspace

    (tmp_path / "keep.py").write_text("x = 1\n")
    (tmp_path / "gone.py").write_text("y = 2\n")

    def racy_walk(root, rules, skip):
        for rel, path in scan.walk(root, rules, skip):
            yield rel, path
            if rel == "gone.py":
                path.unlink()      # deleted after it was listed, before it is read

    monkeypatch.setattr(workspace, "walk", racy_walk)   # the walk the Workspace's scan lists with
    with Workspace(tmp_path, tokenizer=tokenizer, watch=False) as ws:
        assert ws.files() == ["keep.py"]
        assert ws.skipped_paths["gone.py"] == "vanished before it was read"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_unreadable_file_is_skipped(tmp_path, tokenizer):
    f = tmp_path / "locked.py"
    f.write_text("z = 3\n")
    f.chmod(0)
    with Workspace(tmp_path, tokenizer=tokenizer, watch=False) as ws:
        assert ws.skipped_paths["locked.py"].startswith("unreadable")


def test_live_edits_creates_deletes_renames_and_bursts(tmp_path, tokenizer, watcher):
    make_repo(tmp_path)
    with Workspace(tmp_path, tokenizer=tokenizer, max_file_bytes=4096) as ws:
        idx = ws.index
        total = "    def total(self):\n        return"
        # edit: the new content becomes draftable, the old is gone
        path = tmp_path / "src" / "ledger.py"
        assert continues(idx, tokenizer, total, " sum(amount for _,")
        path.write_text(MODULE.replace("return sum(amount for _, amount in self.entries)",
                                       "return round(sum(a for _, a in self.entries), 2)"))
        assert until(lambda: continues(idx, tokenizer, total, " round(sum(a for _, a in")), "edit never indexed"
        assert not continues(idx, tokenizer, total, " sum(amount for _,")
        # create
        (tmp_path / "src" / "new_mod.py").write_text("def brand_new_function_xyz():\n    return 'pelican-harbor'\n")
        assert until(lambda: "src/new_mod.py" in ws.files()), ws.files()
        new_fn = "def brand_new_function_xyz():\n    return"
        assert until(lambda: continues(idx, tokenizer, new_fn, " 'pelican-harbor'"))
        # rename: documents move with the file
        (tmp_path / "src" / "new_mod.py").rename(tmp_path / "src" / "renamed_mod.py")
        assert until(lambda: "src/new_mod.py" not in ws.files() and "src/renamed_mod.py" in ws.files()), ws.files()
        assert continues(idx, tokenizer, new_fn, " 'pelican-harbor'")
        # delete: gone from the drafts
        (tmp_path / "src" / "renamed_mod.py").unlink()
        assert until(lambda: "src/renamed_mod.py" not in ws.files()), ws.files()
        assert not continues(idx, tokenizer, new_fn, " 'pelican-harbor'")
        # a burst of 100 saves: the last one wins, and the work is coalesced (with one re-index
        # per event, the 200+ events of the first 99 saves would be counted before the last
        # save's content could be drafted)
        before = ws.updates
        burst = tmp_path / "src" / "burst.py"
        for i in range(100):
            burst.write_text(f"def burst_value():\n    return {i} * 1000 + {i}\n")
        assert until(lambda: continues(idx, tokenizer, "def burst_value():\n    return", " 99 * 1000 + 99"))
        assert ws.updates - before < 100
        assert not continues(idx, tokenizer, "def burst_value():\n    return", " 98 * 1000")
        # an editor's atomic save: write a temp file, rename it over the original
        tmp = tmp_path / "src" / ".ledger.py.swp~"
        tmp.write_text(MODULE.replace("def add_tax(amount, rate):", "def add_vat(amount, rate):"))
        os.replace(tmp, path)
        assert until(lambda: ".ledger.py.swp~" not in " ".join(ws.files()) and "src/ledger.py" in ws.files()
                     and continues(idx, tokenizer, 'def add_vat(amount, rate):\n    """Return',
                                   ' amount with tax applied')), ws.files()
        # a file newly gitignored while watching is dropped
        assert "README.md" in ws.files()
        (tmp_path / ".gitignore").write_text("secret/\n*.log\nREADME.md\n")
        assert until(lambda: "README.md" not in ws.files()), ws.files()


def test_new_folders_are_watched_and_ignored_trees_are_not(tmp_path, tokenizer, watcher):
    make_repo(tmp_path)
    (tmp_path / ".venv" / "lib").mkdir(parents=True)
    with Workspace(tmp_path, tokenizer=tokenizer) as ws:
        watches = ws._watcher.watches   # watched folder (relative) -> its watch
        assert ".venv" not in watches and ".venv/lib" not in watches and "src" in watches
        # churn in an ignored tree (a fresh venv compiling .pyc files) reaches nothing: a file
        # saved after it in the (watched) root is indexed, and nothing of the churn is
        for i in range(200):
            (tmp_path / ".venv" / "lib" / f"m{i}.py").write_text("x = 1\n")
        (tmp_path / "after_churn.txt").write_text("saved after the churn\n")
        assert until(lambda: "after_churn.txt" in ws.files()), ws.files()
        assert not any(f.startswith(".venv") for f in ws.files())
        assert ".venv" not in watches and ".venv/lib" not in watches
        # a new folder tree gets watches, and edits inside it after that are seen
        deep = tmp_path / "pkg" / "sub"
        deep.mkdir(parents=True)
        (deep / "a.py").write_text("def first_version_qq():\n    return 'one-one'\n")
        assert until(lambda: "pkg/sub/a.py" in ws.files() and "pkg/sub" in watches), (ws.files(), watches)
        (deep / "a.py").write_text("def second_version_qq():\n    return 'two-two'\n")
        assert until(lambda: continues(ws.index, tokenizer, "def second_version_qq():\n    return", " 'two-two'"))
        # a deleted folder loses its watches
        import shutil

        shutil.rmtree(tmp_path / "pkg")
        assert until(lambda: "pkg/sub" not in watches and "pkg/sub/a.py" not in ws.files()), (ws.files(), watches)
        assert not continues(ws.index, tokenizer, "def second_version_qq():\n    return", " 'two-two'")


def test_folders_moved_within_into_and_out_of_the_tree(tmp_path, tokenizer, watcher):
    root = tmp_path / "repo"
    root.mkdir()
    make_repo(root)
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "sub" / "m.py").write_text("def moved_fn_kk():\n    return 'kestrel-one'\n")
    outside = tmp_path / "outside"
    (outside / "inner").mkdir(parents=True)
    (outside / "inner" / "o.py").write_text("def outside_fn_kk():\n    return 'osprey-one'\n")
    with Workspace(root, tokenizer=tokenizer) as ws:
        watches, idx = ws._watcher.watches, ws.index
        # renamed within the tree, then edited at once: the edit is read at the new path
        (root / "pkg").rename(root / "lib")
        (root / "lib" / "sub" / "m.py").write_text("def moved_fn_kk():\n    return 'kestrel-two'\n")
        assert until(lambda: "lib/sub/m.py" in ws.files() and "pkg/sub/m.py" not in ws.files()
                     and continues(idx, tokenizer, "def moved_fn_kk():\n    return", " 'kestrel-two'")), ws.files()
        assert until(lambda: "lib/sub" in watches and "pkg/sub" not in watches), watches
        (root / "lib" / "sub" / "m.py").write_text("def moved_fn_kk():\n    return 'kestrel-three'\n")
        assert until(lambda: continues(idx, tokenizer, "def moved_fn_kk():\n    return", " 'kestrel-three'"))
        # moved in from outside: indexed and watched
        (outside / "inner").rename(root / "inner")
        assert until(lambda: "inner/o.py" in ws.files() and "inner" in watches), (ws.files(), watches)
        (root / "inner" / "o.py").write_text("def outside_fn_kk():\n    return 'osprey-two'\n")
        assert until(lambda: continues(idx, tokenizer, "def outside_fn_kk():\n    return", " 'osprey-two'"))
        # moved into an ignored folder (secret/ is gitignored): gone from the index and unwatched
        (root / "lib").rename(root / "secret" / "lib")
        assert until(lambda: not any(f.startswith("lib/") for f in ws.files())), ws.files()
        assert until(lambda: not any(k.startswith(("lib", "secret")) for k in watches)), watches
        assert not continues(idx, tokenizer, "def moved_fn_kk():\n    return", " 'kestrel-three'")
        # moved out of the tree: gone from the index and unwatched
        (root / "inner").rename(outside / "back")
        assert until(lambda: "inner/o.py" not in ws.files() and "inner" not in watches), (ws.files(), watches)
        (outside / "back" / "o.py").write_text("def outside_fn_kk():\n    return 'osprey-three'\n")
        (root / "after.txt").write_text("written after the moves\n")
        assert until(lambda: "after.txt" in ws.files()), ws.files()
        assert not any("o.py" in f or f.startswith("back") for f in ws.files())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")
def test_one_watcher_thread_however_many_folders(tmp_path, tokenizer, monkeypatch):
    """The inotify watcher reads every folder's watch on one descriptor with one thread: a
    repository of 300 folders costs two threads (reader and updater), not one per folder (what
    watchdog's observer runs: an emitter thread per watch)."""
    monkeypatch.delenv("AGENTSPEC_WATCHER", raising=False)   # the default
    for i in range(300):
        d = tmp_path / f"pkg{i // 20}" / f"mod{i}"
        d.mkdir(parents=True)
        (d / "m.py").write_text(f"VALUE_{i} = {i}\n")
    before = threading.active_count()
    with Workspace(tmp_path, tokenizer=tokenizer) as ws:
        assert type(ws._watcher).__name__ == "InotifyWatcher"
        assert len(ws._watcher.watches) == 316   # the root, 15 pkg folders, 300 modules
        assert threading.active_count() - before == 2, [t.name for t in threading.enumerate()]
        (tmp_path / "pkg14" / "mod299" / "m.py").write_text("VALUE_299 = 'edited-ibis'\n")
        assert until(lambda: continues(ws.index, tokenizer, "VALUE_299 =", " 'edited-ibis'"))
    assert threading.active_count() == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")
def test_lost_events_rescan_and_rewatch_the_tree(tmp_path, tokenizer, monkeypatch):
    """A full kernel queue (IN_Q_OVERFLOW: events were dropped) makes the watcher watch and scan
    the whole tree again. Here events are lost for real: the root's watch is removed behind the
    watcher's back, a file is written where no watch sees it, then the queue's overflow event
    (what the kernel would have sent) reaches the reader's translation."""
    from inotify_simple import Event, flags

    monkeypatch.delenv("AGENTSPEC_WATCHER", raising=False)
    make_repo(tmp_path)
    with Workspace(tmp_path, tokenizer=tokenizer) as ws:
        w = ws._watcher
        w._ino.rm_watch(w.watches[""])
        assert until(lambda: "" not in w.watches)   # IN_IGNORED reached the reader
        (tmp_path / "unseen.py").write_text("def unseen_fn_pp():\n    return 'lost-event-petrel'\n")
        assert ws.wait_idle() and "unseen.py" not in ws.files()
        w._event(Event(-1, flags.Q_OVERFLOW, 0, ""), None)
        assert until(lambda: "unseen.py" in ws.files() and "" in w.watches), (ws.files(), w.watches)
        assert continues(ws.index, tokenizer, "def unseen_fn_pp():\n    return", " 'lost-event-petrel'")
        (tmp_path / "unseen.py").write_text("def unseen_fn_pp():\n    return 'watched-again-tern'\n")
        assert until(lambda: continues(ws.index, tokenizer, "def unseen_fn_pp():\n    return", " 'watched-again-tern'"))


def _events_until(q, cond, timeout: float = 30.0) -> list:
    """Events off ``q`` until one satisfies ``cond`` (a hang guard, never a time bound)."""
    got: list = []
    assert until(lambda: _drain(q, got) or any(cond(e) for e in got), timeout), got
    return got


def _drain(q, got: list) -> bool:
    import queue as queue_mod

    while True:
        try:
            got.append(q.get_nowait())
        except queue_mod.Empty:
            return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")
def test_inotify_reader_moves_a_folders_watches_with_it_at_once(tmp_path):
    """The reader alone (no updater to re-walk the tree): a folder renamed, then a file written in
    it before anything else happens, is reported at its new path, and the watches moved with it."""
    import queue as queue_mod

    from agentspec.workspace.ignore import IgnoreRules
    from agentspec.workspace.watcher import InotifyWatcher

    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    q: queue_mod.Queue = queue_mod.Queue()
    w = InotifyWatcher(tmp_path, IgnoreRules(tmp_path, []), q)
    w.start()
    try:
        assert {"", "pkg", "pkg/sub"} <= set(w.watches)
        (tmp_path / "pkg").rename(tmp_path / "lib")
        (tmp_path / "lib" / "sub" / "m.py").write_text("x = 1\n")
        new = str(tmp_path / "lib" / "sub" / "m.py")
        got = _events_until(q, lambda e: e[1] == new and e[0] == "closed")
        assert ("moved", str(tmp_path / "pkg"), str(tmp_path / "lib"), True) in got
        assert not any("pkg/sub/m.py" in e[1] for e in got), got
        assert {"lib", "lib/sub"} <= set(w.watches) and not {"pkg", "pkg/sub"} & set(w.watches)
    finally:
        w.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")
def test_inotify_watcher_stops_cleanly(tmp_path):
    """Its descriptors are closed at stop; after it, adding a watch is an OSError (what the updater
    catches, finishing a batch while the workspace closes) and removing one does nothing, so a
    closed descriptor (or another one given its number) is never used; a second stop is harmless."""
    import queue as queue_mod

    from agentspec.workspace.ignore import IgnoreRules
    from agentspec.workspace.watcher import InotifyWatcher

    (tmp_path / "a").mkdir()
    fds = set(os.listdir("/proc/self/fd"))
    w = InotifyWatcher(tmp_path, IgnoreRules(tmp_path, []), queue_mod.Queue())
    w.start()
    assert len(set(os.listdir("/proc/self/fd")) - fds) == 3   # the inotify descriptor and the wake pipe
    wd = w.watches["a"]
    w.stop()
    assert set(os.listdir("/proc/self/fd")) - fds == set()
    with pytest.raises(OSError):
        w._add(tmp_path / "a", "a")
    w._remove(wd)
    w.stop()


def _exchange(a: Path, b: Path) -> None:
    """renameat2(RENAME_EXCHANGE): ``a`` and ``b`` swap places in one step (``mv --exchange``)."""
    import ctypes
    import ctypes.util
    import errno

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if not hasattr(libc, "renameat2"):
        pytest.skip("this C library has no renameat2")
    if libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), 2) != 0:   # AT_FDCWD, RENAME_EXCHANGE
        e = ctypes.get_errno()
        if e in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            pytest.skip(f"this file system cannot exchange folders: {os.strerror(e)}")
        raise OSError(e, os.strerror(e))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")
def test_an_exchange_rename_keeps_both_folders_watched(tmp_path, tokenizer, monkeypatch):
    monkeypatch.delenv("AGENTSPEC_WATCHER", raising=False)
    (tmp_path / "a" / "deep").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "one.py").write_text("def one_fn_xx():\n    return 'first-crane'\n")
    (tmp_path / "a" / "deep" / "x.py").write_text("def deep_fn_xx():\n    return 'first-heron'\n")
    (tmp_path / "b" / "two.py").write_text("def two_fn_xx():\n    return 'first-stork'\n")
    with Workspace(tmp_path, tokenizer=tokenizer) as ws:
        w = ws._watcher
        _exchange(tmp_path / "a", tmp_path / "b")
        want = ["a/two.py", "b/deep/x.py", "b/one.py"]
        assert until(lambda: ws.files() == want), ws.files()
        assert until(lambda: {"a", "b", "b/deep"} <= set(w.watches) and "a/deep" not in w.watches), w.watches
        assert all(w._paths[wd] == rel for rel, wd in w.watches.items()), (w.watches, w._paths)
        # edits in both, at their new places, are followed
        (tmp_path / "a" / "two.py").write_text("def two_fn_xx():\n    return 'second-stork'\n")
        (tmp_path / "b" / "deep" / "x.py").write_text("def deep_fn_xx():\n    return 'second-heron'\n")
        assert until(lambda: continues(ws.index, tokenizer, "def two_fn_xx():\n    return", " 'second-stork'"))
        assert until(lambda: continues(ws.index, tokenizer, "def deep_fn_xx():\n    return", " 'second-heron'"))
        assert ws.files() == want


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")
def test_inotify_reader_follows_an_exchange(tmp_path):
    """The reader alone: after ``a`` and ``b`` swap places, a file written in each is reported at
    its folder's new place (each folder's watches went with it), whatever batches the updater
    would see the two renames in."""
    import queue as queue_mod

    from agentspec.workspace.ignore import IgnoreRules
    from agentspec.workspace.watcher import InotifyWatcher

    (tmp_path / "a" / "deep").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    q: queue_mod.Queue = queue_mod.Queue()
    w = InotifyWatcher(tmp_path, IgnoreRules(tmp_path, []), q)
    w.start()
    try:
        _exchange(tmp_path / "a", tmp_path / "b")
        a, b = str(tmp_path / "a"), str(tmp_path / "b")
        _events_until(q, lambda e: e[:3] == ("moved", b, a))
        (tmp_path / "a" / "new_a.py").write_text("x = 1\n")        # in the folder that was b
        (tmp_path / "b" / "deep" / "new_b.py").write_text("y = 2\n")   # in the one that was a
        want = {str(tmp_path / "a" / "new_a.py"), str(tmp_path / "b" / "deep" / "new_b.py")}
        got: list = []
        assert until(lambda: _drain(q, got) or want <= {e[1] for e in got if e[0] == "closed"}, 30), got
        assert not any(e[1].endswith(("b/new_a.py", "a/deep/new_b.py")) for e in got), got
        assert {"a", "b", "b/deep"} <= set(w.watches) and "a/deep" not in w.watches
        assert all(w._paths[wd] == rel for rel, wd in w.watches.items())
    finally:
        w.stop()


@pytest.mark.parametrize("value", ["inotfy", "poll"])
def test_an_unknown_watcher_is_refused_by_name(tmp_path, tokenizer, monkeypatch, value):
    """A ConfigError: ``agentspec serve --repo`` prints it and exits 2, no traceback."""
    from agentspec.errors import ConfigError

    monkeypatch.setenv("AGENTSPEC_WATCHER", value)
    with pytest.raises(ConfigError, match=f"AGENTSPEC_WATCHER='{value}'.*inotify, watchdog"):
        Workspace(tmp_path, tokenizer=tokenizer)


def test_response_reproducing_a_file_not_in_the_prompt_is_drafted_from_the_workspace(tmp_path, tokenizer):
    make_repo(tmp_path)
    with Workspace(tmp_path, tokenizer=tokenizer, watch=False) as ws:
        mat = replay_mat(ws.index, tokenizer, "Show me src/ledger.py exactly as it is.\n", MODULE)
        without = replay_mat(SuffixIndex(), tokenizer, "Show me src/ledger.py exactly as it is.\n", MODULE)
    assert mat >= 10, mat
    assert without < 3, without


def test_two_tenants_never_cross(tmp_path, tokenizer):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "mod.py").write_text("def shared_name():\n    return 'alpaca-lighthouse-canary-1177'\n")
    (b / "mod.py").write_text("def shared_name():\n    return 'other'\n")
    shared = SuffixIndex()
    with Workspace(a, tenant="alice", tokenizer=tokenizer, index=shared, watch=False), \
            Workspace(b, tenant="bob", tokenizer=tokenizer, index=shared, watch=False):
        prefix = "def shared_name():\n    return"
        assert continues(shared, tokenizer, prefix, " 'alpaca-lighthouse", tenant="alice")
        canary = set(tokenizer.encode("alpaca-lighthouse-canary-1177"))
        assert not canary & set(drafts_of(shared, tokenizer, prefix, tenant="bob"))
        assert continues(shared, tokenizer, prefix, " 'other'", tenant="bob")


def test_snapshot_reload_reindexes_only_changed_files(tmp_path, tokenizer):
    repo, snap = tmp_path / "repo", tmp_path / "snap"
    repo.mkdir()
    (repo / "one.py").write_text("def one():\n    return 'first-version-marmot'\n")
    (repo / "two.py").write_text("def two():\n    return 'stays-the-same-otter'\n")
    with Workspace(repo, tokenizer=tokenizer, watch=False, snapshot=snap) as ws:
        assert not ws.summary()["loaded_from_snapshot"]
    assert (snap / "index.bin").exists() and (snap / "manifest.json").exists()
    one = repo / "one.py"
    old = one.stat()
    one.write_text("def one():\n    return 'second-version-marmot'\n")   # same size
    os.utime(one, ns=(old.st_atime_ns, old.st_mtime_ns + 10**9))  # a later mtime, whatever the clock's grain
    (repo / "three.py").write_text("def three():\n    return 'brand-new-heron'\n")

    calls = []

    class Counting(Workspace):
        def _replace(self, rel, *args):
            calls.append(rel)
            return super()._replace(rel, *args)

    with Counting(repo, tokenizer=tokenizer, watch=False, snapshot=snap) as ws:
        assert ws.summary()["loaded_from_snapshot"]
        assert sorted(calls) == ["one.py", "three.py"]          # two.py came from the snapshot
        assert continues(ws.index, tokenizer, "def one():\n    return", " 'second-version")
        assert continues(ws.index, tokenizer, "def two():\n    return", " 'stays-the-same")
        assert continues(ws.index, tokenizer, "def three():\n    return", " 'brand-new")
    # a damaged snapshot is not trusted: the tree is indexed from scratch
    (snap / "index.bin").write_bytes(b"garbage")
    with Workspace(repo, tokenizer=tokenizer, watch=False, snapshot=snap) as ws:
        assert not ws.summary()["loaded_from_snapshot"]
        assert continues(ws.index, tokenizer, "def two():\n    return", " 'stays-the-same")


def test_engine_drafts_from_its_workspace(tmp_path, tokenizer):
    import agentspec

    (tmp_path / "ledger.py").write_text(MODULE)
    with Workspace(tmp_path, tokenizer=tokenizer, watch=False) as ws:
        eng = agentspec.Engine.embedded(workspace=ws, quiet=True, row_cost=0.05)
        assert eng.drafter.index is ws.index
        with pytest.raises(agentspec.ConfigError, match="either drafter or workspace"):
            agentspec.Engine.embedded(workspace=ws, drafter=SuffixDrafter(), quiet=True)
    with pytest.raises(ValueError, match="not a directory"):
        Workspace(tmp_path / "nope", tokenizer=tokenizer)


def test_cli_index_json(tmp_path):
    make_repo(tmp_path)
    r = subprocess.run([sys.executable, "-m", "agentspec", "index", str(tmp_path), "--json",
                        "--max-file-bytes", "4096"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["files"] == 6 and summary["skipped"]["binary"] == 1 and summary["tokens"] > 100
    r = subprocess.run([sys.executable, "-m", "agentspec", "index", str(tmp_path / "missing")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "not a directory" in r.stderr


def test_overlay_shadows_the_disk_until_dropped(tmp_path, tokenizer):
    """An editor's unsaved buffer (``overlay``) is what drafts come from; saves on disk meanwhile
    do not replace it; ``drop_overlay`` goes back to the disk copy."""
    make_repo(tmp_path)
    path = tmp_path / "src" / "ledger.py"
    total = "    def total(self):\n        return"
    with Workspace(tmp_path, tokenizer=tokenizer) as ws:
        idx = ws.index
        buffer = MODULE.replace("return sum(amount for _, amount in self.entries)",
                                "return unsaved_sum_canary(self.entries)")
        assert ws.overlay("src/ledger.py", buffer) is True
        assert ws.overlays() == ["src/ledger.py"]
        assert continues(idx, tokenizer, total, " unsaved_sum_canary(self.")
        assert not continues(idx, tokenizer, total, " sum(amount for _,")
        # a save of other text on disk while the buffer is open does not replace the buffer
        path.write_text(MODULE.replace("return sum(amount for _, amount in self.entries)", "return disk_canary()"))
        (tmp_path / "src" / "other.py").write_text("def other_canary_fn():\n    return 'kestrel-ridge'\n")
        assert until(lambda: "src/other.py" in ws.files())   # the watcher ran past the save
        assert ws.wait_idle()
        assert continues(idx, tokenizer, total, " unsaved_sum_canary(self.")
        assert not continues(idx, tokenizer, total, " disk_canary()")
        # a buffer for a file not yet on disk, and a buffer edited key by key
        assert ws.overlay(tmp_path / "src" / "draft_new.py", "def brand_new_buffer_fn():\n    return 'osprey'\n")
        assert "src/draft_new.py" in ws.files()
        assert continues(idx, tokenizer, "def brand_new_buffer_fn():\n    return", " 'osprey'")
        # closing the buffer: the disk copy is back, the unsaved text is gone
        ws.drop_overlay("src/ledger.py")
        assert continues(idx, tokenizer, total, " disk_canary()")
        assert not continues(idx, tokenizer, total, " unsaved_sum_canary(self.")
        ws.drop_overlay("src/draft_new.py")
        assert "src/draft_new.py" not in ws.files()
        assert not continues(idx, tokenizer, "def brand_new_buffer_fn():\n    return", " 'osprey'")
        assert ws.overlays() == []
        # ignored paths are not indexed from a buffer either; paths outside the root are refused
        assert ws.overlay("secret/keys.py", "API_KEY = 'buffer-canary-heron-5512'\n") is False
        assert ws.overlay("debug.log", "buffer-canary-heron-5512\n") is False
        assert not continues(idx, tokenizer, "API_KEY = 'buffer", "-canary-heron")
        for bad in ("../outside.py", tmp_path.parent / "outside.py", "/etc/hostname", ""):
            with pytest.raises(ValueError, match="not a file under the workspace root"):
                ws.overlay(bad, "x = 1\n")


def test_overlay_retokenizes_only_changed_chunks(tmp_path, tokenizer):
    """Typing in a large buffer re-tokenizes the chunk being edited, not the file."""
    big = "".join(f"def fn_{i}(x):\n    return x * {i} + {i + 1}\n\n\n" for i in range(1500))   # ~6k lines
    (tmp_path / "big.py").write_text(big)

    class Counting:
        def __init__(self, inner):
            self.inner, self.texts = inner, 0
            self.vocab_size = getattr(inner, "vocab_size", None)

        def encode_batch(self, texts):
            self.texts += len(texts)
            return self.inner.encode_batch(texts)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    counting = Counting(tokenizer)
    with Workspace(tmp_path, tokenizer=counting, watch=False) as ws:
        chunks = len(ws._files["big.py"]["docs"])
        assert chunks > 50
        counting.texts = 0
        edited = big.replace("return x * 700 + 701", "return x * 700 + 701  # typed")
        ws.overlay("big.py", edited)
        assert counting.texts <= 2, counting.texts
        assert continues(ws.index, tokenizer, "def fn_700(x):\n    return x * 700 + 701", "  # typed")
        assert ws.summary()["tokens"] > 0
