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
The zygote exits after IDLE_EXIT_S without a request and with no call running, when asked to
stop, or when a caller of another settled (its version, install or interpreter) asks it for
anything, so an upgrade never runs old code.

The CLI may ask too: a request that starts with VERB_REQUEST_MAGIC (cli/thin.py) gets a worker
forked with the caller's stdio and directory, which runs the verb through the CLI's function
named when the zygote started (`runtime.VERB_RUNNER`, imported before the heap is frozen); the
zygote reaps each worker and tells its caller how one ended that could not say
(verb_workers.py).

Trust: the socket lives in the home's run directory (0700, hidden from every command by its
mount namespace), and the zygote serves only its own uid (SO_PEERCRED) and, whatever the uid
(root included), only a process of its own mount and PID namespaces outside every session's
cgroup (peers.py): any other connection gets one word (REFUSED) and is closed unread, and the
log says why; its caller fails at once naming the log. It holds no store connection, no lock
but its own, and forks owners that act only on orders from the caller that claimed their
session. Must never: serve another uid or a session's process, answer for a request it did not
fork, run a CLI verb for a caller of other code, or outlive IDLE_EXIT_S without a request
while no call runs.
"""

from __future__ import annotations

import _socket  # the caller's side: `socket` (its enums and selectors, ~2 ms) is the zygote's
import contextlib
import fcntl
import json
import os
import select
import struct
import threading
import time

from settled.errors import OwnerLaunchFailed
from settled.helper_process import NoReport, python_command, read_report, start_helper
from settled.home import run_dir
from settled.owner.forking import (
    MAX_REQUEST,
    ZYGOTE_MODULES,
    Refill,
    Spare,
    fork_owner,
    launch_through,
    preload,
    reap_stubs,
)
from settled.owner.verb_workers import VerbWorkers
from settled.peers import unix_refusal
from settled.store import Store
from settled.where import LAUNCHER_LOG, LAUNCHER_SOCKET, VERB_REQUEST_MAGIC
from settled.where import install_identity as identity

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from collections.abc import Callable
    from typing import Any

    VerbRunner = Callable[[bytes, list[int], int], int]  # (arguments, stdio + cwd, connection)

SOCKET_NAME = LAUNCHER_SOCKET
LOCK_NAME = "launcher.lock"  # held by the running zygote for its whole life
START_NAME = "launcher.start"  # serializes starts
LOG_NAME = LAUNCHER_LOG
IDLE_EXIT_S = 60.0  # SETTLED_LAUNCHER_IDLE_S overrides it, read when a zygote starts
VERB_FDS = 4  # a verb's worker gets its caller's stdin, stdout, stderr and directory
START_TIMEOUT_S = 30.0
REPLY_TIMEOUT_S = 10.0
REFUSED = b"refused\n"  # the answer to a peer peers.py refuses: why is in the log alone


class LauncherUnavailable(OwnerLaunchFailed):
    """No home zygote could be reached or started: a session admitted for it has no owner,
    and recovery decides its fate, as for any owner that did not report (a typed error, exit
    1, not an internal one)."""


# -- the zygote process -------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    """argv: RUN_DIR IDLE_S READY_FD [VERB_RUNNER]. Forks once, so its starter reaps this process
    at once and the zygote is nobody's child but init's. VERB_RUNNER ("module:function") runs a
    CLI verb in a worker the zygote forks (see `_serve_verb`)."""
    run, idle, ready_fd = argv[0], float(argv[1]), int(argv[2])
    run_verb = _load_verb_runner(argv[3]) if len(argv) > 3 else None
    if os.fork() != 0:
        os._exit(0)
    return serve_home(run, idle, ready_fd, run_verb)


def _load_verb_runner(target: str) -> VerbRunner:
    """Import the CLI before the zygote's preload freezes the heap: its workers share it."""
    import importlib

    module, _, function = target.partition(":")
    served: VerbRunner = getattr(importlib.import_module(module), function)
    return served


def serve_home(run: str, idle_s: float, ready_fd: int, run_verb: VerbRunner | None = None) -> int:
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
    poller = select.poll()
    workers = VerbWorkers(poller)
    try:
        _serve(listener, poller, workers, mine, idle_s, run_verb)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # before the lock goes: a caller then starts a new one
        listener.close()
        Spare.end()
        reap_stubs(all_of_them=True)
        os.close(lock)  # the home is another zygote's to serve from here
        workers.finish()  # the calls still running end as they would have; each caller told
    return 0


def _serve(
    listener: socket.socket, poller: select.poll, workers: VerbWorkers, mine: str,
    idle_s: float, run_verb: VerbRunner | None,
) -> None:  # fmt: skip
    poller.register(listener, select.POLLIN)
    refill = Refill()
    while True:
        events = poller.poll(refill.timeout_ms(idle_s * 1000.0))
        if not events and refill.run_if_due((listener, *workers.held())):
            continue  # the spare forked a moment after the request it follows (forking.Refill)
        if not events and not workers:
            return  # idle: nobody asked for anything for a while, and nothing runs
        for fd, _ in events:
            if workers.owns(fd):
                workers.ended(fd)
        if any(fd == listener.fileno() for fd, _ in events):
            conn, _ = listener.accept()
            with conn:
                served = _answer(conn, listener, mine, run_verb, workers)
                if served is None:
                    return  # asked to, or another settled asks: a new zygote serves it
                if isinstance(served, str):
                    refill.after(served)


def _answer(
    conn: socket.socket, listener: socket.socket, mine: str, run_verb: VerbRunner | None,
    workers: VerbWorkers,
) -> str | bool | None:  # fmt: skip
    """One request; None when the zygote must leave, the home of an owner it forked (its spare
    is due: forking.Refill), else False."""
    refused = unix_refusal(conn)
    if refused is not None:
        _log(f"refused {refused}")
        _refuse(conn)  # a session's process, or one not told from one: never a request read
        return False
    if not _same_user(conn):
        return False  # another uid: not a word, not a fork
    conn.settimeout(REPLY_TIMEOUT_S)
    message, fds = _receive(conn)
    if message.startswith(VERB_REQUEST_MAGIC):
        stays = _serve_verb(message, fds, (listener, conn), mine, run_verb, workers)
        return False if stays else None
    request = _request(message)
    if request is None:
        _close_all(fds)
        return False  # a caller that only looked whether one answers, or garbage
    if request.get("op") == "stop" or request.get("identity") != mine:
        _close_all(fds)
        with contextlib.suppress(OSError):
            conn.sendall(b"stop\n")
        return None
    ours = (listener, conn, *workers.held())
    fork_owner(request, fds, ours)
    with contextlib.suppress(OSError):  # the caller went away: its owner runs nothing
        conn.sendall(b"ok\n")
    return str(request["home"])  # the caller has its answer; its spare a moment later


def _serve_verb(
    message: bytes,
    fds: list[int],
    sockets: tuple[socket.socket, socket.socket],
    mine: str,
    run_verb: VerbRunner | None,
    workers: VerbWorkers,
) -> bool:
    """A CLI verb's request: VERB_REQUEST_MAGIC, the caller's identity, then the verb's arguments.
    Forks a worker that runs `run_verb(body, fds, connection)`, keeping the connection (the zygote
    keeps a copy too, to tell the caller how a worker ended that could not: verb_workers.py); False
    when the caller is another settled (the zygote must leave)."""
    parts = message.split(b"\0", 2)
    listener, conn = sockets
    body, answer = parts[-1], None
    if len(parts) != 3 or parts[1].decode(errors="replace") != mine:
        answer = b"stop\n"
    elif run_verb is None or len(fds) != VERB_FDS or workers.full():
        answer = b"noface\n"  # the caller serves itself
    if run_verb is None or answer is not None:
        _close_all(fds)
        with contextlib.suppress(OSError):
            conn.sendall(answer or b"noface\n")
        return answer != b"stop\n"
    served = run_verb
    workers.start(lambda: served(body, fds, conn.fileno()), fds, conn, (listener,))
    return True


def _refuse(conn: socket.socket) -> None:
    """REFUSED, then what the peer sent is dropped unread (a plain recv takes no descriptor:
    the kernel releases those it carried): a socket closed on unread messages makes its peer's
    next read fail (ECONNRESET) ahead of the word waiting for it."""
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.sendall(REFUSED)
        for _ in range(16):  # a peer that keeps writing is not waited for
            if not conn.recv(MAX_REQUEST):
                break


def _receive(conn: socket.socket) -> tuple[bytes, list[int]]:
    import socket

    try:
        message, fds, _flags, _addr = socket.recv_fds(conn, MAX_REQUEST, VERB_FDS)
    except OSError:
        return b"", []
    return message, fds


def _request(message: bytes) -> dict[str, Any] | None:
    try:
        request = json.loads(message) if message else None
    except ValueError:
        request = None
    return request if isinstance(request, dict) else None


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _same_user(conn: socket.socket) -> bool:
    credentials = conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", credentials)
    return bool(uid == os.getuid())


def _log(message: str) -> None:
    """A line of the zygote's log (its stderr is the home's launcher.log)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    with contextlib.suppress(OSError):
        os.write(2, f"{stamp} launcher[{os.getpid()}] {message}\n".encode(errors="replace"))


def _report(fd: int, fields: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, (json.dumps(fields) + "\n").encode())
    os.close(fd)


# -- the caller's side ----------------------------------------------------------------------------


class HomeLauncher:
    """Launches owners through the home's zygote, starting it when none answers. Thread-safe:
    each launch is a connection of its own."""

    def __init__(self, verb_runner: str | None = None) -> None:
        """`verb_runner`: the CLI's verb runner ("module:function", runtime.VERB_RUNNER) that a
        zygote this launcher starts runs in a worker for a CLI call (see `_serve_verb`)."""
        self._identity = identity()
        self._verb_runner = verb_runner
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
                answer = _ask(run, request, fds)
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError):
                answer = b""  # none answers here (yet): start one
            if answer == b"ok\n":
                return
            if answer == REFUSED:
                raise LauncherUnavailable(
                    f"the home's launcher in {run} refused this process: it serves only processes "
                    "of its own mount and PID namespaces outside every session; see "
                    f"{os.path.join(run, LOG_NAME)}"
                )
            if attempt < 2:
                with self._start_lock:
                    start(run, verb_runner=self._verb_runner)
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
        with contextlib.suppress(BrokenPipeError):  # closed on us: a word may still wait
            sock.sendmsg([json.dumps(request).encode()], rights if fds else [])
        try:
            answer: bytes = sock.recv(16)
        except ConnectionResetError:  # the kernel says so before the word that may wait behind
            answer = sock.recv(16)
        return answer
    finally:
        sock.close()


def start(run: str, idle_s: float | None = None, verb_runner: str | None = None) -> None:
    """Start the home's zygote unless one answers; only one starts (the start lock), and one
    that finds another holding the zygote's lock reports so and leaves. `verb_runner`: the
    CLI's function it also serves ("module:function", see `_serve_verb`)."""
    if idle_s is None:
        idle_s = float(os.environ.get("SETTLED_LAUNCHER_IDLE_S") or IDLE_EXIT_S)
    os.makedirs(run, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(run, START_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _answers(run):
            return  # another caller started it meanwhile
        process, ready_r = start_helper(
            lambda ready_w: _zygote_command(run, idle_s, ready_w, verb_runner),
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


def _zygote_command(run: str, idle_s: float, ready_w: int, verb_runner: str | None) -> list[str]:
    target = "settled.owner.home_launcher:main"
    served = [verb_runner] if verb_runner else []
    return python_command(target, ZYGOTE_MODULES, run, repr(idle_s), str(ready_w), *served)


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
