"""A mini-swe-agent environment whose every step runs through settled and ends with a receipt.

Name it in a mini-swe-agent config (its get_environment imports a dotted path):

    environment:
      environment_class: settled.integrations.mini_swe_agent.SettledEnvironment
      workspace: /path/to/repo
      task_key: my-run-42        # the same key after a crash replays, never reruns, steps

Step n of the task keyed `task_key` is admitted under a key derived from both, so a harness
that restarts and replays its steps gets the first run's sessions (and receipts) back. The
exit code and the timeout come from the process receipt, never from the command's output.

The task closes when mini's run ends. mini's agents never close an environment, so the close
rides on what they do call: the step whose command submits (the environment raises
`Submitted`, mini's end of a run) closes the task before the agent saves its trajectory, and
`serialize()`, which every save merges into the trajectory, writes the task id and the close
receipt's digests into its `info`. A run that ends any other way (a limit, an error, Ctrl-C)
is closed by the `atexit` hook, or by `with SettledEnvironment(...)` / `close()` if the caller
holds the environment. A step after a submit (mini's interactive agent lets the user type a
new task) opens the next task, keyed `task_key.1`, `.2`, ...: each submission is one closed
task, all of them listed in `info`.

The command's environment follows LocalEnvironment's rule (os.environ | config env) through
settled's recorded `inherit_env`; the interpreter mini runs under is granted read-only, so
`python3` on that PATH is the same one (`inherit_env: false` and `grant_interpreter: false`
give settled's fixed base environment instead).
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
from typing import Any

from minisweagent.environments.local import LocalEnvironment, LocalEnvironmentConfig
from minisweagent.exceptions import Submitted
from pydantic import Field

from settled.integrations._steps import (
    LocalSteps,
    ServiceSteps,
    StepEnv,
    StepResult,
    interpreter_grants,
    step_key,
)

_log = logging.getLogger(__name__)


class SettledEnvironmentConfig(LocalEnvironmentConfig):
    """LocalEnvironment's fields (cwd is relative to the workspace, env is added to the
    command's) plus where the task lives."""

    workspace: str = ""
    """The task's workspace: the directory the commands may change (default: the cwd)."""
    task_key: str = ""
    """Names the task and, with each step's ordinal, each step's session (default: random)."""
    home: str | None = None
    """The settled home (default: SETTLED_HOME, else the user's), when no `url` is given."""
    url: str = ""
    """A settled service's address (`settled serve`): steps run there, not in a local home."""
    token: str | None = Field(default=None, exclude=True)
    """The service's bearer token (default: SETTLED_TOKEN); never written to a trajectory."""
    inherit_env: bool = True
    """Pass this process's environment, as LocalEnvironment does (settled's own variables and
    the home's credentials withheld); false: settled's base PATH, HOME and LANG only."""
    grant_interpreter: bool = True
    """Grant read-only the interpreter mini runs under, so `python3` is the same one."""


class SettledEnvironment(LocalEnvironment):
    """mini-swe-agent's Environment protocol (execute, get_template_vars, serialize) over a
    settled task, closed when the run ends (see the module's docstring)."""

    config: SettledEnvironmentConfig

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(config_class=SettledEnvironmentConfig, **kwargs)
        self.backend: LocalSteps | ServiceSteps = (
            ServiceSteps(self.config.url, self.config.token)
            if self.config.url
            else LocalSteps(self.config.home)
        )
        self.workspace = self.config.workspace or os.getcwd()
        self.task, self.task_key = self.backend.new_task(
            self.workspace, self.config.task_key or None
        )
        self.run_key = self.task_key  # the continuations' keys derive from the first
        self.steps = 0
        self.last: StepResult | None = None
        self.close_receipt: dict[str, Any] | None = None
        self.close_error: str | None = None
        self.closed: list[dict[str, Any]] = []  # the earlier tasks of this run, each closed
        self.done = False  # close() was called: no step runs any more
        atexit.register(self._close_at_exit)

    def __enter__(self) -> SettledEnvironment:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def execute(
        self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None
    ) -> dict[str, Any]:
        """Run the action's command as the next step; the answer has LocalEnvironment's shape
        (a timeout is returncode -1 with a TimeoutExpired exception_info, like its own). The
        step that submits closes the task before mini records the run's end."""
        if self.done:
            raise RuntimeError(f"settled task {self.task} was closed: this environment is done")
        if self.close_receipt is not None:
            self._next_task()
        command = action.get("command", "")
        key = step_key(self.task_key, self.steps)
        self.steps += 1
        limit = timeout or self.config.timeout
        result = self.backend.step(
            self.task,
            command,
            key=key,
            cwd=cwd or self.config.cwd or ".",
            timeout=float(limit),
            env=self._step_env(),
        )
        self.last = result
        output = _observation(command, limit, result)
        try:
            self._check_finished(output)  # LocalEnvironment's: raises Submitted on the marker
        except Submitted:
            self._close_task()
            raise
        return output

    def _step_env(self) -> StepEnv:
        """LocalEnvironment's rule, os.environ | config env, recorded; a service's host is
        not this one, so its commands get no grant of this interpreter's paths."""
        local = not self.config.url and self.config.grant_interpreter
        return StepEnv(
            env=dict(self.config.env),
            inherit=self.config.inherit_env,
            readable=interpreter_grants(self.workspace) if local else (),
        )

    def _close_task(self) -> None:
        """Close the current task; a close that fails is recorded (in `info`) and retried by
        close(), never allowed to turn the agent's submission into an error."""
        try:
            self.close_receipt = self.backend.close(self.task)
        except Exception as exc:  # the submission stands; info and the atexit close say why
            self.close_error = f"{type(exc).__name__}: {exc}"
            _log.warning("settled task %s did not close: %s", self.task, self.close_error)
            return
        self.close_error = None
        atexit.unregister(self._close_at_exit)  # nothing open is left to close at exit
        self.backend.release()  # a batch of runs holds no connection per finished run

    def _next_task(self) -> None:
        """A step after a submit: the user gave a new task, so settled gets a new one too."""
        self.closed.append(self._task_info())
        key = f"{self.run_key}.{len(self.closed)}"
        self.task, self.task_key = self.backend.new_task(self.workspace, key)
        self.steps, self.close_receipt = 0, None
        atexit.register(self._close_at_exit)

    def close(self) -> dict[str, Any]:
        """Close the task (once; a repeat returns the same receipt) and release the backend."""
        if self.close_receipt is None:
            self.close_receipt = self.backend.close(self.task)
            self.close_error = None
        self.done = True
        atexit.unregister(self._close_at_exit)
        self.backend.release()
        return self.close_receipt

    def _close_at_exit(self) -> None:
        """The run ended without a submit or a close (a limit, an error, Ctrl-C): close now,
        through the backend's exit path (this interpreter can start no thread any more)."""
        try:
            if self.close_receipt is None:
                self.close_receipt = self.backend.close_at_exit(self.task, self.workspace)
            self.close()
        except Exception as exc:  # at exit there is no caller left to raise to
            _log.error("settled task %s did not close at exit: %s", self.task, exc)

    def cleanup(self) -> None:
        """mini-swe-agent's other environments' name for close()."""
        self.close()

    def serialize(self) -> dict[str, Any]:
        """LocalEnvironment's record plus `info.settled`: the task id and key, and once closed
        the close receipt's digest and its checkpoint's; every trajectory save merges it."""
        data: dict[str, Any] = super().serialize()
        current = self._task_info()
        settled = {**current, "tasks": [*self.closed, current]}
        data["info"]["settled"] = settled
        return data

    def _task_info(self) -> dict[str, Any]:
        receipt = self.close_receipt or {}
        info: dict[str, Any] = {
            "task": self.task,
            "task_key": self.task_key,
            "steps": self.steps,
            "closed": self.close_receipt is not None,
            "close_receipt": receipt.get("digest"),
            "checkpoint": (receipt.get("checkpoint") or {}).get("digest"),
        }
        if self.close_error is not None:
            info["close_error"] = self.close_error
        return info


def _observation(command: str, limit: int, result: StepResult) -> dict[str, Any]:
    """LocalEnvironment's answer: stdout then stderr (kept apart by settled, so not
    interleaved), the exit code, and the receipt's session for whoever wants the proof."""
    text = (result.stdout + result.stderr).decode("utf-8", errors="replace")
    extra = {"session": result.session, "reused": result.reused}
    if result.timed_out:
        error = subprocess.TimeoutExpired(command, limit)
        return {
            "output": text,
            "returncode": -1,
            "exception_info": f"An error occurred while executing the command: {error}",
            "extra": {**extra, "exception_type": "TimeoutExpired", "exception": str(error)},
        }
    code = result.code if result.code is not None else -1
    return {"output": text, "returncode": code, "exception_info": "", "extra": extra}
