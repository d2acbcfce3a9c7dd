"""The close deadline is one scope: recorded with final_pending, kept by a resumed close, and
after it every late session is cancelled at once and all are waited for under one bound.

Real owners and commands; the times asserted are the close's own recorded facts, with margins
far wider than any machine's jitter (timing belongs in bench/): what is checked is structure,
one bound where serial waits would take three.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from settled.close.deadline import Deadline, close_deadline, seconds_left, settle_bound
from settled.records import TaskRecord
from settled.runtime import Runtime

SETTLED = [sys.executable, "-m", "settled.cli"]
WEDGED = "trap '' TERM; sleep 1000"  # ignores TERM: only its owner's KILL ends it


def _wait_until(check: object, timeout: float = 30.0) -> None:
    give_up = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.02)


@pytest.mark.timeout(120)
def test_three_wedged_sessions_are_cancelled_together_and_waited_for_under_one_bound(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three sessions whose owners are wedged (SIGSTOP: no cancel is acted on) never settle.
    The close cancels all three at the deadline and gives up on them after one bound, where
    waiting for each in turn would take three; they are left to recovery, as before."""
    from conftest import _skip_unavailable

    _skip_unavailable("cgroup2")
    monkeypatch.setattr("settled.close.join.CANCEL_SETTLE_S", 3.0)
    sessions = [
        rt.exec(task.task, shell=WEDGED, key=f"w{i}", grace=0.5, boundary="cgroup2").session
        for i in range(3)
    ]
    _wait_until(lambda: all(rt.store.get_session(s).state == "running" for s in sessions))
    owners = [rt.store.get_session(s).owner for s in sessions]
    pids = [owner.pid for owner in owners if owner is not None]
    assert len(pids) == 3
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        result = rt.close_task(task.task, deadline=0.3)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)  # wedged for good: recovery ends what they left
    assert not result.complete and result.blocked_on is not None
    assert result.blocked_on["authority"] == "session-owner"  # as before: blocked, named
    steps = rt.store.close_steps(task.task)
    pending, settled = steps["final_pending"], steps["sessions_settled"]
    assert sorted(settled["cancelled_at_deadline"]) == sorted(sessions)
    assert sorted(settled["unsettled"]) == sorted(sessions)
    bound = settled["settle_bound_s"]
    assert bound == 3.0 + 0.5
    assert settled["deadline"] == {
        "at": pending["deadline_at"], "s": 0.3, "source": "recorded"
    }  # fmt: skip
    assert pending["deadline_at"] <= settled["cancelled_at"] < pending["deadline_at"] + bound
    waited = settled["settled_at"] - settled["cancelled_at"]
    assert bound <= waited + 0.05, "each wedged session was given the whole bound"
    assert waited < 2 * bound, f"waited {waited:.1f} s: one bound, not 3 x {bound} s in turn"
    _wait_until(lambda: all(_owner_gone(rt, s) for s in sessions))
    # (each owner is found dead at some look: a killed one may still read alive at one)
    _wait_until(
        lambda: rt.recover(task.task) is not None and all(_settled(rt, s) for s in sessions)
    )
    for session in sessions:
        receipt = rt.store.get_session(session).receipt
        assert receipt is not None and receipt["death"]["proven"], receipt
    closed = rt.close_task(task.task)
    assert closed.complete, closed.blocked_on


def _settled(rt: Runtime, session: str) -> bool:
    return rt.store.get_session(session).state == "settled"


def _owner_gone(rt: Runtime, session: str) -> bool:
    facts = rt.owner_facts(rt.store.get_session(session))
    return facts is not None and not facts.alive


def _cli(home: Path, *args: str, fault: str | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "SETTLED_HOME": str(home)}
    if fault is not None:
        env["SETTLED_FAULT"] = f"{fault}:crash"
    return subprocess.run([*SETTLED, *args], capture_output=True, timeout=90, env=env)


def _close_interrupted_after_final_pending(home: Path, ws: Path, deadline: str) -> str:
    """A task with a stuck command whose close (given `deadline`) was killed right after it
    recorded final_pending; its id."""
    ws.mkdir()
    task = json.loads(_cli(home, "task", "new", "--workspace", str(ws), "--json").stdout)["task"]
    admitted = _cli(home, "exec", "--task", task, "--key", "stuck", "--grace", "0.5",
                    "--json", "--", "sleep 300")  # fmt: skip
    assert admitted.returncode == 0, admitted.stderr
    crashed = _cli(home, "close", task, "--deadline", deadline, "--json",
                   fault="close.after_final_pending")  # fmt: skip
    assert crashed.returncode == -9, crashed.stderr
    return str(task)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("resumed", ["before_the_deadline", "after_the_deadline"])
def test_a_resumed_close_keeps_the_deadline_its_first_attempt_recorded(
    tmp_path: Path, resumed: str
) -> None:
    """A close killed right after recording final_pending (its deadline 4 s) is resumed with
    a deadline of 600 s: it cancels the stuck command at the first deadline, or at once when
    that has passed, never 600 s later."""
    home = tmp_path / "home"
    task = _close_interrupted_after_final_pending(home, tmp_path / "ws", deadline="4")
    with Runtime(str(home)) as rt:
        pending = rt.store.close_steps(task)["final_pending"]
    assert pending["deadline_s"] == 4.0
    assert pending["deadline_at"] == pending["received_at"] + 4.0
    if resumed == "after_the_deadline":
        while time.time() < pending["deadline_at"] + 0.5:
            time.sleep(0.1)
    resumed_at = time.time()
    retried = _cli(home, "close", task, "--deadline", "600", "--json")
    assert retried.returncode == 0, retried.stderr
    receipt = json.loads(retried.stdout)
    assert receipt["outcome"]["complete"] is True
    [stuck] = receipt["outcome"]["commands"]["cancelled"]
    with Runtime(str(home)) as rt:
        steps = rt.store.close_steps(task)
    settled = steps["sessions_settled"]
    assert steps["final_pending"] == pending, "the first attempt's fact stands"
    assert settled["deadline"] == {"at": pending["deadline_at"], "s": 4.0, "source": "recorded"}
    assert settled["cancelled_at_deadline"] == [stuck.split()[0]]
    assert settled["cancelled_at"] >= pending["deadline_at"], "never before the deadline"
    # at the first deadline (or at once past it): 600 s would be far beyond this margin
    assert settled["cancelled_at"] < max(pending["deadline_at"], resumed_at) + 30


@pytest.mark.timeout(180)
def test_a_resumed_close_given_a_sooner_deadline_cancels_at_it(tmp_path: Path) -> None:
    """A close killed after recording a 300 s deadline, resumed with `--deadline 0` (a person
    cutting it short): the stuck command is cancelled now, not 300 s later."""
    home = tmp_path / "home"
    task = _close_interrupted_after_final_pending(home, tmp_path / "ws", deadline="300")
    resumed_at = time.time()
    retried = _cli(home, "close", task, "--deadline", "0", "--json")
    assert retried.returncode == 0, retried.stderr
    assert json.loads(retried.stdout)["outcome"]["complete"] is True
    with Runtime(str(home)) as rt:
        steps = rt.store.close_steps(task)
    settled = steps["sessions_settled"]
    assert steps["final_pending"]["deadline_s"] == 300.0, "the first attempt's fact stands"
    assert settled["deadline"]["source"] == "this close (sooner than the recorded one)"
    assert settled["deadline"]["s"] == 0.0
    assert settled["cancelled_at_deadline"] and settled["cancelled_at"] < resumed_at + 30


def test_a_final_pending_recorded_without_a_deadline_gets_a_fresh_one(
    rt: Runtime, task: TaskRecord
) -> None:
    """An older version's final_pending names no deadline: a close resuming it counts the
    deadline it is given from now, as every close did then, and says so in its fact."""
    stuck = rt.exec(task.task, shell="sleep 300", key="stuck", grace=0.5).session
    long_ago = time.time() - 1000.0
    rt.store.record_close_step(task.task, "final_pending", {"final": None, "received_at": long_ago})
    began = time.time()
    result = rt.close_task(task.task, deadline=0.5)
    assert result.complete and result.receipt is not None
    assert result.receipt["outcome"]["commands"]["cancelled"] == [f"{stuck} (stuck)"]
    settled = rt.store.close_steps(task.task)["sessions_settled"]
    assert settled["deadline"]["source"] == "this close (final_pending recorded none)"
    assert settled["deadline"]["s"] == 0.5 and settled["deadline"]["at"] >= began + 0.5
    assert settled["cancelled_at"] >= began + 0.5, "counted from this close, not the old fact"


NOW = 1_000_000.0


RECORDED = {"final": None, "received_at": NOW - 5, "deadline_s": 10.0, "deadline_at": NOW + 5}
OLDER = {"final": "x", "received_at": NOW - 900}  # an older version's fact


@pytest.mark.parametrize(
    ("pending", "given", "expected"),
    [
        (RECORDED, 600.0, Deadline(NOW + 5, 10.0, "recorded")),  # never later
        (RECORDED, None, Deadline(NOW + 5, 10.0, "recorded")),  # none named: the recorded
        (RECORDED, 5.0, Deadline(NOW + 5, 10.0, "recorded")),  # as soon: the recorded
        (RECORDED, 0.0, Deadline(NOW, 0.0, "this close (sooner than the recorded one)")),
        (RECORDED, 2.0, Deadline(NOW + 2, 2.0, "this close (sooner than the recorded one)")),
        (OLDER, 30.0, Deadline(NOW + 30, 30.0, "this close (final_pending recorded none)")),
        (OLDER, None, Deadline(NOW + 600, 600.0, "this close (final_pending recorded none)")),
        ({"final": None, "deadline_at": NOW + 1},  # half a deadline is none
         7.0, Deadline(NOW + 7, 7.0, "this close (final_pending recorded none)")),
    ],
)  # fmt: skip
def test_close_deadline_keeps_the_recorded_one_unless_asked_for_a_sooner_one(
    pending: dict[str, object], given: float | None, expected: Deadline
) -> None:
    assert close_deadline(pending, given, NOW, 600.0) == expected


@pytest.mark.parametrize(
    ("at", "seconds", "now", "left"),
    [
        (NOW + 5, 10.0, NOW, 5.0),  # within the deadline
        (NOW + 5, 10.0, NOW + 9, 0.0),  # passed: cancel at once
        (NOW + 5, 10.0, NOW - 3600, 10.0),  # the clock stepped back an hour: never > 10 s
        (NOW, 0.0, NOW, 0.0),
    ],
)
def test_seconds_left_stays_within_the_deadline_whatever_the_clock_did(
    at: float, seconds: float, now: float, left: float
) -> None:
    assert seconds_left(Deadline(at, seconds, "recorded"), now) == left


def test_settle_bound_is_the_longest_not_the_sum() -> None:
    assert settle_bound([0.5, 2.0, 1.0], 30.0) == 32.0
    assert settle_bound([], 30.0) == 0.0
