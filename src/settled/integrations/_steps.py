"""What both adapters share: run one step through settled and read back what its receipt covers.

A step's invocation key is derived from the task key and the step's ordinal, so a harness that
retries a step (same task, same ordinal) gets the same session back instead of a second run.

The harnesses' own local environments hand a command their process's environment (mini's
LocalEnvironment: os.environ | config env; Inspect's local sandbox: os.environ | exec env), so
the adapters pass it too, through settled's recorded `inherit_env` (settled's own SETTLED_*
variables and the home's credentials withheld, every inherited name in the spec and digest).
`interpreter_grants` names the read-only grants that make `python3` on that PATH the harness's
own interpreter inside the boundary, which otherwise shows only the system's directories."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from settled.client import Client
from settled.environment import within
from settled.runtime import Runtime

EXIT_CLOSE_DEADLINE_S = 60  # a close at interpreter exit lets sessions run this long at most
EXIT_CLOSE_TIMEOUT_S = EXIT_CLOSE_DEADLINE_S + 240.0  # then the rest of the join: never a hang
_SETTLED_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READ_CHUNK = 1 << 20
WAIT_MARGIN_S = 60.0  # the owner's clock ends the command; this only bounds our wait
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc")  # always in the view


@dataclass(frozen=True)
class StepResult:
    """A settled step: its output streams, exit code (None if signalled or timed out), and
    the process receipt that proves it ended."""

    stdout: bytes
    stderr: bytes
    code: int | None
    timed_out: bool
    receipt: dict[str, Any]
    session: str
    reused: bool


def step_key(task_key: str, ordinal: int) -> str:
    """The same (task, ordinal) always names the same session: a retried step is not rerun."""
    digest = hashlib.sha256(f"{task_key}\0{ordinal}".encode()).hexdigest()[:24]
    return f"step-{ordinal}-{digest}"


def interpreter_grants(workspace: str) -> tuple[str, ...]:
    """The directories of the interpreter this process runs under (its venv, the base install
    it links to, the executable's directory), resolved, less those the view always shows (the
    system's, and the workspace's, which stay writable: a venv in the repo is the agent's): each
    a read-only grant, so a command that runs `python3` from the inherited PATH gets this one."""
    found = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    resolved = {os.path.realpath(path) for path in found}
    shown = (*SYSTEM_DIRS, os.path.realpath(workspace))
    return tuple(sorted(p for p in resolved if not within(p, shown)))


def exit_close_command(task: str) -> list[str]:
    """`python -I -S -c BOOT N ROOT... close TASK --json --deadline S`: settled's root and this
    interpreter's site-packages on sys.path by hand (as settled's own helpers start,
    settled.helper_process), so no .pth file or user site runs."""
    roots = exit_close_roots()
    boot = (
        "import sys; n = int(sys.argv[1]); sys.path += sys.argv[2 : 2 + n]; "
        "from settled.cli import main; sys.exit(main(sys.argv[2 + n :]))"
    )
    tail = ["close", task, "--json", "--deadline", str(EXIT_CLOSE_DEADLINE_S)]
    return [sys.executable, "-I", "-S", "-c", boot, str(len(roots)), *roots, *tail]


def exit_close_roots() -> list[str]:
    """What the exit-time close imports from: settled's root and this interpreter's
    site-packages."""
    import sysconfig

    found = [_SETTLED_ROOT, *(sysconfig.get_path(kind) for kind in ("purelib", "platlib"))]
    return list(dict.fromkeys(found))


def _inside(workspace: str, paths: list[str]) -> str | None:
    """The first of `paths` (or what it resolves to) inside `workspace`, or None."""
    top = os.path.realpath(workspace)
    for path in paths:
        for candidate in (os.path.abspath(path), os.path.realpath(path)):
            if within(candidate, (top,)):
                return path
    return None


def read_all(runtime: Runtime, session: str, stream: str) -> bytes:
    """Every byte the owner stored for `stream` (a settled session's streams are final)."""
    parts: list[bytes] = []
    start = 0
    while chunk := runtime.read(session, stream, start, READ_CHUNK):
        parts.append(chunk)
        start += len(chunk)
    return b"".join(parts)


def run_step(
    runtime: Runtime,
    task: str,
    shell: str | None = None,
    *,
    argv: list[str] | None = None,
    key: str,
    cwd: str = ".",
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    stdin: bytes | None = None,
    inherit_env: bool = False,
    readable: tuple[str, ...] = (),
) -> StepResult:
    """Admit the step under `key`, wait for its process receipt, and return what it covers.
    The exit code and the timeout come from the receipt, never from the command's output."""
    admission = runtime.exec(
        task,
        argv,
        shell,
        key=key,
        cwd=cwd,
        timeout=timeout,
        env=env,
        stdin=stdin,
        inherit_env=inherit_env,
        readable=readable,
    )
    bound = None if not timeout else timeout + WAIT_MARGIN_S  # 0: no limit (Runtime.exec)
    view = runtime.wait(admission.session, timeout=bound)
    receipt: dict[str, Any] = view["receipt"]
    exit_ = receipt["exit"]
    return StepResult(
        stdout=read_all(runtime, admission.session, "stdout"),
        stderr=read_all(runtime, admission.session, "stderr"),
        code=exit_["code"],
        timed_out=exit_["reason"] == "timeout",
        receipt=receipt,
        session=admission.session,
        reused=admission.reused,
    )


def close_with_checkpoint(runtime: Runtime, task: str) -> dict[str, Any]:
    """Close the task: the close receipt carries the workspace checkpoint of what it left."""
    result = runtime.close_task(task)
    if result.receipt is None:
        raise RuntimeError(f"task {task} did not close: blocked on {result.blocked_on}")
    return result.receipt


@dataclass(frozen=True)
class StepEnv:
    """What a step's command is handed besides the base environment: `env` over the caller's
    whole environment when `inherit` (as the harness's local environment does), and the
    read-only grants (the harness's interpreter)."""

    env: dict[str, str]
    inherit: bool
    readable: tuple[str, ...]


class LocalSteps:
    """Steps through a Runtime on this machine's home (one thread: it holds one connection),
    opened when first needed and again after a release."""

    def __init__(self, home: str | None) -> None:
        self.home = home
        self._runtime: Runtime | None = None

    @property
    def runtime(self) -> Runtime:
        if self._runtime is None:
            self._runtime = Runtime(self.home)
        return self._runtime

    def new_task(self, workspace: str, key: str | None) -> tuple[str, str]:
        """The task id and its key (a key already used returns its task)."""
        record = self.runtime.new_task(workspace, key=key)
        return record.task, record.key

    def step(
        self, task: str, shell: str, *, key: str, cwd: str, timeout: float, env: StepEnv
    ) -> StepResult:
        return run_step(
            self.runtime,
            task,
            shell,
            key=key,
            cwd=cwd,
            timeout=timeout,
            env=env.env or None,
            inherit_env=env.inherit,
            readable=env.readable,
        )

    def close(self, task: str) -> dict[str, Any]:
        return close_with_checkpoint(self.runtime, task)

    def close_at_exit(self, task: str, workspace: str) -> dict[str, Any]:
        """The close from an `atexit` hook. An exiting interpreter starts no thread, and the
        close's checkpoint publishes through a pool of them, so a fresh interpreter closes:
        `settled close --json` on the same home, whose one JSON object is the close receipt.
        That interpreter runs code from this one's files, so none may be where the task's
        commands write: `-I -S` (no .pth file runs, no user site), run from /, settled and the
        site-packages put on its path by hand, and refused (RuntimeError) when the interpreter,
        settled or those site-packages lie in `workspace` (a virtualenv inside the repository
        the agent works on, whose files its commands could have replaced)."""
        command = exit_close_command(task)
        if planted := _inside(workspace, [sys.executable, *exit_close_roots()]):
            raise RuntimeError(
                f"not closing task {task} at exit: {planted} is inside its workspace, which its "
                f"commands could change; close it from a trusted interpreter: settled close {task}"
            )
        env = dict(os.environ)
        if self.home is not None:
            env["SETTLED_HOME"] = self.home
        done = subprocess.run(
            command,
            env=env,
            cwd="/",
            capture_output=True,
            timeout=EXIT_CLOSE_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            why = done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}"
            raise RuntimeError(f"settled close {task}: {why}")
        receipt: dict[str, Any] = json.loads(done.stdout)
        return receipt

    def release(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None


class ServiceSteps:
    """Steps through a settled service (`settled serve`): the same keys, so a retried request
    or a replayed step gets the same session back from the server."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url, self.token = url, token
        self._client: Client | None = None

    @property
    def client(self) -> Client:
        """Connected when first needed and again after a release."""
        if self._client is None:
            self._client = Client(self.url, self.token)
        return self._client

    def new_task(self, workspace: str, key: str | None) -> tuple[str, str]:
        record = self.client.new_task(workspace, key)
        return str(record["task"]), str(record["key"])

    def step(
        self, task: str, shell: str, *, key: str, cwd: str, timeout: float, env: StepEnv
    ) -> StepResult:
        """The service's host is not this one: no interpreter grant (its paths are ours)."""
        admission = self.client.exec(
            task,
            shell=shell,
            key=key,
            cwd=cwd,
            timeout=timeout,
            env=env.env or None,
            inherit_env=env.inherit,
        )
        view = self.client.wait(admission.session, timeout=timeout + WAIT_MARGIN_S)
        receipt: dict[str, Any] = view["receipt"]
        return StepResult(
            stdout=self._read_all(admission.session, "stdout"),
            stderr=self._read_all(admission.session, "stderr"),
            code=receipt["exit"]["code"],
            timed_out=receipt["exit"]["reason"] == "timeout",
            receipt=receipt,
            session=admission.session,
            reused=admission.reused,
        )

    def _read_all(self, session: str, stream: str) -> bytes:
        parts: list[bytes] = []
        start = 0
        while True:
            chunk, start = self.client.output(session, stream, start)
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)

    def close(self, task: str) -> dict[str, Any]:
        """The close receipt (the client raises Blocked if the close could not finish)."""
        return self.client.close_task(task)

    def close_at_exit(self, task: str, workspace: str) -> dict[str, Any]:
        """The service closes: one HTTP call, which an exiting interpreter can still make."""
        return self.close(task)

    def release(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
