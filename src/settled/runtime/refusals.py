"""What an exec or a `task new` asks that cannot be honoured, refused before anything is
recorded: a user that cannot be switched to, a limit outside its grammar or that this host
cannot enforce, an isolation this machine lacks, and what a task's own sandbox could not apply.

Must never: record or launch anything (each function answers or raises BadInput), or import at
module level what `settled status` would then pay for (the boundary's checks load on use).
"""

from __future__ import annotations

from settled import boundary as boundaries
from settled import grammar
from settled.errors import BadInput

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from settled.identity import CommandSpec
    from settled.records import TaskRecord


def resolve_user(user: str | tuple[int, int] | list[int] | None) -> tuple[int, int] | None:
    if user is None:
        return None
    from settled.identity import check_user, parse_user

    if isinstance(user, str):
        return parse_user(user)
    return check_user(tuple(user))


def limits_of(
    memory: int | None, pids: int | None, cpus: float | None, defaults: dict[str, Any]
) -> dict[str, Any]:
    """An exec's limits: each its own when given, else its task's default (none: the host's,
    decided where the session's cgroups are made, boundary/limits.py)."""
    return {
        "memory": grammar.check_memory("memory", memory)
        if memory is not None
        else defaults.get("memory"),
        "pids": grammar.check_pids("pids", pids) if pids is not None else defaults.get("pids"),
        "cpus": grammar.check_cpus("cpus", cpus) if cpus is not None else defaults.get("cpus"),
    }


def check_isolation(spec: CommandSpec, kind: str) -> None:
    """Refuse before recording what the owner could only refuse later: `strict` on a machine
    that lacks a protection, or a `--user` this process cannot switch to."""
    if spec.isolation == "none" and spec.user is None:
        return
    from settled.boundary.isolation import IsolationUnavailable, check_available

    try:
        check_available(
            "strict" if spec.isolation == "strict" else "auto",
            pid_namespace=kind in boundaries.PID_NAMESPACE_KINDS,
            uid=spec.user[0] if spec.user is not None else None,
            writable=spec.writable,
        )
    except IsolationUnavailable as exc:
        raise BadInput(str(exc)) from None


def check_limits(spec: CommandSpec) -> None:
    """Refuse, before recording, a limit asked for (by the exec or its task) that this host
    cannot enforce, its controller missing (boundary/limits.py), or below what a session's
    first processes take (pids: the namespace's init and the command)."""
    from settled.boundary import limits

    explicit = {"memory": spec.memory, "pids": spec.pids, "cpus": spec.cpus}
    if all(value is None for value in explicit.values()):
        return
    why = limits.refusal(explicit)
    if why is not None:
        raise BadInput(why)


def check_sandbox(spec: CommandSpec, task: TaskRecord, provider: str) -> bool:
    """Whether the command will run through the task's sandbox's enter prefix; refuses what
    settled could not then honour (its own isolation, a uid, a granted path, a network of
    the task's own) and a task whose sandbox another provider made (or none yet), since this
    one could neither enter nor end it."""
    made_by = (task.sandbox or {}).get("provider", "local")
    if made_by != provider:
        raise BadInput(
            f"task {task.task} has a {made_by} sandbox, and this settled uses the {provider} "
            "provider (SETTLED_SANDBOX): it can neither enter nor destroy it"
        )
    if not (task.sandbox or {}).get("enter"):
        return False
    refused = [
        (spec.isolation == "strict", "--isolation strict"),
        (spec.user is not None, "--user"),
        (bool(spec.writable), "--writable"),
        (bool(spec.readable), "--readable"),
        (spec.network != "host", f"--network {spec.network}"),
    ]
    for asked, what in refused:
        if asked:
            raise BadInput(
                f"{what}: task {task.task} runs its commands inside its {provider} sandbox, "
                "whose own isolation and user apply there; settled cannot apply or check it"
            )
    return True
