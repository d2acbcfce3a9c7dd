"""The Inspect AI sandbox environment "settled": each sample gets a settled task over its own
workspace, every exec (and every file read and write) runs through settled inside the task's
boundary and ends with a process receipt, and the sample's cleanup closes the task, whose close
receipt carries the workspace checkpoint.

Registered when this module is imported (Inspect finds it through the `inspect_ai` entry
point), so `eval(task, sandbox="settled")` or `sandbox=("settled", SettledSandboxConfig(...))`.

File reads and writes are commands too, not the harness's own file I/O: a hostile command
could leave a symlink in the workspace pointing anywhere the harness may write, and writing
through it inside the boundary reaches only what the command itself could.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from typing import Any, Literal, overload

from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    sandboxenv,
)
from pydantic import BaseModel, ConfigDict

from settled.integrations._steps import StepResult, close_with_checkpoint, run_step
from settled.runtime import Runtime

# exit codes of the read script: absent, a directory, unreadable (the shell's own refusals)
_READ = 'if [ ! -e "$1" ]; then exit 3; elif [ -d "$1" ]; then exit 4; fi; exec cat -- "$1"'
_WRITE = 'if [ -d "$1" ]; then exit 4; fi; mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
_ABSENT, _DIRECTORY = 3, 4


class SettledSandboxConfig(BaseModel):
    """Where the sandbox's state lives: the settled home (default: SETTLED_HOME, else the
    user's) and the directory each sample's fresh workspace is made in (default: the temp
    directory). Frozen: Inspect hashes a sandbox spec's config."""

    model_config = ConfigDict(frozen=True)

    home: str | None = None
    workspaces: str | None = None
    keep_workspace: bool = False
    """Leave the sample's workspace after cleanup (its checkpoint is kept either way)."""


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
        return {"default": cls(settings, task, workspace)}

    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        """Close each task (its receipt carries the checkpoint), then drop its workspace."""
        for environment in environments.values():
            await environment.as_type(SettledSandboxEnvironment).close()

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
    ) -> StepResult:
        def run(runtime: Runtime) -> StepResult:
            return run_step(
                runtime,
                self.task,
                argv=argv,
                key=f"inspect-{uuid.uuid4().hex}",
                cwd=cwd or ".",
                timeout=None if timeout is None else float(timeout),
                env=env,
                stdin=stdin,
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
        result = await self._step(["/bin/sh", "-c", _WRITE, "sh", file], stdin=data)
        _raise_for(result, file)

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        """Read by a command in the boundary; its bytes exactly (text: utf-8, newlines kept)."""
        result = await self._step(["/bin/sh", "-c", _READ, "sh", file])
        _raise_for(result, file)
        if len(result.stdout) > SandboxEnvironmentLimits.MAX_READ_FILE_SIZE:
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None)
        return result.stdout.decode("utf-8") if text else result.stdout

    def default_polling_interval(self) -> float:
        return 0.2


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _raise_for(result: StepResult, file: str) -> None:
    """The read or write script's refusal as the exception Inspect documents."""
    if result.code == 0:
        return
    if result.code == _ABSENT:
        raise FileNotFoundError(file)
    if result.code == _DIRECTORY:
        raise IsADirectoryError(file)
    reason = _text(result.stderr).strip() or f"exit {result.code}"
    if "ermission denied" in reason or "ead-only file system" in reason:
        raise PermissionError(f"{file}: {reason}")
    raise OSError(f"{file}: {reason}")
