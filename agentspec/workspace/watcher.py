"""Following a workspace's edits: a file-event producer and the updater that consumes its events.

A ``Watcher`` (the producer) keeps one non-recursive watch per folder that is not ignored and puts
each file event on a queue as ``(kind, src, dest, is_dir)``; a watch on the root's parent sees the
root itself deleted, recreated or replaced. ``run_updater`` (the consumer, the workspace's one
updater thread) drains the queue, coalesces a burst, has the watcher follow new, deleted and
replaced folders, and hands the paths to re-index to the workspace. Nothing on a request's path
waits on either.

Two producers, one bookkeeping (``Watcher``): on Linux ``InotifyWatcher`` holds every watch on one
inotify descriptor read by one thread, however many folders the repository has; elsewhere
``WatchdogWatcher`` uses watchdog's native observer (FSEvents, ReadDirectoryChangesW, kqueue), which
runs a thread per watched folder. ``make_watcher`` picks; ``AGENTSPEC_WATCHER=inotify|watchdog``
overrides.
"""

from __future__ import annotations

import errno
import os
import queue
import select
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .ignore import IgnoreRules, relative

Event = tuple[str, str, str, bool]   # (kind: created|deleted|modified|closed|moved|overflow, src path, dest path or "", is_directory)

WATCHERS = ("inotify", "watchdog")


class Watcher:
    """Watches on ``root``'s folders that ``rules`` keep, feeding ``events``.

    Ignored trees (.venv, build output, node_modules) are never watched, so their churn (a fresh
    venv compiling .pyc files on first import) cannot flood the kernel's event queue or the
    updater. New folders get watches as their events arrive (``follow``, in the updater thread);
    deleted ones lose them. A backend supplies ``start``, ``stop``, ``_add`` and ``_remove``.
    """

    # whether the backend moves a renamed folder's watches itself (else ``follow`` re-watches it)
    MOVES_WATCHES = False

    def __init__(self, root: Path, rules: IgnoreRules, events: queue.Queue) -> None:
        self.root = root
        self.rules = rules
        self.events = events
        self.watches: dict[str, Any] = {}   # folder (relative, "" = root) -> its watch
        self._lock = threading.RLock()      # guards ``watches`` (the updater and a reader thread)
        self._warned_full = False

    # ---- the backend ----------------------------------------------------------------------------

    def start(self) -> None:
        raise NotImplementedError

    def stop(self, timeout: float = 5.0) -> None:
        raise NotImplementedError

    def _add(self, folder: Path, rel: str) -> Any:
        """Watch ``folder`` (not recursively); its handle. OSError where it cannot be watched."""
        raise NotImplementedError

    def _remove(self, handle: Any) -> None:
        raise NotImplementedError

    # ---- the bookkeeping ------------------------------------------------------------------------

    def rewatch_root(self) -> None:
        """The root was deleted, recreated or replaced: drop the watches under it (they watch
        the old folders) and the cached ``.gitignore`` rules, and watch the tree now there."""
        self.unwatch_tree("")
        self.rules.clear()
        if self.root.is_dir():
            self.watch_tree(self.root)

    def watch_tree(self, folder: Path) -> None:
        """Watch ``folder`` and the folders under it that the rules keep. Each folder is watched
        before it is listed, so a subfolder made meanwhile is either listed or reported."""
        stack = [folder]
        while stack:
            base = stack.pop()
            rel = relative(self.root, base)
            if rel.startswith(("../", "/")):
                continue
            if rel not in self.watches:
                try:
                    with self._lock:
                        self.watches[rel] = self._add(base, rel)
                except OSError as e:  # gone meanwhile, or out of watches: its files are still scanned
                    if e.errno == errno.ENOSPC and not self._warned_full:
                        self._warned_full = True
                        print(f"[agentspec] workspace {self.root}: out of inotify watches at {rel or '.'} "
                              f"(fs.inotify.max_user_watches = {_max_user_watches()}); its files are indexed "
                              "but edits in folders past the limit are not followed; raise it: "
                              "sudo sysctl fs.inotify.max_user_watches=524288", file=sys.stderr, flush=True)
            try:
                with os.scandir(base) as it:
                    subs = [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
            except OSError:   # gone, or unreadable
                continue
            stack.extend(d for d in subs if not self.rules.ignored(relative(self.root, d), True))

    def _pop_tree(self, rel: str) -> dict[str, Any]:
        """Take the watches on ``rel`` and the folders under it ("" = the whole tree) out of
        ``watches`` (under the lock)."""
        with self._lock:
            keys = [k for k in self.watches if not rel or k == rel or k.startswith(rel + "/")]
            return {k: self.watches.pop(k) for k in keys}

    def unwatch_tree(self, rel: str) -> None:
        """Drop the watches on ``rel`` and the folders under it ("" = the whole tree)."""
        for handle in self._pop_tree(rel).values():
            try:
                self._remove(handle)
            except (KeyError, OSError):   # its folder is gone, and the watch with it
                pass

    def follow(self, batch: list[Event]) -> set[str]:
        """Keep the watches in line with a batch of events (new folders watched, deleted ones
        not, a replaced root watched again, lost events made good) and return the paths to
        re-index: files, and folders as ``path + os.sep`` (everything under them). A batch's
        folders are unwatched before any is watched (a folder moved away and another moved into
        its place keep the new one's watches)."""
        paths: set[str] = set()
        root = str(self.root)
        unwatch: list[str] = []
        watch: list[Path] = []
        for kind, src, dest, is_dir in batch:
            try:
                if kind == "overflow":   # events were lost: every folder watched (kept ones kept), all rescanned
                    self.rules.clear()
                    watch.append(self.root)
                    paths.add(root + os.sep)
                    continue
                if is_dir and root in (src, dest):
                    # the root itself deleted, (re)created or moved: watch and scan what is there now
                    self.rewatch_root()
                    paths.add(root + os.sep)
                    continue
                if not is_dir and Path(src).name == ".gitignore":
                    watch.append(Path(src).parent)   # folders it no longer ignores need watches
                if is_dir:
                    if kind == "deleted" or (kind == "moved" and not self.MOVES_WATCHES):
                        unwatch.append(relative(self.root, Path(src)))
                    for p in (src if kind == "created" else "", dest):
                        rel = relative(self.root, Path(p)) if p else ""
                        if not rel or rel.startswith(("../", "/")):
                            continue
                        if not self.rules.ignored(rel, True) and Path(p).is_dir():
                            watch.append(Path(p))
                        else:   # moved into an ignored folder: its watches (moved with it) go
                            unwatch.append(rel)
            except Exception as e:  # noqa: BLE001 - watching is best effort; scanning still works
                print(f"[agentspec] workspace watch update failed: {e!r}", file=sys.stderr, flush=True)
            for p in (src, dest):
                if p:
                    paths.add(p)
                    if is_dir or kind == "moved":
                        paths.add(p + os.sep)   # a folder: everything under it
        try:
            for rel in unwatch:
                self.unwatch_tree(rel)
            for folder in watch:
                self.watch_tree(folder)
        except Exception as e:  # noqa: BLE001 - watching is best effort; scanning still works
            print(f"[agentspec] workspace watch update failed: {e!r}", file=sys.stderr, flush=True)
        return paths


def _max_user_watches() -> str:
    try:
        return Path("/proc/sys/fs/inotify/max_user_watches").read_text().strip()
    except OSError:
        return "unknown"


def make_watcher(root: Path, rules: IgnoreRules, events: queue.Queue) -> Watcher:
    """The watcher for this platform: ``InotifyWatcher`` on Linux, ``WatchdogWatcher`` elsewhere;
    ``$AGENTSPEC_WATCHER`` (``inotify`` or ``watchdog``) chooses."""
    from ..errors import ConfigError

    choice = os.environ.get("AGENTSPEC_WATCHER", "").strip().lower()
    if choice not in ("",) + WATCHERS:
        raise ConfigError(f"AGENTSPEC_WATCHER={choice!r}: not a file watcher; use one of {', '.join(WATCHERS)} "
                          "(or leave it unset for this platform's default)")
    if choice == "watchdog" or (not choice and not sys.platform.startswith("linux")):
        return WatchdogWatcher(root, rules, events)
    if not sys.platform.startswith("linux"):
        raise ConfigError(f"AGENTSPEC_WATCHER=inotify: inotify is Linux's; this is {sys.platform}: "
                          "use watchdog (or leave it unset)")
    try:
        import inotify_simple  # noqa: F401
    except ImportError:
        if choice:
            raise ConfigError("AGENTSPEC_WATCHER=inotify needs the inotify-simple package: "
                              "pip install inotify-simple (or use watchdog)") from None
        return WatchdogWatcher(root, rules, events)
    return InotifyWatcher(root, rules, events)


class WatchdogWatcher(Watcher):
    """watchdog's native observer, one non-recursive watch (and emitter thread) per folder."""

    def __init__(self, root: Path, rules: IgnoreRules, events: queue.Queue) -> None:
        super().__init__(root, rules, events)
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

    def _add(self, folder: Path, rel: str) -> Any:
        return self._observer.schedule(self._handler, str(folder), recursive=False)

    def _remove(self, handle: Any) -> None:
        self._observer.unschedule(handle)


class InotifyWatcher(Watcher):
    """Every watch on one inotify descriptor, read by one thread (Linux).

    The reader turns kernel events into the queue's events: a rename within the tree (its
    ``IN_MOVED_FROM`` and ``IN_MOVED_TO`` paired by cookie) is one ``moved`` event, and a moved
    folder's watches take its new path at once, so events from inside it name the right files
    before the updater gets to the move; a half without its other half (moved out of or into
    the tree) is ``deleted`` or ``created``. A full kernel queue (events lost) is reported as
    ``overflow``: the tree is watched again where it is not (the watches it has are kept) and
    scanned again.
    """

    MOVES_WATCHES = True

    # a move's second half follows its first within the same rename(2); this long is allowed
    # for it to be read before the first half counts as moved out of the tree
    PAIR_WAIT_MS = 50

    def __init__(self, root: Path, rules: IgnoreRules, events: queue.Queue) -> None:
        super().__init__(root, rules, events)
        self._ino: Any = None
        self._paths: dict[int, str] = {}   # watch descriptor -> folder (relative, "" = root)
        self._parent_wd: int | None = None
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1
        self._closed = False
        self._displaced: dict[str, dict[str, int]] = {}   # watches set aside by a rename onto their folder

    def start(self) -> None:
        from inotify_simple import INotify, flags

        f = self._flags = flags
        self._mask = (f.CREATE | f.DELETE | f.MODIFY | f.CLOSE_WRITE | f.ATTRIB | f.MOVED_FROM | f.MOVED_TO
                      | f.ONLYDIR | f.DONT_FOLLOW | f.EXCL_UNLINK)
        try:
            self._ino = INotify()
            self._wake_r, self._wake_w = os.pipe()
            self.watch_tree(self.root)
            if self.root.parent != self.root:
                # the root deleted, recreated or replaced (rm -rf and a fresh clone, a deploy's
                # rename) is only seen from its parent: its own watches die with the old folder
                try:
                    self._parent_wd = self._ino.add_watch(
                        str(self.root.parent), f.CREATE | f.DELETE | f.MOVED_FROM | f.MOVED_TO | f.ONLYDIR
                        | f.DONT_FOLLOW)
                except OSError:   # an unreadable parent: the root's own replacement goes unseen
                    pass
            self._thread = threading.Thread(target=self._run, name="agentspec-watch", daemon=True)
            self._thread.start()
        except BaseException:
            self._close()
            raise

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is not None and self._wake_w >= 0:
            os.write(self._wake_w, b"x")
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                return   # (a daemon thread; the descriptors stay with it)
        self._close()

    def _close(self) -> None:
        with self._lock:   # no add or remove of a watch on a descriptor being closed (or reused)
            self._closed = True
            if self._ino is not None:
                self._ino.close()   # every watch goes with the descriptor
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1

    def _add(self, folder: Path, rel: str) -> int:
        if self._closed:   # (called under the lock)
            raise OSError(errno.EBADF, "the watcher is stopped")
        wd = self._ino.add_watch(str(folder), self._mask)
        old = self._paths.get(wd)
        if old is not None and old != rel and self.watches.get(old) == wd:
            del self.watches[old]   # the same folder, known under the path it had before a move
        self._paths[wd] = rel
        return wd

    def _remove(self, wd: int) -> None:
        with self._lock:
            self._paths.pop(wd, None)
            if not self._closed:
                self._ino.rm_watch(wd)

    # ---- the reader thread ----------------------------------------------------------------------

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._ino.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        pending: tuple[int, str, str, bool] | None = None   # an unpaired IN_MOVED_FROM: (cookie, path, rel, is_dir)
        try:
            while True:
                ready = poller.poll(None if pending is None else self.PAIR_WAIT_MS)
                if any(fd == self._wake_r for fd, _ in ready):
                    break
                if not ready:   # the move's other half never came: moved out of the tree
                    self.events.put(("deleted", pending[1], "", pending[3]))
                    pending = None
                    continue
                for ev in self._ino.read(timeout=0):
                    pending = self._event(ev, pending)
        except Exception as e:  # noqa: BLE001 - never die silently: say so, edits go unseen from here
            print(f"[agentspec] workspace watcher stopped: {e!r}", file=sys.stderr, flush=True)
        # (a move's first half still pending at stop is dropped: its files stay as last indexed)

    def _event(self, ev: Any, pending: tuple[int, str, str, bool] | None) -> tuple[int, str, str, bool] | None:
        f = self._flags
        mask, put = ev.mask, self.events.put
        is_dir = bool(mask & f.ISDIR)
        if pending is not None and not (mask & f.MOVED_TO and ev.cookie == pending[0] and ev.wd in self._paths):
            put(("deleted", pending[1], "", pending[3]))   # moved out of the tree
            pending = None
        if mask & f.Q_OVERFLOW:   # events were lost: watch and scan everything again
            put(("overflow", str(self.root), "", True))
            return None
        if mask & f.IGNORED:   # the kernel dropped the watch (its folder deleted, or rm_watch)
            with self._lock:
                rel = self._paths.pop(ev.wd, None)
                if rel is not None and self.watches.get(rel) == ev.wd:
                    del self.watches[rel]
                for key, aside in list(self._displaced.items()) if rel is not None else ():
                    if aside.get(rel) == ev.wd:
                        del aside[rel]
                        if not aside:
                            del self._displaced[key]
            return pending
        if ev.wd == self._parent_wd and ev.wd not in self._paths:
            if is_dir and ev.name == self.root.name:   # the root itself
                gone = mask & (f.DELETE | f.MOVED_FROM)
                put(("deleted" if gone else "created", str(self.root), "", True))
            return pending
        with self._lock:
            folder = self._paths.get(ev.wd)
        if folder is None:   # a watch dropped meanwhile
            return pending
        rel = f"{folder}/{ev.name}" if folder else ev.name
        path = os.path.join(str(self.root), rel)
        if mask & f.MOVED_FROM:
            return (ev.cookie, path, rel, is_dir)
        if mask & f.MOVED_TO:
            if pending is None:   # moved in from outside the tree
                put(("created", path, "", is_dir))
                return None
            if is_dir:   # the folder's watches follow it now
                self._rename(pending[2], rel)
            put(("moved", pending[1], path, is_dir))
            return None
        if mask & f.CREATE:
            put(("created", path, "", is_dir))
        elif mask & f.DELETE:
            put(("deleted", path, "", is_dir))
        elif is_dir:
            pass   # a folder's own metadata; the files in it report their changes
        elif mask & f.CLOSE_WRITE:
            put(("closed", path, "", False))
        elif mask & (f.MODIFY | f.ATTRIB):
            put(("modified", path, "", False))
        return pending

    def _rename(self, src: str, dest: str) -> None:
        """The folder ``src`` is now ``dest``: its watches take the new path. Watches already at
        ``dest`` are set aside under it: a folder renamed over an empty one (whose watch the
        kernel drops next), or the other half of an exchange (``mv --exchange``), whose own
        rename, ``dest`` to ``src``, comes next and takes them."""
        with self._lock:
            moving = self._displaced.pop(src, None)
            if moving is None:
                moving = self._pop_tree(src)
            there = self._pop_tree(dest)
            if there:
                self._displaced[dest] = there
            for key, wd in moving.items():
                new = dest + key[len(src):]
                self.watches[new] = wd
                self._paths[wd] = new


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
