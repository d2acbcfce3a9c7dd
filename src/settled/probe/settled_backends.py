"""How the `settled` adapter reaches settled: the `Backend` protocol and what both ways share.

The experiments of `settled_adapter.py` are written once against `Backend`; its two
implementations are `settled_local.LocalBackend` (the library: a Runtime on a temporary home
made for the probe and removed after, never the user's) and `settled_http.HttpBackend` (the HTTP
API through `settled.client`, token from SETTLED_TOKEN). What only the host can do (kill an
owner, restore a checkpoint, write to the store with an old generation) each either does or
says it cannot (`CannotLook`), and why. `owner_here` and `owners_gone` decide from an owner's
pid, start time and boot id whether it runs on this machine, and check it exited.
Must never: kill a process it has not identified by pid, start time and boot id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from settled.probe import host

CLOSE_DEADLINE_S = 30.0
OWNER_EXIT_S = 10.0
WAIT_S = 60.0


@dataclass(frozen=True)
class Admitted:
    session: str
    reused: bool
    state: str


class ProbeBroke(Exception):
    """The runtime did something the experiment cannot go on from (a close that stays blocked)."""


class Backend(Protocol):
    where: str
    version: str
    on_this_machine: bool

    def new_task(self) -> str: ...
    def exec(self, task: str, shell: str, key: str, env: dict[str, str],
             timeout: float | None = None, grace: float | None = None) -> Admitted: ...  # fmt: skip
    def refusal(self, task: str, shell: str, key: str, env: dict[str, str]) -> str | None:
        """The error an admission met (`Kind: message`), or None when it was admitted."""
        ...

    def lose_response(self, task: str, shell: str, key: str, env: dict[str, str]) -> str:
        """Admit, and lose the answer as a network or a crash would; how it was lost."""
        ...

    def wait(self, session: str, timeout: float = WAIT_S) -> dict[str, Any]: ...
    def status(self, session: str) -> dict[str, Any]: ...
    def task_sessions(self, task: str) -> list[str]: ...
    def output(self, session: str) -> bytes:
        """The whole stdout of a settled session, to its final cursor."""
        ...

    def peek(self, session: str) -> bytes:
        """The stdout stored so far of a running session."""
        ...

    def read_file(self, task: str, name: str) -> bytes: ...
    def close_task(self, task: str) -> dict[str, Any]: ...
    def explain(self, task: str) -> dict[str, Any]: ...
    def recover(self, task: str) -> list[dict[str, Any]]: ...
    def in_checkpoint(self, task: str, name: str) -> bytes | None:
        """The file's bytes as the task's last checkpoint restores them (None: not there);
        raises CannotLook where the backend has no restore."""
        ...

    def stale_write(self, task: str) -> str | None:
        """Write a checkpoint with the task's previous (fenced) generation: the refusal
        (`Kind: message`), None when it was accepted; raises CannotLook where impossible."""
        ...

    def finish(self, task: str) -> list[str]:
        """Leave the task closed whatever the experiment left: cancel what runs, recover what
        is unknown, close; returns what it had to do."""
        ...

    def owners(self, task: str) -> list[dict[str, Any]]:
        """The owner facts (pid, start time, boot id) of every session of the task."""
        ...

    def close(self) -> None: ...


class CannotLook(Exception):
    """What this backend cannot reach, in words (an HTTP API with no restore endpoint)."""


def owner_here(owner: dict[str, Any] | None) -> str | None:
    """None when the owner process named by a status view runs on this machine, with that
    start time (so a kill reaches it and no other); else why not."""
    if not owner or not owner.get("pid"):
        return "the status names no owner process"
    if owner.get("boot_id") != host.boot_id():
        return f"the owner runs on another machine (boot id {owner.get('boot_id')})"
    pid, started = int(owner["pid"]), owner.get("start_time")
    if not host.alive(pid, started):
        return f"no process {pid} started at {started} runs on this machine"
    if "settled.owner" not in host.cmdline(pid):
        return f"process {pid} is not a settled owner: {host.cmdline(pid)[:80]}"
    return None


def owners_gone(owners: list[dict[str, Any]], timeout: float = OWNER_EXIT_S) -> None:
    """Every owner of this machine among `owners` (status views' `owner`) has exited: a
    settled session's owner exits after its receipt. ProbeBroke names one that did not."""
    here = host.boot_id()
    for owner in owners:
        if owner.get("pid") and owner.get("boot_id") == here:
            pid, started = int(owner["pid"]), owner.get("start_time")
            if not host.wait_gone(pid, started, timeout):
                raise ProbeBroke(f"owner pid {pid} still runs {timeout:g} s after its receipt")
