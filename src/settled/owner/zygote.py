"""The warm launcher: a pre-imported interpreter that forks session owners on request.

A fresh `python -I -S` owner pays 7-10 ms of interpreter start before it can run its command,
and ~40 ms of imports while it runs; a fork of this process pays ~1-2 ms for both. The zygote
belongs to one Runtime: it is that Runtime's child, talks to it over a socketpair, and exits
when the socketpair closes (the Runtime closed or its process died), so it never outlives its
owner. Owners it forks are detached at once (setsid, a second fork) and outlive it. It holds
no store connection and no lock while it forks. The launcher claims for the owner and hands it
its orders (handoff.py), as for a fresh owner. The caller's environment and umask travel with
each request, so an owner runs with the caller's environment, not the zygote's (a command sees
neither: only its spec's env, settled.environment).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from settled import faults
from settled.home import make_session_dir
from settled.isolated import ReportReader, python_command
from settled.owner.handoff import hand_over, prepare
from settled.owner.launcher import READY_TIMEOUT_S
from settled.store import Store

MAX_REQUEST = 1 << 20
ZYGOTE_MODULES = ("settled", "blake3")

# -- the zygote process -----------------------------------------------------------------------


def main(argv: list[str]) -> int:
    return serve(int(argv[0]))


def serve(sock_fd: int) -> int:
    """Loop: one request in, one owner forked, its pid out. EOF on the socket ends the zygote."""
    preload()
    sock = socket.socket(fileno=sock_fd)
    os.chdir("/")
    while True:
        try:
            message, fds, _flags, _addr = socket.recv_fds(sock, MAX_REQUEST, 2)
        except InterruptedError:
            continue
        if not message:
            return 0
        fork_owner(json.loads(message), fds, (sock,))
        sock.sendall(b"ok\n")


def preload() -> None:
    """Import, once and before any fork, everything an owner runs: each fork then has it."""
    import ctypes  # noqa: F401 - pidns and subreaper owners need it; import it once, here

    import settled.owner.launch  # the owner's launch path, likewise
    import settled.owner.main  # imported once, before any fork
    import settled.owner.session  # what the owner loads once its command runs
    import settled.workspace.journal.client  # noqa: F401 - the owner's barrier client, likewise
    from settled import store
    from settled.boundary import linux, spawn

    store.load_implementation()  # the store the owner opens, likewise

    linux.capget()  # libc loaded once here, not in every owner that isolates its command
    spawn.clone3_missing()  # probed once here (ctypes' PyDLL handle with it)


def fork_owner(request: dict[str, Any], fds: list[int], sockets: tuple[socket.socket, ...]) -> None:
    """Fork the owner `request` asks for, handing it `fds` (its ready and orders pipes); the
    child closes `sockets` (the zygote's own), detaches and becomes the owner."""
    from settled.owner.main import run_session  # preloaded: no import after the fork

    pid = os.fork()
    if pid == 0:
        for sock in sockets:
            sock.close()
        _become_owner(request, fds, run_session)
    for fd in fds:
        os.close(fd)
    os.waitpid(pid, 0)  # the child forks the real owner and exits at once


def _become_owner(request: dict[str, Any], fds: list[int], run: Any) -> None:
    """In the forked child: detach, take the caller's environment, fork the owner, exit."""
    code = 1
    try:
        os.setsid()
        os.environ.clear()
        os.environ.update(request["env"])
        faults.arm(os.environ.get("SETTLED_FAULT", ""))  # imported with the zygote's own
        os.umask(request["umask"])
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        if os.fork() != 0:
            os._exit(0)
        ready_fd, orders_fd = fds
        code = run(request["home"], request["session"], ready_fd, orders_fd)
    finally:
        os._exit(code)


# -- the Runtime's side -----------------------------------------------------------------------


class WarmLauncher:
    """Starts its zygote on first use; close() (or the end of this process) ends it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._process = subprocess.Popen(
            python_command("settled.owner.zygote:main", ZYGOTE_MODULES, str(theirs.fileno())),
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        return ours

    def launch(self, home: str, session: str, store: Store) -> dict[str, Any]:
        return launch_through(self._send, home, session, store)

    def _send(self, request: dict[str, Any], fds: list[int]) -> None:
        with self._lock:
            if self._sock is None:
                self._sock = self._start()
            socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
            if self._sock.recv(16) != b"ok\n":
                raise RuntimeError("the warm launcher did not answer; see its stderr")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._process is not None:
                self._process.wait(timeout=10)
                self._process = None


def launch_through(
    send: Callable[[dict[str, Any], list[int]], None], home: str, session: str, store: Store
) -> dict[str, Any]:
    """Ask a zygote (through `send`, which returns once it forked the owner) for the session's
    owner, then claim for it and hand it its orders, as for a fresh owner (handoff.py)."""
    log = os.path.join(make_session_dir(home, session), "owner.log")
    launched_at = time.time()
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    orders_r, orders_w = os.pipe2(os.O_CLOEXEC)
    umask = os.umask(0o022)
    os.umask(umask)
    request = {"home": home, "session": session, "env": dict(os.environ), "umask": umask,
               "log": log}  # fmt: skip
    try:
        try:
            send(request, [ready_w, orders_r])
        finally:
            os.close(ready_w)
            os.close(orders_r)
        try:
            prepared = prepare(store, home, session, launched_at)
        except BaseException:
            os.close(orders_w)  # the owner reads EOF: no orders, it runs nothing
            orders_w = -1
            raise
        owner_w, orders_w = orders_w, -1  # hand_over closes it
        return hand_over(store, prepared, ReportReader(ready_r), owner_w, READY_TIMEOUT_S)
    finally:
        if orders_w >= 0:
            os.close(orders_w)
        os.close(ready_r)
