"""The journal daemon: one per home, serving every open task's `Journal` over one Unix socket.

Owns, for one run directory: the lock beside the socket (one daemon per socket, ever), the one
inotify instance (a `Watcher`) every task's journal shares, the socket server that answers the
client's verbs (`client.py` speaks them; each names its task), one state file per task that
persists a reservation above every seq a client has seen (so a crash or a release restarts
that task's sequence above it, and says so), and the exit on `stop`, a signal, or idleness with
no task watched. Started by `lifecycle.ensure_running` as `python -I -S` through `main`.

A kernel that refuses the instance (EMFILE past fs.inotify.max_user_instances) does not stop
the daemon: every journal is then untrusted, naming why, and the instance is tried again at
each watch and reset. Requests are served one at a time: a first `watch` walks the workspace,
and a barrier that waits behind a long walk times out (the caller then does a full scan).

Every connection is first judged by `peers.unix_refusal`: a process of another mount or PID
namespace (a session's command, root or not) or of a session's cgroup gets one error line
(`refused`, so a caller fails at once instead of starting a journal) and is closed unread, and
the log says why.

Must never: answer with a seq before its reservation is on disk, serve a socket whose lock it
does not hold, read a request of a peer that peers.py refuses, let one request's failure take
the other tasks' journals down, or outlive `stop` by more than the reply it owes.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from settled import oomguard
from settled.atomic import write_atomic
from settled.daemons import ReadyReport
from settled.peers import unix_refusal
from settled.workspace.journal.errors import JournalUnavailable
from settled.workspace.journal.inotify import Journal, Watcher
from settled.workspace.journal.wire import SOCKET_NAME, STATE_DIR, unix_address

RESERVE = 1 << 16  # sequence numbers reserved on disk ahead of the last one reported
_MAX_LINE = 1 << 16
_MAX_TASK = 128
REFUSED = (  # the one line a peer peers.py refuses gets: why is in the log alone
    b'{"error":"refused: this journal serves only processes of its own mount and PID '
    b'namespaces outside every session; see its log"}\n'
)


def serve(
    run_dir: str,
    idle_exit_s: float = 60.0,
    on_ready: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    """Run the home's journal until `stop`, a signal, or `idle_exit_s` with no task watched
    and no client. Exits 0 at once if another journal holds the lock beside the socket."""
    report = on_ready or (lambda fields: None)
    run_dir = os.path.abspath(run_dir)
    socket_path = os.path.join(run_dir, SOCKET_NAME)
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
        watcher = Watcher()
        try:
            try:
                server = _Server(watcher, run_dir, idle_exit_s)
            except OSError as exc:
                why = f"cannot serve on {socket_path}: {exc}"
                _log(why)
                report({"state": "error", "error": why})
                return 1
            refused = watcher.refused()
            _log(f"serving on {socket_path}" + (f"; {refused}" if refused else ""))
            report({"state": "ready", "pid": os.getpid(), "instance": refused or "ok"})
            try:
                server.run()
            finally:
                server.close()
            _log(f"exiting: {server.reason}")
            return 0
        finally:
            watcher.close()
    finally:
        os.close(lock_fd)


@dataclass
class _Task:
    """One watched task: its journal, its state file and the seq reserved there."""

    journal: Journal
    state_path: str
    ceiling: int


class _Conn:
    __slots__ = ("eof", "inbuf", "outbuf", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.inbuf, self.outbuf, self.eof = sock, b"", b"", False


ORPHAN_CHECK_S: Final = 5.0  # how often a daemon checks that its socket is still its own


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class _Server:
    def __init__(self, watcher: Watcher, run_dir: str, idle: float) -> None:
        self.watcher, self.run_dir, self.idle = watcher, run_dir, idle
        self.socket_path = os.path.join(run_dir, SOCKET_NAME)
        self.state_dir = os.path.join(run_dir, STATE_DIR)
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        self.tasks: dict[str, _Task] = {}
        self.after_reply: list[Callable[[], None]] = []  # run once the reply is sent
        self.stopping, self.reason = False, f"idle for {idle:g} s with no task"
        self.conns: dict[socket.socket, _Conn] = {}
        self.sel = selectors.DefaultSelector()
        with contextlib.suppress(FileNotFoundError):  # stale: we hold the lock, nobody serves it
            os.unlink(self.socket_path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            with unix_address(self.socket_path) as address:
                self.listener.bind(address)
            os.chmod(self.socket_path, 0o600)
            self.listener.listen(512)
            self.socket_id = _identity(self.socket_path)
        except OSError:
            self.listener.close()
            raise
        self.listener.setblocking(False)
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self.inotify_fd: int | None = None
        self._register_inotify()
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
            timeout = ORPHAN_CHECK_S
            if not self.conns and not self.tasks:
                timeout = min(timeout, last + self.idle - time.monotonic())
                if timeout <= 0:
                    return
            if not self._still_served_here():
                return
            ready = self.sel.select(timeout)
            if ready:
                last = time.monotonic()
            for key, events in ready:
                key.data(key.fileobj, events)

    def _still_served_here(self) -> bool:
        """Whether our socket still holds its name: a home deleted (and perhaps made again,
        with a journal of its own) leaves this daemon unreachable, so it ends instead of
        watching workspaces for nobody."""
        if _identity(self.socket_path) == self.socket_id:
            return True
        self.reason = "its socket was removed or replaced (the home was deleted or moved)"
        return False

    def close(self) -> None:
        if _identity(self.socket_path) == self.socket_id:  # never another journal's socket
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
        for task in list(self.tasks):
            with contextlib.suppress(OSError):
                self._release(task, forget=False)
        if self.old_wakeup is not None:
            signal.set_wakeup_fd(self.old_wakeup)
            for signum, handler in self.old_handlers.items():
                if handler is not None:
                    signal.signal(signum, handler)
        self.sel.close()
        self.wake_r.close()
        self.wake_w.close()

    def _register_inotify(self) -> None:
        """Read the instance once it exists (at start, or when a later watch could make it)."""
        fd = self.watcher.fileno()
        if fd is not None and self.inotify_fd is None:
            self.sel.register(fd, selectors.EVENT_READ, self._on_inotify)
            self.inotify_fd = fd

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopping, self.reason = True, f"signal {signal.Signals(signum).name}"

    def _on_wake(self, fileobj: Any, events: int) -> None:
        with contextlib.suppress(OSError):
            self.wake_r.recv(256)

    def _on_inotify(self, fileobj: Any, events: int) -> None:
        self.watcher.pump()

    def _on_accept(self, fileobj: Any, events: int) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: the client sees no answer
                _log(f"accept failed: {exc}")
                return
            refused = unix_refusal(sock)
            if refused is not None:
                _log(f"refused {refused}")
                _refuse(sock)
                continue
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
                self._send(conn, self._answer(line.strip()))
                self._run_after_reply()
            if len(conn.inbuf) > _MAX_LINE:
                self._drop(conn)

    def _run_after_reply(self) -> None:
        """What a request left to do once its client has the reply, before the next request
        is read (so no request ever sees it undone)."""
        while self.after_reply:
            work = self.after_reply.pop(0)
            try:
                work()
            except OSError as exc:
                _log(f"work after a reply failed: {exc}")

    def _answer(self, line: bytes) -> dict[str, Any]:
        """The reply to one request line; a request that fails is an error reply, never the
        end of the daemon that every other task's journal lives in."""
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            return {"error": f"bad request {line[:64]!r}: {exc}"}
        try:
            return self._command(request)
        except (OSError, JournalUnavailable) as exc:
            _log(f"{request.get('op')!r} for {request.get('task')!r} failed: {exc}")
            return {"error": f"{request.get('op')!r} failed: {exc}"}
        finally:
            self._register_inotify()

    def _command(self, request: dict[str, Any]) -> dict[str, Any]:
        op, task = request.get("op"), request.get("task")
        if op == "stop":
            self.stopping, self.reason = True, "stop requested by a client"
            return {"stopped": True, "tasks": len(self.tasks)}
        if op == "ping" and task is None:
            return self._ping()
        if not _valid_task(task):
            return {"error": f"request {op!r} names no valid task: {str(task)[:64]!r}"}
        assert isinstance(task, str)
        if op == "watch":
            return self._watch(task, request.get("root"))
        if op == "release":
            return self._release(task, forget=request.get("forget") is True, defer=True)
        entry = self.tasks.get(task)
        if op == "ping":
            root = entry.journal.root if entry else None
            seq = self._covered(entry, entry.journal.pump()) if entry else None
            return {**self._ping(), "task": task, "root": root, "seq": seq}
        if entry is None:
            return {"error": f"task {task} is not watched by this journal"}
        if op == "barrier":
            return self._barrier(entry)
        seq = request.get("seq")
        if op == "reset" and type(seq) is int and seq >= 0:
            entry.journal.reset_dirty(seq)
            return self._barrier(entry)
        return {"error": f"unknown request {op!r}: watch, barrier, reset, ping, release or stop"}

    def _ping(self) -> dict[str, Any]:
        return {
            "ok": True,
            "pid": os.getpid(),
            "run_dir": self.run_dir,
            "tasks": len(self.tasks),
            "directories": sum(entry.journal.watched for entry in self.tasks.values()),
            "instance": self.watcher.refused() or "ok",
        }

    def _watch(self, task: str, root: Any) -> dict[str, Any]:
        """Start watching `root` for `task`; for a task already watched, its watermark."""
        if not isinstance(root, str) or not root or "\0" in root:
            return {"error": f"watch {task}: the root {str(root)[:64]!r} is not a path"}
        entry = self.tasks.get(task)
        if entry is not None:
            if entry.journal.root != os.path.realpath(root):
                return {"error": f"task {task} is watched at {entry.journal.root}, not {root}"}
            return {"ok": True, **self._barrier(entry)}
        state_path = os.path.join(self.state_dir, f"{task}.state")
        previous = _read_state(state_path)
        if previous is None:  # where a per-task journal of an older settled kept it
            previous = _read_state(os.path.join(self.run_dir, task, "journal.state"))
        journal = Journal(root, 0 if previous is None else previous + 1, self.watcher)
        try:
            if previous is not None:
                journal.mark_untrusted(
                    f"the journal restarted after seq {previous}: changes made while no journal "
                    "watched this task were not observed"
                )
            entry = _Task(journal, state_path, journal.seq + RESERVE)
            _write_state(state_path, entry.ceiling, clean=False)
        except BaseException:
            journal.close()
            raise
        self.tasks[task] = entry
        _log(f"watching {journal.root} for {task} from seq {journal.seq} ({journal.watched} dirs)")
        return {"ok": True, **self._barrier(entry)}

    def _release(self, task: str, forget: bool, defer: bool = False) -> dict[str, Any]:
        """Stop watching `task`; its state keeps the last seq (a later watch continues above
        it and reports the gap), unless `forget` (the task's creation was undone).

        `defer` (not with `forget`): the watches are removed and the last seq written after
        the reply. A close waits for this reply, and the state's two fsyncs were ~1 ms of it.
        The reply names no seq, no request is read before the work is done, and until it is
        the state on disk is the reservation above every seq any client has seen (unclean):
        a crash in between makes a later watch continue above that reservation and call
        itself untrusted, which is what a crash always does."""
        entry = self.tasks.pop(task, None)
        state_path = os.path.join(self.state_dir, f"{task}.state")
        if entry is not None and defer and not forget:
            self.after_reply.append(functools.partial(self._stop_watching, task, entry))
        elif entry is not None:
            self._stop_watching(task, entry, forget)
        if forget:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(state_path)
        return {"released": entry is not None, "tasks": len(self.tasks)}

    def _stop_watching(self, task: str, entry: _Task, forget: bool = False) -> None:
        entry.journal.close()
        _log(f"released {task} at seq {entry.journal.seq}{' (forgotten)' if forget else ''}")
        if not forget:
            _write_state(entry.state_path, entry.journal.seq, clean=True)

    def _barrier(self, entry: _Task) -> dict[str, Any]:
        watermark = entry.journal.barrier()
        self._covered(entry, watermark.seq)
        return watermark.to_json()

    def _covered(self, entry: _Task, seq: int) -> int:
        """Persist a reservation above `seq` before any client sees it."""
        if seq > entry.ceiling:
            _write_state(entry.state_path, seq + RESERVE, clean=False)
            entry.ceiling = seq + RESERVE
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


def _refuse(sock: socket.socket) -> None:
    """The refusal's one line, then the close. What the peer sent is drained first, never
    read as a request: a unix stream socket closed on unread bytes makes its peer's next read
    fail (ECONNRESET) even with the line waiting, and the caller must get the line."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        sock.send(REFUSED)
        for _ in range(16):  # a peer that keeps writing is not waited for
            if not sock.recv(1 << 16):
                break
    sock.close()


def _valid_task(task: Any) -> bool:
    """A task id names its state file: one plain path component, nothing else."""
    return (
        isinstance(task, str)
        and 0 < len(task) <= _MAX_TASK
        and not task.startswith(".")
        and all(c.isascii() and (c.isalnum() or c in "_-.") for c in task)
    )


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


def main(argv: list[str]) -> int:
    """argv: RUN_DIR IDLE_EXIT_S READY_FD. Forks once so the starter reaps at once."""
    run_dir, idle_text, ready_text = argv[:3]
    if os.fork() != 0:
        os._exit(0)
    oomguard.protect_self()  # never the kernel's choice under memory pressure, where it can
    report = ReadyReport(int(ready_text))
    try:
        return serve(run_dir, float(idle_text), on_ready=report)
    finally:
        report({"state": "error", "error": "the journal exited before it was ready"})
