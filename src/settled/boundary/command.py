"""A sandbox made and ended by commands the host's operator configured (`command:<config>`).

Why commands: a container, a VM or a pod is made by a tool settled does not embed (podman,
kubectl, a microVM manager, or two lines of `unshare`). The config (a JSON file, host root's,
trusted like the kernel) names four argv lists and a time bound:

    {"create": [...], "enter": [...], "destroy": [...], "inspect": [...], "timeout_s": 60}

`create` prints one JSON object with at least `{"sandbox": "<id>"}`; `enter` is the argv prefix
the owner puts before each command of the task so that it runs inside; `destroy` blocks until
the sandbox is gone and prints `{"destroyed": true, ...}`; `inspect` prints `{"exists": bool}`.
Items may name `{task}` and `{sandbox}` (what `create` printed). Only a command that exited 0
and printed the confirmation is evidence: a non-zero exit, output that is not that JSON, a
timeout or `destroyed: false` is not, and the error says which (with the end of its stderr).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from typing import Any

from settled.boundary import inspect as boundary_inspect
from settled.boundary.base import Evidence
from settled.boundary.sandbox import Destroyed, SandboxFailed, never_started
from settled.errors import BadInput
from settled.records import SessionRecord, TaskRecord

COMMANDS = ("create", "enter", "destroy", "inspect")
PLACEHOLDERS = ("task", "sandbox")
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 3600.0
MAX_OUTPUT = 1 << 16  # a provider's answer is one small JSON object
STDERR_TAIL = 400
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_SANDBOX_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]{0,255}")


@dataclass(frozen=True)
class CommandConfig:
    path: str
    create: tuple[str, ...]
    enter: tuple[str, ...]
    destroy: tuple[str, ...]
    inspect: tuple[str, ...]
    timeout_s: float


def load_config(path: str) -> CommandConfig:
    """The config at `path`, every field checked; BadInput naming the first that is wrong."""
    where = f"sandbox config {path}"
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(1 << 20)
    except OSError as exc:
        raise BadInput(f"{where}: cannot be read: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise BadInput(f"{where}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadInput(f"{where}: must be a JSON object with {', '.join(COMMANDS)}")
    unknown = sorted(set(data) - {*COMMANDS, "timeout_s"})
    if unknown:
        raise BadInput(f"{where}: unknown field {unknown[0]!r}")
    argvs = {name: _argv(where, name, data.get(name)) for name in COMMANDS}
    timeout = data.get("timeout_s", DEFAULT_TIMEOUT_S)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout <= MAX_TIMEOUT_S
    ):
        raise BadInput(f"{where}: timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]")
    return CommandConfig(os.path.abspath(path), timeout_s=float(timeout), **argvs)


def _argv(where: str, name: str, value: Any) -> tuple[str, ...]:
    if value is None:
        raise BadInput(f"{where}: missing field {name!r} (an argv list)")
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise BadInput(f"{where}: field {name!r} must be a non-empty list of strings")
    allowed = ("task",) if name == "create" else PLACEHOLDERS
    for item in value:
        for found in _PLACEHOLDER.findall(item):
            if found not in allowed:
                raise BadInput(
                    f"{where}: field {name!r} names unknown placeholder {{{found}}} "
                    f"(allowed: {', '.join('{' + a + '}' for a in allowed)})"
                )
    return tuple(value)


def fill(argv: tuple[str, ...], values: dict[str, str]) -> list[str]:
    """Each placeholder replaced by its value; one argv item stays one item (no shell)."""
    return [_PLACEHOLDER.sub(lambda m: values[m.group(1)], item) for item in argv]


class CommandSandbox:
    """The `SandboxProvider` over a config's commands. Evidence it gives has boundary
    `sandbox` and `observed.source` `provider`, so a recovered receipt names where it came from."""

    name = "command"

    def __init__(self, config_path: str) -> None:
        self.config = load_config(config_path)

    def create(self, task: str) -> dict[str, Any]:
        answer = self._run("create", {"task": task})
        sandbox = answer.get("sandbox")
        if not isinstance(sandbox, str) or not _SANDBOX_ID.fullmatch(sandbox):
            raise SandboxFailed(
                f'sandbox create for task {task}: its JSON has no usable "sandbox" id '
                f"(a string of [A-Za-z0-9._:/@-]): {json.dumps(answer)[:200]}"
            )
        values = {"task": task, "sandbox": sandbox}
        return {
            "provider": self.name,
            "config": self.config.path,
            "sandbox": sandbox,
            "enter": fill(self.config.enter, values),
            "created": answer,
        }

    def destroy(self, task: TaskRecord, sessions: list[SessionRecord]) -> Destroyed:
        values = self._values(task.task, task.sandbox)
        answer = self._run("destroy", values)
        if answer.get("destroyed") is not True:
            raise SandboxFailed(
                f"sandbox destroy of {values['sandbox']} (task {task.task}) did not confirm: "
                f'it printed {json.dumps(answer)[:200]}, not "destroyed": true; '
                "nothing is evidence, its sessions stay as they are"
            )
        facts = {
            "provider": self.name,
            "sandbox": values["sandbox"],
            "confirmation": answer,
            "host": _end_on_host(task.task, None),
        }
        evidence = Evidence(
            "sandbox",
            True,
            f"the provider destroyed sandbox {values['sandbox']} and confirmed it (exit 0, "
            "destroyed: true): nothing of the task can run",
            {"source": "provider", **facts},
        )
        return Destroyed(facts, evidence)

    def inspect(self, session: SessionRecord, task: TaskRecord) -> Evidence:
        before = never_started(session)
        if before is not None:
            return before
        try:
            values = self._values(task.task, task.sandbox)
            answer = self._run("inspect", values)
        except SandboxFailed as exc:
            return Evidence("sandbox", False, None, {"source": "provider", "why": str(exc)})
        exists = answer.get("exists")
        facts = {"source": "provider", "provider": self.name, "sandbox": values["sandbox"]}
        if exists is False:
            _end_on_host(task.task, session.session)
            return Evidence(
                "sandbox",
                True,
                f"the provider reports sandbox {values['sandbox']} does not exist: nothing "
                "of it can run",
                {**facts, "inspection": answer},
            )
        why = (
            f"sandbox {values['sandbox']} still exists; destroy the task's sandbox"
            if exists is True
            else f'sandbox inspect printed {json.dumps(answer)[:200]}, not "exists": bool'
        )
        return Evidence("sandbox", False, None, {**facts, "why": why})

    def _values(self, task: str, recorded: dict[str, Any] | None) -> dict[str, str]:
        if not recorded or recorded.get("provider") != self.name or not recorded.get("sandbox"):
            made_by = (recorded or {}).get("provider")
            raise SandboxFailed(
                f"task {task} has no sandbox of provider {self.name!r} recorded "
                f"(made by {made_by or 'none'}); this provider cannot end it"
            )
        return {"task": task, "sandbox": str(recorded["sandbox"])}

    def _run(self, name: str, values: dict[str, str]) -> dict[str, Any]:
        """Run one configured command, bounded by timeout_s (its whole process group killed
        then), and return the JSON object it printed; SandboxFailed naming why otherwise."""
        argv = fill(getattr(self.config, name), values)
        label = f"sandbox {name} ({argv[0]})"
        try:
            child = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: a timeout kills all of it
                close_fds=True,
            )
        except OSError as exc:
            raise SandboxFailed(f"{label} could not start: {exc.strerror or exc}") from None
        try:
            out, err = child.communicate(timeout=self.config.timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            out, err = _collect(child)
            raise SandboxFailed(
                f"{label} timed out after {self.config.timeout_s:g} s and was killed{_tail(err)}"
            ) from None
        if child.returncode != 0:
            raise SandboxFailed(f"{label} exited {child.returncode}{_tail(err)}")
        try:
            answer = json.loads(out[:MAX_OUTPUT].decode("utf-8")) if len(out) <= MAX_OUTPUT else 0
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise SandboxFailed(f"{label} printed {out[:120]!r}, not one JSON object{_tail(err)}")
        return answer


def _end_on_host(task: str, session: str | None) -> str | None:
    """Kill and remove what ran on this host for the task (or one session): the owners'
    cgroups, which hold each enter command. Not the evidence (the sandbox's end is); what is
    left of the task here must not outlive it. Returns what was observed, if anything."""
    path = boundary_inspect.cgroup_path_of(task, session or "")
    if path is None:
        return None
    ended = boundary_inspect.kill_cgroup(path.rstrip("/")).evidence
    if session is not None:  # the task's cgroup too, once its last session's is gone
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))
    return ended


def _collect(child: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    """What a killed command left in its pipes; a grandchild that kept them open (it left the
    group) is not waited for past a second."""
    try:
        return child.communicate(timeout=1.0)
    except subprocess.TimeoutExpired:
        for pipe in (child.stdout, child.stderr):
            if pipe is not None:
                pipe.close()
        child.wait()
        return b"", b""


def _tail(err: bytes) -> str:
    text = err.decode("utf-8", "replace").strip()
    if not text:
        return ""
    tail = text[-STDERR_TAIL:].replace("\n", " | ")
    return f"; stderr: {tail}"
