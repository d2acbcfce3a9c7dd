"""One session's resource walls: its limits, the cgroup each is enforced in, what the kernel saw.

The owner makes one from its orders (the effective limits and where each came from: explicit,
the task's default or the host's) and the cgroups its command starts in: the v1 ones its placer
joined (placer.py; on the fork path made here and joined by the child) and the session's v2
cgroup. After death evidence and before any cgroup is removed, `observe` reads the kernel's
counters (they go with the cgroup); `facts` is the receipt's `resources`; `oom_kills` is the
memory controller's count of kills in the session (`exit.reason: "oom"`). `remove` takes the v1
cgroups away (the boundary removes the v2 one).

Must never: claim a limit the kernel was not given, or read counters from a cgroup other than
the session's own. Imported on the owner's launch path (os only, through limits).
"""

from __future__ import annotations

import os

from settled.boundary import limits

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class Walls:
    def __init__(
        self,
        chosen: dict[str, dict[str, Any]],
        v1: dict[str, str],
        v2: str | None,
        ceiling: dict[str, Any] | None = None,
    ) -> None:
        """`chosen`: limits.effective()'s answer; `v1`: {controller: the session's v1 cgroup};
        `v2`: the session's v2 cgroup (None: its boundary has none)."""
        self.chosen, self.v1, self.v2 = chosen, v1, v2
        self.ceiling = ceiling
        self.seen: dict[str, dict[str, Any]] = {}
        self.left: list[str] = []
        self.removed = False

    @classmethod
    def from_orders(cls, given: dict[str, Any], v1: dict[str, str], v2: str | None) -> Walls:
        values = given.get("limits") or {}
        sources = given.get("limit_sources") or {}
        chosen = {
            name: {"value": values.get(name), "source": sources.get(name, "host")}
            for name in limits.LIMITS
        }
        return cls(chosen, v1, v2, given.get("ceiling"))

    def values(self) -> dict[str, Any]:
        return {name: fact["value"] for name, fact in self.chosen.items()}

    def where(self, name: str) -> tuple[str | None, str | None, str | None]:
        """(version, cgroup, why missing) of one limit's controller for this session."""
        controller = limits.CONTROLLER_OF[name]
        found = limits.controllers()[controller]
        version = found["version"]
        if version == "v1":
            path = self.v1.get(controller)
            return ("v1", path, None) if path else (None, None, "no v1 cgroup was joined")
        if version == "v2":
            if self.v2 is None:
                return None, None, "the session's boundary has no cgroup v2 of its own"
            return "v2", self.v2, None
        return None, None, found["why"]

    def make_for_fork(self) -> list[str]:
        """The fork path (no placer): make the v1 cgroups and write their limits here; the
        forked child joins the returned cgroups itself. OSError names what failed."""
        made = limits.make(self.v1)
        try:
            limits.write_all(self.v1, "v1", self.values())
        except BaseException:
            limits.remove(made)
            raise
        return made

    def observe(self) -> None:
        """Read what the kernel counted, once, after death evidence and before removal."""
        if self.seen:
            return
        for name in limits.LIMITS:
            version, path, _why = self.where(name)
            if version is not None and path is not None and os.path.isdir(path):
                seen = limits.evidence(path, limits.CONTROLLER_OF[name], version)
                self.seen[name] = seen

    def oom_kills(self) -> int:
        """Processes the memory controller killed in the session (0 before `observe`)."""
        return int(self.seen.get("memory", {}).get("oom_kill") or 0)

    def remove(self) -> None:
        """Remove the v1 cgroups (after `observe`); any that would not go are named."""
        self.observe()
        self.left = limits.remove(list(self.v1.values()), kill=True)
        self.removed = True

    def facts(self, owner_oom: int | None) -> dict[str, Any]:
        """The receipt's `resources`: per limit its value, source, controller and cgroup (or
        why it is missing) with the kernel's counters; the host's ceiling; who the OOM killer
        takes first. `owner_oom`: the owner's oom_score_adj (settled.oomguard)."""
        from settled.oomguard import COMMAND
        from settled.oomguard import facts as oom_facts

        facts: dict[str, Any] = {}
        for name in limits.LIMITS:
            version, path, why = self.where(name)
            fact: dict[str, Any] = {
                "limit": self.chosen[name]["value"],
                "source": self.chosen[name]["source"],
                "controller": version,
            }
            if version is None:
                fact["missing"] = why
            else:
                fact["cgroup"] = path
                fact.update(self.seen.get(name, {}))
            facts[name] = fact
        facts["ceiling"] = self.ceiling or limits.defaults()["ceiling"]
        facts["oom"] = {"command": COMMAND, "owner": oom_facts(owner_oom)}
        if self.left:
            facts["cgroups_left"] = self.left
        return facts
