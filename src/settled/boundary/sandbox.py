"""The `SandboxProvider` seam: what holds a task's sessions, and the evidence its end gives.

A sandbox is the task's outermost boundary. Destroying it is evidence for every session inside
it at once (a destroyed cgroup tree, a removed microVM), which is how a task whose owners are
gone still ends in receipts instead of Unknown. Inspecting it answers, for one session whose
owner is gone, "can anything of it still run?" with positive evidence or with why not.

`boundary/local.py` is the first provider: the task's cgroup v2 subtree and each session's PID
namespace on this host. `boundary/command.py` makes, enters and ends a sandbox with commands a
config names (a container, a VM, namespaces). `open_sandbox` is the one place a provider is
chosen; recovery, the close join and the Runtime do not change with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from settled.boundary.base import Evidence
from settled.errors import BadInput
from settled.errors import SandboxFailed as SandboxFailed
from settled.records import SessionRecord, TaskRecord

SANDBOX_SPECS = "local, command:/path/to/config.json"


@dataclass(frozen=True)
class Destroyed:
    """What a destroy observed (`facts`, shown to the caller) and, when the provider itself
    confirmed the whole sandbox gone, the `evidence` that settles every session of the task;
    None leaves each session to its own boundary's inspection."""

    facts: dict[str, Any] | None
    evidence: Evidence | None = None


class SandboxProvider(Protocol):
    name: str

    def create(self, task: str) -> dict[str, Any]:
        """Make (or find) the task's sandbox; returns what was made, as recorded facts. Those
        facts may hold `enter`: the argv prefix the owner runs each command of the task under.
        Raises SandboxFailed when it could not."""
        ...

    def inspect(self, session: SessionRecord, task: TaskRecord) -> Evidence:
        """Positive evidence that nothing of this session can run (killing what is left of its
        boundary if need be), or an `Evidence` with `proven` False and `observed["why"]`."""
        ...

    def destroy(self, task: TaskRecord, sessions: list[SessionRecord]) -> Destroyed:
        """Kill everything in the task's sandbox. Raises SandboxFailed when the provider
        cannot confirm it: then nothing is evidence."""
        ...


def never_started(session: SessionRecord) -> Evidence | None:
    """Evidence that the session's command never started, from its record alone: no owner
    claimed it (and its claim is fenced now), or its owner died before it made a boundary."""
    if session.owner is None:
        return Evidence(
            "none",
            True,
            "no owner ever claimed this session and its claim is now fenced: its command can "
            "never start",
            {"claimed": False},
        )
    if session.boundary is None:
        return Evidence(
            "none",
            True,
            "the owner died before it created a boundary, so before it started the command",
            {"boundary_recorded": False},
        )
    return None


def open_sandbox(spec: str) -> SandboxProvider:
    """The provider `spec` names: `local`, or `command:<config path>` (BadInput otherwise,
    and for a config that is not right)."""
    if spec == "local":
        from settled.boundary.local import LocalSandbox

        return LocalSandbox()
    kind, _, config = spec.partition(":")
    if kind == "command" and config:
        from settled.boundary.command import CommandSandbox

        return CommandSandbox(config)
    raise BadInput(f"sandbox {spec!r} is not one of {SANDBOX_SPECS}")
