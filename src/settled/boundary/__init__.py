"""Boundaries: where death evidence comes from, strongest first (cgroup2, pidns, subreaper).

`choose(policy)` resolves `auto` to the strongest boundary this machine offers, and refuses an
explicit policy it cannot honour with `BoundaryUnavailable` rather than silently weakening it.
`pgroup` is explicit only and never evidence.
"""

from __future__ import annotations

import importlib

from settled.errors import BoundaryUnavailable

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from settled.boundary.base import Boundary, Evidence
    from settled.boundary.cgroup2 import find_hierarchy as find_hierarchy
    from settled.boundary.isolation import IsolationPlan

# Loaded on first use: a reader (`settled status`, liveness) imports `settled.boundary.procfs`,
# which runs this package first, and must not pay for every boundary's module.
_LAZY = {
    "Boundary": "settled.boundary.base",
    "Evidence": "settled.boundary.base",
    "find_hierarchy": "settled.boundary.cgroup2",
    "IsolationPlan": "settled.boundary.isolation",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Boundary", "BoundaryUnavailable", "Evidence", "availability", "choose", "make"]

STRENGTH_ORDER = ("cgroup2+pidns", "cgroup2", "pidns", "subreaper")
PID_NAMESPACE_KINDS = frozenset({"cgroup2+pidns", "pidns"})


def _unavailable(kind: str) -> str | None:
    """Why this machine cannot give `kind`, or None when it can (probes only that kind)."""
    if kind == "cgroup2+pidns":
        return _unavailable("cgroup2") or _unavailable("pidns")
    if kind == "cgroup2":
        from settled.boundary.cgroup2 import find_hierarchy

        try:
            find_hierarchy()
        except BoundaryUnavailable as exc:
            return str(exc)
        return None
    if kind == "pidns":
        from settled.boundary.pidns import has_cap_sys_admin

        return None if has_cap_sys_admin() else "pidns: needs CAP_SYS_ADMIN"
    if kind in ("subreaper", "pgroup"):
        return None
    raise BoundaryUnavailable(f"unknown boundary {kind!r}")


def availability() -> dict[str, str | None]:
    """Each boundary kind mapped to None when usable, else the reason it is not."""
    return {kind: _unavailable(kind) for kind in (*STRENGTH_ORDER, "pgroup")}


def choose(policy: str, *, pid_namespace: bool = True) -> str:
    """Probe only what the policy needs: `auto` stops at the first that gives evidence (it runs
    at admission and again in every owner, so probing everything each time was wasted work).
    Without `pid_namespace` (a command sandbox's enter joins the sandbox's own PID namespace,
    which a process inside another one the owner made cannot) no PID-namespace kind is chosen,
    and asking for one is refused."""
    if policy == "auto":
        for kind in STRENGTH_ORDER:
            if (pid_namespace or kind not in PID_NAMESPACE_KINDS) and _unavailable(kind) is None:
                return kind
        raise BoundaryUnavailable("no boundary that gives death evidence is available")
    if not pid_namespace and policy in PID_NAMESPACE_KINDS:
        raise BoundaryUnavailable(
            f"boundary {policy} puts the command in a PID namespace of its owner's, and a "
            "command sandbox's enter joins the sandbox's own: use auto, cgroup2 or subreaper"
        )
    reason = _unavailable(policy)
    if reason is not None:
        raise BoundaryUnavailable(reason)
    return policy


def make(kind: str, task: str, session: str, plan: IsolationPlan | None = None) -> Boundary:
    """The boundary of `kind`; a plain cgroup2 whose command could leave it (the plan does not
    contain it) also watches for escapes as a subreaper."""
    from settled.boundary.cgroup2 import Cgroup2Boundary
    from settled.boundary.combined import CgroupPidnsBoundary
    from settled.boundary.pgroup import PgroupBoundary
    from settled.boundary.pidns import PidnsBoundary
    from settled.boundary.subreaper import SubreaperBoundary

    if kind == "cgroup2":
        contained = plan is not None and plan.cgroup_contained
        return Cgroup2Boundary(task, session, watch_escapes=not contained)
    classes: dict[str, type[Boundary]] = {
        "cgroup2+pidns": CgroupPidnsBoundary,
        "pidns": PidnsBoundary,
        "subreaper": SubreaperBoundary,
        "pgroup": PgroupBoundary,
    }
    return classes[kind](task, session)
