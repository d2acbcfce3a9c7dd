"""What `settled serve --swerex` does for each SWE-ReX call: one task, keyed sessions, receipts.

Owns: mapping SWE-ReX's runtime (bash sessions, execute, close) onto settled. One SWE-ReX
runtime is one machine whose bash sessions and commands share a filesystem, so it is **one
settled task** on the workspace (`--swerex-workspace`, else a new directory), made at the first
create_session or execute and closed, with a checkpoint, by SWE-ReX's `close`. Every action is
a settled session of that task with an invocation key: ``swerex:<n>:<name>:<position>`` for
the action at `position` of the n-th bash session (named `name`, or a hash of a name that is
not a plain word), ``swerex:execute:<position>`` for the execute calls. SWE-ReX's client sends
one ``X-Request-ID`` per call and the same one on its retries, so a request id seen before gets
its first position back: the same key, so settled returns the same session, never a second run.

Output is each stream whole up to a cap, or its head and tail with a marker
(server/swerex_output.py); the script of a bash action and its state report are
server/swerex_shell.py's; read_file, write_file and upload, commands of the same task, are
server/swerex_files.py's. Over 400 lines because it is every call's mapping onto one task (and
the bounds a retry needs), which is read best in one place.

Must never: run an action twice for one request id; carry state from text the action printed
(swerex_shell: the state report is on its own stream, behind a nonce); name a CLI flag in what
an HTTP caller reads as an error; answer a close without each task's id and receipt digest.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shlex
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from settled.errors import WorkspaceOverlap
from settled.requests import ExecRequest, TaskRequest
from settled.runtime import Runtime
from settled.server.swerex_output import DEFAULT_OUTPUT_CAP, report_tail, stream_text
from settled.server.swerex_shell import (
    BOOT,
    ShellState,
    new_nonce,
    read_report,
    read_syntax_error,
    report_note,
    script,
)

MAX_ACTION_WAIT_S = 24 * 3600.0  # an action without a timeout is waited for this long at most
RETRY_WINDOW = 256  # the last request ids a retry is recognised by (each session, executes...)
MAX_COMMAND_BYTES = 16 << 20  # one bash action's text (its script is stored as the stdin)
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class SwerexError(Exception):
    """An error the client re-raises as ``class_path`` (a swerex.exceptions class)."""

    def __init__(self, class_path: str, message: str, extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.class_path = class_path
        self.extra = extra or {}


def swerex_error(name: str, message: str, extra: dict[str, Any] | None = None) -> SwerexError:
    return SwerexError(f"swerex.exceptions.{name}", message, extra)


_V = TypeVar("_V")


def remember(window: dict[str, _V], request_id: str, value: _V) -> None:
    """Keep `value` for `request_id`, and only the last RETRY_WINDOW request ids (a dict keeps
    insertion order: the oldest go first)."""
    window[request_id] = value
    while len(window) > RETRY_WINDOW:
        del window[next(iter(window))]


@dataclass
class Positions:
    """Positions handed out, by request id: a retry (same X-Request-ID) gets its first one.
    Only the last RETRY_WINDOW request ids are kept: a retry comes right after its first try,
    and a runtime's memory does not grow with its calls."""

    by_request: dict[str, int] = field(default_factory=dict)
    count: int = 0

    def take(self, request_id: str | None) -> int:
        if request_id is not None and request_id in self.by_request:
            return self.by_request[request_id]
        position = self.count
        self.count += 1
        if request_id is not None:
            remember(self.by_request, request_id, position)
        return position


@dataclass
class BashSession:
    """One SWE-ReX bash session: its number, the state the last action left, its positions."""

    serial: int
    label: str
    task: tuple[str, str]  # (task id, workspace): the task its actions run in
    state: ShellState
    created_by: str | None = None  # the X-Request-ID of its create_session
    positions: Positions = field(default_factory=Positions)
    # (state, nonce) of each action a retry may still come for
    before: dict[int, tuple[ShellState, str]] = field(default_factory=dict)

    def forget_unretryable(self) -> None:
        """Drop what no retry can ask for again (its request id gone from the window, or none)."""
        retryable = set(self.positions.by_request.values())
        for position in [p for p in self.before if p not in retryable]:
            del self.before[position]


class SwerexService:
    """The home, the runtime's one task, its bash sessions and what close answered."""

    def __init__(
        self,
        home: str,
        api_key: str,
        workspace: str | None = None,
        *,
        cap: int = DEFAULT_OUTPUT_CAP,
        say: Callable[[str], None] = lambda message: None,
    ) -> None:
        if not api_key:
            raise ValueError("the SWE-ReX service never runs without a key")
        self.home = home
        self.api_key = api_key
        self.workspace = workspace
        self.cap = cap
        self.say = say
        self.task: tuple[str, str] | None = None  # (task id, workspace) of the open task
        self.sessions: dict[str, BashSession] = {}
        self.executes = Positions()
        self.file_ops = Positions()  # read_file, write_file, upload (server/swerex_files.py)
        self.serials = 0
        self.closed: list[dict[str, Any]] = []  # every task this service closed, in order
        self.close_answers: dict[str, dict[str, Any]] = {}  # X-Request-ID -> close's answer
        self.lock = threading.Lock()  # the maps above
        self.task_lock = threading.Lock()  # making or closing the task: one at a time

    def runtime(self) -> Runtime:
        """A Runtime holds one SQLite connection usable from its own thread only, and calls run
        on worker threads: each call opens its own (closed by its caller's `with`)."""
        return Runtime(self.home)

    def open_task(self, runtime: Runtime) -> tuple[str, str]:
        """The runtime's task, made now if there is none (all sessions and executes share it)."""
        with self.task_lock:
            if self.task is None:
                try:
                    record = runtime.create_task(TaskRequest(workspace=self.workspace))
                except WorkspaceOverlap as exc:
                    held = ", ".join(task for task, _path in exc.others)
                    raise swerex_error(
                        "SwerexException",
                        f"workspace {exc.workspace} is held by open task(s) {held}, not this "
                        "server's: ask again once they are closed",
                    ) from None
                self.task = (record.task, record.workspace)
                self.say(f"task {record.task} opened on workspace {record.workspace}")
            return self.task

    # -- bash sessions -------------------------------------------------------------------

    def create_session(self, body: dict[str, Any], request_id: str | None) -> dict[str, Any]:
        name = str(body.get("session", "default"))
        with self.runtime() as runtime:
            task = self.open_task(runtime)
        with self.lock:
            found = self.sessions.get(name)
            if found is not None and (request_id is None or found.created_by != request_id):
                raise swerex_error("SessionExistsError", f"session {name} already exists")
            if found is None:
                self.serials += 1
                label = name if _PLAIN_NAME.fullmatch(name) else _hashed(name)
                found = BashSession(self.serials, label, task, ShellState(task[1]), request_id)
                self.sessions[name] = found
        output = ""
        for index, source in enumerate(body.get("startup_source", [])):
            again = f"{request_id}:startup:{index}" if request_id is not None else None
            command = f"source {shlex.quote(str(source))}"
            output += self._run(name, command, None, again)["output"]
        return {"output": output, "session_type": "bash"}

    def _session(self, name: str) -> BashSession:
        with self.lock:
            found = self.sessions.get(name)
        if found is None:
            raise swerex_error("SessionDoesNotExistError", f"session {name!r} does not exist")
        return found

    def run_in_session(self, body: dict[str, Any], request_id: str | None) -> dict[str, Any]:
        name = str(body.get("session", "default"))
        if body.get("action_type", "bash") == "bash_interrupt":
            # SWE-agent interrupts after a timeout; settled already ended that command and its
            # whole boundary when the timeout passed, so there is nothing left to interrupt.
            self._session(name)
            return {"output": "", "exit_code": 0, "failure_reason": "", "session_type": "bash"}
        command = _bash_command(body)
        observation = self._run(name, command, body.get("timeout"), request_id)
        if body.get("check", "raise") == "raise" and observation["exit_code"] != 0:
            message = (
                f"Command {command!r} failed with exit code {observation['exit_code']}. "
                f"Here is the output:\n{observation['output']!r}"
            )
            if body.get("error_msg"):
                message = f"{body['error_msg']}: {message}"
            code = observation["exit_code"]
            raise swerex_error("NonZeroExitCodeError", message, {"exit_code": code})
        return observation

    def _run(self, name: str, command: str, timeout: Any, request_id: str | None) -> dict[str, Any]:
        session = self._session(name)
        with self.lock:
            position = session.positions.take(request_id)
            # a retry runs the very script its first try ran: same key, same digest
            state, nonce = session.before.setdefault(position, (session.state, new_nonce()))
            session.forget_unretryable()
        task, workspace = session.task  # never another: a close ends the session with it
        with self.runtime() as runtime:
            request = ExecRequest(
                argv=["/bin/bash", "-c", BOOT],  # the script, nonce and all, is the stdin
                stdin=script(state, command, nonce, workspace),
                key=f"swerex:{session.serial}:{session.label}:{position}",
                cwd=".",  # the script cds itself: a session may cd outside the workspace
                timeout=_seconds(timeout),
            )
            admission = runtime.admit(task, request)
            status = _settled(runtime, admission.session, timeout)
            exit_facts = _exit_facts(status)
            if exit_facts.get("reason") == "timeout":
                raise swerex_error(
                    "CommandTimeoutError",
                    f"timeout after {timeout} seconds while running command {command!r}",
                    {"session": admission.session},
                )
            reported = report_tail(runtime, admission.session)
            _refuse_syntax(command, read_syntax_error(reported, nonce, exit_facts))
            output = stream_text(runtime, admission.session, "stdout", status, "replace", self.cap)
            report = read_report(reported, nonce, exit_facts)
        with self.lock:
            # the newest action's report only: a late retry changes nothing
            if report is not None and position == session.positions.count - 1:
                session.state = report.state
        return {
            "output": output + report_note(report),
            **_exit_answer(exit_facts),
            "expect_string": "",
            "session_type": "bash",
        }

    def close_session(self, body: dict[str, Any]) -> dict[str, Any]:
        """Ends the bash session: its actions are settled sessions with receipts already; the
        task they belong to is closed (with its checkpoint) by SWE-ReX's `close`."""
        name = str(body.get("session", "default"))
        self._session(name)
        with self.lock:
            self.sessions.pop(name, None)
        return {"session_type": "bash"}

    # -- commands ------------------------------------------------------------------------

    def execute(self, body: dict[str, Any], request_id: str | None) -> dict[str, Any]:
        command = _field(body, "command", "execute")
        with self.lock:
            position = self.executes.take(request_id)
        with self.runtime() as runtime:
            task, workspace = self.open_task(runtime)
            argv, shell, cwd = _command_line(body, command, workspace)
            timeout = body.get("timeout")
            request = ExecRequest(
                argv=argv,
                shell=shell,
                key=f"swerex:execute:{position}",
                cwd=cwd,
                env=body.get("env"),
                timeout=_seconds(timeout),
            )
            admission = runtime.admit(task, request)
            status = _settled(runtime, admission.session, timeout)
            exit_facts = _exit_facts(status)
            if exit_facts.get("reason") == "timeout":
                raise swerex_error(
                    "CommandTimeoutError", f"Timeout ({timeout}s) exceeded while running command"
                )
            answer = {
                name: stream_text(
                    runtime, admission.session, name, status, "backslashreplace", self.cap
                )
                for name in ("stdout", "stderr")
            }
        code = exit_facts.get("code")
        if body.get("check") and code != 0:
            message = (
                f"Command {command!r} failed with exit code {code}. "
                f"Stdout:\n{answer['stdout']!r}\nStderr:\n{answer['stderr']!r}"
            )
            if body.get("error_msg"):
                message = f"{body['error_msg']}: {message}"
            raise swerex_error("NonZeroExitCodeError", message, {"exit_code": code})
        return {**answer, "exit_code": code}

    # -- close ---------------------------------------------------------------------------

    def close(self, request_id: str | None = None) -> dict[str, Any]:
        """Close the runtime's task with its checkpoint; the answer names each task closed by
        this call with its close receipt's digest (a retried close answers the same)."""
        with self.lock:
            if request_id is not None and request_id in self.close_answers:
                return self.close_answers[request_id]
            self.sessions.clear()
            self.executes = Positions()
            self.file_ops = Positions()
        with self.task_lock:
            closing = self.task
            entries = []
            if closing is not None:
                with self.runtime() as runtime:
                    entries.append(_closed(closing, runtime.close_task(closing[0]).to_json()))
                self.task = None
        answer = {"settled": {"tasks": entries}}
        with self.lock:
            self.closed.extend(entries)
            if request_id is not None:
                remember(self.close_answers, request_id, answer)
        for entry in entries:
            self.say(
                f"task {entry['task']} closed: complete {str(entry['complete']).lower()}, "
                f"close receipt {entry['close_receipt']}"
            )
        return answer


def _exit_answer(exit_facts: dict[str, Any]) -> dict[str, Any]:
    code = exit_facts.get("code")
    return {
        "exit_code": code,
        "failure_reason": "" if code is not None else str(exit_facts.get("reason", "")),
    }


def _bash_command(body: dict[str, Any]) -> str:
    """The action's text: refused by name when bash could not take it whole."""
    command = str(_field(body, "command", "run_in_session"))
    if "\0" in command:
        raise swerex_error("SwerexException", "run_in_session: the command holds a NUL byte")
    try:
        size = len(command.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:
        raise swerex_error(
            "SwerexException", "run_in_session: the command holds a lone surrogate, not text"
        ) from None
    if size > MAX_COMMAND_BYTES:
        raise swerex_error(
            "SwerexException",
            f"run_in_session: the command is {size} bytes; at most {MAX_COMMAND_BYTES}",
        )
    return command


def _settled(runtime: Runtime, session: str, timeout: Any) -> dict[str, Any]:
    """The session's status once it has its receipt (the wait is bounded by the timeout and a
    margin, or MAX_ACTION_WAIT_S for none: 0 is none, as Runtime.exec reads it)."""
    status = runtime.wait(session, _wait_for(timeout))
    if not status.get("receipt"):
        raise swerex_error(
            "SwerexException",
            f"settled session {session} has no receipt after {_wait_for(timeout):.0f}s",
        )
    return status


def _exit_facts(status: dict[str, Any]) -> dict[str, Any]:
    """The receipt's exit; a command that never started raises as subprocess.run would: an
    OSError of its errno (FileNotFoundError for a program that is not there), as SWE-ReX's
    own server sends it."""
    facts: dict[str, Any] = (status.get("receipt") or {}).get("exit") or {}
    if facts.get("reason") == "not_started":
        error = str(facts.get("error", ""))
        number = re.match(r"\[Errno (\d+)\] ", error)
        if number is not None:
            raise OSError(int(number.group(1)), error[number.end() :])
        raise swerex_error("SwerexException", f"the command never started: {error}")
    return facts


def _refuse_syntax(command: str, said: str | None) -> None:
    """SWE-ReX's BashIncorrectSyntaxError, worded as its own server words it."""
    if said is None:
        return
    raise swerex_error(
        "BashIncorrectSyntaxError",
        f"Error (exit code 2) while checking bash command \n{command!r}\n"
        f"---- Stderr ----\n{said}\n---- Stdout ----\n",
        {"bash_stdout": "", "bash_stderr": said},
    )


def _closed(task: tuple[str, str], result: dict[str, Any]) -> dict[str, Any]:
    """One task of a close's answer: its id, workspace, whether complete, the close receipt's
    digest and the checkpoint's manifest (or what it is blocked on)."""
    entry: dict[str, Any] = {
        "task": task[0],
        "workspace": task[1],
        "complete": bool((result.get("outcome") or {}).get("complete", result.get("complete"))),
        "close_receipt": result.get("digest"),
        "checkpoint": (result.get("checkpoint") or {}).get("manifest"),
    }
    if result.get("blocked_on") is not None:
        entry["blocked_on"] = result["blocked_on"]
    return entry


def _field(body: dict[str, Any], name: str, route: str) -> Any:
    if name not in body:
        raise swerex_error("SwerexException", f"{route}: the request has no {name!r}")
    return body[name]


def _hashed(name: str) -> str:
    return "h" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _seconds(timeout: Any) -> float | None:
    return float(timeout) if timeout is not None else None


def _wait_for(timeout: Any) -> float:
    limit = _seconds(timeout)
    return limit + 60.0 if limit else MAX_ACTION_WAIT_S  # None and 0 are no limit


def _command_line(
    body: dict[str, Any], command: Any, workspace: str
) -> tuple[list[str] | None, str | None, str]:
    """(argv, shell, cwd) of an execute: subprocess.run's meaning of `command` and `shell`; a
    cwd outside the workspace is entered by the shell (a session sees more than its workspace)."""
    use_shell = bool(body.get("shell")) or isinstance(command, str)
    argv = None if use_shell else [str(part) for part in command]
    shell = (command if isinstance(command, str) else shlex.join(command)) if use_shell else None
    if body.get("merge_output_streams"):
        shell, argv = "exec 2>&1\n" + (shell if shell is not None else shlex.join(argv or [])), None
    wanted = os.path.join(workspace, str(body.get("cwd") or "."))
    root, target = os.path.realpath(workspace), os.path.realpath(wanted)
    if os.path.commonpath([root, target]) == root:  # the workspace: the host sees what it holds
        if not os.path.isdir(target):
            number = errno.ENOENT if not os.path.exists(target) else errno.ENOTDIR
            raise OSError(number, os.strerror(number), wanted)
        return argv, shell, os.path.relpath(target, root)
    enter = f"cd -- {shlex.quote(wanted)} || exit 1\n"  # the view may hold what the host does not
    return None, enter + (shell if shell is not None else f"exec {shlex.join(argv or [])}"), "."
