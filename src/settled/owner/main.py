"""Entry point of the session owner process, and its launch path: from its orders to its command
running inside the boundary.

An owner is started by a launcher (launcher.py: a fresh `python -I -S`; zygote.py: a fork of a
pre-imported one). It installs its signal handlers, says its pid, and waits for orders: the
launcher claims the session for that pid (CAS with its start time, boot id and a lease) and
records the boundary in the same write before it sends them (handoff.py). An owner that gets no
orders runs nothing. With orders: reserve the last words, set up the boundary, start the
command inside it (clone3 straight into its cgroup and PID namespace where the kernel can), and
report that it runs.

Everything up to the running command imports only the standard library's os, sys, time,
marshal, errno and fcntl, and settled's boundary package (ctypes where it clones or isolates):
no json, typing, dataclasses, signal, sqlite3 or store. Supervision, logs, the lease, receipts,
the store and the journal client load while the command runs (session.py): each stream's pipe
buffers its first output (1 MiB). Must never: start a command without orders, or anywhere but
inside its boundary. Exit status is for the log only: the receipt in the store is the answer.
"""

from __future__ import annotations

import marshal
import os
import sys
import time

from settled import boundary as boundaries
from settled import faults
from settled.boundary.isolation import IsolationPlan
from settled.boundary.spawn import ChildIO, Launch, SpawnFailed, spawn_via
from settled.errors import BoundaryUnavailable
from settled.isolated import json_text
from settled.owner.last_words import LastWords
from settled.owner.signals import OwnerSignals

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from settled.boundary.base import Boundary
    from settled.owner.session import OwnerSession

OWNER_HOME_ENV = "SETTLED_OWNER_HOME"
ORDERS_VERSION = 1  # handoff.ORDERS_VERSION: the launcher's side
PIPE_SIZE = 1 << 20  # each output pipe: what the command may write before the drain starts
F_SETPIPE_SZ = 1031


class Ready:
    """The launcher's readiness pipe: the owner's pid first, then one line once the command
    runs (or cannot). Written without json (isolated.json_text)."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        if fd is not None:
            os.set_inheritable(fd, False)

    def say(self, **fields: Any) -> None:
        if self.fd is None:
            return
        try:  # noqa: SIM105 - contextlib stays off the owner's launch path
            os.write(self.fd, (json_text(fields) + "\n").encode())
        except OSError:  # the launcher went away; the session goes on
            pass

    def send(self, **fields: Any) -> None:
        """The last report: the pipe is closed after it."""
        self.say(**fields)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_orders(fd: int) -> dict[str, Any] | None:
    """The launcher's orders, or None at EOF with none (no claim was made for this process)."""
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    if not chunks:
        return None
    given: dict[str, Any] = marshal.loads(b"".join(chunks))
    if given.get("v") != ORDERS_VERSION:
        raise ValueError(f"orders of version {given.get('v')!r}, this owner reads v1")
    return given


def sealed_stdin(data_path: str) -> int:
    """The stored stdin as a sealed memfd: the command reads the bytes but cannot reopen the
    stored copy through /proc/self/fd/0 and change it for the next session that uses it."""
    import fcntl

    fd = os.memfd_create("settled-stdin", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with open(data_path, "rb") as source:
            while chunk := source.read(1 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def output_pipes() -> dict[str, int]:
    """stdout and stderr pipes, each enlarged so the command can write while the owner is
    still loading its drain: {name: read end, name_w: write end}."""
    import fcntl

    fds: dict[str, int] = {}
    for name in ("stdout", "stderr"):
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        try:  # noqa: SIM105 - contextlib stays off the owner's launch path
            fcntl.fcntl(read_end, F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:  # above /proc/sys/fs/pipe-max-size for this user: keep the default
            pass
        fds[name], fds[f"{name}_w"] = read_end, write_end
    return fds


class Launching:
    """One owner from its orders to its running command; then it hands over to session.py."""

    def __init__(
        self, home: str, given: dict[str, Any], signals: OwnerSignals, ready: Ready
    ) -> None:
        self.home, self.orders, self.signals, self.ready = home, given, signals, ready
        self.timings: dict[str, float] = dict(given["timings"])
        self.plan = IsolationPlan(**given["plan"]) if given["plan"] is not None else None
        self.last_words: LastWords | None = None
        self.session: OwnerSession | None = None

    def run(self) -> int:
        given = self.orders
        faults.point("owner.after_claim")
        if given["never_ran"] is not None:
            return self._never_ran(*given["never_ran"])
        boundary = boundaries.make(
            given["boundary"], given["task"], given["session"], self.plan, given["hierarchy"]
        )
        cancel = given["cancel"] or self.signals.stop_reason
        if cancel:
            boundary.discard()
            return self._never_ran("cancelled", "admission", cancel, planned=False)
        try:  # before anything runs: a place to say why, should the receipt not fit later
            self.last_words = LastWords(given["last_words"])
        except OSError as exc:
            boundary.discard()
            why = _storage_text(exc, self.home)
            return self._never_ran("not_started", "space", why, planned=False)
        if self._threads_first(boundary):
            self._open_session().lease.start()
        try:
            boundary.setup()
        except BoundaryUnavailable as exc:
            boundary.discard()
            return self._never_ran("not_started", "boundary", str(exc))
        faults.point("owner.after_boundary")
        return self._start(boundary)

    def _threads_first(self, boundary: Boundary) -> bool:
        """Where the command's PID namespace cannot be cloned, this process unshares one for its
        children in `setup`, after which the kernel refuses it any thread: the lease keeper's
        thread (and so the session's imports) must come first, as they always did."""
        pid_namespace = boundary.kind in boundaries.PID_NAMESPACE_KINDS
        return pid_namespace and spawn_via(boundary.birth_cgroup(), True) == "fork"

    def _start(self, boundary: Boundary) -> int:
        given = self.orders
        pipes = output_pipes()
        stdin_fd = (
            sealed_stdin(given["stdin"])
            if given["stdin"]
            else os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        )
        out_w, err_w = pipes.pop("stdout_w"), pipes.pop("stderr_w")
        launch = Launch(given["argv"], given["cwd"], given["env"], ChildIO(stdin_fd, out_w, err_w))
        if self.plan is not None:
            launch.isolation = self.plan
        via = spawn_via(boundary.birth_cgroup(), boundary.kind in boundaries.PID_NAMESPACE_KINDS)
        started = time.monotonic()
        self.timings["spawned_at"] = time.time()  # the wall-clock twin of `started`
        try:
            pid = boundary.start(launch)
        except SpawnFailed as exc:
            for fd in (stdin_fd, out_w, err_w):
                os.close(fd)
            boundary.await_empty(5.0)
            boundary.teardown()
            return self._never_ran("not_started", exc.stage, str(exc), pipes)
        # clone or fork, boundary, isolated view, privileges and exec, until exec succeeded
        self.timings["spawn_s"] = round(time.monotonic() - started, 6)
        for fd in (stdin_fd, out_w, err_w):
            os.close(fd)
        start_time = _start_time(pid)
        self.ready.send(
            state="running", owner_pid=os.getpid(), pid=pid, boundary=boundary.kind,
            ref=boundary.ref, start=start_time, spawn=via,
        )  # fmt: skip
        faults.point("owner.after_spawn")
        session = self._open_session()
        return session.supervise(boundary, pipes, started, pid, start_time, via)

    def _open_session(self) -> OwnerSession:
        """The rest of the owner (store, logs, lease, supervision, receipt): imported here."""
        if self.session is None:
            from settled.owner.session import OwnerSession

            self.session = OwnerSession(
                self.home, self.orders, self.ready, self.signals, self.timings, self.last_words
            )
        return self.session

    def _never_ran(
        self,
        reason: str,
        stage: str,
        error: str,
        pipes: dict[str, int] | None = None,
        *,
        planned: bool = True,
    ) -> int:
        """The session's receipt says its command never started (session.py writes it); the
        caller removed the boundary the launcher made for it, if any."""
        return self._open_session().never_ran(reason, stage, error, pipes, planned=planned)

    def say_last_words(self, reason: str) -> None:
        if self.session is not None:
            self.session.say_last_words(reason)
        elif self.last_words is not None:
            self.last_words.record(reason)
        try:  # noqa: SIM105 - contextlib stays off the owner's launch path
            print(f"settled owner: {reason}", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        if self.last_words is not None:
            self.last_words.close()


def _start_time(pid: int) -> int | None:
    from settled.boundary import procfs

    return procfs.start_time(pid)


def _storage_text(exc: OSError, home: str) -> str:
    from settled.home import storage_error

    return str(storage_error(exc, home, "reserving the owner's last words") or exc)


def main(argv: list[str] | None = None) -> int:
    """argv: SESSION READY_FD ORDERS_FD; the home comes in SETTLED_OWNER_HOME, so that it is
    not on the command line, which /proc shows to everyone (a PID namespace's init is a fork
    of this process). Forks once so the launcher can reap the parent at once."""
    session, ready_text, orders_text = (argv if argv is not None else sys.argv[1:])[:3]
    home = os.environ.pop(OWNER_HOME_ENV)
    if os.fork() != 0:
        os._exit(0)
    return run_session(home, session, int(ready_text), int(orders_text))


def run_session(home: str, session: str, ready_fd: int | None, orders_fd: int) -> int:
    """The owner of `session`, once detached. Its first report is its pid, which the launcher
    claims the session for before it sends the orders."""
    os.chdir("/")
    signals = OwnerSignals()  # before the claim: a TERM from now on is a cancel, not a death
    ready = Ready(ready_fd)
    ready.say(owner_pid=os.getpid(), at=time.time())
    launching: Launching | None = None
    try:
        given = read_orders(orders_fd)
        if given is None:
            return 0  # no claim was made for this process: nothing ran, nothing to say
        if given["session"] != session:
            raise ValueError(f"orders for session {given['session']}, not {session}")
        launching = Launching(home, given, signals, ready)
        return launching.run()
    except BaseException as exc:
        ready.send(error=f"owner failed: {exc!r}")
        if launching is not None and not isinstance(exc, SystemExit | KeyboardInterrupt):
            launching.say_last_words(f"the owner failed: {exc!r}")
        raise
    finally:
        if launching is not None:
            launching.close()


if __name__ == "__main__":
    sys.exit(main())
