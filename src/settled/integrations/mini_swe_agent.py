"""A mini-swe-agent environment whose every step runs through settled and ends with a receipt.

Name it in a mini-swe-agent config (its get_environment imports a dotted path):

    environment:
      environment_class: settled.integrations.mini_swe_agent.SettledEnvironment
      workspace: /path/to/repo
      task_key: my-run-42        # the same key after a crash replays, never reruns, steps

Step n of the task keyed `task_key` is admitted under a key derived from both, so a harness
that restarts and replays its steps gets the first run's sessions (and receipts) back. The
exit code and the timeout come from the process receipt, never from the command's output.

The command's environment follows LocalEnvironment's rule (os.environ | config env) through
settled's recorded `inherit_env`; the interpreter mini runs under is granted read-only, so
`python3` on that PATH is the same one (`inherit_env: false` and `grant_interpreter: false`
give settled's fixed base environment instead).
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

from minisweagent.environments.local import LocalEnvironment, LocalEnvironmentConfig
from pydantic import Field

from settled.integrations._steps import (
    LocalSteps,
    ServiceSteps,
    StepEnv,
    StepResult,
    interpreter_grants,
    step_key,
)


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
    settled task; `close()` closes the task, whose receipt carries its workspace checkpoint."""

    config: SettledEnvironmentConfig

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(config_class=SettledEnvironmentConfig, **kwargs)
        self.backend: LocalSteps | ServiceSteps = (
            ServiceSteps(self.config.url, self.config.token)
            if self.config.url
            else LocalSteps(self.config.home)
        )
        workspace = self.config.workspace or os.getcwd()
        self.task, self.task_key = self.backend.new_task(workspace, self.config.task_key or None)
        self.steps = 0
        self.last: StepResult | None = None
        self.close_receipt: dict[str, Any] | None = None

    def execute(
        self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None
    ) -> dict[str, Any]:
        """Run the action's command as the next step; the answer has LocalEnvironment's shape
        (a timeout is returncode -1 with a TimeoutExpired exception_info, like its own)."""
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
        self._check_finished(output)  # LocalEnvironment's: raises Submitted on the marker
        return output

    def _step_env(self) -> StepEnv:
        """LocalEnvironment's rule, os.environ | config env, recorded; a service's host is
        not this one, so its commands get no grant of this interpreter's paths."""
        local = not self.config.url and self.config.grant_interpreter
        return StepEnv(
            env=dict(self.config.env),
            inherit=self.config.inherit_env,
            readable=interpreter_grants() if local else (),
        )

    def close(self) -> dict[str, Any]:
        """Close the task (once; a repeat returns the same receipt) and release the backend."""
        if self.close_receipt is None:
            self.close_receipt = self.backend.close(self.task)
            self.backend.release()
        return self.close_receipt

    def cleanup(self) -> None:
        """mini-swe-agent's other environments' name for close()."""
        self.close()


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
