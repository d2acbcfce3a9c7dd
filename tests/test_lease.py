"""The owner's lease is renewed off the drain path, and still only while the supervise loop lives.

The supervise loop runs in-process here, around a real child in its own process group, with a
fake renewal whose speed and answers the test controls; one test runs a real owner against a store
whose write lock the test holds. Every child is killed and every lease thread joined before the
test ends.
"""

from __future__ import annotations

import contextlib
import os
import select
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from settled.boundary.pgroup import PgroupBoundary
from settled.errors import StaleWrite
from settled.log.writer import StreamWriter
from settled.owner.lease import LeaseKeeper, Renew
from settled.owner.supervise import Outcome, Streams, Supervisor
from settled.records import TaskRecord
from settled.runtime import Runtime

BEAT_S = 0.05
MIB = 1 << 20


class ChildBoundary(PgroupBoundary):
    """A process group around a child spawned without fork_exec: enough for the loop."""

    def spawn(self, argv: list[str], stdout_w: int, stderr_w: int) -> None:
        self.main_pid = os.posix_spawn(
            argv[0],
            argv,
            dict(os.environ),
            file_actions=[
                (os.POSIX_SPAWN_DUP2, stdout_w, 1),
                (os.POSIX_SPAWN_DUP2, stderr_w, 2),
            ],
            setpgroup=0,
        )
        self._pidfd = os.pidfd_open(self.main_pid)

    def end(self) -> None:
        """Whatever the test did: the child is killed and reaped."""
        if self.main_pid is not None:
            self.kill_all()
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.main_pid, 0)
        self.teardown()


class QuietSignals:
    """The loop's signal wake-up pipe, without installing handlers in the test process."""

    def __init__(self) -> None:
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.stop_reason: str | None = None

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.wake_r, 4096)

    def close(self) -> None:
        os.close(self.wake_r)
        os.close(self.wake_w)


class Renewals:
    """A renewal the test steers: each call is recorded; `hold` blocks it; `answer` is returned
    (or raised, if it is an exception)."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float]] = []  # (monotonic when called, alive_at)
        self.released = threading.Event()
        self.released.set()
        self.answer: str | BaseException | None = None
        self.thread_ids: set[int] = set()

    @contextlib.contextmanager
    def connect(self) -> Iterator[Renew]:
        self.thread_ids.add(threading.get_ident())
        yield self.renew

    def renew(self, alive_at: float) -> str | None:
        self.calls.append((time.monotonic(), alive_at))
        self.released.wait(30)
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """rig(argv, settling=...) -> (supervisor, boundary, streams); all of it ends with the test."""
    made: list[tuple[ChildBoundary, Streams, QuietSignals, LeaseKeeper]] = []

    def make(
        argv: list[str],
        settling: Callable[[], None] = lambda: None,
        soon: Callable[[LeaseKeeper, Streams], None] | None = None,
    ) -> Any:
        """`soon`: the loop's `soon` work, given the keeper (not started: it must start it)."""
        renewals = Renewals()
        fds: dict[str, int] = {}
        for name in ("stdout", "stderr"):
            fds[name], write_end = os.pipe2(os.O_CLOEXEC)
            fds[f"{name}_w"] = write_end
        writers = {n: StreamWriter(str(tmp_path / f"{n}.log")) for n in ("stdout", "stderr")}
        boundary = ChildBoundary("t_test", "s_test")
        boundary.spawn(argv, fds["stdout_w"], fds["stderr_w"])
        os.close(fds.pop("stdout_w"))
        os.close(fds.pop("stderr_w"))
        streams, signals = Streams(fds, writers), QuietSignals()
        lease = LeaseKeeper(renewals.connect, stale_after=2 * BEAT_S)
        if soon is None:
            lease.start()  # as an owner whose threads come first does, before its boundary
        made.append((boundary, streams, signals, lease))
        supervisor = Supervisor(
            boundary,
            streams,
            timeout=None,
            grace=0.2,
            lease=lease,
            heartbeat_every=BEAT_S,
            signals=signals,  # type: ignore[arg-type]
            settling=settling,
            soon=None if soon is None else lambda: soon(lease, streams),
        )
        return supervisor, boundary, streams, renewals

    yield make
    for boundary, streams, signals, lease in made:
        lease.close()
        boundary.end()
        for writer in streams.writers.values():
            writer.close()
        for fd in streams.fds.values():
            os.close(fd)
        signals.close()
    assert not [t for t in threading.enumerate() if t.name == "settled-lease"]


def _supervise_in_background(supervisor: Supervisor) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["outcome"] = supervisor.run(time.monotonic())
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def _until(predicate: Callable[[], bool], timeout: float) -> bool:
    give_up = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > give_up:
            return False
        time.sleep(0.005)
    return True


@pytest.mark.timeout(30)
def test_the_drain_goes_on_while_a_renewal_is_blocked(rig: Callable[..., Any]) -> None:
    supervisor, _, streams, renewals = rig(
        ["/bin/sh", "-c", "sleep 0.3; head -c 16777216 /dev/zero; exec sleep 30"]
    )
    renewals.released.clear()  # the store hangs from the first renewal on
    thread, result = _supervise_in_background(supervisor)
    try:
        assert _until(lambda: len(renewals.calls) == 1, 5.0), "no renewal was asked for"
        writer = streams.writers["stdout"]
        assert _until(lambda: writer.cursor == 16 * MIB, 10.0), (
            f"the drain stopped at {writer.cursor} bytes while a renewal was blocked"
        )
        assert len(renewals.calls) == 1  # the blocked one; later requests wait behind it
    finally:
        renewals.answer = "test over"
        renewals.released.set()
        thread.join(15)
    assert not thread.is_alive()
    outcome: Outcome = result["outcome"]
    assert outcome.reason == "cancelled" and outcome.evidence is not None


@pytest.mark.timeout(30)
def test_a_stuck_loop_is_not_renewed(rig: Callable[..., Any]) -> None:
    stuck: dict[str, float] = {}

    def settling() -> None:  # the loop is stuck here, its lease thread is free
        stuck["from"] = time.monotonic()
        time.sleep(20 * BEAT_S)
        stuck["to"] = time.monotonic()

    # a straggler outlives the main process, so the loop records settling (a command that
    # leaves nothing to stop settles in one step, without it)
    supervisor, _, _, renewals = rig(["/bin/sh", "-c", "sleep 30 & sleep 0.5"], settling=settling)
    thread, result = _supervise_in_background(supervisor)
    thread.join(15)
    assert not thread.is_alive() and "outcome" in result, result
    assert len([c for c in renewals.calls if c[0] < stuck["from"]]) >= 5  # a live loop renews
    during = [c for c in renewals.calls if stuck["from"] + BEAT_S < c[0] < stuck["to"]]
    assert during == [], "renewed while the supervise loop was stuck"
    last_alive = max(alive_at for called, alive_at in renewals.calls if called < stuck["to"])
    wall_stuck = time.time() - (time.monotonic() - stuck["from"])
    assert last_alive <= wall_stuck + 0.01, "a lease ran from a moment the loop was not alive"


@pytest.mark.timeout(30)
def test_a_refused_renewal_leaves_the_loop_at_once(rig: Callable[..., Any]) -> None:
    supervisor, boundary, _, renewals = rig(["/bin/sh", "-c", "exec sleep 30"])
    renewals.answer = StaleWrite("session s_test: fenced by recovery")
    started = time.monotonic()
    with pytest.raises(StaleWrite, match="fenced by recovery"):
        supervisor.run(started)
    assert time.monotonic() - started < 1.0
    assert boundary.members(), "a fenced owner touches nothing: the boundary is recovery's"


@pytest.mark.timeout(30)
def test_a_crash_in_the_lease_thread_surfaces_from_the_loop(rig: Callable[..., Any]) -> None:
    supervisor, _, _, renewals = rig(["/bin/sh", "-c", "exec sleep 30"])
    renewals.answer = RuntimeError("disk on fire")
    with pytest.raises(RuntimeError, match="disk on fire"):
        supervisor.run(time.monotonic())
    assert renewals.thread_ids and threading.get_ident() not in renewals.thread_ids


@pytest.mark.timeout(30)
def test_a_cancel_reason_from_a_renewal_stops_the_command(rig: Callable[..., Any]) -> None:
    supervisor, _, _, renewals = rig(["/bin/sh", "-c", "exec sleep 30"])
    renewals.answer = "user asked"
    started = time.monotonic()
    outcome = supervisor.run(started)
    assert outcome.reason == "cancelled" and outcome.evidence is not None
    assert (outcome.stop_decided or 0) - started < 1.0


@pytest.mark.timeout(60)
def test_a_real_owner_drains_while_the_store_is_locked(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SETTLED_LEASE_S", "5.0")  # a heartbeat every second
    size = 32 * MIB
    admission = rt.exec(
        task.task,
        # 2 s: the owner's session loads meanwhile (~50 ms) and its supervise loop runs
        shell=f"printf go; sleep 2; head -c {size} /dev/zero; exec sleep 600",
        key="locked",
    )
    directory = Path(rt.home, "sessions", admission.session)
    log, index = directory / "stdout.log", directory / "interleave.idx"
    assert _until(lambda: log.exists() and log.stat().st_size == 2, 10.0), "nothing drained"
    # The first drain writes "go" before the session exists; the session's first heartbeat
    # syncs the index that records it: from then on the supervise loop drains.
    assert _until(lambda: index.exists() and index.stat().st_size > 0, 10.0), "no heartbeat"
    blocker = sqlite3.connect(os.path.join(rt.home, "settled.db"), isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")  # every store write waits, the owner's heartbeat too
        held = time.monotonic()
        drained = _until(lambda: log.stat().st_size == 2 + size, 3.0)
        blocked_for = time.monotonic() - held
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert drained, f"drained {log.stat().st_size - 2} of {size} bytes behind a locked store"
    assert blocked_for > 1.0  # so a heartbeat (one a second) was waiting on the lock meanwhile
    rt.cancel(admission.session, "test over")
    receipt = rt.wait(admission.session, timeout=30)["receipt"]
    assert receipt["output"]["stdout"]["cursor"] == 2 + size
    assert receipt["exit"]["reason"] == "cancelled"


def test_a_keeper_never_renews_unasked() -> None:
    renewals = Renewals()
    keeper = LeaseKeeper(renewals.connect, stale_after=1.0)
    keeper.start()
    try:
        time.sleep(0.2)
        assert renewals.calls == []
        keeper.request()
        assert _until(lambda: len(renewals.calls) == 1, 2.0)
    finally:
        keeper.close()
    assert keeper.collect() is None


def test_a_request_that_went_stale_behind_a_slow_renewal_is_dropped() -> None:
    renewals = Renewals()
    renewals.released.clear()
    keeper = LeaseKeeper(renewals.connect, stale_after=0.1)

    def renewed_once() -> bool:
        # asked again until one is renewed: a keeper thread starved past stale_after (0.1 s,
        # a loaded machine) rightly drops even the first request
        keeper.request()
        return len(renewals.calls) == 1

    keeper.start()
    try:
        assert _until(renewed_once, 2.0)
        keeper.request()  # and then the loop asks for nothing more
        time.sleep(0.3)
        renewals.released.set()
        time.sleep(0.2)
        assert len(renewals.calls) == 1, "a request 0.3 s old was renewed"
    finally:
        renewals.released.set()
        keeper.close()


class SoonWork:
    """The `soon` work of a test loop: when it ran, what was drained by then; starts the keeper
    as the owner's does."""

    def __init__(self) -> None:
        self.runs: list[tuple[float, int]] = []  # (monotonic, stdout bytes stored by then)
        self.keeper: LeaseKeeper | None = None

    def __call__(self, lease: LeaseKeeper, streams: Streams) -> None:
        self.runs.append((time.monotonic(), streams.writers["stdout"].cursor))
        self.keeper = lease
        lease.start()


@pytest.mark.timeout(30)
def test_a_command_gone_before_the_loop_looks_is_settled_without_the_soon_work(
    rig: Callable[..., Any],
) -> None:
    soon = SoonWork()
    supervisor, boundary, _, renewals = rig(["/bin/true"], soon=soon)
    ready, _, _ = select.select([boundary.exit_fd()], [], [], 10)  # it exited already
    assert ready
    outcome = supervisor.run(time.monotonic())
    assert outcome.wait_status == 0 and outcome.evidence is not None
    assert soon.runs == [] and renewals.calls == []  # no thread, no store read: the receipt next
    assert not [t for t in threading.enumerate() if t.name == "settled-lease"]


@pytest.mark.timeout(30)
def test_a_quiet_command_gets_the_soon_work_before_the_loop_waits_and_before_any_renewal(
    rig: Callable[..., Any],
) -> None:
    soon = SoonWork()
    supervisor, _, _, renewals = rig(["/bin/sh", "-c", "exec sleep 30"], soon=soon)
    renewals.answer = "test over"  # the first renewal cancels it
    started = time.monotonic()
    outcome = supervisor.run(started)
    assert outcome.reason == "cancelled"
    assert len(soon.runs) == 1 and soon.runs[0][0] - started < BEAT_S  # not at the first beat
    assert renewals.calls and renewals.calls[0][0] > soon.runs[0][0]


@pytest.mark.timeout(60)
def test_a_flooding_command_that_never_lets_the_loop_wait_gets_the_soon_work_early(
    rig: Callable[..., Any],
) -> None:
    soon = SoonWork()
    size = 64 * MIB
    supervisor, _, streams, _ = rig(["/bin/sh", "-c", f"exec head -c {size} /dev/zero"], soon=soon)
    outcome = supervisor.run(time.monotonic())
    assert outcome.evidence is not None and streams.writers["stdout"].cursor == size
    assert len(soon.runs) == 1
    assert soon.runs[0][1] < 8 * MIB  # within its first turns, not after the flood
