"""The local sandbox: a task's cgroup v2 subtree and its sessions' PID namespaces on this host.

A session's resource walls live in v1 cgroups named for its owner where the host has no v2
controller (boundary/limits.py): once its boundary proved the session dead, recovery kills
what they may still hold and removes them; `sweep` removes the empty ones of any owner that no
longer runs (a spare killed before it served, an owner dead before its claim).

The task's cgroup (`<hierarchy>/settled/<task>`) is made by the first session's boundary, not
here, so `create` only names it; destroying it kills every session cgroup below it. A session's
own evidence comes from the boundary its owner recorded: a cgroup watched to `populated 0` and
removed, a PID-namespace init reaped. A subreaper or process group whose owner died gives none:
its orphans were re-parented to init and cannot be enumerated.
"""

from __future__ import annotations

import os
from typing import Any

from settled.boundary import inspect as boundary_inspect
from settled.boundary import limits
from settled.boundary.base import Evidence
from settled.boundary.isolation import recorded_cgroup_contained
from settled.boundary.sandbox import Destroyed, never_started
from settled.records import SessionRecord, TaskRecord


class LocalSandbox:
    name = "local"

    def create(self, task: str) -> dict[str, Any]:
        return {"provider": self.name, "cgroup": boundary_inspect.cgroup_path_of(task, "")}

    def destroy(self, task: TaskRecord, sessions: list[SessionRecord]) -> Destroyed:
        """Each session's evidence then comes from its own boundary's inspection: no facts
        when the task has no cgroup tree (its sessions depend on their own boundaries)."""
        sandbox = boundary_inspect.cgroup_path_of(task.task, "")
        killed = boundary_inspect.kill_cgroup(sandbox.rstrip("/")) if sandbox else None
        for session in sessions:  # a namespace init outside the cgroup tree dies by its pid
            if session.boundary == "pidns" and session.boundary_ref:
                boundary_inspect.kill_pidns_init(session.boundary_ref)
            elif session.boundary == "cgroup2+pidns" and session.boundary_ref:
                boundary_inspect.kill_cgroup_pidns(session.boundary_ref, None)
        return Destroyed(killed.to_json("sandbox-destroyed") if killed else None)

    def inspect(self, session: SessionRecord, task: TaskRecord) -> Evidence:
        evidence = self._inspect(session)
        _remove_walls(session, evidence.proven)
        return evidence

    def sweep(self) -> list[str]:
        """Remove the v1 limit cgroups of every owner that no longer runs; what was removed."""
        return limits.sweep()

    def _inspect(self, session: SessionRecord) -> Evidence:
        before = never_started(session)
        kind, ref = session.boundary, session.boundary_ref
        if before is not None or kind is None:
            _remove_made_ahead(session)
            return before or Evidence("none", True, None)
        if kind == "cgroup2+pidns":
            return boundary_inspect.kill_cgroup_pidns(
                ref, boundary_inspect.cgroup_path_of(session.task, session.session)
            )
        if kind == "cgroup2":
            return _inspect_cgroup(session, ref)
        if kind == "pidns":
            if ref is None:
                return _no_evidence(
                    kind, "the owner died between forking the namespace init and recording it"
                )
            return boundary_inspect.kill_pidns_init(ref)
        return _no_evidence(
            kind,
            f"boundary {kind} gives no evidence once its owner is gone: its orphans were "
            "re-parented to init and cannot be enumerated; destroy the task's sandbox",
        )


def _remove_walls(session: SessionRecord, proven: bool) -> None:
    """The session's v1 limit cgroups (named for its owner), after its boundary's inspection.
    With its evidence, what they still hold (nothing of the command's; v1 has no cgroup.kill)
    is killed and they are removed; without, they are removed only if empty: what runs there
    is left to the task's destroy, as the boundary's own orphans are (`sweep` takes them
    once empty)."""
    if session.owner is not None:
        paths = limits.owner_paths(session.owner.pid, session.owner.start_time)
        limits.remove(paths, kill=proven)


def _remove_made_ahead(session: SessionRecord) -> None:
    """A launcher makes the session's cgroup before its claim; one that died between the two
    left it, empty, for a session recovery has now fenced. It holds nothing of the command
    (none ever started), so it is killed (a root process of another session could have joined
    it) and removed, never taken as evidence."""
    path = boundary_inspect.cgroup_path_of(session.task, session.session)
    if path is not None and os.path.isdir(path):
        boundary_inspect.kill_cgroup(path)


def _inspect_cgroup(session: SessionRecord, ref: str | None) -> Evidence:
    path = ref or boundary_inspect.cgroup_path_of(session.task, session.session)
    if path is None:
        return _no_evidence("cgroup2", "cgroup2 is not available to recovery")
    if not recorded_cgroup_contained(session.isolation):
        boundary_inspect.kill_cgroup(path)  # stop what is inside, even without evidence
        return _no_evidence(
            "cgroup2",
            "the command ran without a cgroup namespace, so a process of it could have moved "
            "to another cgroup, and only its owner (a subreaper) could have found it; destroy "
            "the task's sandbox",
        )
    return boundary_inspect.kill_cgroup(path)


def _no_evidence(kind: str, why: str) -> Evidence:
    return Evidence(kind, False, None, {"why": why})
