"""A launch that fails before any owner is claimed for its session: the launcher settles the
session at once as never started (recovery.settle_unlaunched), instead of leaving it admitted
until the launch timeout turns it unknown and freezes its task until `settled recover`.

Only a launcher claims, and an owner runs nothing without the orders sent after the claim: a
session still admitted never ran. A claimed one is its owner's, and, lost, recovery's."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import _skip_unavailable

from settled.errors import OwnerLaunchFailed
from settled.owner.home_launcher import LauncherUnavailable
from settled.records import TaskRecord
from settled.runtime import Runtime

COMMAND = "echo x >> ran; printf out"  # `ran` in the workspace: whether it ever ran


def _never_started_by_its_launcher(receipt: dict[str, object], error: str) -> None:
    exit_fact, death, owner = receipt["exit"], receipt["death"], receipt["owner"]
    assert isinstance(exit_fact, dict) and isinstance(death, dict) and isinstance(owner, dict)
    assert exit_fact["reason"] == "not_started" and exit_fact["stage"] == "launch", exit_fact
    assert error in exit_fact["error"], exit_fact
    assert death["proven"] is True and death["source"] == "launcher", death
    assert death["observed"] == {"claimed": False}, death
    assert owner["role"] == "launcher" and owner["pid"] == os.getpid(), owner
    output = receipt["output"]
    assert isinstance(output, dict)
    assert output["stdout"]["cursor"] == 0 and output["drain"] == "complete", output


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ("warm", "home"))
def test_an_owner_dead_before_it_said_its_pid_leaves_its_session_never_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launcher: str
) -> None:
    """A zygote's owner says its pid before the launcher claims: dead before that, nothing was
    claimed, so the session is settled at once, and the task goes on (not frozen)."""
    _skip_unavailable("cgroup2")
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    with Runtime(str(tmp_path / "home"), launcher=launcher) as rt:
        task = rt.new_task(str(workspace))
        first = rt.exec(task.task, shell="true", key="warm-up")  # the zygote starts unarmed
        rt.wait(first.session, timeout=30)
        monkeypatch.setenv("SETTLED_FAULT", "owner.before_ready:crash")
        admission = rt.exec(task.task, shell=COMMAND, key="k")
        monkeypatch.delenv("SETTLED_FAULT")
        assert admission.state == "settled", admission
        view = rt.wait(admission.session, timeout=5)
        _never_started_by_its_launcher(view["receipt"], "exited before it reported")
        again = rt.exec(task.task, shell=COMMAND, key="k")
        assert again.reused and again.session == admission.session, "a retry never relaunches"
        later = rt.exec(task.task, shell="printf y", key="later")
        assert rt.wait(later.session, timeout=30)["receipt"]["exit"]["code"] == 0
        assert not (workspace / "ran").exists(), "the command never ran"
        result = rt.close_task(task.task, deadline=10)
        assert result.complete, result.blocked_on


@pytest.mark.timeout(60)
def test_a_launcher_that_raises_before_a_claim_leaves_its_session_never_started(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller is told the launcher's error, and the session it admitted is settled."""

    def unavailable(session: str) -> dict[str, object]:
        raise LauncherUnavailable(f"no zygote answers for {session}")

    monkeypatch.setattr(rt, "_launch", unavailable)
    with pytest.raises(LauncherUnavailable):
        rt.exec(task.task, shell=COMMAND, key="k")
    record = rt.store.find_session(task.task, "k")
    assert record is not None and record.state == "settled" and record.receipt is not None
    _never_started_by_its_launcher(record.receipt, "LauncherUnavailable: no zygote answers")
    monkeypatch.undo()
    later = rt.exec(task.task, shell="printf y", key="later")
    assert rt.wait(later.session, timeout=30)["receipt"]["exit"]["code"] == 0
    assert not Path(task.workspace, "ran").exists()


@pytest.mark.timeout(120)
def test_a_fresh_owner_is_claimed_before_it_says_its_pid_so_recovery_settles_it(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh owner is claimed while its interpreter starts: dead before it reports, its
    session is claimed, so not the launcher's to settle; recovery's receipt ends it."""
    _skip_unavailable("cgroup2")
    monkeypatch.setenv("SETTLED_FAULT", "owner.before_ready:crash")
    with pytest.raises(OwnerLaunchFailed):
        rt.exec(task.task, shell=COMMAND, key="k")
    monkeypatch.delenv("SETTLED_FAULT")
    record = rt.store.find_session(task.task, "k")
    assert record is not None and record.owner is not None and record.receipt is None, record
    give_up = time.monotonic() + 30
    while not (recovered := rt.recover(task.task)) and time.monotonic() < give_up:
        time.sleep(0.05)  # until the dead owner is seen gone (reaped by its launcher)
    assert [r["state"] for r in recovered] == ["settled"], recovered
    receipt = rt.store.get_session(record.session).receipt
    assert receipt is not None and receipt["owner"]["role"] == "recovery", receipt
    # the claim recorded the boundary and the orders followed it: recovery cannot tell whether
    # the command started, so it says the exit was lost with the owner (it never ran here)
    assert receipt["exit"]["reason"] == "owner_lost", receipt["exit"]
    assert receipt["death"]["proven"] is True, receipt["death"]
    assert not Path(task.workspace, "ran").exists()


@pytest.mark.timeout(60)
def test_a_claimed_session_is_never_the_launchers_to_settle(rt: Runtime, task: TaskRecord) -> None:
    _skip_unavailable("cgroup2")
    admission = rt.exec(task.task, shell="sleep 300", key="k")
    assert rt.recovery.settle_unlaunched(admission.session, "a late error") is False
    assert rt.store.get_session(admission.session).state == "running"
    rt.cancel(admission.session, "test")
    assert rt.wait(admission.session, timeout=30)["receipt"]["exit"]["reason"] == "cancelled"
