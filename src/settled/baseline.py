"""What a plain `subprocess` gives on the essay's probes: the baseline `settled demo` compares with.

Each probe runs for real here, the way most harnesses run a tool call (`subprocess.run` with
`capture_output` and a `timeout`, or asyncio's line reader), and reports what the caller could
observe; nothing is assumed. These probes are measurements of the baseline, not settled: they
start their own processes on purpose, bounded by short sleeps, and end every process they start
(a descendant they leave is killed here by the pid it wrote).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

HOLD_S = 4  # how long a descendant holds the pipe in the baseline probes: bounds the demo


@dataclass(frozen=True)
class Observed:
    """What the caller of a plain subprocess saw, in words, and how long it took."""

    words: str
    seconds: float


def _timed(started: float, words: str) -> Observed:
    return Observed(words, time.monotonic() - started)


def retry_after_lost_response(scratch: str) -> Observed:
    """A retried call has no identity to return: it runs the command again."""
    started = time.monotonic()
    marker = os.path.join(scratch, "launches")
    for _ in range(2):  # the first response "lost", the harness retries
        subprocess.run(["sh", "-c", f"echo launched >> {marker}"], check=False, timeout=30)
    with open(marker) as handle:
        launches = len(handle.readlines())
    return _timed(started, f"{launches} launches (no key: a retry runs it again)")


async def _read_line(command: str) -> str:
    proc = await asyncio.create_subprocess_shell(
        command, stdout=asyncio.subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=10)
        return f"readline got {len(line)} bytes"
    except ValueError as exc:  # asyncio's LimitOverrunError surfaces as ValueError here
        return f"asyncio readline: {type(exc).__name__} ({exc}); the writer blocks on the pipe"
    finally:  # the whole group: `tr` would hold the pipe, and asyncio's wait waits for it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), timeout=10)


def long_line() -> Observed:
    """A 4 MiB line with no newline through asyncio's line reader (64 KiB default limit)."""
    started = time.monotonic()
    words = asyncio.run(_read_line("head -c 4194304 /dev/zero | tr '\\0' x"))
    return _timed(started, words)


def random_binary() -> Observed:
    """64 KiB of random bytes through `subprocess.run(text=True)`, as many harnesses decode."""
    started = time.monotonic()
    try:
        subprocess.run(
            ["head", "-c", "65536", "/dev/urandom"], capture_output=True, text=True, timeout=30
        )
        return _timed(started, "decoded (by luck)")
    except UnicodeDecodeError as exc:
        return _timed(started, f"UnicodeDecodeError at byte {exc.start}: output lost")


def silent_timeout() -> Observed:
    """`sleep 30` with a 1 s timeout: here the caller's own clock does fire."""
    started = time.monotonic()
    try:
        subprocess.run(["sleep", "30"], capture_output=True, timeout=1)
        words = "returned (no timeout)"
    except subprocess.TimeoutExpired:
        words = "TimeoutExpired; the child killed (its own descendants are not)"
    return _timed(started, words)


def holder_of_the_pipe(scratch: str) -> Observed:
    """`setsid sleep & echo`: the parent exits at once, a descendant keeps stdout open."""
    pid_file = os.path.join(scratch, "holder.pid")
    started = time.monotonic()
    try:
        subprocess.run(
            ["sh", "-c", f"setsid sleep {HOLD_S * 3} & echo $! > {pid_file}; echo parent exits"],
            capture_output=True,
            timeout=HOLD_S,
        )
        words = "returned"
    except subprocess.TimeoutExpired:
        words = f"hung until its timeout ({HOLD_S} s) although the command had exited"
    alive = _kill_survivor(pid_file)
    survivor = "the descendant was still alive after the call" if alive else "nothing survived"
    return _timed(started, f"{words}; {survivor}; no one proved the tree dead")


def _kill_survivor(pid_file: str) -> bool:
    try:
        with open(pid_file) as handle:
            pid = int(handle.read().strip())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def write_before_exit(scratch: str) -> Observed:
    """A file written a moment before exit: the call returns an exit code, nothing more."""
    started = time.monotonic()
    done = subprocess.run(["sh", "-c", "printf late > late.txt"], cwd=scratch, timeout=30)
    return _timed(started, f"exit code {done.returncode}; no checkpoint names the file")


def run_all() -> dict[str, Observed]:
    """Every baseline probe, keyed as `settled demo`'s table rows."""
    with tempfile.TemporaryDirectory(prefix="settled-baseline-") as scratch:
        return {
            "retry": retry_after_lost_response(scratch),
            "long_line": long_line(),
            "binary": random_binary(),
            "silent": silent_timeout(),
            "holder": holder_of_the_pipe(scratch),
            "late_write": write_before_exit(scratch),
        }
