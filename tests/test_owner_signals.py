"""A signal sent to an owner (a cancel's USR1, a TERM) may be handed by the kernel to any of its
threads, and after a stop and a continue to whichever runs first: the thread that takes it goes
on waiting, and the owner acts on the signal all the same.

`os.eventfd_read` raises InterruptedError when a handled signal lands on the thread blocked in
it (it is not retried as `os.read` is); the lease keeper's thread died of that, and its owner
with it, leaving a cancelled session without a receipt (unknown, its command still running).
The kernel's choice of thread is forced here with tgkill(2); the last test is the host's case
as it happens: owners stopped while they are cancelled, then continued.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from settled.log.flush import Flusher
from settled.owner.lease import LeaseKeeper, Renew
from settled.records import TaskRecord
from settled.runtime import Runtime

_libc = ctypes.CDLL(None, use_errno=True)


def _tgkill(pid: int, tid: int, sig: int) -> None:
    if _libc.tgkill(pid, tid, sig) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid}, {sig})")


def _wait_until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    give_up = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.01)


def _threads(pid: int) -> set[int]:
    return {int(tid) for tid in os.listdir(f"/proc/{pid}/task")}


def _sleeping(pid: int, tid: int) -> bool:
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "S"


@contextlib.contextmanager
def _new_thread(start: Callable[[], None]) -> Iterator[int]:
    """The tid of the one thread `start` starts in this process, once it is blocked."""
    me = os.getpid()
    before = _threads(me)
    start()
    _wait_until(lambda: len(_threads(me) - before) == 1)
    [tid] = _threads(me) - before
    _wait_until(lambda: _sleeping(me, tid))
    yield tid


@pytest.fixture
def usr1_handled() -> Iterator[None]:
    """USR1 handled in this process, as in an owner (signals.py): a thread blocked in a read
    when it lands is interrupted (EINTR), not restarted."""
    previous = signal.signal(signal.SIGUSR1, lambda _signum, _frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("usr1_handled")
def test_the_lease_keeper_thread_goes_on_after_a_signal_lands_on_it() -> None:
    renewed: list[float] = []

    def renew(alive_at: float) -> str | None:
        renewed.append(alive_at)
        return None

    @contextlib.contextmanager
    def connect() -> Iterator[Renew]:
        yield renew

    keeper = LeaseKeeper(connect, stale_after=5.0)
    try:
        with _new_thread(keeper.start) as tid:
            _tgkill(os.getpid(), tid, signal.SIGUSR1)  # while it waits to be asked
        time.sleep(0.05)
        keeper.request()
        _wait_until(lambda: len(renewed) == 1, 5.0)
        assert keeper.collect() is None, "the signal is no failure of the renewal"
        assert keeper.confirm() is None and len(renewed) == 2
    finally:
        keeper.close()


class _Counted:
    def __init__(self) -> None:
        self.syncs = 0

    def sync(self) -> None:
        self.syncs += 1


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("usr1_handled")
def test_the_flusher_thread_goes_on_after_a_signal_lands_on_it() -> None:
    flusher, target = Flusher(1 << 20), _Counted()
    flusher.attach([target])
    try:
        with _new_thread(flusher.start) as tid:
            _tgkill(os.getpid(), tid, signal.SIGUSR1)
        time.sleep(0.05)
        flusher.poke()
        _wait_until(lambda: target.syncs == 1, 5.0)
    finally:
        flusher.close()


def _running_owner(rt: Runtime, session: str) -> int:
    _wait_until(lambda: rt.store.get_session(session).state == "running")
    owner = rt.store.get_session(session).owner
    assert owner is not None
    return owner.pid


def _assert_cancelled(rt: Runtime, session: str) -> None:
    view = rt.wait(session, timeout=30)
    assert view["state"] == "settled", view
    assert view["receipt"]["exit"]["reason"] == "cancelled", view["receipt"]["exit"]
    assert view["receipt"]["death"]["proven"]


@pytest.mark.timeout(60)
def test_an_owner_whose_threads_take_its_signals_still_settles_a_cancel(
    rt: Runtime, task: TaskRecord
) -> None:
    """USR1 handed to each of the owner's threads but its main one (where the kernel may
    deliver a signal sent to the process), then a cancel: a receipt, not a dead owner."""
    session = rt.exec(task.task, shell="sleep 300", key="usr1", grace=0.5).session
    pid = _running_owner(rt, session)
    helpers = _threads(pid) - {pid}
    assert helpers, "the owner's lease keeper and flusher are threads of its own"
    _wait_until(lambda: all(_sleeping(pid, tid) for tid in helpers))  # each blocked in a wait
    for tid in helpers:
        _tgkill(pid, tid, signal.SIGUSR1)
    time.sleep(0.2)  # a thread that died of it has failed its owner by now
    rt.cancel(session, "test over")
    _assert_cancelled(rt, session)


@pytest.mark.timeout(90)
def test_owners_stopped_while_cancelled_settle_once_continued(
    rt: Runtime, task: TaskRecord
) -> None:
    """The host stops three owners (a suspend, a freezer, a debugger); each is cancelled
    meanwhile, its wake-up USR1 pending; continued, each stops its command and settles."""
    sessions = [rt.exec(task.task, shell="sleep 300", key=f"s{i}", grace=0.5).session
                for i in range(3)]  # fmt: skip
    pids = [_running_owner(rt, session) for session in sessions]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        for session in sessions:
            rt.cancel(session, "cancelled while its owner was stopped")
        time.sleep(0.5)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    for session in sessions:
        _assert_cancelled(rt, session)
