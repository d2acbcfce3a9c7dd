"""The Inspect AI sandbox environment "settled": each sample gets a settled task over its own
workspace, every exec (and every file read and write) runs through settled inside the task's
boundary and ends with a process receipt, and the sample's cleanup closes the task, whose close
receipt carries the workspace checkpoint.

Registered when this module is imported (Inspect finds it through the `inspect_ai` entry
point), so `eval(task, sandbox="settled")` or `sandbox=("settled", SettledSandboxConfig(...))`.

The sample's record: its store's "settled" entry holds the task id from the sample's start and,
after cleanup, the close receipt's digest, its checkpoint's, and the sample's commands by
outcome; an info event in the transcript says the same. Both are in the .eval log.

File reads and writes run inside the task's boundary too, not as the harness's own file I/O: a
hostile command could leave a symlink in the workspace pointing anywhere the harness may write,
and writing through it inside the boundary reaches only what the command itself could. They
are not the agent's commands: their sessions are keyed `inspect-file-read-…` and
`inspect-file-write-…` (an exec's `inspect-exec-…`), so the close receipt's outcome tells them
apart, and the sample's summary counts them apart. A missing file or a directory is the
script's answer (exit 0, said on stderr), not a failed session. The scripts and their answers
are settled.integrations.fileops's, shared with `settled serve --swerex`.

A command's environment follows Inspect's local sandbox (os.environ | the exec's env), through
settled's recorded `inherit_env` (settled's own variables and the home's credentials withheld);
the interpreter Inspect runs under is granted read-only, so `python3` on that PATH is the same.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from typing import Any, Literal, overload

from inspect_ai.log import transcript
from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    sandboxenv,
    store,
)
from pydantic import BaseModel, ConfigDict

from settled.integrations import fileops
from settled.integrations._steps import (
    StepResult,
    close_with_checkpoint,
    interpreter_grants,
    run_step,
)
from settled.runtime import Runtime

EXEC_KEY, READ_KEY, WRITE_KEY = "inspect-exec-", "inspect-file-read-", "inspect-file-write-"
FILE_KEY = "inspect-file-"
STORE_KEY = "settled"  # the sample store's entry (and the info event's source)


class SettledSandboxConfig(BaseModel):
    """Where the sandbox's state lives: the settled home (default: SETTLED_HOME, else the
    user's) and the directory each sample's fresh workspace is made in (default: the temp
    directory). Frozen: Inspect hashes a sandbox spec's config."""

    model_config = ConfigDict(frozen=True)

    home: str | None = None
    workspaces: str | None = None
    keep_workspace: bool = False
    """Leave the sample's workspace after cleanup (its checkpoint is kept either way)."""
    inherit_env: bool = True
    """Pass this process's environment to exec, as Inspect's local sandbox does (settled's own
    variables and the home's credentials withheld); false: settled's base environment."""
    grant_interpreter: bool = True
    """Grant read-only the interpreter Inspect runs under, so `python3` is the same one."""


def _config(config: SandboxEnvironmentConfigType | None) -> SettledSandboxConfig:
    """None, this model, or a string naming the home."""
    if config is None:
        return SettledSandboxConfig()
    if isinstance(config, str):
        return SettledSandboxConfig(home=config)
    if isinstance(config, SettledSandboxConfig):
        return config
    return SettledSandboxConfig(**config.model_dump())


@sandboxenv(name="settled")
class SettledSandboxEnvironment(SandboxEnvironment):
    """One sample's settled task. A Runtime holds one SQLite connection per thread, so every
    call opens its own in a worker thread: the event loop never blocks on a wait."""

    def __init__(self, config: SettledSandboxConfig, task: str, workspace: str) -> None:
        super().__init__()
        self.config, self.task, self.workspace = config, task, workspace
        self.close_receipt: dict[str, Any] | None = None

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return SettledSandboxConfig(**config)

    @classmethod
    async def sample_init(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        metadata: dict[str, str],
    ) -> dict[str, SandboxEnvironment]:
        """A fresh workspace and a task over it, keyed uniquely for this sample."""
        settings = _config(config)
        workspace = tempfile.mkdtemp(prefix="settled-inspect-", dir=settings.workspaces)
        key = f"inspect-{uuid.uuid4().hex}"

        def open_task() -> str:
            with Runtime(settings.home) as runtime:
                return runtime.new_task(workspace, key=key).task

        task = await asyncio.to_thread(open_task)
        _record({"task": task, "key": key, "closed": False})  # there even if never cleaned up
        return {"default": cls(settings, task, workspace)}

    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        """Close each task (its receipt carries the checkpoint), then drop its workspace, and
        write the close into the sample's record (store and transcript)."""
        for environment in environments.values():
            box = environment.as_type(SettledSandboxEnvironment)
            record = _record(_summary(box.task, await box.close()))
            transcript().info(record, source=STORE_KEY)

    async def close(self) -> dict[str, Any]:
        """Close the task once; a repeat returns the same close receipt."""
        if self.close_receipt is not None:
            return self.close_receipt
        receipt: dict[str, Any] = await asyncio.to_thread(self._with_runtime, self._close)
        self.close_receipt = receipt
        if not self.config.keep_workspace:
            shutil.rmtree(self.workspace, ignore_errors=True)
        return receipt

    def _close(self, runtime: Runtime) -> dict[str, Any]:
        return close_with_checkpoint(runtime, self.task)

    def _with_runtime(self, call: Any) -> Any:
        with Runtime(self.config.home) as runtime:
            return call(runtime)

    async def _step(
        self,
        argv: list[str],
        *,
        stdin: bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: int | None = None,
        kind: str = EXEC_KEY,
    ) -> StepResult:
        """One step keyed by its kind; an exec gets Inspect's local environment rule, a file
        script none of the caller's environment (it sets its own PATH)."""
        command = kind == EXEC_KEY
        inherit = command and self.config.inherit_env
        grant = command and self.config.grant_interpreter
        grants = interpreter_grants(self.workspace) if grant else ()

        def run(runtime: Runtime) -> StepResult:
            return run_step(
                runtime,
                self.task,
                argv=argv,
                key=f"{kind}{uuid.uuid4().hex}",
                cwd=cwd or ".",
                timeout=None if timeout is None else float(timeout),
                env=env,
                stdin=stdin,
                inherit_env=inherit,
                readable=grants,
            )

        result: StepResult = await asyncio.to_thread(self._with_runtime, run)
        return result

    async def exec(
        self,
        cmd: list[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout: int | None = None,
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        """Run `cmd` in the sample's workspace (a relative `cwd` is inside it); TimeoutError
        when the receipt says the command's timeout ended it."""
        if user is not None:
            from inspect_ai.util import SandboxUserUnsupportedError

            raise SandboxUserUnsupportedError(f"the settled sandbox runs no command as {user!r}")
        stdin = input.encode() if isinstance(input, str) else input
        result = await self._step(list(cmd), stdin=stdin, cwd=cwd, env=env, timeout=timeout)
        if result.timed_out:
            raise TimeoutError(f"command timed out after {timeout} s: {cmd!r}")
        limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        if max(len(result.stdout), len(result.stderr)) > limit:  # like Inspect's own subprocess
            truncated = _text(result.stdout[-limit:])
            raise OutputLimitExceededError(
                SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR, truncated
            )
        code = result.code if result.code is not None else -1
        stdout, stderr = _text(result.stdout), _text(result.stderr)
        return ExecResult(success=code == 0, returncode=code, stdout=stdout, stderr=stderr)

    async def write_file(self, file: str, contents: str | bytes) -> None:
        """Written by a command in the boundary (parents made), so it lands where the
        command could write, never through a link to where only the harness could."""
        data = contents.encode() if isinstance(contents, str) else contents
        op = fileops.write_op(file, data)
        fileops.answer(await self._step(op.argv, stdin=op.stdin, kind=WRITE_KEY), file)

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        """Read by a command in the boundary; its bytes exactly (text: utf-8, newlines kept)."""
        limit = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE
        result = await self._step(fileops.read_op(file, limit).argv, kind=READ_KEY)
        data = fileops.answer(result, file)
        if len(data) > limit:  # the script read at most one byte past it
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None)
        return data.decode("utf-8") if text else data

    def default_polling_interval(self) -> float:
        return 0.2


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _record(facts: dict[str, Any]) -> dict[str, Any]:
    """Merge `facts` into the sample store's "settled" entry (the running sample's store: the
    sandbox's init and cleanup run inside the sample, and the store goes into the log)."""
    box = store()
    merged = {**box.get(STORE_KEY, {}), **facts}
    box.set(STORE_KEY, merged)
    return merged


def _summary(task: str, receipt: dict[str, Any]) -> dict[str, Any]:
    """The close, for the sample's record: its receipt's digest and its checkpoint's, and the
    receipt's sessions by outcome, the exec commands (`commands`) apart from the file reads
    and writes (`file_io`), told apart by their keys."""
    outcome: dict[str, list[str]] = (receipt.get("outcome") or {}).get("commands") or {}
    commands: dict[str, int] = {}
    file_io: dict[str, int] = {}
    for group, labels in outcome.items():
        files = sum(1 for label in labels if f"({FILE_KEY}" in label)
        commands[group], file_io[group] = len(labels) - files, files
    return {
        "task": task,
        "closed": True,
        "close_receipt": receipt.get("digest"),
        "checkpoint": (receipt.get("checkpoint") or {}).get("digest"),
        "commands": {group: n for group, n in commands.items() if n},
        "file_io": {group: n for group, n in file_io.items() if n},
    }
