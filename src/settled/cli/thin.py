"""The command line's thin client: when the home's warm process answers, a verb runs there, in
a worker it forks for this one call with this process's stdin, stdout, stderr, directory,
environment and umask; this process only relays signals to it and exits with its code.

Why: a CLI call is a new interpreter, and an agent makes hundreds of them a task. Importing the
runtime, the store, argparse and the launcher cost this process ~25 ms before it did anything;
the home's zygote (owner/home_launcher.py) has all of it imported already, and a fork of it
costs ~1 ms. This is how chg serves Mercurial and Bazel's client its server: the expensive
process stays warm, the process a user starts stays thin. The verb itself is unchanged: the
worker runs the same `run_here` with the same arguments (cli/worker.py), and every file and
byte it writes is this process's own, passed by descriptor.

When it is not used, the verb runs in this process as before: no zygote answers on the home's
socket, the zygote is of another install (it then leaves: the next `run` starts one of this
install), SETTLED_CLI=local or a SETTLED_LAUNCHER other than "home", a long-lived verb (serve,
mcp, demo, probe, soak), or anything this parser does not read as plainly as argparse would.

Must never: run a command line twice (once the worker named itself, the call is its own: a
worker that ends without a code is reported, never retried here), or import more than `os`,
`sys` and the C halves of `socket` and `signal`.
"""

from __future__ import annotations

import _socket
import os
import sys

from settled.where import (
    LAUNCHER_LOG,
    LAUNCHER_SOCKET,
    VERB_REQUEST_MAGIC,
    install_identity,
    resolve_home,
    run_dir,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal  # the same names, typed
else:
    import _signal  # `signal` builds its enums on import: ~0.4 ms this module saves

SERVED = frozenset({
    "task", "exec", "run", "attach", "ls", "ps", "wait", "logs", "status", "cancel", "close",
    "checkpoint", "recover", "hosts", "explain", "restore", "verify",
})  # fmt: skip
GLOBAL_VALUED = ("--home", "--store", "--objects")
GLOBAL_FLAGS = ("--json", "-q", "--quiet", "--debug")
FORWARDED = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP, _signal.SIGQUIT, _signal.SIGCONT)
ANSWER_TIMEOUT_S = 10.0  # the zygote forks and the worker names itself within this
EXIT_FAILURE = 1  # errors.EXIT_FAILURE, not imported: that module costs what this one saves
MAX_REQUEST = 200_000  # under a SOCK_SEQPACKET send buffer's default (net.core.wmem_default)


def answered_by_home(argv: list[str]) -> int | None:
    """The verb's exit code if the home's warm process ran it; None if this process must."""
    if os.environ.get("SETTLED_CLI") == "local":
        return None
    if os.environ.get("SETTLED_LAUNCHER", "home") != "home":
        return None  # a test or a user chose how owners start: the verb runs here, as asked
    home = served_home(argv)
    if home is None:
        return None
    sock = _connect(os.path.join(run_dir(home), LAUNCHER_SOCKET))
    if sock is None:
        return None
    try:
        worker = _hand_over(sock, argv)
        return None if worker is None else _relay(sock, worker, home)
    finally:
        sock.close()


def served_home(argv: list[str]) -> str | None:
    """The home named by argv (else SETTLED_HOME, else the default), if its verb is served
    and its options before the verb are ones this reads exactly as argparse does."""
    explicit: str | None = None
    words = iter(argv)
    verb = None
    for word in words:
        if word == "--":
            break
        if verb is None and word in GLOBAL_FLAGS:
            continue
        name, equals, value = word.partition("=")
        if name in GLOBAL_VALUED:
            value = value if equals else next(words, "")
            if not value or value.startswith("-"):
                return None  # argparse words that error
            explicit = value if name == "--home" else explicit
        elif verb is None:
            if word.startswith("-"):
                return None  # --help, an abbreviation, anything else: argparse reads it
            verb = word
    if verb not in SERVED:
        return None
    return resolve_home(explicit)


def _connect(path: str) -> _socket.socket | None:
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET | _socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(ANSWER_TIMEOUT_S)
        sock.connect(path)
    except (OSError, ValueError):  # none answers here, or no such path: this process runs it
        sock.close()
        return None
    return sock


def _hand_over(sock: _socket.socket, argv: list[str]) -> int | None:
    """Send the command line with this process's stdio and directory; the worker's pid once it
    named itself, None if nothing will run it there (this process then runs it)."""
    try:
        request = _request(argv)
    except ValueError:  # a word no file name can hold: this process says which
        return None
    if request is None:
        return None
    try:
        here = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fds = b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in (0, 1, 2, here))
        sock.sendmsg([request], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
    except OSError:
        return None  # too large, or a descriptor closed under us: nothing was sent
    finally:
        os.close(here)
    try:
        answer = sock.recv(64)
    except TimeoutError:
        late = f"the home's warm process did not answer in {ANSWER_TIMEOUT_S:g} s"
        raise SystemExit(_say(f"{late} (SETTLED_CLI=local runs verbs in this process)")) from None
    except OSError:
        return None  # closed on us (a zygote that left, or one that refuses this process): here
    if not answer.startswith(b"pid "):
        return None  # b"stop" (another install), b"noface", b"refused", a zygote that left: here
    return int(answer[4:])


def _request(argv: list[str]) -> bytes | None:
    streams = sys.stdin, sys.stdout, sys.stderr
    if any(stream is None for stream in streams):
        return None  # started without one of them: Python's own handling, here
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            return None
    umask = os.umask(0o022)
    os.umask(umask)
    out, err = sys.stdout, sys.stderr
    fields = [
        b"cli", b"%d" % umask, out.encoding.encode(), (out.errors or "strict").encode(),
        (err.errors or "backslashreplace").encode(),
        os.fsencode(sys.argv[0] if sys.argv else "settled"), b"%d" % len(argv),
        *map(os.fsencode, argv), *(k + b"=" + v for k, v in os.environb.items()),
    ]  # fmt: skip
    request = VERB_REQUEST_MAGIC + install_identity().encode() + b"\0" + b"\0".join(fields)
    return request if len(request) <= MAX_REQUEST else None


def _relay(sock: _socket.socket, worker: int, home: str) -> int:
    """Forward the signals a terminal or a supervisor sends this process; the worker's code,
    or its end: a worker that a signal ended (told by the zygote, its parent) ends this
    process by the same signal, as the verb run here would have."""

    def forward(signum: int, _frame: object) -> None:
        try:  # noqa: SIM105 - contextlib costs what this module saves
            os.kill(worker, signum)
        except ProcessLookupError:
            pass

    def suspend(signum: int, _frame: object) -> None:
        """Ctrl-Z: the worker stops first, then this process (SIGCONT, forwarded, resumes both)."""
        forward(_signal.SIGSTOP, _frame)
        os.kill(os.getpid(), _signal.SIGSTOP)

    for signum in FORWARDED:
        _signal.signal(signum, forward)
    _signal.signal(_signal.SIGTSTP, suspend)
    sock.settimeout(None)
    answer = sock.recv(64)
    word, _, number = answer.partition(b" ")
    if word == b"exit":
        return int(number)
    if word == b"killed":
        try:  # noqa: SIM105 - contextlib costs what this module saves
            _signal.signal(int(number), _signal.SIG_DFL)
        except OSError:
            pass  # SIGKILL and SIGSTOP have no handler to reset
        os.kill(os.getpid(), int(number))
        return 128 + int(number)  # a signal that does not end a process: the shell's code
    log = os.path.join(run_dir(home), LAUNCHER_LOG)
    ended = f"exited {int(number)}" if word == b"ended" else "ended"
    return _say(f"the worker that ran this command line {ended} without an exit code (see {log})")


def _say(message: str) -> int:
    print(f"settled: WorkerLost: {message}", file=sys.stderr)
    return EXIT_FAILURE
