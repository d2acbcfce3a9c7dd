"""The four clocks (`Runtime.clocks`, settled.clocks) over real sessions: each clock says when it
settled and which receipt settled it, and says "not yet" or "unknown" until a receipt proves it.

Every session here is a real command under a real boundary; the `rt` fixture settles whatever a
test leaves live, and conftest kills anything carrying the test's marker.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import _skip_unavailable

from settled.records import TaskRecord
from settled.runtime import Runtime


def _until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    give_up = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < give_up, "condition not reached in time"
        time.sleep(0.01)


def _row(rt: Runtime, task: str, session: str) -> dict[str, Any]:
    [row] = [s for s in rt.clocks(task)["sessions"] if s["session"] == session]
    return row


def _states(row: dict[str, Any]) -> dict[str, str]:
    return {name: clock["state"] for name, clock in row["clocks"].items()}


def test_a_running_session_has_only_its_transport_clock_settled(
    rt: Runtime, task: TaskRecord
) -> None:
    admission = rt.exec(task.task, shell="echo started; exec sleep 600", key="running")
    _until(lambda: rt.session_record(admission.session).stdout_durable > 0)
    row = _row(rt, task.task, admission.session)
    assert _states(row) == {
        "transport": "settled",
        "process": "not_yet",
        "output": "not_yet",
        "workspace": "not_yet",
    }
    transport = row["clocks"]["transport"]
    record = rt.session_record(admission.session)
    assert transport["by"] == {"kind": "admission", "digest": record.digest}
    assert transport["at"] == record.created_at
    assert row["clocks"]["output"]["facts"]["durable"]["stdout"] == len(b"started\n")
    assert row["clocks"]["process"]["by"] is None
    rt.cancel(admission.session, "the test is done")
    rt.wait(admission.session, timeout=30)


def test_process_and_output_settle_by_the_process_receipt_and_workspace_by_the_close(
    rt: Runtime, task: TaskRecord
) -> None:
    admission = rt.exec(task.task, shell="printf out; printf err >&2; echo x > f", key="k")
    receipt = rt.wait(admission.session, timeout=60)["receipt"]
    row = _row(rt, task.task, admission.session)
    assert _states(row) == {
        "transport": "settled",
        "process": "settled",
        "output": "settled",
        "workspace": "not_yet",
    }
    process, output = row["clocks"]["process"], row["clocks"]["output"]
    assert process["by"] == {"kind": "process", "digest": receipt["digest"]}
    assert process["at"] == receipt["timings"]["settled_at"]
    assert process["words"] == receipt["death"]["evidence"]
    assert output["by"] == process["by"]
    for stream in ("stdout", "stderr"):
        assert output["facts"]["streams"][stream]["cursor"] == receipt["output"][stream]["cursor"]
        assert output["facts"]["streams"][stream]["digest"] == receipt["output"][stream]["digest"]
    assert "no checkpoint yet" in row["clocks"]["workspace"]["words"]
    assert rt.clocks(task.task)["close_receipt"] is None

    close = rt.close_task(task.task).receipt
    assert close is not None
    view = rt.clocks(task.task)
    workspace = _row(rt, task.task, admission.session)["clocks"]["workspace"]
    assert workspace["state"] == "settled"
    assert workspace["by"] == {"kind": "checkpoint", "digest": close["checkpoint"]["digest"]}
    assert workspace["facts"]["close"] == close["digest"]
    assert workspace["facts"]["manifest"] == close["checkpoint"]["manifest"]
    assert view["close_receipt"] == close
    assert view["close"] == {"kind": "close", "digest": close["digest"], "at": close["issued_at"]}
    assert view["complete"] is True and view["final"] is True and view["state"] == "complete"


@pytest.mark.parametrize("kind", ["cgroup2"])
def test_a_lost_owner_shows_unknown_clocks_and_recovery_an_incomplete_output(
    rt: Runtime, task: TaskRecord, kind: str
) -> None:
    _skip_unavailable(kind)
    ticker = "while :; do printf tick; sleep 0.02; done"
    admission = rt.exec(task.task, shell=ticker, boundary=kind, key="lost")
    _until(lambda: rt.session_record(admission.session).stdout_durable > 0)
    owner = rt.session_record(admission.session).owner
    assert owner is not None
    os.kill(owner.pid, signal.SIGKILL)
    _until(lambda: rt.session_status(admission.session)["state"] == "unknown")
    row = _row(rt, task.task, admission.session)
    assert row["state"] == "unknown"
    assert _states(row) == {
        "transport": "settled",
        "process": "unknown",
        "output": "unknown",
        "workspace": "unknown",
    }
    assert "not failed" in row["clocks"]["process"]["words"]

    [result] = rt.recover(task.task)
    assert result["state"] == "settled", result
    receipt = rt.session_record(admission.session).receipt
    assert receipt is not None
    row = _row(rt, task.task, admission.session)
    assert row["clocks"]["process"]["state"] == "settled"
    assert row["clocks"]["process"]["facts"]["source"] == "recovery"
    assert row["clocks"]["output"]["state"] == "incomplete"
    assert row["clocks"]["output"]["by"] == {"kind": "process", "digest": receipt["digest"]}


def test_a_task_shows_its_newest_sessions_and_counts_the_rest(
    rt: Runtime, task: TaskRecord
) -> None:
    sessions = [rt.exec(task.task, argv=["true"], key=f"k{n}").session for n in range(3)]
    for session in sessions:
        rt.wait(session, timeout=60)
    view = rt.clocks(task.task, limit=2)
    assert view["sessions_total"] == 3
    assert [s["session"] for s in view["sessions"]] == sessions[:0:-1]  # newest first
