"""The in-process journal: inotify watches on workspaces, their mutation sequences, dirty dirs.

`Watcher` owns the one inotify instance of a daemon and routes each event to the journals that
watch its directory (two tasks may watch the same directory: one watch descriptor, shared, and
removed only when neither needs it). `Journal` owns, for one task, the watches on every
directory under its root (each opened with O_NOFOLLOW from its parent's descriptor), the
sequence that every reported change advances, the directories changed since the consumer's
last reset, and the reasons it cannot vouch for an interval (an overflow, an unmount, a watch or
an instance the kernel refused, a restart gap). Single-threaded; the daemon serves them. Why a
barrier is sound, and what it does not catch: the package docstring.

Cost: one instance per daemon whatever the number of tasks; per watched directory, one kernel
watch and one entry (watch descriptor -> relative path) in its journal; per task, one Journal.

Must never: follow a symlink, read file contents, or report an interval as trustworthy while a
reason against it stands. inotify_simple is imported only when the instance is made.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from typing import Protocol

from settled.workspace.journal.errors import JournalUnavailable
from settled.workspace.journal.wire import Watermark

IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_UNMOUNT, IN_Q_OVERFLOW, IN_IGNORED = (
    0x400,
    0x800,
    0x2000,
    0x4000,
    0x8000,
)
IN_ONLYDIR, IN_ISDIR = 0x01000000, 0x40000000
CHANGES = (
    IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
) | (IN_DELETE_SELF | IN_MOVE_SELF)
# Watched through /proc/self/fd/N of a directory opened with O_NOFOLLOW, so IN_DONT_FOLLOW is
# left out: that magic link must be followed (to exactly the directory opened, never further).
# No IN_EXCL_UNLINK: a write through an unlinked name may still change a hard-linked sibling.
WATCH_MASK = CHANGES | IN_ONLYDIR
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

OVERFLOWED = "the inotify queue overflowed (IN_Q_OVERFLOW): events were dropped"
UNMOUNTED = "a filesystem under the workspace was unmounted"
_MAX_READS = 64  # reads per pump; the barrier needs only the first one after its request
_MAX_DEPTH = 512  # directories open at once while walking; deeper ones are reported lost
_SHOWN_LOST = 10


class _Inotify(Protocol):  # the narrow, typed face of inotify_simple.INotify
    def fileno(self) -> int: ...
    def add_watch(self, path: str, mask: int) -> int: ...
    def rm_watch(self, wd: int) -> None: ...
    def read(self, timeout: int | None = None) -> list[tuple[int, int, int, str]]: ...
    def close(self) -> None: ...


def _open_inotify() -> _Inotify:
    """A new inotify instance. OSError when the kernel refuses one (EMFILE: the per-user
    limit fs.inotify.max_user_instances is reached; ENFILE, ENOMEM)."""
    try:
        import inotify_simple  # type: ignore[import-untyped]
    except ImportError as exc:
        raise JournalUnavailable(
            "the journal needs inotify_simple: pip install inotify_simple"
        ) from exc
    handle: _Inotify = inotify_simple.INotify(nonblocking=True)
    return handle


def _refused_instance(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    if exc.errno == errno.EMFILE:
        return (
            f"the kernel refused an inotify instance ({name}: the per-user limit "
            f"{_limit('instances')} is reached)"
        )
    return f"the kernel refused an inotify instance ({name}: {exc.strerror})"


def _limit(kind: str) -> str:
    """The limit on inotify `kind` ("instances", "watches") as the kernel applies it: the
    host's sysctl, and this user namespace's own when it is lower (both are enforced)."""
    host = _read(f"/proc/sys/fs/inotify/max_user_{kind}")
    text = f"fs.inotify.max_user_{kind} = {host}"
    own = _read(f"/proc/sys/user/max_inotify_{kind}")
    if own.isdigit() and host.isdigit() and int(own) < int(host):
        text += f", user.max_inotify_{kind} = {own} in this user namespace"
    return text


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return "unknown"


def _why(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return (
            f"ENOSPC: the inotify watch limit is reached ({_limit('watches')}); "
            "raise it with sysctl"
        )
    return f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror}"


def _join(parent: str, name: str) -> str:
    return name if parent == "." else f"{parent}/{name}"


def _under(path: str, top: str) -> bool:
    return top == "." or path == top or path.startswith(top + "/")


class Watcher:
    """One inotify instance shared by every journal of a daemon, made on first need and
    retried while the kernel refuses it (then each journal says why it cannot vouch)."""

    def __init__(self) -> None:
        self._ino: _Inotify | None = None
        self._subscribers: dict[int, set[Journal]] = {}  # watch descriptor -> its journals
        self._journals: set[Journal] = set()
        self._closed = False

    def refused(self) -> str | None:
        """None once the instance exists (it is made here if it can be); else why not."""
        if self._ino is None and not self._closed:
            try:
                self._ino = _open_inotify()
            except OSError as exc:
                return _refused_instance(exc)
        return None if self._ino is not None else "the watcher is closed"

    def fileno(self) -> int | None:
        return None if self._ino is None else self._ino.fileno()

    def attach(self, journal: Journal) -> None:
        self._journals.add(journal)

    def detach(self, journal: Journal) -> None:
        self._journals.discard(journal)

    def add_watch(self, journal: Journal, path: str) -> int:
        """Watch `path` for `journal`; OSError (ENOSPC past max_user_watches) if refused."""
        why = self.refused()
        if self._ino is None:
            raise OSError(errno.EMFILE, why)
        wd = self._ino.add_watch(path, WATCH_MASK)
        self._subscribers.setdefault(wd, set()).add(journal)
        return wd

    def drop(self, journal: Journal, wd: int) -> None:
        """`journal` no longer needs `wd`; the kernel watch goes when no journal needs it."""
        subscribers = self._subscribers.get(wd)
        if subscribers is None:
            return
        subscribers.discard(journal)
        if not subscribers:
            del self._subscribers[wd]
            if self._ino is not None:
                with contextlib.suppress(OSError):
                    self._ino.rm_watch(wd)

    def pump(self) -> None:
        """Read every queued event without blocking and hand each to its journals."""
        if self._ino is None:
            return
        for _ in range(_MAX_READS):
            events = self._ino.read(timeout=0)
            if not events:
                break
            for wd, mask, _cookie, name in events:
                if mask & IN_Q_OVERFLOW:  # the shared queue dropped events of every journal
                    for journal in self._journals:
                        journal._event(wd, mask, name)
                    continue
                for journal in list(self._subscribers.get(wd, ())):
                    journal._event(wd, mask, name)
                if mask & IN_IGNORED:
                    self._subscribers.pop(wd, None)
        for journal in list(self._journals):
            journal._settle()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._ino is not None:
                self._ino.close()


class Journal:
    """One workspace's watches, sequence and dirty directories. Single-threaded. Without a
    `watcher` it makes its own (the in-process tests); a daemon passes its shared one."""

    def __init__(self, root: str, start_seq: int = 0, watcher: Watcher | None = None) -> None:
        self.root = os.path.realpath(root)
        if not os.path.isdir(self.root):
            raise JournalUnavailable(f"workspace root {root!r} is not a directory")
        self._own_watcher = watcher is None
        self._watcher = Watcher() if watcher is None else watcher
        self._seq = start_seq
        self._paths: dict[int, str] = {}  # watch descriptor -> directory relative to root
        self._dirty: dict[str, int] = {}  # directory -> seq of its last change
        self._lost: dict[str, str] = {}  # directory without a watch -> why
        self._untrusted: dict[str, int] = {}  # reason -> last seq it applied at
        self._overflow_at: int | None = None
        self._detached: set[int] = set()  # watches of directories moved away, pending a MOVED_TO
        self._rewatch = False
        self._closed = False
        self._watcher.attach(self)
        try:
            self._walk(".", count=False)
        except BaseException:
            self.close()
            raise

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def watched(self) -> int:
        """How many directories this journal watches."""
        return len(self._paths)

    def fileno(self) -> int | None:
        return self._watcher.fileno()

    def pump(self) -> int:
        """Read every queued event without blocking; each reported change advances seq."""
        if self._closed:
            raise JournalUnavailable(f"the journal of {self.root} is closed")
        self._watcher.pump()
        return self._seq

    def _settle(self) -> None:
        """After a pump: drop watches of what moved away, watch what an overflow hid."""
        for wd in self._detached:  # moved out of the workspace: stop watching them
            self._forget(wd)
        self._detached.clear()
        if self._rewatch:
            self._rewatch = False
            self._rewatch_all()

    def barrier(self) -> Watermark:
        """Consume every event of every change that completed before this call (the package doc)."""
        self.pump()
        return self._watermark()

    def reset_dirty(self, upto_seq: int) -> None:
        """The consumer checkpointed everything up to `upto_seq`: forget what that covers."""
        upto = min(upto_seq, self._seq)
        self._dirty = {path: seq for path, seq in self._dirty.items() if seq > upto}
        self._untrusted = {why: seq for why, seq in self._untrusted.items() if seq > upto}
        if self._overflow_at is not None and self._overflow_at <= upto:
            self._overflow_at = None
        for path in sorted(self._lost):  # try again: every entry re-found counts as a change
            del self._lost[path]
            if path != "." or os.path.isdir(self.root):
                self._walk(path, count=True)
            else:
                self._lose(".", "the workspace root is gone")

    def mark_untrusted(self, reason: str) -> None:
        """Record a gap the journal did not observe; it stays until a reset covers it."""
        self._seq += 1
        self._untrusted[reason] = self._seq

    def close(self) -> None:
        """Stop watching: each of its watches goes unless another journal shares it."""
        if not self._closed:
            self._closed = True
            for wd in list(self._paths):
                self._forget(wd)
            self._watcher.detach(self)
            if self._own_watcher:
                self._watcher.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- events --------------------------------------------------------------------------

    def _event(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            self._seq += 1
            self._overflow_at = self._untrusted[OVERFLOWED] = self._seq
            self._rewatch = True  # directories created while events were dropped have no watch
            return
        if mask & IN_IGNORED:
            self._detached.discard(wd)
            if self._paths.pop(wd, None) == ".":
                self._lose_root("the workspace root was deleted")
            return
        base = self._paths.get(wd)
        if base is None:  # a watch already dropped (moved out, deleted): not the workspace now
            return
        if mask & IN_UNMOUNT:
            self.mark_untrusted(UNMOUNTED)
            return
        if not mask & CHANGES:
            return
        self._bump(base)
        if not name:
            if base == "." and mask & (IN_DELETE_SELF | IN_MOVE_SELF):
                self._lose_root("the workspace root was deleted or moved away")
            return
        if mask & IN_ISDIR:
            child = _join(base, name)
            if mask & IN_MOVED_FROM:
                moved = [w for w, path in self._paths.items() if _under(path, child)]
                self._detached.update(moved)  # re-attached if a MOVED_TO re-walk finds them
                self._lost = {p: why for p, why in self._lost.items() if not _under(p, child)}
            elif mask & (IN_CREATE | IN_MOVED_TO):
                self._walk(child, count=True)

    def _bump(self, path: str) -> None:
        self._seq += 1
        self._dirty[path] = self._seq

    def _walk(self, top: str, count: bool, seen: set[int] | None = None) -> None:
        """Watch `top` and every directory under it, each before it is listed, so an entry made
        before its directory's watch existed is found by the listing (and counted when `count`).
        Each directory is opened with O_NOFOLLOW from its parent's descriptor and watched through
        that descriptor: no symlink is followed anywhere in the path, not only in the last
        component (all IN_DONT_FOLLOW would guard), even if one replaces a directory mid-walk.
        Without an inotify instance nothing is watched: `top` is lost, saying why."""
        refused = self._watcher.refused()
        if refused is not None:
            self._lose(top, refused)
            return
        fd = self._open_path(top)
        if fd is None:
            return
        frames: list[tuple[str, int, Iterator[str]]] = []
        try:
            self._enter(top, fd, count, seen, frames)
            while frames:
                path, parent_fd, children = frames[-1]
                name = next(children, None)
                if name is None:
                    frames.pop()
                    os.close(parent_fd)
                    continue
                child = _join(path, name)
                if len(frames) >= _MAX_DEPTH:
                    self._lose(child, f"nested deeper than {_MAX_DEPTH} directories")
                    continue
                child_fd = self._open_at(parent_fd, name, child)
                if child_fd is not None:
                    self._enter(child, child_fd, count, seen, frames)
        finally:
            for _, open_fd, _ in frames:
                os.close(open_fd)

    def _enter(
        self,
        path: str,
        fd: int,
        count: bool,
        seen: set[int] | None,
        frames: list[tuple[str, int, Iterator[str]]],
    ) -> None:
        wd = self._watch(path, fd)
        if wd >= 0 and seen is not None:
            seen.add(wd)
        if count:
            self._bump(path)
        subdirs = []
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if count:
                        self._bump(path)
                    with contextlib.suppress(OSError):
                        if entry.is_dir(follow_symlinks=False):
                            subdirs.append(entry.name)
        except OSError as exc:
            self._lose(path, f"cannot list it: {_why(exc)}")
        frames.append((path, fd, iter(subdirs)))

    def _open_path(self, path: str) -> int | None:
        """Open `path` one component at a time, never through a symlink; None if it is gone."""
        try:
            fd = os.open(self.root, _DIR_FLAGS)
        except OSError as exc:
            self._lose(".", f"the workspace root cannot be opened: {_why(exc)}")
            return None
        if path == ".":
            return fd
        for name in path.split("/"):
            child_fd = self._open_at(fd, name, path)
            os.close(fd)
            if child_fd is None:
                return None
            fd = child_fd
        return fd

    def _open_at(self, parent_fd: int, name: str, path: str) -> int | None:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                self._lose(path, _why(exc))
            return None  # gone, or not a directory (any more): its parent's events say so

    def _watch(self, path: str, fd: int) -> int:
        """The watch descriptor of the open directory `fd`, or -1 if it could not be watched."""
        try:
            wd = self._watcher.add_watch(self, f"/proc/self/fd/{fd}")
        except OSError as exc:
            self._lose(path, _why(exc))
            return -1
        self._paths[wd] = path  # a directory moved within the workspace keeps its wd
        self._detached.discard(wd)
        return wd

    def _lose(self, path: str, why: str) -> None:
        self._lost[path] = why
        self._bump(path)

    def _lose_root(self, why: str) -> None:
        for wd in list(self._paths):
            self._forget(wd)
        self._lose(".", why)

    def _forget(self, wd: int) -> None:
        if self._paths.pop(wd, None) is not None:
            self._watcher.drop(self, wd)

    def _rewatch_all(self) -> None:
        """After an overflow: watch what was missed, drop watches of what left the workspace."""
        if "." in self._lost:
            return
        seen: set[int] = set()
        self._walk(".", count=False, seen=seen)
        for wd in [wd for wd in self._paths if wd not in seen]:
            self._forget(wd)

    def _watermark(self) -> Watermark:
        reasons = sorted(self._untrusted, key=self._untrusted.__getitem__)
        lost = sorted(self._lost.items())
        reasons += [f"no watch on {path!r}: {why}" for path, why in lost[:_SHOWN_LOST]]
        if len(lost) > _SHOWN_LOST:
            reasons.append(f"... and {len(lost) - _SHOWN_LOST} more directories without a watch")
        return Watermark(
            seq=self._seq,
            overflowed=self._overflow_at is not None,
            trustworthy=not self._untrusted and not self._lost,
            dirty_dirs=frozenset(self._dirty),
            lost_watches=frozenset(self._lost),
            reasons=tuple(reasons),
        )
