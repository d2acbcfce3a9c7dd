"""The one-line notices the command line prints on stderr beside a verb's result: what a
person would otherwise not see (stdin that was not passed to the command; why `settled run`
ended with a code of settled's own rather than the command's).

Must never: block (stdin is looked at, never read), print on stdout (it is the verb's, and
with --json one JSON object), or import more than the standard library's C modules: `settled
run` pays for this on every call (tests/test_startup.py).
"""

from __future__ import annotations

import os
import stat
import sys

from settled.exitcodes import RUN_UNKNOWN, command_exit_code
from settled.printable import printable

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def stdin_left_behind(given: str | None, fd: int = 0) -> str | None:
    """The warning for stdin that holds bytes the command will not get (it reads empty stdin
    unless `--stdin` names a source), or None: `--stdin` was given, or stdin is a terminal,
    /dev/null, a socket, an empty or finished pipe, a file read to its end. Only bytes already
    waiting count: a pipe whose writer has written nothing yet is not waited for."""
    if given is not None:
        return None
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return None  # no stdin at all
    if stat.S_ISFIFO(mode):
        kind, waiting = "a pipe", _pipe_bytes(fd)
    elif stat.S_ISREG(mode):
        kind, waiting = "a file", _file_bytes(fd)
    else:
        return None
    if not waiting:
        return None
    return (
        f"settled: your stdin ({kind} with {waiting} bytes waiting) is not passed to the "
        "command, which gets empty stdin; pass it with --stdin - (stored with the session)"
    )


def _pipe_bytes(fd: int) -> int:
    import fcntl
    import termios

    try:
        answer = fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0")
    except OSError:
        return 0
    return int.from_bytes(answer, sys.byteorder)


def _file_bytes(fd: int) -> int:
    try:
        return max(0, os.fstat(fd).st_size - os.lseek(fd, 0, os.SEEK_CUR))
    except OSError:
        return 0  # not seekable: nothing to say


# -- why `settled run` ended with a code of settled's own ---------------------------------------


def outcome_line(
    session: str, task: str, receipt: dict[str, Any] | None, spec: dict[str, Any],
    cancel_reason: str | None = None,
) -> str | None:  # fmt: skip
    """The line `settled run` prints on stderr when its exit code is settled's, not the
    command's: why (from the receipt and the spec) and what to do. None when the command
    exited on its own (whatever its code: a command's own 124 or 127 is its business), so
    that nothing settled did not cause is ever said."""
    unknown = _unknown_because(receipt)
    if unknown is not None:
        death = receipt.get("death") if isinstance(receipt, dict) else None
        proven = isinstance(death, dict) and death.get("proven") is True  # recovered already
        then = "" if proven else f"; `settled recover --task {task}` settles it"
        return (
            f"settled: the outcome of {session} is unknown (exit 117): {unknown}. "
            f"`settled status {session}` says why{then}"
        )
    assert receipt is not None
    exit_fact: dict[str, Any] = receipt["exit"]
    reason = exit_fact["reason"]
    if reason == "exited":
        return None
    if reason == "not_started":
        return _never_started(session, exit_fact, spec)
    if reason == "timeout":
        grace = float(spec.get("grace") or 0)
        return (
            f"settled: {session} ran past its --timeout of {float(spec['timeout']):g} s: "
            f"stopped by settled (TERM, then KILL after {grace:g} s), exit 124; "
            f"what the command did on TERM is in `settled status {session}`"
        )
    if reason == "oom":
        limit = spec.get("memory")
        said = f"memory limit of {limit} bytes" if limit else "memory limit"
        return (
            f"settled: {session} was killed by the kernel at its {said} (--memory), exit 137; "
            f"see `settled status {session}`"
        )
    if reason == "cancelled":
        why = f" ({printable(cancel_reason)})" if cancel_reason else ""
        return f"settled: {session} was cancelled{why}; see `settled status {session}`"
    return None


def _unknown_because(receipt: dict[str, Any] | None) -> str | None:
    """Why no outcome can be claimed (what makes `command_exit_code` 117), or None: the code
    is known, or the command itself exited 117."""
    if command_exit_code(receipt) != RUN_UNKNOWN:
        return None
    if not isinstance(receipt, dict) or receipt.get("kind") != "process":
        return "it has no process receipt yet"
    death, exit_fact = receipt.get("death"), receipt.get("exit")
    if not isinstance(death, dict) or not isinstance(exit_fact, dict):
        return "its receipt has no death or exit facts"
    if death.get("proven") is not True:
        evidence = death.get("evidence") or death.get("why") or "none"
        return f"nothing proves its processes are gone ({printable(str(evidence))})"
    reason = exit_fact.get("reason")
    if reason == "owner_lost":
        return printable(str(exit_fact.get("note") or "the exit status was lost with its owner"))
    if reason == "exited" and exit_fact.get("code") == RUN_UNKNOWN:
        return None  # the command's own 117
    return "its receipt does not verify, or records no exit this settled can read"


ENOENT_AT_EXEC = "[Errno 2] "  # how the spawn words an exec's ENOENT (boundary/spawn.py)


def _never_started(session: str, exit_fact: dict[str, Any], spec: dict[str, Any]) -> str:
    stage = str(exit_fact.get("stage") or "start")
    error = printable(str(exit_fact.get("error") or exit_fact.get("note") or "no reason recorded"))
    argv = spec.get("argv") or []
    name = printable(str(argv[0])) if argv else ""
    if stage == "exec" and name and error.startswith(ENOENT_AT_EXEC):
        if "/" in name:
            return f"settled: {name}: no such file; the command never started (exit 127)"
        path = printable(dict(spec.get("env") or []).get("PATH", "(none)"))
        return (
            f"settled: {name}: not found on PATH (PATH={path}); the command never started "
            "(exit 127): give its full path, or a PATH that has it (--env PATH=...)"
        )
    return (
        f"settled: {session} never started ({stage}): {error} (exit 127); "
        f"see `settled status {session}`"
    )
