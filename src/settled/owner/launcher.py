"""Starting a session owner, detached from whoever asked for it: the `Launcher` seam.

A `Launcher` turns an admitted session into a running owner and returns the owner's readiness
report. Two implement it: `FreshLauncher` here, and the zygote's `WarmLauncher`
(`owner/zygote.py`); a third (an owner started inside a remote sandbox) is a new module.

The owner is a fresh `python -I -S` (6-10 ms to start, against ~47 ms for a default
interpreter) with only settled and blake3 on its path, posix_spawned in a session of its own
(a vfork: the caller's memory is not copied), so its pid is known at once. While its
interpreter starts, the launcher prepares the session in the caller's process and claims it for
that pid (handoff.py), so the owner imports nothing heavy and waits for no fsync before its
command runs; the readiness pipe reports when it does. The owner stays this process's child
until it exits or this process does (then it is re-parented and outlives it): `Reaper` reaps
each one by its pidfd as it exits, never with a blanket wait, so none is left a zombie.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time

from settled.boundary import procfs
from settled.boundary.limits import WALLS_ENV, exported
from settled.boundary.spawn import PROBED_ENV, clone3_missing
from settled.helper_process import ReportReader, import_roots, python_command, spawn_detached
from settled.home import make_session_dir
from settled.owner import receipt_wake
from settled.owner.handoff import hand_over, prepare
from settled.owner.signals import HANDLED
from settled.store import Store

READY_TIMEOUT_S = 30.0
OWNER_MODULES = ("settled", "blake3")

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Protocol
else:
    Protocol = object  # a protocol is the type checker's; at run time a plain base


class Launcher(Protocol):
    """Starts one detached owner per call; thread-safe, so one may serve many Runtimes."""

    def launch(self, home: str, session: str, store: Store) -> dict[str, Any]:
        """The owner's readiness report, or {"error": why} when it never reported. `store` is
        the caller's (its thread's): the launcher claims the session through it."""
        ...

    def close(self) -> None:
        """End what the launcher keeps (a zygote); owners it started run on."""
        ...


class FreshLauncher:
    """A fresh interpreter per owner: nothing kept, nothing to close."""

    def launch(self, home: str, session: str, store: Store) -> dict[str, Any]:
        return launch_owner(home, session, store)

    def close(self) -> None:
        return None


def owner_path() -> list[str]:
    return import_roots(*OWNER_MODULES)


def owner_command(session: str, ready_fd: int, orders_fd: int) -> list[str]:
    """The home travels in the environment (SETTLED_OWNER_HOME), never on the command line."""
    return python_command(
        "settled.owner.main:main", OWNER_MODULES, session, str(ready_fd), str(orders_fd)
    )


def launch_owner(home: str, session: str, store: Store) -> dict[str, Any]:
    """Spawn the owner's interpreter, prepare and claim the session meanwhile, hand it over."""
    log = os.path.join(make_session_dir(home, session), "owner.log")
    launched_at = time.time()
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    orders_r, orders_w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = spawn_detached(
            owner_command(session, ready_w, orders_r),
            log,
            {
                **os.environ,
                "SETTLED_OWNER_HOME": home,
                WALLS_ENV: exported(),
                PROBED_ENV: clone3_missing() or "",
            },
            (ready_w, orders_r),
            blocked=HANDLED,  # claimed for before its handlers exist: a signal waits for them
        )
    except BaseException:
        os.close(ready_r)
        os.close(orders_w)
        raise
    finally:
        os.close(ready_w)
        os.close(orders_r)
    start_time = procfs.start_time(pid)  # the owner's identity, read before anything can reap it
    REAPER.watch(pid)
    try:
        try:
            prepared = prepare(store, home, session, launched_at)  # while the interpreter starts
        except BaseException:
            os.close(orders_w)  # the owner reads EOF: no orders, it runs nothing
            raise
        reader = ReportReader(ready_r)
        spawned = (pid, start_time)
        report = hand_over(store, prepared, reader, orders_w, READY_TIMEOUT_S, spawned)
        ready_r = receipt_wake.kept_after(report, ready_r)
        return report
    finally:
        if ready_r >= 0:
            os.close(ready_r)


class Reaper:
    """Reaps this process's owner children as they exit: one thread, one poll over their
    pidfds, `waitpid` of exactly their pids (never -1: FACTS.md, statuses of the caller's own
    children are the caller's). Started with the first owner; idle costs a blocked poll."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pidfds: dict[int, int] = {}  # pidfd -> pid
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None

    def watch(self, pid: int) -> None:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # reaped already by the caller's own blanket wait
            return
        with self._lock:
            self._pidfds[pidfd] = pid
            if self._thread is None or not self._thread.is_alive():
                self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
                self._thread = threading.Thread(target=self._run, name="settled-reaper")
                self._thread.daemon = True
                # Started with every signal blocked (a thread inherits its creator's mask): a
                # signal sent to the caller's process is then delivered to its own threads
                # only, so a caller that blocks SIGINT around a critical block (settled run's
                # relay, counting what it printed) is never interrupted through this thread.
                held = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
                try:
                    self._thread.start()
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, held)
            else:
                os.write(self._wake_w, b"w")

    def _run(self) -> None:
        while True:
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            with self._lock:
                for pidfd in self._pidfds:
                    poller.register(pidfd, select.POLLIN)
            for fd, _events in poller.poll():
                if fd == self._wake_r:
                    _drain(fd)
                else:
                    self._reap(fd)

    def _reap(self, pidfd: int) -> None:
        with self._lock:
            pid = self._pidfds.pop(pidfd)
        with contextlib.suppress(ChildProcessError):  # the caller reaped it (a blanket wait)
            os.waitpid(pid, os.WNOHANG)
        os.close(pidfd)

    def after_fork(self) -> None:
        """In a forked child of this process: the owners are not its children."""
        for fd in (*self._pidfds, self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._pidfds, self._thread = {}, None
        self._wake_r = self._wake_w = -1
        self._lock = threading.Lock()


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass


REAPER = Reaper()
os.register_at_fork(after_in_child=REAPER.after_fork)
