"""A lane's part in one server fault of `settled soak --faults store`: commands launched before
the fault, then, once the driver has done it, every invariant checked with no manual step.

Owns: `launch` (the round's commands in the lane's task, beside its ticking service) and
`check` (after the fault: the lane's store connections found fresh again, each session waited
for without recovery, its receipt the owner's with its exit code (a store back within the lease
loses no exit status), the session checks of every cycle, then the task closed by the library
and again by the CLI, and the close's checks), each answering one JSON object.

`SETTLED_SOAK_PLANT=owner_lost` (tests only) kills the owner of each lane's first command of a
round, a lost exit status the check must name.

Must never: call recovery (`settled recover` or `Runtime.recover`): a close that needs it has
not converged by itself; retry anything but what a caller retries after a connection error
(a read, the same wait, the same close).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from settled.errors import NotSettled, StoreUnreachable
from settled.soak.plan import Fault, Violation

if TYPE_CHECKING:
    from settled.soak.lane import Lane

T = TypeVar("T")
STEADY_CALLS = 12  # consecutive reads that must succeed: every pooled connection tried
RETRY_S = 60.0


def launch(lane: Lane, fault: Fault) -> dict[str, Any]:
    """The round's commands, running when the fault strikes; their sessions answered."""
    try:
        lane.open_task()
        sessions = [lane.launch(work) for work in fault.work(lane.seed, lane.index)]
        if lane.plant == "owner_lost":
            kill_owner(lane, sessions[0])
    except Violation as violation:
        return {"violation": violation.to_json()}
    except Exception:
        return {"error": traceback.format_exc()}
    return {"sessions": sessions}


def check(lane: Lane, sessions: list[str]) -> dict[str, Any]:
    """After the fault: no lost exit status, the usual checks, a close that converges alone."""
    try:
        steady(lane)
        for session in sessions:
            settled_alone(lane, session)
            exit_kept(lane, session)
        retrying(lambda: lane.check_sessions(sessions))
        lane.check_ticker()
        receipt = retrying(lane.close_by_library)
        lane.finish_task(receipt)
    except Violation as violation:
        return {"violation": violation.to_json()}
    except Exception:
        return {"error": traceback.format_exc()}
    return {"checked": len(sessions)}


def retrying(call: Callable[[], T], seconds: float = RETRY_S) -> T:
    """A caller's call made again after a connection error (a pooled connection the fault
    broke is discarded at its first use), bounded."""
    give_up = time.monotonic() + seconds
    while True:
        try:
            return call()
        except StoreUnreachable:
            if time.monotonic() > give_up:
                raise
            time.sleep(0.1)


def steady(lane: Lane) -> None:
    """Reads until STEADY_CALLS in a row succeed: the lane's pool holds no broken connection."""
    give_up, good = time.monotonic() + RETRY_S, 0
    while good < STEADY_CALLS:
        try:
            lane.rt.task_status(lane.open_task().task)
            good += 1
        except StoreUnreachable:
            if time.monotonic() > give_up:
                raise
            good = 0
            time.sleep(0.1)


def settled_alone(lane: Lane, session: str) -> None:
    """Waits for the session's receipt; nobody recovers it: its owner must write it."""
    from settled.soak.lane import SETTLE_S

    give_up = time.monotonic() + SETTLE_S
    while (left := give_up - time.monotonic()) > 0:
        try:
            view = lane.rt.wait(session, timeout=min(left, 5.0))
        except (NotSettled, StoreUnreachable):
            time.sleep(0.05)
            continue
        if view["state"] == "settled":
            return
    state = retrying(lambda: lane.rt.session_status(session))
    raise Violation(
        "lost_exit",
        f"session {session} did not settle by itself in {SETTLE_S:.0f} s after the fault: "
        f"{state.get('state')} ({state.get('why')})",
    )


def exit_kept(lane: Lane, session: str) -> None:
    """The receipt is its owner's: exited with the command's code (0), not owner_lost."""
    record = retrying(lambda: lane.rt.session_record(session))
    receipt = record.receipt or {}
    death, exit_fact = receipt.get("death") or {}, receipt.get("exit") or {}
    if (death.get("source"), exit_fact.get("reason"), exit_fact.get("code")) != (
        "owner",
        "exited",
        0,
    ):
        raise Violation(
            "lost_exit",
            f"session {session} ran to its end through the fault, yet its receipt says "
            f"death {death.get('source')}, exit {exit_fact}",
        )


def kill_owner(lane: Lane, session: str) -> None:
    """(tests only) The session's owner SIGKILLed: its exit status is lost, as the check of
    the round must say."""
    give_up = time.monotonic() + RETRY_S
    while (owner := lane.rt.session_record(session).owner) is None:
        if time.monotonic() > give_up:
            return
        time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError):
        os.kill(owner.pid, signal.SIGKILL)
