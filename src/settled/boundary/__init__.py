"""Boundaries: where death evidence comes from, strongest first (cgroup2, pidns, subreaper).

`choose(policy)` resolves `auto` to the strongest boundary this machine offers, and refuses an
explicit policy it cannot honour with `BoundaryUnavailable` rather than silently weakening it.
`pgroup` is explicit only and never evidence.
"""

from __future__ import annotations

from settled.boundary.base import Boundary, Evidence
from settled.boundary.cgroup2 import Cgroup2Boundary, find_hierarchy
from settled.boundary.pgroup import PgroupBoundary
from settled.boundary.pidns import PidnsBoundary, has_cap_sys_admin
from settled.boundary.subreaper import SubreaperBoundary
from settled.errors import BoundaryUnavailable

__all__ = ["Boundary", "BoundaryUnavailable", "Evidence", "availability", "choose", "make"]

STRENGTH_ORDER = ("cgroup2", "pidns", "subreaper")


def availability() -> dict[str, str | None]:
    """Each boundary kind mapped to None when usable, else the reason it is not."""
    reasons: dict[str, str | None] = {}
    try:
        find_hierarchy()
        reasons["cgroup2"] = None
    except BoundaryUnavailable as exc:
        reasons["cgroup2"] = str(exc)
    reasons["pidns"] = None if has_cap_sys_admin() else "pidns: needs CAP_SYS_ADMIN"
    reasons["subreaper"] = None
    reasons["pgroup"] = None
    return reasons


def choose(policy: str) -> str:
    reasons = availability()
    if policy == "auto":
        for kind in STRENGTH_ORDER:
            if reasons[kind] is None:
                return kind
        raise BoundaryUnavailable("no boundary that gives death evidence is available")
    if policy not in reasons:
        raise BoundaryUnavailable(f"unknown boundary {policy!r}")
    reason = reasons[policy]
    if reason is not None:
        raise BoundaryUnavailable(reason)
    return policy


def make(kind: str, task: str, session: str) -> Boundary:
    classes: dict[str, type[Boundary]] = {
        "cgroup2": Cgroup2Boundary,
        "pidns": PidnsBoundary,
        "subreaper": SubreaperBoundary,
        "pgroup": PgroupBoundary,
    }
    return classes[kind](task, session)
