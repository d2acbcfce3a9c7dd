"""The worker side of the command line's thin client: in a process the home's zygote forked for
one call, become the caller (its stdio, directory, environment, umask, argv), run its command
line exactly as the CLI does, and send the exit code back.

Why: see cli/thin.py. The zygote imported this module, and with it the CLI, the Runtime and
the store, once; each call pays a fork. A worker serves one call and ends, so nothing one call
did (a store connection, a module's state) is seen by another.

Must never: run anything before it told its caller who it is (a caller that is gone by then
gets nothing run), outlive its caller (the caller's end of the connection closing kills it, as
the caller's own death would have ended the verb), or leave the caller's output unflushed
before the code is sent.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import sys

from settled import faults
from settled.cli import run_here
from settled.cli import verbs as _verbs  # noqa: F401 - the handlers, imported once, here
from settled.cli.frame import broken_pipe
from settled.cli.parser import prebuild
from settled.cli.reads import parse_quick as _parse_quick  # noqa: F401 - imported once, here
from settled.relay import Relay as _Relay  # noqa: F401 - likewise (in the zygote)
from settled.runtime import load_for_calls

KIND = b"cli"
# The verbs argparse parses (status, ps and ls have their own quick parser), built once here.
PREBUILT = ("run", "exec", "wait", "logs", "attach", "task", "cancel", "close", "checkpoint")
prebuild(PREBUILT)
load_for_calls()


def serve(body: bytes, fds: list[int], conn: int) -> int:
    """`body`: what cli/thin.py's `_request` wrote after the identity; `fds`: the caller's
    stdin, stdout, stderr and working directory; `conn`: the caller's connection, kept."""
    os.setsid()  # signals for the zygote's group are not this call's
    os.set_blocking(conn, True)
    argv = _become_caller(body, fds)
    try:
        os.write(conn, b"pid %d" % os.getpid())
    except OSError:
        return 0  # the caller is gone: it ran nothing, and nothing runs for it
    _die_with_caller(conn)
    code = _flushed(_run(argv))
    with contextlib.suppress(OSError):  # the caller is gone: nobody to tell
        os.write(conn, b"exit %d" % code)
    return 0


def _become_caller(body: bytes, fds: list[int]) -> list[str]:
    fields = body.split(b"\0")
    if fields[0] != KIND:
        raise ValueError(f"not a command line: {fields[0]!r}")
    umask, encoding, out_errors, err_errors = fields[1:5]
    argv0, count = os.fsdecode(fields[5]), int(fields[6])
    argv = [os.fsdecode(word) for word in fields[7 : 7 + count]]
    os.environb.clear()
    for item in fields[7 + count :]:
        name, _, value = item.partition(b"=")
        if name:
            os.environb[name] = value
    faults.arm(os.environ.get("SETTLED_FAULT", ""))  # imported with the zygote's environment
    os.umask(int(umask))
    os.fchdir(fds[3])
    os.close(fds[3])
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    text = encoding.decode()
    sys.stdin = open(0, encoding=text, closefd=False)  # noqa: SIM115 - the process's own
    sys.stdout = open(1, "w", encoding=text, errors=out_errors.decode(), closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", 1, text, err_errors.decode(), closefd=False)  # noqa: SIM115
    sys.argv = [argv0, *argv]
    return argv


def _die_with_caller(conn: int) -> None:
    """The caller sends nothing after its request, so its end becoming readable is its end:
    the kernel then signals SIGIO (O_ASYNC), whose default action ends this process as the
    caller's own death would have ended the verb. No thread: starting one waits for a CPU."""
    signal.signal(signal.SIGIO, signal.SIG_DFL)
    fcntl.fcntl(conn, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(conn, fcntl.F_SETFL, fcntl.fcntl(conn, fcntl.F_GETFL) | os.O_ASYNC)
    if select.select([conn], [], [], 0)[0]:
        os.kill(os.getpid(), signal.SIGKILL)  # it ended before the signal was armed


def _run(argv: list[str]) -> int:
    try:
        return run_here(argv)
    except SystemExit as exc:  # argparse's --help and usage errors end this way
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # outside the verb's own handling: as Python ends on it
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise


def _flushed(code: int) -> int:
    """Flush what the verb printed; a closed pipe is the CLI's quiet 141 (`frame.broken_pipe`),
    any other failing flush 120, as Python's own exit does when its last flush fails."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:
            code = code or broken_pipe()
        except OSError:
            code = code or 120
    return code
