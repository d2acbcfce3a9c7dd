"""The mutation journal of one task workspace: inotify feeding a monotonic mutation sequence.

Owns the watches on every directory under one workspace root, the sequence that every reported
change advances, the directories changed since the consumer's last checkpoint, and the daemon
(one per workspace, detached, reached over a Unix socket) that serves barriers to every session
owner. It is a hint, never the proof: the final scan after death evidence is what a checkpoint
covers. It must never be silently wrong: a queue overflow, a watch that could not be added, a
restart gap or a journal that is not running is reported (`trustworthy` False, or no answer at
all) so that the consumer falls back to a full scan.

Must never: follow a symlink, read file contents, or decide what a checkpoint covers. The client
half (`barrier`, `reset`, `ping`, `stop`) imports only the standard library, so a session owner
started with `-I -S` can ask for a barrier without inotify_simple on its path.

Why a barrier is sound. fsnotify is synchronous with the syscall: `write`, `truncate`, `rename`,
`unlink`, `mkdir`, `chmod`... call the fsnotify hook before they return, and the hook appends the
event to this instance's queue under its lock (or, when the queue is full, appends one
IN_Q_OVERFLOW). IN_CLOSE_WRITE comes from `__fput`, which runs as task work before close(2)
returns to user space, and in `do_exit` before the exiting process is reported to its parent. So
once a writer's syscall has returned (or its parent has reaped it), its event is in the kernel
queue. `barrier()` reads the queue (FIONREAD, then read) only after the request arrived, so it
consumes every event of every change that completed before the request: a change completed
before barrier B1 returned is in seq <= B1.seq, and any change completed after it advances a
later barrier past B1.seq (the drained queue has no tail event it could coalesce into).

What is NOT caught (and why the final scan exists): writes through a shared mmap (no event;
IN_CLOSE_WRITE only when the fd opened for writing is closed, nothing for later stores); writes
through a hard link whose name lies outside the workspace; changes on network filesystems made by
other hosts; changes while the journal is down (reported as a restart gap); repeated identical
events coalesce (seq counts events, not writes).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from settled.atomic import write_atomic
from settled.errors import SettledError
from settled.isolated import HelperUnavailable, python_command

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
SOCKET_NAME, STATE_NAME, LOG_NAME = "journal.sock", "journal.state", "journal.log"
RESERVE = 1 << 16  # sequence numbers reserved on disk ahead of the last one reported
_MAX_READS = 64  # reads per pump; the barrier needs only the first one after its request
_MAX_LINE = 4096
_MAX_DEPTH = 512  # directories open at once while walking; deeper ones are reported lost
_SHOWN_LOST = 10


class JournalUnavailable(SettledError):
    """The journal cannot be started or reached; the consumer must fall back to a full scan."""


@dataclass(frozen=True)
class Watermark:
    """Where the journal stood at a barrier. `trustworthy` False: do a full scan."""

    seq: int
    overflowed: bool
    trustworthy: bool
    dirty_dirs: frozenset[str]
    lost_watches: frozenset[str] = frozenset()
    reasons: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "overflowed": self.overflowed,
            "trustworthy": self.trustworthy,
            "dirty_dirs": sorted(self.dirty_dirs),
            "lost_watches": sorted(self.lost_watches),
            "reasons": list(self.reasons),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Watermark:
        return cls(
            seq=int(data["seq"]),
            overflowed=bool(data["overflowed"]),
            trustworthy=bool(data["trustworthy"]),
            dirty_dirs=frozenset(data["dirty_dirs"]),
            lost_watches=frozenset(data.get("lost_watches", ())),
            reasons=tuple(data.get("reasons", ())),
        )


class _Inotify(Protocol):  # the narrow, typed face of inotify_simple.INotify
    def fileno(self) -> int: ...
    def add_watch(self, path: str, mask: int) -> int: ...
    def rm_watch(self, wd: int) -> None: ...
    def read(self, timeout: int | None = None) -> list[tuple[int, int, int, str]]: ...
    def close(self) -> None: ...


def _open_inotify() -> _Inotify:
    try:
        import inotify_simple  # type: ignore[import-untyped]
    except ImportError as exc:
        raise JournalUnavailable(
            "the journal needs inotify_simple: pip install inotify_simple"
        ) from exc
    try:
        handle: _Inotify = inotify_simple.INotify(nonblocking=True)
    except OSError as exc:
        raise JournalUnavailable(
            f"cannot create an inotify instance ({exc.strerror}); the per-user limit is "
            f"fs.inotify.max_user_instances = {_sysctl('max_user_instances')}"
        ) from exc
    return handle


def _sysctl(name: str) -> str:
    try:
        with open(f"/proc/sys/fs/inotify/{name}") as handle:
            return handle.read().strip()
    except OSError:
        return "unknown"


def _why(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return (
            "ENOSPC: the inotify watch limit is reached (fs.inotify.max_user_watches = "
            f"{_sysctl('max_user_watches')}); raise it with sysctl"
        )
    return f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror}"


def _join(parent: str, name: str) -> str:
    return name if parent == "." else f"{parent}/{name}"


def _under(path: str, top: str) -> bool:
    return top == "." or path == top or path.startswith(top + "/")


class Journal:
    """The in-process core: watches, sequence, dirty directories. Single-threaded."""

    def __init__(self, root: str, start_seq: int = 0) -> None:
        self.root = os.path.realpath(root)
        if not os.path.isdir(self.root):
            raise JournalUnavailable(f"workspace root {root!r} is not a directory")
        self._ino = _open_inotify()
        self._seq = start_seq
        self._paths: dict[int, str] = {}  # watch descriptor -> directory relative to root
        self._dirty: dict[str, int] = {}  # directory -> seq of its last change
        self._lost: dict[str, str] = {}  # directory without a watch -> why
        self._untrusted: dict[str, int] = {}  # reason -> last seq it applied at
        self._overflow_at: int | None = None
        self._detached: set[int] = set()  # watches of directories moved away, pending a MOVED_TO
        self._rewatch = False
        self._closed = False
        try:
            self._walk(".", count=False)
        except BaseException:
            self._ino.close()
            raise

    @property
    def seq(self) -> int:
        return self._seq

    def fileno(self) -> int:
        return self._ino.fileno()

    def pump(self) -> int:
        """Read every queued event without blocking; each reported change advances seq."""
        if self._closed:
            raise JournalUnavailable(f"the journal of {self.root} is closed")
        for _ in range(_MAX_READS):
            events = self._ino.read(timeout=0)
            if not events:
                break
            for wd, mask, _cookie, name in events:
                self._event(wd, mask, name)
        for wd in self._detached:  # moved out of the workspace: stop watching them
            self._forget(wd)
        self._detached.clear()
        if self._rewatch:
            self._rewatch = False
            self._rewatch_all()
        return self._seq

    def barrier(self) -> Watermark:
        """Consume every event of every change that completed before this call (module doc)."""
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
        if not self._closed:
            self._closed = True
            self._ino.close()

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
        component (all IN_DONT_FOLLOW would guard), even if one replaces a directory mid-walk."""
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
            wd = self._ino.add_watch(f"/proc/self/fd/{fd}", WATCH_MASK)
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
            with contextlib.suppress(OSError):
                self._ino.rm_watch(wd)

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


# -- the daemon: one per workspace, reached over a Unix socket ------------------------------


def serve(
    root: str,
    socket_path: str,
    state_path: str,
    idle_exit_s: float = 600.0,
    on_ready: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    """Run the journal of `root` until `stop`, a signal, or `idle_exit_s` with no client and no
    event. Exits 0 at once if another journal holds the lock beside the socket."""
    report = on_ready or (lambda fields: None)
    socket_path, state_path = os.path.abspath(socket_path), os.path.abspath(state_path)
    lock_fd = os.open(socket_path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"another journal holds {socket_path}.lock: exiting")
            report({"state": "locked"})
            return 0
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
        try:
            previous = _read_state(state_path)
            journal = Journal(root, 0 if previous is None else previous + 1)
        except JournalUnavailable as exc:
            _log(f"cannot start: {exc}")
            report({"state": "error", "error": str(exc)})
            return 1
        with journal:
            if previous is not None:
                journal.mark_untrusted(
                    f"the journal restarted after seq {previous}: changes made while no journal "
                    "ran were not observed"
                )
            try:
                server = _Server(journal, socket_path, state_path, idle_exit_s)
            except OSError as exc:
                why = f"cannot serve on {socket_path} (state {state_path}): {exc}"
                _log(why)
                report({"state": "error", "error": why})
                return 1
            _log(f"watching {journal.root} from seq {journal.seq} on {socket_path}")
            report({"state": "ready", "pid": os.getpid(), "seq": journal.seq})
            try:
                server.run()
            finally:
                server.close()
            _log(f"exiting at seq {journal.seq}: {server.reason}")
            return 0
    finally:
        os.close(lock_fd)


class _Conn:
    __slots__ = ("eof", "inbuf", "outbuf", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.inbuf, self.outbuf, self.eof = sock, b"", b"", False


class _Server:
    def __init__(self, journal: Journal, socket_path: str, state_path: str, idle: float) -> None:
        self.journal, self.socket_path, self.state_path, self.idle = (
            journal,
            socket_path,
            state_path,
            idle,
        )
        self.stopping, self.reason = False, f"idle for {idle:g} s"
        self.ceiling = journal.seq + RESERVE  # a crash restarts above every seq ever reported
        _write_state(state_path, self.ceiling, clean=False)
        self.conns: dict[socket.socket, _Conn] = {}
        self.sel = selectors.DefaultSelector()
        with contextlib.suppress(FileNotFoundError):  # stale: we hold the lock, nobody serves it
            os.unlink(socket_path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            with _address(socket_path) as address:
                self.listener.bind(address)
            os.chmod(socket_path, 0o600)
            self.listener.listen(128)
        except OSError:
            self.listener.close()
            raise
        self.listener.setblocking(False)
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self.sel.register(journal.fileno(), selectors.EVENT_READ, self._on_inotify)
        self.sel.register(self.listener, selectors.EVENT_READ, self._on_accept)
        self.sel.register(self.wake_r, selectors.EVENT_READ, self._on_wake)
        self.old_wakeup: int | None = None
        self.old_handlers: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            self.old_wakeup = signal.set_wakeup_fd(self.wake_w.fileno(), warn_on_full_buffer=False)
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                self.old_handlers[signum] = signal.signal(signum, self._on_signal)

    def run(self) -> None:
        last = time.monotonic()
        while not self.stopping:
            timeout = None
            if not self.conns:
                timeout = last + self.idle - time.monotonic()
                if timeout <= 0:
                    return
            ready = self.sel.select(timeout)
            if ready:
                last = time.monotonic()
            for key, events in ready:
                key.data(key.fileobj, events)

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        self.listener.close()
        for conn in self.conns.values():
            if conn.outbuf:  # the reply to `stop`, above all
                with contextlib.suppress(OSError):
                    conn.sock.settimeout(0.5)
                    conn.sock.sendall(conn.outbuf)
            conn.sock.close()
        self.conns.clear()
        _write_state(self.state_path, self.journal.seq, clean=True)
        if self.old_wakeup is not None:
            signal.set_wakeup_fd(self.old_wakeup)
            for signum, handler in self.old_handlers.items():
                if handler is not None:
                    signal.signal(signum, handler)
        self.sel.close()
        self.wake_r.close()
        self.wake_w.close()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopping, self.reason = True, f"signal {signal.Signals(signum).name}"

    def _on_wake(self, fileobj: Any, events: int) -> None:
        with contextlib.suppress(OSError):
            self.wake_r.recv(256)

    def _on_inotify(self, fileobj: Any, events: int) -> None:
        self.journal.pump()

    def _on_accept(self, fileobj: Any, events: int) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: the client sees no answer
                _log(f"accept failed: {exc}")
                return
            sock.setblocking(False)
            self.conns[sock] = _Conn(sock)
            self.sel.register(sock, selectors.EVENT_READ, self._on_conn)
            self._on_conn(sock, selectors.EVENT_READ)  # the request is usually already here

    def _on_conn(self, sock: socket.socket, events: int) -> None:
        conn = self.conns.get(sock)
        if conn is None:
            return
        if events & selectors.EVENT_WRITE:
            self._flush(conn)
        while events & selectors.EVENT_READ and not conn.eof and sock in self.conns:
            try:
                data = sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:  # our client half-closes after its request: reply, then drop
                conn.eof = True
                self._flush(conn)  # drops it once the reply is out; until then, write interest only
                return
            conn.inbuf += data
            while b"\n" in conn.inbuf and not self.stopping and sock in self.conns:
                line, _, conn.inbuf = conn.inbuf.partition(b"\n")
                self._send(conn, self._command(line.strip()))
            if len(conn.inbuf) > _MAX_LINE:
                self._drop(conn)

    def _command(self, line: bytes) -> dict[str, Any]:
        verb, _, arg = line.partition(b" ")
        if verb == b"barrier":
            return self._barrier()
        if verb == b"ping":
            seq = self._covered(self.journal.pump())
            return {"ok": True, "pid": os.getpid(), "root": self.journal.root, "seq": seq}
        if verb == b"reset" and arg.strip().isdigit():
            self.journal.reset_dirty(int(arg))
            return self._barrier()
        if verb == b"stop":
            self.stopping, self.reason = True, "stop requested by a client"
            return {"stopped": True, **self._barrier()}
        return {"error": f"unknown command {line[:64]!r}: barrier, reset SEQ, ping or stop"}

    def _barrier(self) -> dict[str, Any]:
        watermark = self.journal.barrier()
        self._covered(watermark.seq)
        return watermark.to_json()

    def _covered(self, seq: int) -> int:
        """Persist a reservation above `seq` before any client sees it."""
        if seq > self.ceiling:
            self.ceiling = seq + RESERVE
            _write_state(self.state_path, self.ceiling, clean=False)
        return seq

    def _send(self, conn: _Conn, reply: dict[str, Any]) -> None:
        conn.outbuf += json.dumps(reply, separators=(",", ":")).encode() + b"\n"
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbuf) if conn.outbuf else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(conn)
            return
        conn.outbuf = conn.outbuf[sent:]
        if conn.eof and not conn.outbuf:
            self._drop(conn)
            return
        wanted = (0 if conn.eof else selectors.EVENT_READ) | (
            selectors.EVENT_WRITE if conn.outbuf else 0
        )
        if self.sel.get_key(conn.sock).events != wanted:
            self.sel.modify(conn.sock, wanted, self._on_conn)

    def _drop(self, conn: _Conn) -> None:
        if self.conns.pop(conn.sock, None) is not None:
            self.sel.unregister(conn.sock)
            conn.sock.close()


def _log(message: str) -> None:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    print(f"{stamp} journal[{os.getpid()}] {message}", file=sys.stderr, flush=True)


def _read_state(state_path: str) -> int | None:
    try:
        with open(state_path, "rb") as handle:
            seq = json.loads(handle.read())["seq"]
        if not isinstance(seq, int) or seq < 0:
            raise ValueError(f"seq {seq!r} is not a non-negative integer")
        return seq
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise JournalUnavailable(
            f"journal state {state_path} is unreadable ({exc}), so the sequence cannot continue "
            "monotonically; remove it only if every consumer treats the next watermark as new"
        ) from exc


def _write_state(state_path: str, seq: int, clean: bool) -> None:
    write_atomic(state_path, json.dumps({"seq": seq, "clean": clean, "pid": os.getpid()}).encode())


@contextlib.contextmanager
def _address(path: str) -> Iterator[str]:
    """An AF_UNIX address for `path`: sun_path holds 107 bytes, a run directory may be longer."""
    if len(os.fsencode(path)) < 100:
        yield path
        return
    fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{os.path.basename(path)}"
    finally:
        os.close(fd)


# -- the client: standard library only --------------------------------------------------------


def _request(socket_path: str, line: bytes, timeout: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    data = b""
    try:
        with (
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock,
            _address(socket_path) as address,
        ):
            sock.settimeout(timeout)
            sock.connect(address)
            sock.sendall(line)
            sock.shutdown(
                socket.SHUT_WR
            )  # one request per connection: the journal drops it at once
            while b"\n" not in data:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                sock.settimeout(remaining)
                chunk = sock.recv(1 << 16)
                if not chunk:
                    return None
                data += chunk
        reply = json.loads(data.partition(b"\n")[0])
    except (OSError, ValueError):
        return None
    return reply if isinstance(reply, dict) else None


def _watermark_of(reply: dict[str, Any] | None) -> Watermark | None:
    if reply is None:
        return None
    try:
        return Watermark.from_json(reply)
    except (KeyError, TypeError, ValueError):
        return None


def barrier(socket_path: str, timeout: float = 2.0) -> Watermark | None:
    """The journal's watermark after every change completed before this call; None if no journal
    answers within `timeout` (record that the journal was down and do a full scan)."""
    return _watermark_of(_request(socket_path, b"barrier\n", timeout))


def terminal_mutation(socket_path: str, timeout: float = 2.0) -> dict[str, Any]:
    """A process receipt's `terminal_mutation`: the barrier read after death evidence, so every
    write of the session's processes is at or below `seq`; or why there is no sequence."""
    watermark = barrier(socket_path, timeout)
    if watermark is None:
        return {
            "seq": None,
            "source": "none",
            "why": "the task's journal did not answer; the final scan covers this session",
        }
    return {"seq": watermark.seq, "source": "journal", "trustworthy": watermark.trustworthy}


def reset(socket_path: str, upto_seq: int, timeout: float = 2.0) -> Watermark | None:
    """Tell the journal a checkpoint covers `upto_seq`; returns the watermark after the reset."""
    return _watermark_of(_request(socket_path, f"reset {int(upto_seq)}\n".encode(), timeout))


def ping(socket_path: str, timeout: float = 2.0) -> dict[str, Any] | None:
    """`{"ok", "pid", "root", "seq"}` of the journal answering on `socket_path`, or None."""
    reply = _request(socket_path, b"ping\n", timeout)
    return reply if reply is not None and reply.get("ok") is True else None


def stop(socket_path: str, timeout: float = 5.0) -> None:
    """Stop the journal on `socket_path` and wait until it has released its lock."""
    if _request(socket_path, b"stop\n", timeout) is None:
        return  # nobody answers: nothing to stop
    lock_path = socket_path + ".lock"
    give_up = time.monotonic() + timeout
    while not _lock_free(lock_path):
        if time.monotonic() > give_up:
            raise JournalUnavailable(
                f"the journal on {socket_path} acknowledged stop but still holds {lock_path} "
                f"after {timeout:g} s (pid {_lock_owner(lock_path)})"
            )
        time.sleep(0.002)


def _lock_free(lock_path: str) -> bool:
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _lock_owner(lock_path: str) -> str:
    try:
        with open(lock_path) as handle:
            return handle.read().strip() or "unknown"
    except OSError:
        return "unknown"


def ensure_running(
    root: str, run_dir: str, *, idle_exit_s: float = 600.0, timeout: float = 5.0
) -> str:
    """Start the journal of `root` detached unless one answers; return its socket path.
    Concurrent callers are serialized by a start lock, so only one daemon is ever started."""
    root, run_dir = os.path.realpath(root), os.path.abspath(run_dir)
    socket_path = os.path.join(run_dir, SOCKET_NAME)
    if _answers(socket_path, root, 0.5):
        return socket_path
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    log_path = os.path.join(run_dir, LOG_NAME)
    deadline = time.monotonic() + timeout
    with _start_lock(os.path.join(run_dir, "journal.start"), deadline):
        while True:
            remaining = deadline - time.monotonic()
            if _answers(socket_path, root, min(0.5, max(remaining, 0.05))):
                return socket_path
            if remaining <= 0:
                raise JournalUnavailable(
                    f"no journal for {root} answered on {socket_path} within {timeout:g} s "
                    f"(lock held by pid {_lock_owner(socket_path + '.lock')}); see {log_path}"
                )
            report = _spawn(root, run_dir, idle_exit_s, remaining)
            if report.get("state") == "locked":
                time.sleep(0.01)  # a journal holds the lock: it answers soon, or is exiting
            elif report.get("state") != "ready":
                raise JournalUnavailable(
                    f"the journal for {root} did not start: {report.get('error')}; see {log_path}"
                )


def _answers(socket_path: str, root: str, timeout: float) -> bool:
    reply = ping(socket_path, timeout)
    if reply is None:
        return False
    if reply.get("root") != root:
        raise JournalUnavailable(
            f"{socket_path} serves the journal of {reply.get('root')!r}, not {root!r}: "
            "use one run directory per workspace"
        )
    return True


@contextlib.contextmanager
def _start_lock(path: str, deadline: float) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise JournalUnavailable(
                        f"another caller holds {path} (starting the journal) for too long"
                    ) from None
                time.sleep(0.005)
        yield
    finally:
        os.close(fd)


def _spawn(root: str, run_dir: str, idle_exit_s: float, timeout: float) -> dict[str, Any]:
    """Start `python -I -S` (about 10 ms) that forks the daemon and exits; read its report."""
    try:
        argv = python_command(
            "settled.workspace.journal:_daemon_main",
            ("settled", "inotify_simple"),
            root,
            os.path.join(run_dir, SOCKET_NAME),
            os.path.join(run_dir, STATE_NAME),
        )
    except HelperUnavailable as exc:
        raise JournalUnavailable(f"cannot start the journal: {exc}") from exc
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    log_fd = os.open(
        os.path.join(run_dir, LOG_NAME),
        os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
        0o600,
    )
    try:
        process = subprocess.Popen(
            [*argv, repr(float(idle_exit_s)), str(ready_w)],
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
            pass_fds=(ready_w,),
            start_new_session=True,
            close_fds=True,
            cwd="/",
        )
    finally:
        os.close(ready_w)
        os.close(log_fd)
    try:
        give_up = time.monotonic() + timeout
        try:
            process.wait(timeout)  # the first process only forks the daemon and exits
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            return {"state": "error", "error": f"the journal did not fork within {timeout:g} s"}
        return _read_report(ready_r, give_up)
    finally:
        os.close(ready_r)


def _read_report(fd: int, give_up: float) -> dict[str, Any]:
    data = b""
    while b"\n" not in data:
        remaining = give_up - time.monotonic()
        if remaining <= 0:
            return {"state": "error", "error": "the journal did not report in time"}
        readable, _, _ = select.select([fd], [], [], remaining)
        if not readable:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            return {"state": "error", "error": "the journal exited before it reported"}
        data += chunk
    try:
        report = json.loads(data.partition(b"\n")[0])
    except ValueError:
        report = None
    return report if isinstance(report, dict) else {"state": "error", "error": "bad report"}


def _daemon_main(argv: list[str]) -> int:
    """argv: ROOT SOCKET STATE IDLE_EXIT_S READY_FD. Forks once so the starter reaps at once."""
    root, socket_path, state_path, idle_text, ready_text = argv[:5]
    if os.fork() != 0:
        os._exit(0)
    ready_fd = int(ready_text)

    def report(fields: dict[str, Any]) -> None:
        nonlocal ready_fd
        if ready_fd >= 0:
            with contextlib.suppress(OSError):
                os.write(ready_fd, (json.dumps(fields) + "\n").encode())
            with contextlib.suppress(OSError):
                os.close(ready_fd)
            ready_fd = -1

    try:
        return serve(root, socket_path, state_path, float(idle_text), on_ready=report)
    finally:
        report({"state": "error", "error": "the journal exited before it was ready"})
