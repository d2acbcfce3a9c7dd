"""Owners looked at many at once (recovery at every admission): the held pidfds answer exactly
what a read of /proc answers, for live, exited, zombie, reused and other-boot owners."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from settled.boundary import procfs
from settled.owner.liveness import HELD, HostedOwners, LocalOwners
from settled.owner.local_beat import LocalBeat
from settled.records import OwnerInfo


def _owner_of(pid: int, *, lease_s: float = 60.0, boot: str | None = None) -> OwnerInfo:
    start = procfs.start_time(pid)
    assert start is not None
    return OwnerInfo(pid, start, boot or procfs.boot_id(), time.time() + lease_s)


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "300"])


@pytest.fixture
def sleepers() -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """Start sleepers; every one is killed and reaped when the test ends."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        started.append(_sleeper())
        return started[-1]

    yield start
    for process in started:
        process.kill()
        process.wait()


def _same(owners: list[OwnerInfo], liveness: LocalOwners) -> list[bool]:
    """facts_many's answers, checked equal to facts' one by one."""
    many = liveness.facts_many(owners)
    one = [liveness.facts(owner) for owner in owners]
    assert [(f.alive, f.process_alive, f.lease_fresh) for f in many] == [
        (f.alive, f.process_alive, f.lease_fresh) for f in one
    ]
    return [f.alive for f in many]


def test_a_held_owner_that_exits_reads_dead_at_the_next_look_zombie_or_reaped() -> None:
    first, second = _sleeper(), _sleeper()
    try:
        owners = [_owner_of(first.pid), _owner_of(second.pid)]
        assert _same(owners, LocalOwners()) == [True, True]
        assert (first.pid, owners[0].start_time) in HELD._fds  # held for the next look
        first.send_signal(signal.SIGKILL)
        while procfs.state_of(first.pid) != "Z":  # exited, not reaped: a zombie
            time.sleep(0.01)
        assert _same(owners, LocalOwners()) == [False, True]
        assert (first.pid, owners[0].start_time) not in HELD._fds  # closed once readable
        first.wait()  # reaped: the pid is free for another process
        assert _same(owners, LocalOwners()) == [False, True]
    finally:
        for process in (first, second):
            process.kill()
            process.wait()
    assert _same(owners, LocalOwners()) == [False, False]
    assert (second.pid, owners[1].start_time) not in HELD._fds


def test_an_owner_whose_start_time_differs_is_gone_and_never_held(
    sleepers: Callable[[], subprocess.Popen[bytes]],
) -> None:
    process = sleepers()
    real = _owner_of(process.pid)
    reused = OwnerInfo(real.pid, real.start_time - 1, real.boot_id, real.lease_until)
    assert _same([reused], LocalOwners()) == [False]
    assert (reused.pid, reused.start_time) not in HELD._fds
    assert _same([real, reused], LocalOwners()) == [True, False]  # held or not, the same


def test_a_stale_lease_another_boot_and_another_host_answer_as_one_by_one(
    sleepers: Callable[[], subprocess.Popen[bytes]],
) -> None:
    process = sleepers()
    stale = _owner_of(process.pid, lease_s=-5.0)
    other_boot = _owner_of(process.pid, boot="another-boot")
    assert _same([stale, other_boot], LocalOwners()) == [False, False]
    elsewhere = OwnerInfo(1, 1, "b", time.time() + 60, host="other")
    here = OwnerInfo(process.pid, stale.start_time, stale.boot_id, time.time() + 60, "me")
    hosted = HostedOwners("me")
    assert _same([elsewhere, here, stale], hosted) == [True, True, False]


def test_a_forked_child_holds_no_owner_pidfd(
    sleepers: Callable[[], subprocess.Popen[bytes]],
) -> None:
    process = sleepers()
    owner = _owner_of(process.pid)
    assert _same([owner], LocalOwners()) == [True]
    fd = HELD._fds[(owner.pid, owner.start_time)]
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.fstat(fd)
            os.write(write, b"open" if HELD._fds else b"kept")
        except OSError:
            os.write(write, b"closed" if not HELD._fds else b"kept")
        os._exit(0)
    os.close(write)
    assert os.read(read, 16) == b"closed"
    os.close(read)
    os.waitpid(child, 0)
    os.fstat(fd)  # the parent's own is still open


def test_past_its_share_of_descriptors_an_owner_is_looked_at_in_proc_and_not_held(
    monkeypatch: pytest.MonkeyPatch, sleepers: Callable[[], subprocess.Popen[bytes]]
) -> None:
    """Pidfds only save reads of /proc: past the process's share of descriptors none is kept,
    and every owner is answered all the same."""
    from settled.owner import liveness

    processes = [sleepers() for _ in range(3)]
    monkeypatch.setattr(liveness, "HELD", liveness._HeldOwners())
    monkeypatch.setattr(liveness, "_held_limit", lambda: 1)
    owners = [_owner_of(p.pid) for p in processes]
    assert _same(owners, LocalOwners()) == [True, True, True]
    assert len(liveness.HELD._fds) == 1
    processes[2].kill()
    processes[2].wait()
    assert _same(owners, LocalOwners()) == [True, True, False]


def test_a_lapsed_lease_with_a_fresh_local_beat_is_alive_on_its_own_host(tmp_path: Path) -> None:
    """The store was out, not the owner: its process and its loop's last request (local_beat.py)
    say alive on its host; a stale beat, a beat that is gone or another host's look do not."""
    home = str(tmp_path)
    lapsed = _owner_of(os.getpid(), lease_s=-5.0)  # this process stands for the owner
    beat = LocalBeat(home, lease_s=2.0)
    assert LocalOwners(home).facts(lapsed).alive is False  # no beat yet: the lease alone
    beat(time.time())
    facts = LocalOwners(home).facts(lapsed)
    assert (facts.alive, facts.lease_fresh, facts.process_alive) == (True, False, True)
    assert _same([lapsed], LocalOwners(home)) == [True]
    assert LocalOwners().facts(lapsed).alive is False  # no home given: the lease alone
    elsewhere = OwnerInfo(lapsed.pid, lapsed.start_time, lapsed.boot_id, lapsed.lease_until, "a")
    assert HostedOwners("b", home).facts(elsewhere).alive is False  # another host's: lease
    assert HostedOwners("a", home).facts(elsewhere).alive is True
    beat(time.time() - 2.5)  # the loop last asked longer ago than its lease: stuck or stopped
    assert LocalOwners(home).facts(lapsed).alive is False
    beat(time.time())
    other_boot = OwnerInfo(lapsed.pid, lapsed.start_time, "another-boot", lapsed.lease_until)
    assert LocalOwners(home).facts(other_boot).alive is False
    beat.close()  # the owner ended: its beat is gone
    assert LocalOwners(home).facts(lapsed).alive is False
