"""The verbs that start a command and stay with it: `exec`, `run` and `attach`. Each admits
through the Runtime with the command's words, environment and stdin as the caller gave them
(settled.environment's policy: the caller's PATH unless --clean-env), says before it starts
what a person should know (stdin left behind, a PATH that leads outside the command's view),
relays both streams as the owner stores them, and exits with the command's code, saying in one
line why when the code is settled's own.

Must never: decide a command's outcome (the receipt does, settled.exitcodes words it), read the
caller's stdin unless asked (`--stdin -`), or print on stdout anything but the command's bytes
(`run`, `attach`) or the one answer (`exec`, `--json`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from settled.cli.frame import broken_pipe, emit, settled_code
from settled.cli.parser import UsageError
from settled.environment import caller_policy, path_of, unseen_on_path
from settled.errors import EXIT_INTERRUPTED, EXIT_OK, BadInput
from settled.exitcodes import command_exit_code
from settled.printable import printable
from settled.render import status_text

TYPE_CHECKING = False
if TYPE_CHECKING:  # the runtime is imported by the verbs that open one
    from typing import Any

    from settled.relay import Relay
    from settled.requests import ExecRequest
    from settled.runtime import Admission, Runtime


def _read_stdin_arg(value: str | None) -> bytes | None:
    if value is None:
        return None
    if value == "-":
        return sys.stdin.buffer.read()
    try:
        with open(value, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise BadInput(f"--stdin {value!r} cannot be read: {exc.strerror}") from exc


def _command_words(args: argparse.Namespace, verb: str) -> list[str]:
    command = list(args.command)
    if not command or command[0] != "--":
        raise UsageError(f"{verb} needs `--` before the command: settled {verb} [options] -- CMD")
    if len(command) == 1:
        raise UsageError(f"{verb} needs a command after `--`")
    return command[1:]


def _environment(args: argparse.Namespace) -> dict[str, str]:
    """--env-file files in order, then --env pairs: the last word on a name wins."""
    explicit: dict[str, str] = {}
    for path in args.env_file:
        from settled.environment import parse_env_file

        explicit.update(parse_env_file(path))
    for pair in args.env:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise UsageError(f"--env {pair!r} is not NAME=VALUE")
        explicit[name] = value
    return explicit


def _admit(rt: Runtime, args: argparse.Namespace, verb: str) -> Admission:
    command = _command_words(args, verb)
    from settled.cli.notices import stdin_left_behind

    if (warning := stdin_left_behind(args.stdin)) is not None:
        print(warning, file=sys.stderr, flush=True)
    explicit = _environment(args)  # --env-file read once, for the hint and the command
    _say_where_path_leads(rt, args, command, explicit)
    return rt.admit(args.task, _exec_request(args, command, explicit))


def _exec_request(
    args: argparse.Namespace, command: list[str], explicit: dict[str, str]
) -> ExecRequest:
    """The request the flags ask for: each of `ExecRequest`'s options from the flag of its
    name (`cli/parser.py`), but those made from the command's words, the env files, stdin and
    the caller's environment (FROM_WORDS)."""
    from settled.requests import ExecRequest

    flags = {o.name: getattr(args, o.name) for o in ExecRequest.OPTIONS if o.name not in FROM_WORDS}
    return ExecRequest(
        argv=command if len(command) > 1 else None,
        shell=command[0] if len(command) == 1 else None,
        env=explicit,
        stdin=_read_stdin_arg(args.stdin),
        allow_hosts=args.allow_host,
        inherit=caller_policy(args.inherit, args.inherit_env, args.clean_env, os.environ),
        inherited=(),  # what a remote caller names; here the Runtime reads the caller's own
        **flags,
    )


# The options not taken as their flag gives them: each is made by _exec_request.
FROM_WORDS = frozenset({"argv", "shell", "env", "stdin", "allow_hosts", "inherit", "inherited"})


def _say_where_path_leads(
    rt: Runtime, args: argparse.Namespace, command: list[str], explicit: dict[str, str]
) -> None:
    """A line on stderr when the command's first word is found on its PATH in a directory its
    view does not show (a virtualenv outside the workspace): said before it runs."""
    roots = rt.view_roots(args.task, args.writable, args.readable, args.isolation)
    if roots is None:
        return
    words = command if len(command) > 1 else command[0].split()  # a shell string's first word
    first = words[0] if words else ""
    # the caller's PATH whole: an entry in the task's own dirs is never in `roots`, so never
    # what it runs instead (Runtime.exec leaves those out)
    search = path_of(explicit, args.clean_env, os.environ)
    if note := unseen_on_path(first, search, roots):
        print(f"settled: {printable(note)}", file=sys.stderr, flush=True)


def cmd_exec(rt: Runtime, args: argparse.Namespace) -> int:
    admission = _admit(rt, args, "exec")
    payload = admission.to_json()
    verb = "reused" if admission.reused else "admitted"
    text = f"{verb} session {admission.session} (key {printable(admission.key)}): {admission.state}"
    if not args.wait:
        emit(args, payload, text, brief=admission.session)
        return EXIT_OK
    view = rt.wait(admission.session)
    payload.update(state=view["state"], receipt=view.get("receipt"))
    emit(args, payload, text + "\n" + status_text(view), brief=admission.session)
    return settled_code(view)


def cmd_run(rt: Runtime, args: argparse.Namespace) -> int:
    """Admit, relay both streams as they arrive, exit with the command's code."""
    admission = _admit(rt, args, "run")
    if getattr(args, "json", False):
        view = rt.wait(admission.session)
        receipt = view.get("receipt")
        print(json.dumps(receipt or view, sort_keys=True))
        _say_why(rt, admission.session, receipt)
        return command_exit_code(receipt)
    from settled.relay import Relay

    return _relay(rt, Relay(admission.session), args.cancel_on_interrupt)


def cmd_attach(rt: Runtime, args: argparse.Namespace) -> int:
    """Go on relaying a session from the cursors a detach printed."""
    rt.session_record(args.session)  # UnknownSession: one line, exit 2
    from settled.relay import Relay

    relay = Relay(args.session, {"stdout": args.start, "stderr": args.stderr_start})
    return _relay(rt, relay, args.cancel_on_interrupt)


def _relay(rt: Runtime, relay: Relay, cancel_on_interrupt: bool) -> int:
    sinks = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}
    try:
        short = relay.run(rt, sinks)
    except KeyboardInterrupt:
        if not cancel_on_interrupt:
            print(
                f"settled: detached; session {relay.session} runs on. Re-attach: "
                f"{relay.resume_hint()}",
                file=sys.stderr,
            )
            return EXIT_INTERRUPTED
        rt.cancel(relay.session, "cancelled by Ctrl-C of settled run")
        print(f"settled: cancelling session {relay.session} (TERM, grace, KILL)", file=sys.stderr)
        short = relay.run(rt, sinks)  # a second Ctrl-C detaches, through main's handler
    except BrokenPipeError:
        return broken_pipe()  # `settled run ... | head`: quiet, and the command runs on
    for stream, (stored, final) in short.items():
        print(
            f"settled: {stream} of {relay.session} is stored only to byte {stored} of its "
            f"final cursor {final}: the output shown is incomplete",
            file=sys.stderr,
        )
    receipt = rt.wait(relay.session).get("receipt")
    _say_why(rt, relay.session, receipt)
    return command_exit_code(receipt)


def _say_why(rt: Runtime, session: str, receipt: dict[str, Any] | None) -> None:
    """One line on stderr when run's code is settled's (timeout, never started, unknown,
    cancelled, oom), never for the command's own exit (cli/notices.py)."""
    from settled.cli.notices import outcome_line

    record = rt.session_record(session)
    line = outcome_line(session, record.task, receipt, record.spec, record.cancel_requested)
    if line is not None:
        print(line, file=sys.stderr, flush=True)
