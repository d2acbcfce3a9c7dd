"""Process-group boundary: explicit only, and never death evidence.

A `setsid` descendant leaves the group and can hold the output pipe open after `killpg`
(FACTS.md), so a pgroup session can never be proven dead; its receipt says so and it stays
unknown. Exists so that a caller who cannot have anything stronger gets an honest answer.
"""

from __future__ import annotations

import os

from settled.boundary import procfs
from settled.boundary.base import Boundary, Evidence


class PgroupBoundary(Boundary):
    kind = "pgroup"

    @property
    def ref(self) -> str | None:
        return f"pgid:{self.main_pid}" if self.main_pid else None

    def prepare_child(self, placed: bool) -> None:
        os.setpgid(0, 0)

    def placed_child(self) -> dict[str, bool]:
        return {"init": False, "setpgid": True}

    def members(self) -> list[int]:
        return procfs.pids_in_group(self.main_pid) if self.main_pid else []

    def kill_all(self) -> None:
        if self.main_pid is None:
            return
        try:  # noqa: SIM105 - contextlib stays off the owner's launch path
            os.killpg(self.main_pid, 9)  # SIGKILL
        except ProcessLookupError:
            pass

    def is_empty(self) -> bool:
        self.collect_main()
        return not self.members()

    def evidence(self) -> Evidence:
        observed: dict[str, object] = {
            "pgid": self.main_pid,
            "group_members_left": len(self.members()),
            "why_not_evidence": "a process that called setsid() or setpgid() leaves the group "
            "and is invisible to killpg",
        }
        return Evidence(self.kind, False, None, observed)
