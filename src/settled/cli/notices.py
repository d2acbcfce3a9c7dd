"""The one-line notices the command line prints on stderr beside a verb's result: what a
person would otherwise not see (stdin that was not passed to the command).

Must never: block (stdin is looked at, never read), print on stdout (it is the verb's, and
with --json one JSON object), or import more than the standard library's C modules: `settled
run` pays for this on every call (tests/test_startup.py).
"""

from __future__ import annotations

import os
import stat
import sys


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
