"""Status is a projection over recorded facts, never a stored value.

Pure functions: the runtime gathers facts (the store's records, whether the recorded owner is
alive) and hands them in. A live-looking record whose owner is gone is shown as `unknown`, with
why; it is never shown as failed, and nothing here may relaunch it.
"""

from __future__ import annotations

from settled.netledger import brief
from settled.records import OwnerFacts, SessionRecord, TaskRecord
from settled.states import SETTLED, TASK_OPEN, UNKNOWN

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

TASK_FROZEN: Final = "frozen"
"""The word every view shows for an open task whose admission `recover --host` stopped for
good (`tasks.frozen` says why): it admits nothing, so it is not shown as `open`."""


def task_state_word(task: TaskRecord) -> str:
    """The task's state as every view shows it: `frozen` for an open task that was frozen,
    else its stored state (a close under way or done says more than the freeze)."""
    return TASK_FROZEN if task.state == TASK_OPEN and task.frozen else task.state


def command_words(spec: dict[str, Any]) -> str:
    """The command as a person would type it: the shell text, or the argv quoted for sh."""
    if spec.get("shell") is not None:
        return str(spec["shell"])
    import shlex  # a rendering need: loaded when a command is shown, not for every status

    return shlex.join(str(word) for word in spec.get("argv") or ())


def session_status(record: SessionRecord, owner: OwnerFacts | None) -> dict[str, Any]:
    view: dict[str, Any] = {
        "session": record.session,
        "task": record.task,
        "key": record.key,
        "digest": record.digest,
        "state": record.state,
        "owner": None,
        "command": command_words(record.spec),
        "boundary": record.boundary,
        "cursors": {"stdout": record.stdout_durable, "stderr": record.stderr_durable},
        "created_at": record.created_at,
        "started_at": record.started_at,
        "settled_at": record.settled_at,
    }
    if record.owner is not None:
        view["owner"] = {
            **record.owner.to_json(),
            "alive": owner.alive if owner else None,
            "lease_fresh": owner.lease_fresh if owner else None,
        }
    if record.receipt is not None:
        view["receipt"] = record.receipt
        exit_fact = record.receipt.get("exit", {})
        view["exit"] = exit_fact
        ledger = (record.receipt.get("network") or {}).get("ledger")
        if ledger is not None:  # what left the sandbox through the proxy, in one line
            view["network"] = brief(ledger)
    if record.isolation is not None:
        # What the command could do: a missing protection is stated, never left to be assumed.
        view["protections_missing"] = record.isolation.get("missing", {})
    if record.live and owner is not None and not owner.alive:
        view["state"] = UNKNOWN
        view["why"] = (
            f"{owner.why}; the process tree has not been proven dead, so the session is unknown "
            "(not failed) until recovery inspects its boundary"
        )
    elif record.state == UNKNOWN:
        view["why"] = _unknown_why(record)
    elif record.state == SETTLED and record.receipt is not None:
        view["why"] = record.receipt["death"].get("evidence")
    return view


def _unknown_why(record: SessionRecord) -> str:
    if record.unknown_why:
        return (
            f"{record.unknown_why}; unknown (not failed) until its owner returns at its "
            "generation or its boundary gives death evidence: a wait or a close recovers it "
            "once its owner's process is gone; else run `settled recover`, or `settled task "
            "destroy TASK`"
        )
    receipt = record.receipt
    if receipt is not None and not receipt["death"].get("proven", False):
        return (
            f"boundary {receipt['death'].get('boundary')} gives no death evidence: "
            f"{receipt['death'].get('observed', {}).get('why_not_evidence', 'nothing observed')}"
        )
    return "the session's owner is missing and its boundary has not been inspected"


SESSION_ROW = (
    "session", "key", "command", "state", "exit", "why", "network", "cursors",
    "created_at", "started_at", "settled_at",
)  # fmt: skip
"""What a task's view says of each session (`settled ps`): enough to tell them apart."""


def task_status(task: TaskRecord, sessions: list[dict[str, Any]]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for view in sessions:
        counts[view["state"]] = counts.get(view["state"], 0) + 1
    return {
        "task": task.task,
        "key": task.key,
        "workspace": task.workspace,
        "state": task_state_word(task),
        "created_at": task.created_at,
        "generation": task.generation,
        "sessions": [{k: view.get(k) for k in SESSION_ROW} for view in sessions],
        "counts": counts,
        "host": task.host,
        **({"frozen": task.frozen} if task.frozen else {}),
    }
