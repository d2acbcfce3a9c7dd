"""The journal daemon: one `Journal` served over a Unix socket, its state file, its entry point.

Owns, for one workspace: the lock beside the socket (one daemon per socket, ever), the socket
server that answers the client's verbs (`client.py` speaks them), the state file that persists a
reservation above every seq a client has seen (so a crash restarts the sequence above it, and
says so), and the exit on `stop`, a signal or idleness. Started by `lifecycle.ensure_running`
as `python -I -S` through `main`.

Must never: answer with a seq before its reservation is on disk, serve a socket whose lock it
does not hold, or outlive `stop` by more than the reply it owes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from settled.atomic import write_atomic
from settled.workspace.journal.client import unix_address
from settled.workspace.journal.errors import JournalUnavailable
from settled.workspace.journal.inotify import Journal

RESERVE = 1 << 16  # sequence numbers reserved on disk ahead of the last one reported
_MAX_LINE = 4096


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
            with unix_address(socket_path) as address:
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


def main(argv: list[str]) -> int:
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
