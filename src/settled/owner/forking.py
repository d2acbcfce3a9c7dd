"""What both zygotes share: what they import before any fork, how one forks a detached owner
with its caller's environment, and the caller's half of a launch through either.

A zygote (`zygote.py`, a Runtime's own; `home_launcher.py`, the home's) imports everything an
owner runs once, then forks one per request; the fork detaches (setsid, a second fork, so it
outlives the zygote), takes the caller's environment and umask, and runs the session only on
the orders of the caller that claimed it (handoff.py). Must never: import after the fork, or
run a command without the caller's orders.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

from settled import faults
from settled.home import make_session_dir
from settled.isolated import ReportReader
from settled.owner.handoff import hand_over, prepare
from settled.owner.launcher import READY_TIMEOUT_S
from settled.store import Store

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket
    from typing import Any

MAX_REQUEST = 1 << 20
ZYGOTE_MODULES = ("settled", "blake3")


def preload() -> None:
    """Import, once and before any fork, everything an owner runs: each fork then has it."""
    import ctypes  # noqa: F401 - pidns and subreaper owners need it; import it once, here
    import encodings.ascii  # noqa: F401 - a codec looked up by name is imported at first use
    import gc

    import settled.owner.launch  # the owner's launch path, likewise
    import settled.owner.main  # imported once, before any fork
    import settled.owner.session  # what the owner loads once its command runs
    import settled.workspace.journal.client  # noqa: F401 - the owner's barrier client, likewise
    from settled import boundary, store
    from settled.boundary import linux, spawn

    store.load_implementation()  # the store the owner opens, likewise
    boundary.preload()  # the boundary it makes, likewise

    linux.capget()  # libc loaded once here, not in every owner that isolates its command
    spawn.clone3_missing()  # probed once here (ctypes' PyDLL handle with it)
    # Last: the collector of every fork never walks what was loaded here, so it never writes
    # to (and makes the kernel copy) the pages of the shared heap. Those objects live as long
    # as the process anyway; only garbage this very call made would now never be collected.
    gc.freeze()


def fork_owner(request: dict[str, Any], fds: list[int], sockets: tuple[socket.socket, ...]) -> None:
    """Fork the owner `request` asks for, handing it `fds` (its ready and orders pipes); the
    child closes `sockets` (the zygote's own), detaches and becomes the owner."""
    from settled.owner.main import run_session  # preloaded: no import after the fork

    def become() -> int:
        os.setsid()
        if os.fork() != 0:
            os._exit(0)  # the stub: the owner outlives the zygote, nobody's child but init's
        return _become_owner(request, fds, run_session)

    _STUBS.add(fork_child(become, fds, sockets))
    # The stub is not waited for: it forks the real owner and exits at once, but under load it
    # waits for a CPU first, and the zygote serves one caller at a time (200 queued behind
    # each other's scheduling). It is reaped at the next fork or when the zygote ends; what
    # the caller learns of the owner comes over the ready pipe, as before (EOF if it failed).


_STUBS: set[int] = set()  # the owners' stubs this zygote forked and has not reaped


def fork_child(
    become: Callable[[], int], fds: list[int], sockets: tuple[socket.socket, ...]
) -> int:
    """Fork a child that closes `sockets` (the zygote's own) and exits with `become()`; the
    zygote closes `fds`, which were the child's alone, and reaps the stubs that exited."""
    reap_stubs()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for sock in sockets:
                sock.close()
            code = become()
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    reap_stubs()
    return pid


def reap_stubs(*, all_of_them: bool = False) -> None:
    """Reap the owners' stubs that exited (by pid: a face's workers are reaped by whoever
    forked them, face_workers.py); `all_of_them`: wait for every one, as a zygote does before
    it ends."""
    for pid in list(_STUBS):
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, 0 if all_of_them else os.WNOHANG)[0] == 0:
                continue  # still running
        _STUBS.discard(pid)


def _become_owner(request: dict[str, Any], fds: list[int], run: Any) -> int:
    """In the detached child: take the caller's environment and become the owner."""
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
    ready_fd, orders_fd = fds
    code: int = run(request["home"], request["session"], ready_fd, orders_fd)
    return code


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
