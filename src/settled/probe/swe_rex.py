"""The `swerex` adapter: the essay's checklist against SWE-ReX's local runtime, as agents use it.

Drives `swerex.runtime.local.LocalRuntime` (installed with `pip install 'settled[swerex]'`) the
way SWE-agent does: a bash session (pexpect on a pty) per experiment, `run_in_session` with a
`BashAction` and its timeout. "The owner killed" kills the runtime process itself: the same
calls in a child interpreter, SIGKILLed once its command launched. Each answer is what the
observation carried and what the kernel's process table shows afterwards.
Must never: import swerex before it is asked for (it is an optional extra), or leave a bash
session or a command of it running (each is closed, then swept by its marker).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Coroutine
from typing import Any

from settled.probe import questions as q
from settled.probe.host import Sweep, await_running

HOW = (
    "swerex.runtime.local.LocalRuntime: a bash session (pexpect) per experiment, "
    "run_in_session(BashAction(command, timeout))"
)
STARTUP_S = 30.0  # its default (1 s) is too short for a bash on a loaded 2-CPU machine
# The runtime process that dies mid-call: a child interpreter making the same calls.
CHILD = """
import asyncio, sys
from swerex.runtime.abstract import BashAction, CreateBashSessionRequest
from swerex.runtime.local import LocalRuntime

async def main():
    rt = LocalRuntime()
    await rt.create_session(CreateBashSessionRequest(session="probe", startup_timeout=30))
    cd = BashAction(session="probe", command=f"cd {sys.argv[1]}", check="silent")
    await rt.run_in_session(cd)
    run = BashAction(session="probe", command=sys.argv[2], timeout=60, check="silent")
    await rt.run_in_session(run)

asyncio.run(main())
"""


def installed() -> str | None:
    """SWE-ReX's version, or None when it is not installed here."""
    from importlib import metadata

    try:
        return metadata.version("swe-rex")
    except metadata.PackageNotFoundError:
        return None


class Observed:
    """One action's observation: its output (None after a timeout), exit code and time."""

    def __init__(self, output: str | None, exit_code: int | None, seconds: float, error: str = ""):
        self.output, self.exit_code, self.seconds, self.error = output, exit_code, seconds, error

    @property
    def timed_out(self) -> bool:
        return self.error == "CommandTimeoutError"


def _sync(coroutine: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coroutine)


class SwerexAdapter:
    """`settled probe --runtime swerex`."""

    name = "swerex"

    def __init__(self, sweep: Sweep) -> None:
        from swerex.runtime.local import LocalRuntime

        self.sweep = sweep
        self.version = installed() or "unknown"
        self.runtime = LocalRuntime()

    def describe(self) -> dict[str, str]:
        return {
            "name": self.name,
            "version": f"swe-rex {self.version}",
            "how": HOW,
            "where": "this process (the runtime) and its bash sessions, this machine",
        }

    def experiments(self) -> dict[str, q.Experiment]:
        return q.experiments_of(self)

    def close(self) -> None:
        _sync(self.runtime.close())

    # -- driving the runtime --------------------------------------------------------------

    @contextlib.contextmanager
    def _session(self, question: str, scratch: str) -> Any:
        """A bash session in `scratch` whose commands carry the question's marker; closed
        after, and whatever of it still runs is then ended."""
        from swerex.runtime.abstract import CloseBashSessionRequest, CreateBashSessionRequest

        request = CreateBashSessionRequest(session=question, startup_timeout=STARTUP_S)
        _sync(self.runtime.create_session(request))
        try:
            mark = self.sweep.mark(question)
            self._act(question, f"export PROBE_MARK={mark} && cd {scratch}", 30)
            yield question
        finally:
            _sync(self.runtime.close_session(CloseBashSessionRequest(session=question)))

    def _act(self, session: str, command: str, timeout: float = 60.0) -> Observed:
        from swerex.exceptions import SwerexException
        from swerex.runtime.abstract import BashAction

        action = BashAction(session=session, command=command, timeout=timeout, check="silent")
        started = time.monotonic()
        try:
            seen = _sync(self.runtime.run_in_session(action))
        except SwerexException as exc:
            return Observed(None, None, time.monotonic() - started, type(exc).__name__)
        return Observed(seen.output, seen.exit_code, time.monotonic() - started)

    def _ended(self, question: str) -> list[dict[str, object]]:
        left = self.sweep.left(question)
        self.sweep.end(question)
        return [proc.to_json() for proc in left]

    # -- the experiments ------------------------------------------------------------------

    def retry(self, scratch: str) -> q.Outcome:
        with self._session("retry", scratch) as session:
            self._act(session, q.LAUNCH)  # its observation "lost": the agent retries
            self._act(session, q.LAUNCH)
        launches = q.count(_read(scratch, "launches.txt"))
        return q.judged(
            launches == 1,
            f"{launches} launches: an action has no key, so the retry ran the command again",
            launches=launches,
        )

    def long_line(self, scratch: str) -> q.Outcome:
        with self._session("long_line", scratch) as session:
            seen = self._act(session, q.LONG_LINE)
        return _compared((seen.output or "").encode(), b"x" * q.LINE_BYTES, seen)

    def binary(self, scratch: str) -> q.Outcome:
        with self._session("binary", scratch) as session:
            seen = self._act(session, q.BINARY)
        return _compared((seen.output or "").encode(), _read(scratch, "random.bin"), seen)

    def silent(self, scratch: str) -> q.Outcome:
        with self._session("silent", scratch) as session:
            seen = self._act(session, q.SILENT, timeout=q.SILENT_TIMEOUT_S)
            left = self.sweep.left("silent")  # before the session's close ends the shell
        ended = self._ended("silent")
        on_time = seen.timed_out and seen.seconds <= q.SILENT_TIMEOUT_S + q.ON_TIME_SLACK_S
        words = f"{seen.error or 'returned'} after {seen.seconds:.2f} s"
        if left:
            words += f", but `{left[0].cmdline}` (pid {left[0].pid}) ran on after the call"
        return q.judged(
            on_time and not left, words, returned_after_s=round(seen.seconds, 3),
            timed_out=seen.timed_out, running_after_the_call=[p.to_json() for p in left],
            ended_by_the_probe=ended,
        )  # fmt: skip

    def holder(self, scratch: str) -> q.Outcome:
        with self._session("holder", scratch) as session:
            seen = self._act(session, q.HOLDER, timeout=q.HOLDER_TIMEOUT_S)
            left = self.sweep.left("holder")
        ended = self._ended("holder")
        words = f"{seen.error or 'returned'} after {seen.seconds:.2f} s"
        if left:
            words += f"; `{left[0].cmdline}` (pid {left[0].pid}) was alive after the call"
        words += "; nothing proves the tree dead"
        return q.fails(
            words, returned_after_s=round(seen.seconds, 3),
            running_after_the_call=[p.to_json() for p in left], ended_by_the_probe=ended,
            proof=None,
        )  # fmt: skip

    def owner_killed(self, scratch: str) -> q.Outcome:
        env = {**os.environ, **self.sweep.env("owner_killed")}
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, scratch, q.KILLED], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            launched = await_running(self.sweep, "owner_killed", q.KILLED_SLEEP, 30.0)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)
        time.sleep(0.2)  # the pty's hangup reaches the shell and its jobs
        after_kill = self.sweep.left("owner_killed")
        with self._session("owner_killed_retry", scratch) as session:
            self._act(session, q.KILLED, timeout=q.SILENT_TIMEOUT_S)  # the agent's retry
        launches = q.count(_read(scratch, "launches.txt"))
        ended = self._ended("owner_killed") + self._ended("owner_killed_retry")
        ran_on = sorted(after_kill, key=lambda p: not p.cmdline.startswith("sleep"))
        words = (
            f"the runtime process was SIGKILLed; `{ran_on[0].cmdline}` ran on (pid "
            f"{ran_on[0].pid})" if ran_on
            else "the runtime process was SIGKILLed; nothing of the command ran 0.2 s later"
        )  # fmt: skip
        words += f"; nothing said Unknown; a retry launched it again ({launches} launches)"
        return q.judged(
            launches == 1 and not ran_on, words, launched_before_the_kill=launched,
            runtime_pid=child.pid, running_after_the_kill=[p.to_json() for p in after_kill],
            launches=launches, ended_by_the_probe=ended,
        )  # fmt: skip

    def late_write(self, scratch: str) -> q.Outcome:
        with self._session("late_write", scratch) as session:
            seen = self._act(session, q.LATE_WRITE.format(token="late-swerex"))
        return q.not_applicable(
            f"SWE-ReX keeps no checkpoint: the action returned exit code {seen.exit_code}",
            exit_code=seen.exit_code,
            on_disk=os.path.exists(os.path.join(scratch, "late.txt")),
        )

    def fenced(self, scratch: str) -> q.Outcome:
        del scratch
        return q.not_applicable(
            "SWE-ReX has no close and no generation: nothing can be fenced, so a late "
            "writer's write lands"
        )

    def receipt(self, scratch: str) -> q.Outcome:
        with self._session("receipt", scratch) as session:
            seen = self._act(session, q.DONE)
        return q.fails(
            f"exit code {seen.exit_code} (read with `echo $?` after the prompt), nothing more: "
            "no receipt",
            exit_code=seen.exit_code, output=seen.output, receipt=None,
        )  # fmt: skip


def _read(scratch: str, name: str) -> bytes:
    try:
        with open(os.path.join(scratch, name), "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        return b""


def _compared(got: bytes, want: bytes, seen: Observed) -> q.Outcome:
    at = q.first_difference(got, want)
    evidence = {
        "written": len(want), "received": len(got), "written_digest": q.sha256(want),
        "received_digest": q.sha256(got), "first_difference": at,
        "returned_after_s": round(seen.seconds, 3), "error": seen.error or None,
    }  # fmt: skip
    if at is None:
        return q.holds(f"{len(got):,} bytes, bit for bit, in {seen.seconds:.2f} s", **evidence)
    if want and want in got:  # whole, but not alone: the prompt's and the pty's bytes around it
        return q.fails(
            f"the {len(want):,} bytes came back inside {len(got):,} after {seen.seconds:.2f} s, "
            f"with {len(got) - len(want)} bytes the shell and the pty added around them",
            **evidence,
        )
    return q.fails(
        f"{len(want):,} bytes written, {len(got):,} came back through the pty in "
        f"{seen.seconds:.2f} s; they differ from byte {at:,}",
        **evidence,
    )
