"""The home's warm launcher: one zygote per home, reached on `<home>/run/launcher.sock`, that
forks session owners for every process of the home's user.

Why: a Runtime's own zygote (`WarmLauncher`) dies with it, so a CLI call, a new process each
time, could only start a fresh `python -I -S` owner, which then imports ~25 ms of settled while
its command runs before it can drain, settle and write the receipt; `settled run -- true` spent
most of its time there. The home's zygote imported all of it once; a fork of it costs ~1-2 ms.

How: the first caller that finds no zygote answering starts one (under a start lock, so one
per home), detached, with the same readiness report as the journal's. Each request is one
connection: the caller's environment and umask, and its two pipes (SCM_RIGHTS), exactly as
`WarmLauncher` sends them; the zygote forks the owner (setsid, a second fork: it outlives the
zygote) and answers `ok`; the caller then claims for it and hands it its orders (handoff.py).
The zygote exits after IDLE_EXIT_S without a request, when asked to stop, or when a caller of
another settled (its version or install) asks it for an owner, so an upgrade never runs old code.

Trust: the socket lives in the home's run directory (0700, hidden from every command by its
mount namespace), and the zygote serves only its own uid (SO_PEERCRED). It holds no store
connection, no lock but its own, and forks owners that act only on orders from the caller that
claimed their session. Must never: serve another uid, answer for a request it did not fork, or
outlive IDLE_EXIT_S without a request.
"""

from __future__ import annotations

import _socket  # the caller's side: `socket` (its enums and selectors, ~2 ms) is the zygote's
import contextlib
import fcntl
import json
import os
import struct
import threading
import time

from settled.home import run_dir
from settled.isolated import NoReport, python_command, read_report, start_helper
from settled.owner.forking import (
    MAX_REQUEST,
    ZYGOTE_MODULES,
    fork_owner,
    launch_through,
    preload,
    reap_stubs,
)
from settled.store import Store

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from typing import Any

SOCKET_NAME = "launcher.sock"
LOCK_NAME = "launcher.lock"  # held by the running zygote for its whole life
START_NAME = "launcher.start"  # serializes starts
LOG_NAME = "launcher.log"
IDLE_EXIT_S = float(os.environ.get("SETTLED_LAUNCHER_IDLE_S") or 60.0)
START_TIMEOUT_S = 30.0
REPLY_TIMEOUT_S = 10.0


class LauncherUnavailable(RuntimeError):
    """No home zygote could be reached or started; the caller may launch a fresh owner."""


def identity() -> str:
    """What a zygote must share with its caller to fork its owners: this settled's version,
    where it is installed, and the newest change to any of its modules (a reinstall in place,
    or an edit of an editable install, changes it: ~0.5 ms for ~150 files)."""
    import settled

    package = os.path.dirname(os.path.abspath(settled.__file__))
    return f"{settled.__version__} {package} {_newest_change(package)}"


def _newest_change(package: str) -> int:
    newest, folders = 0, [package]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if entry.name != "__pycache__":
                        folders.append(entry.path)
                elif entry.name.endswith((".py", ".so")):
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime_ns)
    return newest


# -- the zygote process -------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    """argv: RUN_DIR IDLE_S READY_FD. Forks once, so its starter reaps this process at once
    and the zygote is nobody's child but init's."""
    run, idle, ready_fd = argv[0], float(argv[1]), int(argv[2])
    if os.fork() != 0:
        os._exit(0)
    return serve_home(run, idle, ready_fd)


def serve_home(run: str, idle_s: float, ready_fd: int) -> int:
    lock = os.open(os.path.join(run, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        _report(ready_fd, {"state": "locked"})  # another zygote serves this home
        return 0
    os.ftruncate(lock, 0)
    os.write(lock, str(os.getpid()).encode())
    preload()
    mine = identity()
    path = os.path.join(run, SOCKET_NAME)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a dead zygote's: the lock says none runs
    import socket  # preloaded by now: the zygote's own serving

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(64)
    os.chdir("/")
    _report(ready_fd, {"state": "ready", "pid": os.getpid()})
    try:
        _serve(listener, mine, idle_s)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # before the lock goes: a caller then starts a new one
        listener.close()
        reap_stubs(all_of_them=True)
        os.close(lock)
    return 0


def _serve(listener: socket.socket, mine: str, idle_s: float) -> None:
    import select

    poller = select.poll()
    poller.register(listener, select.POLLIN)
    while True:
        if not poller.poll(idle_s * 1000.0):
            return  # idle: nobody asked for an owner for a while
        conn, _ = listener.accept()
        with conn:
            if not _same_user(conn):
                continue  # another uid: not a word, not a fork
            conn.settimeout(REPLY_TIMEOUT_S)
            request, fds = _receive(conn)
            if request is None:
                continue  # a caller that only looked whether one answers, or garbage
            if request.get("op") == "stop" or request.get("identity") != mine:
                for fd in fds:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    conn.sendall(b"stop\n")
                return  # asked to, or another settled asks: a new zygote serves it
            fork_owner(request, fds, (listener, conn))
            with contextlib.suppress(OSError):  # the caller went away: its owner runs nothing
                conn.sendall(b"ok\n")


def _receive(conn: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    import socket

    try:
        message, fds, _flags, _addr = socket.recv_fds(conn, MAX_REQUEST, 2)
    except OSError:
        return None, []
    try:
        request = json.loads(message) if message else None
    except ValueError:
        request = None
    if not isinstance(request, dict):
        for fd in fds:
            os.close(fd)
        return None, []
    return request, fds


def _same_user(conn: socket.socket) -> bool:
    credentials = conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", credentials)
    return bool(uid == os.getuid())


def _report(fd: int, fields: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, (json.dumps(fields) + "\n").encode())
    os.close(fd)


# -- the caller's side ----------------------------------------------------------------------------


class HomeLauncher:
    """Launches owners through the home's zygote, starting it when none answers. Thread-safe:
    each launch is a connection of its own."""

    def __init__(self) -> None:
        self._identity = identity()
        self._start_lock = threading.Lock()

    def launch(self, home: str, session: str, store: Store) -> dict[str, Any]:
        run = run_dir(home)
        return launch_through(lambda r, fds: self._send(run, r, fds), home, session, store)

    def close(self) -> None:
        return None  # the zygote is the home's, not this process's: it leaves when idle

    def _send(self, run: str, request: dict[str, Any], fds: list[int]) -> None:
        request = {**request, "identity": self._identity}
        for attempt in range(3):
            try:
                if _ask(run, request, fds) == b"ok\n":
                    return
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError):
                pass  # none answers here (yet): start one
            if attempt < 2:
                with self._start_lock:
                    start(run)
        raise LauncherUnavailable(f"the home's launcher in {run} did not fork an owner; see "
                                  f"{os.path.join(run, LOG_NAME)}")  # fmt: skip


def _ask(run: str, request: dict[str, Any], fds: list[int]) -> bytes:
    """One request. The connect blocks, bounded by SO_SNDTIMEO: when a burst of callers (a
    server's threads, 200 sessions at once) fills the zygote's listen backlog, the kernel
    queues this caller until the zygote accepts, where a socket with a timeout (non-blocking
    underneath) failed the launch at once with EAGAIN."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
    try:
        wait = struct.pack("ll", int(REPLY_TIMEOUT_S), 0)
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_SNDTIMEO, wait)
        sock.connect(os.path.join(run, SOCKET_NAME))
        sock.settimeout(REPLY_TIMEOUT_S)
        rights = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
        sock.sendmsg([json.dumps(request).encode()], rights if fds else [])
        answer: bytes = sock.recv(16)
        return answer
    finally:
        sock.close()


def start(run: str, idle_s: float = IDLE_EXIT_S) -> None:
    """Start the home's zygote unless one answers; only one starts (the start lock), and one
    that finds another holding the zygote's lock reports so and leaves."""
    os.makedirs(run, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(run, START_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _answers(run):
            return  # another caller started it meanwhile
        process, ready_r = start_helper(
            lambda ready_w: _zygote_command(run, idle_s, ready_w),
            os.path.join(run, LOG_NAME),
            cwd="/",
        )
        try:
            process.wait(START_TIMEOUT_S)  # the first process only forks the zygote
            report = read_report(ready_r, time.monotonic() + START_TIMEOUT_S)
        except NoReport:
            report = {"state": "error"}
        finally:
            os.close(ready_r)
        if report.get("state") == "locked":
            time.sleep(0.01)  # a zygote is leaving: the next attempt starts a new one
    finally:
        os.close(fd)


def _zygote_command(run: str, idle_s: float, ready_w: int) -> list[str]:
    target = "settled.owner.home_launcher:main"
    return python_command(target, ZYGOTE_MODULES, run, repr(idle_s), str(ready_w))


def _answers(run: str) -> bool:
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
    try:
        sock.connect(os.path.join(run, SOCKET_NAME))
    except OSError:
        return False
    finally:
        sock.close()
    return True


def stop(run: str, timeout: float = 10.0) -> bool:
    """Ask the home's zygote to leave and wait until it released its lock; False if none ran."""
    try:
        _ask(run, {"op": "stop"}, [])
    except OSError:
        return False
    give_up = time.monotonic() + timeout
    lock = os.path.join(run, LOCK_NAME)
    while time.monotonic() < give_up:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.005)
        finally:
            os.close(fd)
    raise LauncherUnavailable(f"the home's launcher in {run} did not stop within {timeout:g} s")
