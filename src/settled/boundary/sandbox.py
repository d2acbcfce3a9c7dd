"""The `SandboxProvider` seam: what holds a task's sessions, and the evidence its end gives.

A sandbox is the task's outermost boundary. Destroying it is evidence for every session inside
it at once (a destroyed cgroup tree, a removed microVM), which is how a task whose owners are
gone still ends in receipts instead of Unknown. Inspecting it answers, for one session whose
owner is gone, "can anything of it still run?" with positive evidence or with why not.

`boundary/local.py` is the first provider: the task's cgroup v2 subtree and each session's PID
namespace on this host. A provider for a remote sandbox (a container or VM service) is a new
module beside it; recovery, the close join and the Runtime do not change.
"""

from __future__ import annotations

from typing import Any, Protocol

from settled.boundary.base import Evidence
from settled.records import SessionRecord


class SandboxProvider(Protocol):
    name: str

    def create(self, task: str) -> dict[str, Any]:
        """Make (or find) the task's sandbox; returns what was made, as recorded facts."""
        ...

    def inspect(self, session: SessionRecord) -> Evidence:
        """Positive evidence that nothing of this session can run (killing what is left of its
        boundary if need be), or an `Evidence` with `proven` False and `observed["why"]`."""
        ...

    def destroy(self, task: str, sessions: list[SessionRecord]) -> dict[str, Any] | None:
        """Kill everything in the task's sandbox; the facts observed, or None when the task
        has no sandbox to destroy (its sessions then depend on their own boundaries)."""
        ...
