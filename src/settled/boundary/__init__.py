"""Boundaries: where death evidence comes from, strongest first (cgroup2, pidns, subreaper).

`choose(policy)` resolves `auto` to the strongest boundary this machine offers, and refuses an
explicit policy it cannot honour with `BoundaryUnavailable` rather than silently weakening it.
`pgroup` is explicit only and never evidence.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # the owner's launch path imports this package: no typing at run time
if TYPE_CHECKING:
    from typing import Any

    from settled.boundary.base import Boundary, Evidence
    from settled.boundary.cgroup2 import find_hierarchy as find_hierarchy
    from settled.boundary.isolation import IsolationPlan
    from settled.errors import BoundaryUnavailable as BoundaryUnavailable

# Loaded on first use: a reader (`settled status`, liveness) imports `settled.boundary.procfs`,
# which runs this package first, and must not pay for every boundary's module.
_LAZY = {
    "BoundaryUnavailable": "settled.errors",
    "Boundary": "settled.boundary.base",
    "Evidence": "settled.boundary.base",
    "find_hierarchy": "settled.boundary.cgroup2",
    "IsolationPlan": "settled.boundary.isolation",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Boundary", "BoundaryUnavailable", "Evidence", "availability", "choose", "make"]


def unavailable(reason: str) -> Exception:
    """settled.errors.BoundaryUnavailable(reason), its module imported only when one is raised:
    the owner's launch path loads this package, and the foundation's error vocabulary would
    cost it ~0.3 ms for an error it almost never raises."""
    from settled.errors import BoundaryUnavailable

    return BoundaryUnavailable(reason)


STRENGTH_ORDER = ("cgroup2+pidns", "cgroup2", "pidns", "subreaper")
PID_NAMESPACE_KINDS = frozenset({"cgroup2+pidns", "pidns"})


def _unavailable(kind: str) -> str | None:
    """Why this machine cannot give `kind`, or None when it can (probes only that kind)."""
    if kind == "cgroup2+pidns":
        return _unavailable("cgroup2") or _unavailable("pidns")
    if kind == "cgroup2":
        from settled.boundary.cgroup2 import find_hierarchy
        from settled.errors import BoundaryUnavailable

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
    raise unavailable(f"unknown boundary {kind!r}")


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
        raise unavailable("no boundary that gives death evidence is available")
    if not pid_namespace and policy in PID_NAMESPACE_KINDS:
        raise unavailable(
            f"boundary {policy} puts the command in a PID namespace of its owner's, and a "
            "command sandbox's enter joins the sandbox's own: use auto, cgroup2 or subreaper"
        )
    reason = _unavailable(policy)
    if reason is not None:
        raise unavailable(reason)
    return policy


KIND_MODULES = (  # every kind's module, as `make` imports them
    "settled.boundary.cgroup2",
    "settled.boundary.combined",
    "settled.boundary.pidns",
    "settled.boundary.subreaper",
    "settled.boundary.pgroup",
)


def preload() -> None:
    """Import every kind's module: a zygote calls this once before it forks owners, so that
    no owner imports its boundary after the fork (~2 ms of CPU each, times 200 owners)."""
    import importlib

    for module in KIND_MODULES:
        importlib.import_module(module)


def placement(
    kind: str, task: str, session: str, hierarchy: str | None
) -> tuple[dict[str, bool], str | None]:
    """What a placer clones for a boundary of `kind` (its `placed_child()`) and the cgroup the
    clone is born in (its `birth_cgroup()`), from the orders alone, before the boundary's own
    object exists: an owner sends its placer the launch the moment its orders are in, and
    makes the boundary (whose module it may still have to import) while the clone builds the
    command's view. tests/test_limits.py holds the two answers equal."""
    cgroup = None
    if kind in ("cgroup2", "cgroup2+pidns") and hierarchy is not None:
        cgroup = os.path.join(hierarchy, "settled", task, session)  # cgroup2.ROOT_DIR_NAME
    return {"init": kind in PID_NAMESPACE_KINDS, "setpgid": kind == "pgroup"}, cgroup


def make(
    kind: str,
    task: str,
    session: str,
    plan: IsolationPlan | None = None,
    hierarchy: str | None = None,
) -> Boundary:
    """The boundary of `kind`; a plain cgroup2 whose command could leave it (the plan does not
    contain it) also watches for escapes as a subreaper. `hierarchy`: the cgroup v2 directory
    the launcher found (an owner then probes nothing)."""
    if kind == "cgroup2":  # each kind imports only its own module: an owner loads one
        from settled.boundary.cgroup2 import Cgroup2Boundary

        contained = plan is not None and plan.cgroup_contained
        return Cgroup2Boundary(task, session, hierarchy, watch_escapes=not contained)
    if kind == "cgroup2+pidns":
        from settled.boundary.combined import CgroupPidnsBoundary

        return CgroupPidnsBoundary(task, session, hierarchy)
    if kind == "pidns":
        from settled.boundary.pidns import PidnsBoundary

        return PidnsBoundary(task, session)
    if kind == "subreaper":
        from settled.boundary.subreaper import SubreaperBoundary

        return SubreaperBoundary(task, session)
    if kind == "pgroup":
        from settled.boundary.pgroup import PgroupBoundary

        return PgroupBoundary(task, session)
    raise unavailable(f"unknown boundary {kind!r}")
