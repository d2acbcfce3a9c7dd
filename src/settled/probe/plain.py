"""The `subprocess` adapter: the essay's checklist against a plain `subprocess.run` with a timeout.

This is the baseline most harnesses use: `subprocess.run(cmd, shell=True, capture_output=True,
text=True, encoding="utf-8", errors="replace", timeout=T)`, the caller reading what it returns.
Each experiment runs for real and reports what the caller could observe and what the kernel's
process table shows afterwards; nothing is assumed about subprocess. It starts its own processes
on purpose, each carrying the probe's marker, and ends each one it started (a process the call
left running is killed here, and the answer says it was).
Must never: describe subprocess from memory instead of from the experiment it just ran.
"""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import time

from settled.probe import questions as q
from settled.probe.host import Proc, Sweep, await_running

HOW = (
    'subprocess.run(cmd, shell=True, capture_output=True, text=True, encoding="utf-8", '
    'errors="replace", timeout=T)'
)
# A caller that dies mid-call: a child interpreter running the same call, killed by the probe.
CALLER = "import subprocess, sys; subprocess.run(sys.argv[1], shell=True, timeout=60)"


class Result:
    """What one call returned: the decoded stdout, the return code or the timeout, and when."""

    def __init__(self, stdout: str, returncode: int | None, seconds: float) -> None:
        self.stdout, self.returncode, self.seconds = stdout, returncode, seconds

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


class PlainAdapter:
    """`settled probe --runtime subprocess`."""

    name = "subprocess"

    def __init__(self, sweep: Sweep) -> None:
        self.sweep = sweep

    def describe(self) -> dict[str, str]:
        return {
            "name": self.name,
            "version": f"Python {platform.python_version()} subprocess",
            "how": HOW,
            "where": "this process, this machine",
        }

    def experiments(self) -> dict[str, q.Experiment]:
        return q.experiments_of(self)

    def close(self) -> None:
        """Nothing stays open between experiments: each ended what it started."""

    def _run(self, question: str, cmd: str, cwd: str, timeout: float = 60.0) -> Result:
        env = {**os.environ, **self.sweep.env(question)}
        started = time.monotonic()
        try:
            done = subprocess.run(
                cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True,
                encoding="utf-8", errors="replace", timeout=timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode("utf-8", "replace") if isinstance(exc.stdout, bytes) else ""
            return Result(out, None, time.monotonic() - started)
        return Result(done.stdout, done.returncode, time.monotonic() - started)

    def _left(self, question: str) -> tuple[list[Proc], list[dict[str, object]]]:
        """What of the question's commands still runs, then ended by the probe."""
        left = self.sweep.left(question)
        self.sweep.end(question)
        return left, [proc.to_json() for proc in left]

    # -- the experiments ------------------------------------------------------------------

    def retry(self, scratch: str) -> q.Outcome:
        first = self._run("retry", q.LAUNCH, scratch)  # its answer "lost": the caller retries
        second = self._run("retry", q.LAUNCH, scratch)
        launches = q.count(_read(scratch, "launches.txt"))
        return q.judged(
            launches == 1,
            f"{launches} launches: subprocess has no key, so the retry ran the command again",
            launches=launches,
            returncodes=[first.returncode, second.returncode],
        )

    def long_line(self, scratch: str) -> q.Outcome:
        got = self._run("long_line", q.LONG_LINE, scratch)
        data = got.stdout.encode()
        want = b"x" * q.LINE_BYTES
        return _compared(data, want, got.seconds)

    def binary(self, scratch: str) -> q.Outcome:
        got = self._run("binary", q.BINARY, scratch)
        written = _read(scratch, "random.bin")
        outcome = _compared(got.stdout.encode(), written, got.seconds)
        replaced = got.stdout.count("\ufffd")
        if replaced:
            words = f"{outcome.answer}; {replaced} bytes decoded as U+FFFD (errors='replace')"
            return q.Outcome(outcome.verdict, words, {**outcome.evidence, "replaced": replaced})
        return outcome

    def silent(self, scratch: str) -> q.Outcome:
        got = self._run("silent", q.SILENT, scratch, timeout=q.SILENT_TIMEOUT_S)
        left, ended = self._left("silent")
        on_time = got.timed_out and got.seconds <= q.SILENT_TIMEOUT_S + q.ON_TIME_SLACK_S
        words = (
            f"TimeoutExpired after {got.seconds:.2f} s" if got.timed_out
            else f"returned {got.returncode} after {got.seconds:.2f} s"
        )  # fmt: skip
        if left:
            proc = left[0]
            words += f", but `{proc.cmdline}` (pid {proc.pid}) ran on: the kill hit /bin/sh only"
        return q.judged(
            on_time and not left, words, returned_after_s=round(got.seconds, 3),
            timed_out=got.timed_out, running_after_the_call=ended,
        )  # fmt: skip

    def holder(self, scratch: str) -> q.Outcome:
        got = self._run("holder", q.HOLDER, scratch, timeout=q.HOLDER_TIMEOUT_S)
        left, ended = self._left("holder")
        words = (
            f"hung {got.seconds:.2f} s until its timeout though the command exited at once"
            if got.timed_out else f"returned after {got.seconds:.2f} s"
        )  # fmt: skip
        if left:
            words += f"; `{left[0].cmdline}` (pid {left[0].pid}) was alive after the call"
        words += "; nothing proves the tree dead"
        return q.fails(
            words, returned_after_s=round(got.seconds, 3), timed_out=got.timed_out,
            running_after_the_call=ended, proof=None,
        )  # fmt: skip

    def owner_killed(self, scratch: str) -> q.Outcome:
        """The caller is the only supervisor: run the call in a child interpreter, SIGKILL it
        once the command launched, look at the command, then retry as a harness would."""
        env = {**os.environ, **self.sweep.env("owner_killed")}
        caller = subprocess.Popen(
            [sys.executable, "-c", CALLER, q.KILLED], cwd=scratch, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            launched = await_running(self.sweep, "owner_killed", q.KILLED_SLEEP, 20.0)
        finally:
            caller.send_signal(signal.SIGKILL)
            caller.wait(timeout=10)
        orphans = self.sweep.left("owner_killed")
        retry = self._run("owner_killed", q.KILLED, scratch, timeout=q.SILENT_TIMEOUT_S)
        launches = q.count(_read(scratch, "launches.txt"))
        _, ended = self._left("owner_killed")
        ran_on = sorted(orphans, key=lambda p: not p.cmdline.startswith("sleep"))
        words = (
            f"the caller (its only supervisor) was SIGKILLed; `{ran_on[0].cmdline}` ran on "
            f"unsupervised (pid {ran_on[0].pid})" if ran_on
            else "the caller (its only supervisor) was SIGKILLed; its command died with it"
        )  # fmt: skip
        words += f"; nothing said Unknown; a retry launched it again ({launches} launches)"
        return q.judged(
            launches == 1 and not ran_on, words, launched_before_the_kill=launched,
            caller_pid=caller.pid, running_after_the_kill=[p.to_json() for p in orphans],
            launches=launches, retry_timed_out=retry.timed_out, ended_by_the_probe=ended,
        )  # fmt: skip

    def late_write(self, scratch: str) -> q.Outcome:
        got = self._run("late_write", q.LATE_WRITE.format(token="late-plain"), scratch)
        on_disk = os.path.exists(os.path.join(scratch, "late.txt"))
        return q.not_applicable(
            f"no checkpoint exists: the call returned exit code {got.returncode}, and late.txt "
            f"is {'on disk, unrecorded' if on_disk else 'not on disk'}",
            returncode=got.returncode, on_disk=on_disk,
        )  # fmt: skip

    def fenced(self, scratch: str) -> q.Outcome:
        del scratch
        return q.not_applicable(
            "subprocess has no task, no close and no generation: nothing can be fenced, so a "
            "late writer's write lands"
        )

    def receipt(self, scratch: str) -> q.Outcome:
        got = self._run("receipt", q.DONE, scratch)
        return q.fails(
            f"return code {got.returncode}, nothing more: nothing names what ended, what was "
            "drained or what the workspace held",
            returncode=got.returncode, receipt=None,
        )  # fmt: skip


def _read(scratch: str, name: str) -> bytes:
    try:
        with open(os.path.join(scratch, name), "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        return b""


def _compared(got: bytes, want: bytes, seconds: float) -> q.Outcome:
    """Holds when the caller got exactly the bytes written."""
    at = q.first_difference(got, want)
    evidence = {
        "written": len(want), "received": len(got), "written_digest": q.sha256(want),
        "received_digest": q.sha256(got), "first_difference": at,
        "returned_after_s": round(seconds, 3),
    }  # fmt: skip
    if at is None:
        return q.holds(f"{len(got):,} bytes, bit for bit", **evidence)
    return q.fails(
        f"{len(want):,} bytes written, {len(got):,} received after decoding; they differ "
        f"from byte {at:,}",
        **evidence,
    )
