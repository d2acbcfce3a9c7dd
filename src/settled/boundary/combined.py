"""cgroup2+pidns: the command runs under a PID namespace's init that lives in a session cgroup.

The strongest local boundary, and `auto`'s choice where both exist: each half answers the other's
weakness against a root command. A process can move itself out of a cgroup (where no cgroup
namespace stops it) but never out of a PID namespace: when init dies the kernel kills every
member, wherever its cgroup is. A PID namespace's evidence needs the owner that reaps its init,
but a cgroup can be killed and watched empty by recovery after the owner is gone, and its
`cgroup.kill` reaches every member at once, stopped ones included.

Evidence: init reaped by the owner (the kernel kills every member before init's exit completes)
and then the cgroup killed, `populated 0` and removed. Init is cloned into the cgroup and its
namespace at once (or, forked, joins the cgroup before it builds the command's view or forks
anything), so every process of the namespace starts inside it.
"""

from __future__ import annotations

from settled.boundary import procfs
from settled.boundary.base import Evidence
from settled.boundary.cgroup2 import Cgroup2Boundary
from settled.boundary.pidns import PidnsBoundary
from settled.boundary.spawn import join_cgroup
from settled.helper_process import json_text


class CgroupPidnsBoundary(PidnsBoundary):
    kind = "cgroup2+pidns"

    def __init__(self, task: str, session: str, hierarchy: str | None = None) -> None:
        super().__init__(task, session)
        self.cgroup = Cgroup2Boundary(task, session, hierarchy)
        self.hierarchy = self.cgroup.hierarchy

    @property
    def ref(self) -> str:
        """JSON: the cgroup path and, once forked, init's pid and start time (recovery kills
        both; either alone is evidence). Written without the json module, which the owner's
        launch path does not import (helper_process.json_text writes what json.dumps would)."""
        init = self.init_pid
        start = procfs.start_time(init) if init is not None else None
        return json_text({"cgroup": self.cgroup.path, "init": init, "start": start})

    def create(self) -> None:
        self.cgroup.create()

    def discard(self) -> None:
        self.cgroup.discard()

    def setup(self) -> None:
        self.cgroup.setup()
        super().setup()

    def birth_cgroup(self) -> str:
        return self.cgroup.path

    def prepare_child(self, placed: bool) -> None:
        if not placed:
            join_cgroup(self.cgroup.path)

    def members(self) -> list[int]:
        """The command's processes: the cgroup's, init (settled's own) left out."""
        return [p for p in self.cgroup.members() if p != self.init_pid]

    def kill_all(self) -> None:
        self.cgroup.kill_all()
        super().kill_all()

    def is_empty(self) -> bool:
        return super().is_empty() and self.cgroup.is_empty()

    def evidence(self) -> Evidence:
        pidns = super().evidence()
        cgroup = self.cgroup.evidence()
        proven = pidns.proven and cgroup.proven
        text = f"{pidns.evidence}; {cgroup.evidence}" if proven else None
        return Evidence(self.kind, proven, text, {**pidns.observed, **cgroup.observed})

    def teardown(self) -> None:
        super().teardown()
        self.cgroup.teardown()
