"""Commands for settled's own helper processes (owners, the zygote, journals), and their reports.

Each runs as a fresh `python -I -S` (about 10 ms to start, against ~47 ms for a default
interpreter with site packages) with only the import roots it needs put on sys.path by hand.
Never imports anything heavy: the launchers call it on the admission path, and a helper itself
imports it (`json_text`) before its work is done, so its module imports are os and sys alone
(json alone would cost a fresh owner 3-6 ms here: it brings re and enum).

A helper reports readiness as one JSON line on a pipe. `read_report` waits for it with poll(),
never select(): a launcher in a process with more than 1,024 descriptors open (a busy server)
gets a pipe numbered past FD_SETSIZE, which select() refuses.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable
    from typing import Any


class HelperUnavailable(RuntimeError):
    pass


_ROOTS: dict[str, str] = {}  # module -> its root: found once per process (every launch asks)


def import_roots(*modules: str) -> list[str]:
    """The sys.path entries that hold these modules (a package's parent, a module's folder)."""
    roots: list[str] = []
    for module in modules:
        root = _ROOTS.get(module) or _find_root(module)
        if root not in roots:
            roots.append(root)
    return roots


def _find_root(module: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise HelperUnavailable(f"cannot locate module {module!r}: pip install it")
    origin = os.path.dirname(spec.origin)
    root = os.path.dirname(origin) if spec.submodule_search_locations else origin
    _ROOTS[module] = root
    return root


def python_command(target: str, modules: tuple[str, ...], *args: str) -> list[str]:
    """`python -I -S -c …` that puts `modules` on sys.path and calls `target(argv)`,
    where target is "package.module:function"; its return value is the exit status. The
    roots travel as a count and that many arguments: no json (nor any other import) to parse
    them before the helper's own imports. They go after the standard library's entries, as
    site-packages does in any interpreter: a standard module is then found without listing
    site-packages (hundreds of entries), ~0.5 ms of a fresh owner's start."""
    module, _, function = target.partition(":")
    roots = import_roots(*modules)
    boot = (
        "import sys; n = int(sys.argv[1]); sys.path += sys.argv[2 : 2 + n]; "
        f"from {module} import {function}; sys.exit({function}(sys.argv[2 + n :]))"
    )
    return [sys.executable, "-I", "-S", "-c", boot, str(len(roots)), *roots, *args]


def start_helper(
    command: Callable[[int], list[str]],
    log: str,
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    pass_fds: tuple[int, ...] = (),
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a helper detached from the caller (its own session, stdin /dev/null, stdout and
    stderr appended to `log`), handing it the write end of a readiness pipe as `command(fd)`
    (and `pass_fds`, which the caller closes). Returns the first process (the caller waits for
    it) and the pipe's read end (the caller reads the report with `read_report` and closes it)."""
    import subprocess

    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    try:
        log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            process = subprocess.Popen(
                command(ready_w),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
                pass_fds=(ready_w, *pass_fds),
                start_new_session=True,
                close_fds=True,
                cwd=cwd,
            )
        finally:
            os.close(log_fd)
    except BaseException:
        os.close(ready_r)
        raise
    finally:
        os.close(ready_w)
    return process, ready_r


def spawn_detached(
    argv: list[str],
    log: str,
    env: dict[str, str],
    fds: tuple[int, ...],
    blocked: tuple[int, ...] = (),
) -> int:
    """posix_spawn a helper in its own session (stdin /dev/null, stdout and stderr appended to
    `log`), passing it `fds` at their own numbers (close-on-exec descriptors of the caller, so
    no other child of the caller inherits them), with the `blocked` signals blocked until it
    unblocks them. Returns its pid at once: it is the caller's child, for the caller to reap.
    A vfork: the caller's memory is not copied, whatever its size."""
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        actions = [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, log_fd, 1),
            (os.POSIX_SPAWN_DUP2, log_fd, 2),
            # dup2 onto itself clears close-on-exec in the child only (POSIX; glibc >= 2.29)
            *((os.POSIX_SPAWN_DUP2, fd, fd) for fd in fds),
        ]
        return os.posix_spawn(
            argv[0], argv, env, file_actions=actions, setsid=True, setsigmask=blocked
        )
    finally:
        os.close(log_fd)


class NoReport(Exception):
    """The helper did not report: `timeout` (the deadline passed) or `eof` (it exited first)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class ReportReader:
    """A helper's report lines, one at a time: a helper that says more than one thing (an
    owner: its pid, then that its command runs) keeps what follows a line for the next."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._pending = b""

    def next(self, give_up: float) -> Any:
        """The next line, parsed as JSON, by the monotonic `give_up`. Raises NoReport; a line
        that is not JSON raises ValueError."""
        import json
        import select
        import time

        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while b"\n" not in self._pending:
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                raise NoReport("timeout")
            if not poller.poll(remaining * 1000.0):
                continue
            chunk = os.read(self.fd, 4096)
            if not chunk:
                raise NoReport("eof")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)


def read_report(fd: int, give_up: float) -> Any:
    """The first line a helper writes on `fd`, parsed as JSON, by the monotonic `give_up`.
    Raises NoReport; a line that is not JSON raises ValueError."""
    return ReportReader(fd).next(give_up)


# -- JSON without the json module ---------------------------------------------------------

_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_SHORT_ESCAPES |= {"\b": "\\b", "\f": "\\f"}


def _json_string(text: str) -> str:
    """What json.dumps writes for a string (ensure_ascii: every character outside ' '..'~'
    escaped, astral ones as a surrogate pair)."""
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return f'"{text}"'
    out = []
    for char in text:
        code = ord(char)
        if char in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[char])
        elif 0x20 <= code <= 0x7E:
            out.append(char)
        elif code > 0xFFFF:
            code -= 0x10000
            out.append(f"\\u{0xD800 | (code >> 10):04x}\\u{0xDC00 | (code & 0x3FF):04x}")
        else:
            out.append(f"\\u{code:04x}")
    return '"' + "".join(out) + '"'


def json_text(value: object) -> str:
    """json.dumps(value) for None, bool, int, float, str and lists and str-keyed dicts of them,
    byte for byte, without importing json: a helper writes its reports with it before its own
    imports. Anything else is refused (TypeError), never written approximately."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        if value != value:
            return "NaN"
        if value in (float("inf"), float("-inf")):
            return "Infinity" if value > 0 else "-Infinity"
        return float.__repr__(value)
    if isinstance(value, str):
        return _json_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(json_text(item) for item in value) + "]"
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        items = (f"{_json_string(key)}: {json_text(item)}" for key, item in value.items())
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"json_text writes no {type(value).__name__}: {value!r}")
