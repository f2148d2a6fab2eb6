"""Following a workspace's edits: a watchdog producer and the updater that consumes its events.

``Watcher`` (the producer) keeps one non-recursive watchdog watch per folder that is not
ignored and puts each file event on a queue as ``(kind, src, dest, is_dir)``; a watch on the
root's parent sees the root itself deleted, recreated or replaced. ``run_updater`` (the
consumer, the workspace's one updater thread) drains the queue, coalesces a burst, has the
watcher follow new, deleted and replaced folders, and hands the paths to re-index to the
workspace. Nothing on a request's path waits on either.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .ignore import IgnoreRules, relative

Event = tuple[str, str, str, bool]   # (watchdog event type, src path, dest path or "", is_directory)


class Watcher:
    """Watchdog watches on ``root``'s folders that ``rules`` keep, feeding ``events``.

    Ignored trees (.venv, build output, node_modules) are never watched, so their churn (a fresh
    venv compiling .pyc files on first import) cannot flood inotify or the updater. New folders
    get watches as their events arrive (``follow``, in the updater thread); deleted ones lose
    them.
    """

    def __init__(self, root: Path, rules: IgnoreRules, events: queue.Queue) -> None:
        self.root = root
        self.rules = rules
        self.events = events
        self.watches: dict[str, Any] = {}   # folder (relative, "" = root) -> its watchdog watch
        self._observer: Any = None
        self._handler: Any = None

    def start(self) -> None:
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer

        events = self.events

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event):
                if event.event_type in ("opened", "closed_no_write"):
                    return
                if event.is_directory and event.event_type in ("modified", "closed"):
                    return   # a folder's own metadata; the files in it report their changes
                events.put((event.event_type, event.src_path, getattr(event, "dest_path", "") or "",
                            event.is_directory))

        root = str(self.root)

        class RootHandler(FileSystemEventHandler):   # on the parent folder: the root's own fate
            def on_any_event(self, event):
                dest = getattr(event, "dest_path", "") or ""
                if event.is_directory and root in (event.src_path, dest) and event.event_type in (
                        "created", "deleted", "moved"):
                    events.put((event.event_type, event.src_path, dest, True))

        self._handler = Handler()
        self._observer = Observer()
        self._observer.daemon = True
        self.watch_tree(self.root)
        if self.root.parent != self.root:
            # the root deleted, recreated or replaced (rm -rf and a fresh clone, a deploy's rename)
            # is only seen from its parent: its own watches die with the old folder
            try:
                self._observer.schedule(RootHandler(), str(self.root.parent), recursive=False)
            except OSError:   # an unreadable parent: the root's own replacement goes unseen
                pass
        self._observer.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._observer.stop()
        self._observer.join(timeout=timeout)

    def rewatch_root(self) -> None:
        """The root was deleted, recreated or replaced: drop the watches under it (they watch
        the old folders) and the cached ``.gitignore`` rules, and watch the tree now there."""
        for key in list(self.watches):
            try:
                self._observer.unschedule(self.watches.pop(key))
            except (KeyError, OSError):
                pass
        self.rules.clear()
        if self.root.is_dir():
            self.watch_tree(self.root)

    def watch_tree(self, folder: Path) -> None:
        for dirpath, dirnames, _ in os.walk(folder):
            base = Path(dirpath)
            dirnames[:] = [d for d in dirnames if not self.rules.ignored(relative(self.root, base / d), True)]
            rel = relative(self.root, base)
            if rel in self.watches or rel.startswith("../") or rel.startswith("/"):
                continue
            try:
                self.watches[rel] = self._observer.schedule(self._handler, str(base), recursive=False)
            except OSError:  # gone meanwhile, or out of inotify watches: its files are still scanned
                pass

    def unwatch_tree(self, rel: str) -> None:
        for key in [k for k in self.watches if k == rel or k.startswith(rel + "/")]:
            try:
                self._observer.unschedule(self.watches.pop(key))
            except (KeyError, OSError):
                pass

    def follow(self, batch: list[Event]) -> set[str]:
        """Keep the watches in line with a batch of events (new folders watched, deleted ones
        not, a replaced root watched again) and return the paths to re-index: files, and
        folders as ``path + os.sep`` (everything under them)."""
        paths: set[str] = set()
        root = str(self.root)
        for kind, src, dest, is_dir in batch:
            if is_dir and root in (src, dest):
                # the root itself deleted, (re)created or moved: watch and scan what is there now
                try:
                    self.rewatch_root()
                except Exception as e:  # noqa: BLE001 - watching is best effort; scanning still works
                    print(f"[agentspec] workspace watch update failed: {e!r}", file=sys.stderr, flush=True)
                paths.add(root + os.sep)
                continue
            if not is_dir and Path(src).name == ".gitignore":
                self.watch_tree(Path(src).parent)   # folders it no longer ignores need watches
            if is_dir:
                try:
                    if kind in ("deleted", "moved"):
                        self.unwatch_tree(relative(self.root, Path(src)))
                    for p in (src if kind == "created" else "", dest):
                        rel = relative(self.root, Path(p)) if p else None
                        if rel is not None and not self.rules.ignored(rel, True) and Path(p).is_dir():
                            self.watch_tree(Path(p))
                except Exception as e:  # noqa: BLE001 - watching is best effort; scanning still works
                    print(f"[agentspec] workspace watch update failed: {e!r}", file=sys.stderr, flush=True)
            for p in (src, dest):
                if p:
                    paths.add(p)
                    if is_dir or kind == "moved":
                        paths.add(p + os.sep)   # a folder: everything under it
        return paths


def run_updater(events: queue.Queue, watcher: Watcher, apply: Callable[[set[str]], None],
                busy: threading.Event, *, debounce: float) -> None:
    """The updater thread: take events off ``events`` until a None, coalescing each burst
    (until the queue stays quiet for ``debounce`` seconds), and ``apply`` the paths they touch.
    ``busy`` is set while a burst is being applied; every item taken is marked done."""
    while True:
        item = events.get()
        if item is None:
            events.task_done()
            return
        busy.set()
        items = [item]
        # coalesce a burst: keep draining until the queue stays quiet for `debounce`
        deadline = time.monotonic() + max(debounce * 10, 0.2)
        while time.monotonic() < deadline:
            try:
                nxt = events.get(timeout=debounce)
            except queue.Empty:
                break
            items.append(nxt)
        stop = any(x is None for x in items)
        paths = watcher.follow([x for x in items if x is not None])
        try:
            apply(paths)
        except Exception as e:  # never let the updater die: report and carry on
            print(f"[agentspec] workspace update failed: {e!r}", file=sys.stderr, flush=True)
        finally:
            for _ in items:
                events.task_done()
            busy.clear()
        if stop:
            return
