"""What every verb of the command line shares: printing a result, failing in one line, and
running a handler with every error mapped to its documented exit code.

The one line is escaped as every human view is (`printable`): an error may quote a command's
text. The JSON beside it is printed as it is.

Costs nothing to import (no argparse, no runtime until a verb opens one), so the read verbs'
quick path (`cli/reads.py`) and the full parser (`cli/parser.py`, handlers in `cli/verbs.py`)
run their handlers alike.
"""

from __future__ import annotations

import json
import os
import sys

from settled.errors import (
    EXIT_BLOCKED,
    EXIT_BROKEN_PIPE,
    EXIT_CODES,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CursorOutOfRange,
    SettledError,
)
from settled.printable import printable
from settled.states import SETTLED

TYPE_CHECKING = False
if TYPE_CHECKING:
    from argparse import Namespace
    from collections.abc import Callable
    from typing import Any, BinaryIO

    from settled.runtime import Runtime

    Handler = Callable[[Runtime, Namespace], int]


def emit(args: Namespace, payload: dict[str, Any], text: str, brief: str | None = None) -> None:
    """One JSON object with --json; with -q only `brief` (the id a script wants), if any."""
    if getattr(args, "json", False):
        print(json.dumps(payload, sort_keys=True))
    elif getattr(args, "quiet", False):
        if brief is not None:
            print(brief)
    else:
        print(text)


def settled_code(view: dict[str, Any]) -> int:
    proven = view.get("receipt", {}).get("death", {}).get("proven", False)
    return EXIT_OK if view["state"] == SETTLED and proven else EXIT_BLOCKED


def fail(args: Namespace, payload: dict[str, Any], message: str, code: int) -> int:
    if getattr(args, "debug", False) and sys.exc_info()[0] is not None:
        import traceback

        traceback.print_exc()
    if getattr(args, "json", False):
        print(json.dumps(payload, sort_keys=True))
    print(f"settled: {printable(str(payload['error']))}: {printable(message)}", file=sys.stderr)
    return code if code in EXIT_CODES and code != EXIT_OK else EXIT_FAILURE


def internal_error(args: Namespace, exc: Exception) -> int:
    """A bug: one line (the traceback only with --debug), and a code that is listed."""
    message = f"{type(exc).__name__}: {exc} (please report this)"
    return fail(args, {"error": "internal error", "message": message}, message, EXIT_FAILURE)


def execute(args: Namespace, dispatch: Callable[[Namespace], int]) -> int:
    """Run `dispatch(args)`; every error is one line on stderr (and a JSON object with --json)
    and a listed exit code, never a traceback unless --debug asked for it."""
    try:
        code = dispatch(args)
        sys.stdout.flush()  # a closed pipe is found here, not by the interpreter's last flush
        return code
    except BrokenPipeError:
        return broken_pipe()
    except SettledError as exc:
        return fail(args, exc.to_json(), str(exc), exc.exit_code)
    except CursorOutOfRange as exc:
        return fail(args, {"error": "CursorOutOfRange", "message": str(exc)}, str(exc), EXIT_USAGE)
    except OSError as exc:  # a disk error no verb typed: still one line naming the disk
        from settled.runtime import storage_error

        typed = storage_error(exc, getattr(args, "home", None) or "the settled home", args.verb)
        if typed is None:
            return internal_error(args, exc)
        return fail(args, typed.to_json(), str(typed), typed.exit_code)
    except KeyboardInterrupt:
        payload = {"error": "Interrupted", "message": "interrupted"}
        return fail(args, payload, "interrupted", EXIT_INTERRUPTED)
    except Exception as exc:
        return internal_error(args, exc)


def write_all(sink: BinaryIO, data: bytes) -> None:
    """All of `data`, or an error: a buffered write as large as a pipe's capacity returns
    short (and raises nothing) when the reader leaves in the middle of it; the next write
    finds the closed pipe (BrokenPipeError)."""
    view = memoryview(data)
    while view:
        written = sink.write(view)
        view = view[written or 0 :]


def broken_pipe() -> int:
    """The reader of stdout went away (`settled ls | head -1`): stop without a word, as git
    does (a shell reports it killed by SIGPIPE, 141; Python ignores SIGPIPE, so the code is
    returned). What was buffered is dropped: stdout becomes /dev/null, so no later flush (the
    interpreter's own at exit) fails again and prints its `Exception ignored`."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return EXIT_BROKEN_PIPE
    try:
        os.dup2(devnull, sys.stdout.fileno(), inheritable=False)
    except (OSError, ValueError, AttributeError):
        pass  # stdout is not a descriptor: nothing to flush there
    finally:
        os.close(devnull)
    return EXIT_BROKEN_PIPE


def bind_backends(args: Namespace) -> None:
    """--store, --objects and --password-file travel through the environment, so every face
    (a server's worker Runtimes, MCP, owners) binds the same."""
    for flag, name in (
        ("store", "SETTLED_STORE"),
        ("objects", "SETTLED_OBJECTS"),
        ("password_file", "SETTLED_STORE_PASSWORD_FILE"),  # storepass.PASSWORD_FILE_ENV
    ):
        if getattr(args, flag, None):
            os.environ[name] = getattr(args, flag)


CLI_LAUNCHER = "home"  # a CLI call is a new process: the home's zygote forks its owners


def _launcher_for(args: Namespace) -> str:
    """The demo is one long process on a temporary home: its own zygote ends with it, where
    the home's would outlive the home."""
    return "warm" if getattr(args, "verb", None) == "demo" else CLI_LAUNCHER


def with_runtime(args: Namespace) -> int:
    """The verb's handler with a Runtime on the verb's home, closed after. Its owners come from
    the home's warm launcher unless SETTLED_LAUNCHER names another."""
    from settled.runtime import Runtime

    bind_backends(args)
    handler: Handler = args.handler
    launcher = os.environ.get("SETTLED_LAUNCHER") or _launcher_for(args)
    with Runtime(getattr(args, "home", None), launcher=launcher) as rt:
        return handler(rt, args)
