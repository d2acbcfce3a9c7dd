"""The owner's launch path after it said its pid: from its orders to its command running inside
the boundary.

Imported by main.py right after the owner reported its pid, so these imports (the boundary
package, ctypes where it clones or isolates) and the work that needs no orders (the output
pipes, the clone3 probe, libc) happen while the launcher makes the claim: the owner is ready to
start the command the moment its orders arrive. With them: reserve the last words, set up the
boundary, create its logs, start the command inside it (clone3 straight into its cgroup and
PID namespace where the kernel can), report that it runs, then load the rest of the owner
(session.py) while its first drain (early.py) reads both pipes in order.

Imports only the standard library's os, sys, time and errno, and settled's boundary
package: no json, typing, dataclasses, signal, sqlite3 or store. Must never: start the command
anywhere but inside its boundary, or before its orders (which follow a successful claim).
"""

from __future__ import annotations

import os
import sys
import time

from settled import boundary as boundaries
from settled import faults, nothreads
from settled.boundary import procfs
from settled.boundary.isolation import IsolationPlan
from settled.boundary.spawn import ChildIO, Launch, SpawnFailed, sealed_stdin, spawn_via
from settled.owner.ahead import Ahead as Ahead  # the launch path's, re-exported
from settled.owner.last_words import LastWords

TYPE_CHECKING = False
if TYPE_CHECKING:
    from contextlib import AbstractContextManager
    from typing import Any

    from settled.boundary.base import Boundary
    from settled.boundary.placer import Placer
    from settled.boundary.walls import Walls
    from settled.log.flush import Flusher
    from settled.owner.early import EarlyDrain
    from settled.owner.lease import LeaseKeeper, Renew
    from settled.owner.main import Ready
    from settled.owner.session import OwnerSession
    from settled.owner.signals import OwnerSignals
    from settled.records import SessionRecord
    from settled.store import Store

# log/writer.py's and log/interleave.py's own flags: the writers adopt what is created here
LOG_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
SPLICE_LOG_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC  # read back to hash
INDEX_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
# "1": splice where the log is out of the command's reach. Off by default: measured slower than
# read + write here (bench/drain.py: the digest must read the bytes back, so no copy is saved).
LOG_SPLICE_ENV = "SETTLED_LOG_SPLICE"


def log_out_of_reach(plan: IsolationPlan | None, sandbox: object, kind: str | None) -> bool:
    """Whether nothing but this owner can write the session's logs while it drains: the
    command's mount namespace hides the home and its PID namespace (with its own /proc) hides
    this process and its descriptors. Only then may a log splice and hash its bytes back from
    the file (log/writer.py); otherwise it hashes what it writes."""
    return (
        plan is not None
        and sandbox is None
        and plan.mount_namespace
        and plan.home_hidden
        and plan.private_proc
        and kind in boundaries.PID_NAMESPACE_KINDS
    )


def reserve_logs(paths: dict[str, str], splice: bool) -> dict[str, int]:
    """Create the session's logs and interleave index before its command runs (so they exist
    once exec returns, and a full disk refuses the command, not its output); the writers
    (session.py) adopt the descriptors. OSError (no space) to the caller, nothing left open."""
    fds: dict[str, int] = {}
    log_flags = SPLICE_LOG_FLAGS if splice else LOG_FLAGS
    try:
        for name in ("stdout", "stderr", "index"):
            flags = INDEX_FLAGS if name == "index" else log_flags
            fds[name] = os.open(paths[name], flags, 0o600)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


class Launching:
    """One owner from its orders to its running command; then it hands over to session.py."""

    def __init__(
        self,
        home: str,
        given: dict[str, Any],
        signals: OwnerSignals,
        ready: Ready,
        ahead: Ahead,
        store: Store | None = None,
        record: SessionRecord | None = None,
    ) -> None:
        """`store`: the home's, opened ahead (a zygote's spare); the session takes it over,
        with the session's `record` read from it while the launcher claimed."""
        self.home, self.orders, self.signals, self.ready = home, given, signals, ready
        self.ahead = ahead
        self.store, self.record = store, record
        self.timings: dict[str, float] = dict(given["timings"])
        self.plan = IsolationPlan(**given["plan"]) if given["plan"] is not None else None
        self.last_words: LastWords | None = None
        self.logs: dict[str, int] = {}  # created before the command, adopted by the session
        self.early: EarlyDrain | None = None
        self.session: OwnerSession | None = None
        self.lease: LeaseKeeper | None = None  # started here, before the command
        self.flusher: Flusher | None = None  # likewise
        self.walls: Walls | None = None  # the command's limits and their cgroups
        self._placer: Placer | None = None  # the placer handed the launch, until it ran
        self.splice = os.environ.get(LOG_SPLICE_ENV) == "1" and log_out_of_reach(
            self.plan, given["sandbox"], given["boundary"]
        )

    def run(self) -> int:
        given = self.orders
        faults.point("owner.after_claim")
        if given["never_ran"] is not None:
            return self._never_ran(*given["never_ran"])
        if self.ahead.placer is not None and not given["cancel"]:
            # first: its clone builds the command's view (and waits at its gate) while this
            # owner makes the boundary and starts its threads; a launch that ends before the
            # gate opens closes it, and the clone exits having run nothing
            plan = self.plan or IsolationPlan("none", no_new_privs=False)
            kind, task, session = given["boundary"], given["task"], given["session"]
            child, cgroup = boundaries.placement(kind, task, session, given["hierarchy"])
            self.timings["placed_at"] = time.time()
            self.ahead.placer.prepare(child, cgroup, given, plan.fields())
        boundary = boundaries.make(
            given["boundary"], given["task"], given["session"], self.plan, given["hierarchy"]
        )
        cancel = given["cancel"] or self.signals.stop_reason
        if cancel:
            boundary.discard()
            return self._never_ran("cancelled", "admission", cancel, planned=False)
        try:  # before anything runs: a place to say why, should the receipt not fit later
            self.last_words = LastWords(given["last_words"])
            self.logs = reserve_logs(given["logs"], self.splice)
        except OSError as exc:
            boundary.discard()
            why = _storage_text(exc, self.home)
            return self._never_ran("not_started", "space", why, planned=False)
        # Every thread this owner will have, before its command exists (settled.nothreads):
        # a fork storm may leave the host no task to give a thread started later.
        self._start_lease()
        self._start_early_drain()
        try:
            boundary.setup()
        except Exception as exc:  # the error module loads only if it is one of its errors
            from settled.errors import BoundaryUnavailable

            if not isinstance(exc, BoundaryUnavailable):
                raise
            boundary.discard()
            return self._never_ran("not_started", "boundary", str(exc))
        faults.point("owner.after_boundary")
        return self._start(boundary)

    def _start_lease(self) -> None:
        """The lease keeper's and the log flusher's threads, started before the boundary (a
        process that unshared a PID namespace for its children, the fork path's, may start
        none after) and the command: the keeper connects (through the session, loaded once the
        command runs) only at the loop's first request, and the flusher idles until the
        session attaches the logs."""
        from settled.log.flush import FLUSH_ENV, Flusher, flush_every
        from settled.owner.lease import (
            HEARTBEATS_PER_LEASE,
            STALE_BEATS,
            LeaseKeeper,
            lease_seconds,
        )

        stale_after = STALE_BEATS * lease_seconds() / HEARTBEATS_PER_LEASE
        self.lease = LeaseKeeper(self._renewals, stale_after=stale_after)
        self.lease.start()
        self.flusher = Flusher(flush_every(os.environ.get(FLUSH_ENV)))  # idle until attached
        self.flusher.start()

    def _renewals(self) -> AbstractContextManager[Renew]:
        """In the keeper's thread, at the loop's first request: the session runs the loop."""
        assert self.session is not None
        return self.session.renewals()

    def _start(self, boundary: Boundary) -> int:
        given = self.orders
        pipes, self.ahead.pipes = self.ahead.pipes, {}
        placer, self.ahead.placer = self.ahead.placer, None
        if given["stdin"] and placer is None:  # a placer seals its own copy, prepared
            stdin_fd = sealed_stdin(given["stdin"])
        else:
            stdin_fd, self.ahead.devnull = self.ahead.devnull, -1
        out_w, err_w = pipes.pop("stdout_w"), pipes.pop("stderr_w")
        launch = Launch(given["argv"], given["cwd"], given["env"], ChildIO(stdin_fd, out_w, err_w))
        if self.plan is not None:
            launch.isolation = self.plan
        via = spawn_via(boundary.birth_cgroup(), boundary.kind in boundaries.PID_NAMESPACE_KINDS)
        started = time.monotonic()
        self.timings["spawned_at"] = time.time()  # the wall-clock twin of `started`
        try:
            via = self._place(boundary, launch, via, placer)
            nothreads.refuse("the owner's command runs")  # every thread has started
            pid = boundary.start(launch)
        except SpawnFailed as exc:
            for fd in (stdin_fd, out_w, err_w):
                os.close(fd)
            boundary.await_empty(5.0)
            boundary.teardown()
            self._remove_walls()
            return self._never_ran("not_started", exc.stage, str(exc), pipes)
        # clone or fork, boundary, isolated view, privileges and exec, until exec succeeded
        self.timings["spawn_s"] = round(time.monotonic() - started, 6)
        for fd in (stdin_fd, out_w, err_w):
            os.close(fd)
        start_time = procfs.start_time(pid)
        # the pipe stays open until the receipt is written (receipt_wake.py)
        self.ready.say(
            state="running", owner_pid=os.getpid(), pid=pid, boundary=boundary.kind,
            ref=boundary.ref, start=start_time, spawn=via,
        )  # fmt: skip
        self.early_quicken()
        if self._placer is not None:
            self._placer.close(wait=False)  # it exits once it replied: reaped here or later
        faults.point("owner.after_spawn")
        session = self._open_session()
        assert self.early is not None
        logs, self.logs = self.logs, {}
        walls = self._walls(boundary)
        return session.supervise(
            boundary, pipes, logs, self.early, started, pid, start_time, via, walls
        )

    def _place(self, boundary: Boundary, launch: Launch, via: str, placer: Placer | None) -> str:
        """How the command's first process will start inside its limits' cgroups: through the
        placer, which joined the v1 ones ahead and was prepared (`clone3`), or, on the fork
        path, by a child that joins the cgroups made here itself (paying their migration on
        the launch path). SpawnFailed (stage `limits`) when neither can be."""
        if placer is not None:
            launch.placer = placer
            self._placer = placer
            return "clone3"
        if self.ahead.placer_failed is not None:
            raise SpawnFailed("limits", 11, self.ahead.placer_failed)  # EAGAIN
        walls = self._walls(boundary)
        try:
            launch.join = walls.make_for_fork()
        except OSError as exc:
            raise SpawnFailed("limits", exc.errno or 5, str(exc)) from None
        return via

    def _walls(self, boundary: Boundary) -> Walls:
        if self.walls is None:
            from settled.boundary.limits import owner_dir, v1_paths
            from settled.boundary.walls import Walls

            placer = self._placer
            v1 = (
                placer.made  # as the placer made them, with the owner's cgroup at its fork
                if placer is not None
                else v1_paths(owner_dir(os.getpid(), procfs.start_time(os.getpid())))
            )
            v2 = boundary.birth_cgroup() if boundary.hierarchy is not None else None
            self.walls = Walls.from_orders(self.orders, v1, v2)
        return self.walls

    def _remove_walls(self) -> None:
        """A command that never started: its placer is reaped, its v1 cgroups removed."""
        placer, self._placer = self._placer, None
        if placer is not None:
            placer.remove()
        elif self.walls is not None:
            self.walls.remove()

    def early_quicken(self) -> None:
        """The command runs: the first drain's thread now takes the GIL sooner (early.py)."""
        if self.early is not None:
            self.early.quicken()

    def _start_early_drain(self) -> None:
        """Read both pipes in order from the command's start until the session's drain takes
        over: started before the command, with every other thread of this owner."""
        from settled.owner.early import EarlyDrain

        pipes = {name: self.ahead.pipes[name] for name in ("stdout", "stderr")}
        cap = os.environ.get("SETTLED_LOG_CAP")  # session.LOG_CAP_ENV, read without loading it
        logs = {name: self.logs[name] for name in pipes}
        self.early = EarlyDrain(pipes, logs, int(cap) if cap else None)

    def _open_session(self) -> OwnerSession:
        """The rest of the owner (store, logs, lease, supervision, receipt): imported here."""
        if self.session is None:
            from settled.owner.session import OwnerSession

            store, self.store = self.store, None
            self.session = OwnerSession(
                self.home,
                self.orders,
                self.ready,
                self.signals,
                self.timings,
                self.last_words,
                self.lease,
                self.flusher,
                splice=self.splice,
                store=store,
                record=self.record,
                oom=self.ahead.oom,
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
        if self.early is not None:
            self.early.handover()  # nothing of a command that never started
        logs, self.logs = self.logs, {}
        session = self._open_session()
        return session.never_ran(reason, stage, error, pipes, planned=planned, logs=logs)

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
        if self.early is not None:
            self.early.handover()  # a session that failed: the thread ends before the owner
        for fd in self.logs.values():
            os.close(fd)
        self.logs = {}
        self.ahead.close()
        if self._placer is not None:
            self._placer.close()  # reaped at last, if it was still exiting after the launch
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.session is not None:
            self.session.close()
        else:
            for thread in (self.lease, self.flusher):
                if thread is not None:
                    thread.close()
        if self.last_words is not None:
            self.last_words.close()


def _storage_text(exc: OSError, home: str) -> str:
    from settled.home import storage_error

    return str(storage_error(exc, home, "reserving the owner's last words") or exc)
