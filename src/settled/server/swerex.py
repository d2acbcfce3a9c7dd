"""`settled serve --swerex`: SWE-ReX's remote runtime protocol, so SWE-agent uses settled unchanged.

Routes, bodies and auth are those of the installed ``swerex`` package (``swerex.server`` and
``swerex.runtime.remote.RemoteRuntime``): POST JSON endpoints, an ``X-API-Key`` header, errors as
HTTP 511 ``{"swerexception": _ExceptionTransfer}`` which the client re-raises as the named class:
as SWE-ReX's own server does, an error of Python's own (``FileNotFoundError`` from read_file,
``IsADirectoryError`` from write_file) is sent as ``builtins.<name>``, so the client raises that
very type; settled's own errors go as ``swerex.exceptions.SwerexException`` with their message.
Unlike SWE-ReX's own server, there is always a key (server/swerex_key.py makes one when none is
given), and every connection passes the peer gate first (server/peering.py): a process inside
one of settled's sessions is refused (403) before any route runs, key or not.

Mapping onto settled: each bash session (create_session) is one settled task; each
run_in_session action is one settled session whose invocation key is
``swerex:<session name>:<position>``, the position being the action's index in that bash session.
The client sends one ``X-Request-ID`` per call and reuses it on its retries, so a request id seen
before gets its first position back: the same key, so settled returns the same session (never a
second run) and the same output.

Statefulness (cd, exported variables persist across actions), kept honest: settled runs each
action as a fresh ``bash -c`` whose script *is written out in full*: a prefix that re-creates the
state left by the previous action (its ``export -p`` text and ``cd``), then the action, and an
EXIT trap that prints a trailer (a marker, ``pwd``, ``export -p``) on stdout. The state is thus
part of the command digest and of the recorded stdout; nothing is carried in hidden memory of a
shell. The marker is derived from (task, position), and the last one in stdout wins: a hostile
command that forges a trailer can only change its *own* next cwd/env, which it could do with
``cd``/``export`` anyway; it cannot change any receipt. Shell functions, aliases and unexported
variables do not persist (documented difference from SWE-ReX's pexpect shell).

Timeouts map to ``swerex.exceptions.CommandTimeoutError``; a nonzero exit with
``check="raise"`` to ``NonZeroExitCodeError``. read_file/write_file/upload act on the server's
filesystem as SWE-ReX's own server does (upload unzips a directory sent as a zip). close closes
every open task (close join with checkpoint), so each gets its receipt.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import io
import json
import os
import re
import shlex
import socket
import sys
import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from settled.runtime import Runtime
from settled.server.jsonbody import AsciiJSONResponse

MAX_ACTION_WAIT_S = 24 * 3600.0  # an action without a timeout is waited for this long at most


class SwerexError(Exception):
    """An error the client re-raises as ``class_path`` (a swerex.exceptions class)."""

    def __init__(self, class_path: str, message: str, extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.class_path = class_path
        self.extra = extra or {}


def _exc(name: str, message: str, extra: dict[str, Any] | None = None) -> SwerexError:
    return SwerexError(f"swerex.exceptions.{name}", message, extra)


@dataclass
class BashSession:
    """One SWE-ReX bash session: its task and the shell state the last action left."""

    task: str
    cwd: str
    exports: str = ""
    positions: dict[str, int] = field(default_factory=dict)  # X-Request-ID -> position
    count: int = 0
    before: dict[int, tuple[str, str]] = field(default_factory=dict)  # position -> (cwd, exports)


class SwerexService:
    """Holds the home, the bash sessions and one Runtime per worker thread."""

    def __init__(self, home: str, api_key: str, workspace: str | None = None) -> None:
        if not api_key:
            raise ValueError("the SWE-ReX service never runs without a key")
        self.home = home
        self.api_key = api_key
        self.workspace = workspace
        self.sessions: dict[str, BashSession] = {}
        self.tasks: list[str] = []
        self.exec_task: str | None = None
        self.lock = threading.Lock()

    def runtime(self) -> Runtime:
        """A Runtime holds one SQLite connection usable from its own thread only, and calls run
        on worker threads: each call opens its own (closed by its caller's `with`)."""
        return Runtime(self.home)

    # -- bash sessions -------------------------------------------------------------------

    def create_session(self, body: dict[str, Any]) -> dict[str, Any]:
        name = str(body.get("session", "default"))
        with self.lock:
            if name in self.sessions:
                raise _exc("SessionExistsError", f"session {name!r} already exists")
        with self.runtime() as runtime:
            task = runtime.new_task(self.workspace)
        session = BashSession(task=task.task, cwd=task.workspace)
        with self.lock:
            self.sessions[name] = session
            self.tasks.append(task.task)
        output = ""
        for source in body.get("startup_source", []):
            output += self._run(name, f"source {shlex.quote(str(source))}", None, None)["output"]
        return {"output": output, "session_type": "bash"}

    def _session(self, name: str) -> BashSession:
        with self.lock:
            found = self.sessions.get(name)
        if found is None:
            raise _exc("SessionDoesNotExistError", f"session {name!r} does not exist")
        return found

    def _position(self, session: BashSession, request_id: str | None) -> int:
        """A retried request (same X-Request-ID) gets its first position back."""
        with self.lock:
            if request_id is not None and request_id in session.positions:
                return session.positions[request_id]
            position = session.count
            session.count += 1
            if request_id is not None:
                session.positions[request_id] = position
            return position

    def run_in_session(self, body: dict[str, Any], request_id: str | None) -> dict[str, Any]:
        if body.get("action_type", "bash") == "bash_interrupt":
            # SWE-agent interrupts after a timeout; settled already ended that command and its
            # whole boundary when the timeout passed, so there is nothing left to interrupt.
            self._session(str(body.get("session", "default")))
            return {"output": "", "exit_code": 0, "failure_reason": "", "session_type": "bash"}
        name = str(body.get("session", "default"))
        timeout = body.get("timeout")
        observation = self._run(name, str(body["command"]), timeout, request_id)
        check = body.get("check", "raise")
        if check == "raise" and observation["exit_code"] != 0:
            message = body.get("error_msg") or f"Command {body['command']!r} failed"
            raise _exc(
                "NonZeroExitCodeError",
                f"{message} with exit code {observation['exit_code']}: {observation['output']}",
                {"exit_code": observation["exit_code"]},
            )
        return observation

    def _run(self, name: str, command: str, timeout: Any, request_id: str | None) -> dict[str, Any]:
        session = self._session(name)
        position = self._position(session, request_id)
        with self.runtime() as runtime:
            return self._run_action(runtime, session, name, position, command, timeout)

    def _run_action(
        self,
        runtime: Runtime,
        session: BashSession,
        name: str,
        position: int,
        command: str,
        timeout: Any,
    ) -> dict[str, Any]:
        marker = (
            "__SETTLED_SWEREX_"
            + hashlib.sha256(f"{session.task}:{position}".encode()).hexdigest()[:24]
        )
        with self.lock:
            # a retry runs the very script its first try ran: same key, same digest
            cwd, exports = session.before.setdefault(position, (session.cwd, session.exports))
        script = _script(cwd, exports, command, marker)
        admission = runtime.exec(
            session.task,
            argv=["/bin/bash", "-c", script],  # SWE-ReX sessions are bash, not /bin/sh
            key=f"swerex:{name}:{position}",
            cwd=".",  # the script cds itself: a session may cd outside the workspace
            timeout=float(timeout) if timeout is not None else None,
        )
        wait = float(timeout) + 60.0 if timeout is not None else MAX_ACTION_WAIT_S
        status = runtime.wait(admission.session, wait)
        raw = runtime.read(admission.session, "stdout").decode(errors="replace")
        output, state = _split_trailer(raw, marker)
        with self.lock:
            if state is not None and position == session.count - 1:  # a late retry changes nothing
                session.cwd, session.exports = state
        exit_facts = (status.get("receipt") or {}).get("exit") or {}
        if exit_facts.get("reason") == "timeout":
            raise _exc(
                "CommandTimeoutError",
                f"timeout after {timeout} seconds while running command {command!r}",
                {"session": admission.session},
            )
        code = exit_facts.get("code")
        return {
            "output": output,
            "exit_code": code,
            "failure_reason": "" if code is not None else str(exit_facts.get("reason", "")),
            "expect_string": "",
            "session_type": "bash",
        }

    def close_session(self, body: dict[str, Any]) -> dict[str, Any]:
        name = str(body.get("session", "default"))
        session = self._session(name)
        with self.lock:
            del self.sessions[name]
        self._close_task(session.task)
        return {"session_type": "bash"}

    def _close_task(self, task: str) -> None:
        with self.runtime() as runtime:
            runtime.close_task(task)
        with self.lock:
            if task in self.tasks:
                self.tasks.remove(task)

    # -- commands and files --------------------------------------------------------------

    def execute(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.runtime() as runtime:
            return self._execute(runtime, body)

    def _execute(self, runtime: Runtime, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            task = self.exec_task
        if task is None:
            task = runtime.new_task(self.workspace).task
            with self.lock:
                self.exec_task = task
                self.tasks.append(task)
        command = body["command"]
        use_shell = bool(body.get("shell")) or isinstance(command, str)
        shell = (
            (command if isinstance(command, str) else shlex.join(command)) if use_shell else None
        )
        argv = None if use_shell else [str(part) for part in command]
        if body.get("merge_output_streams") and shell is not None:
            shell = "exec 2>&1\n" + shell
        timeout = body.get("timeout")
        admission = runtime.exec(
            task,
            argv=argv,
            shell=shell,
            cwd=body.get("cwd") or ".",
            env=body.get("env"),
            timeout=float(timeout) if timeout is not None else None,
        )
        wait = float(timeout) + 60.0 if timeout is not None else MAX_ACTION_WAIT_S
        status = runtime.wait(admission.session, wait)
        exit_facts = (status.get("receipt") or {}).get("exit") or {}
        if exit_facts.get("reason") == "timeout":
            raise _exc("CommandTimeoutError", f"timeout after {timeout} seconds: {command!r}")
        answer = {
            "stdout": runtime.read(admission.session, "stdout").decode(errors="replace"),
            "stderr": runtime.read(admission.session, "stderr").decode(errors="replace"),
            "exit_code": exit_facts.get("code"),
        }
        if body.get("check") and answer["exit_code"] != 0:
            raise _exc(
                "NonZeroExitCodeError",
                f"{body.get('error_msg') or 'Command failed'}: exit code {answer['exit_code']}",
            )
        return answer

    def close(self) -> dict[str, Any]:
        """Close every open task: each gets its close receipt (checkpoint included)."""
        with self.lock:
            tasks = list(self.tasks)
            self.sessions.clear()
            self.exec_task = None
        for task in tasks:
            self._close_task(task)
        return {}


def _script(cwd: str, exports: str, command: str, marker: str) -> str:
    """The whole script settled runs: the restored state, the action, the state trailer."""
    trailer = f"trap 'printf \"\\n{marker}\\n\"; pwd; export -p' EXIT\n"
    return f"exec 2>&1\n{exports}\ncd {shlex.quote(cwd)} || exit 1\n{trailer}{command}\n"


_UNSAFE_EXPORT = re.compile(r"^declare -x (BASHOPTS|SHELLOPTS|BASH_\w*|OLDPWD|PWD|SHLVL|_)(=|$)")


def _split_trailer(raw: str, marker: str) -> tuple[str, tuple[str, str] | None]:
    """The output before the last trailer, and the (cwd, exports) it names."""
    at = raw.rfind(f"\n{marker}\n")
    if at < 0:
        return raw, None
    output = raw[:at]
    rest = raw[at + len(marker) + 2 :].split("\n")
    cwd = rest[0]
    exports = "\n".join(
        line
        for line in rest[1:]
        if line.startswith("declare -x ") and not _UNSAFE_EXPORT.match(line)
    )
    return output, (cwd, exports)


# -- HTTP ------------------------------------------------------------------------------


def _class_path(error: BaseException) -> str:
    """The class the client raises: a swerex one named by the service, Python's own as itself
    (``builtins.FileNotFoundError``, as SWE-ReX's server sends it), else SwerexException."""
    if isinstance(error, SwerexError):
        return error.class_path
    if type(error).__module__ == "builtins":
        return f"builtins.{type(error).__qualname__}"
    return "swerex.exceptions.SwerexException"


def _transfer(error: BaseException) -> AsciiJSONResponse:
    class_path = _class_path(error)
    content = {
        "swerexception": {
            "message": str(error),
            "class_path": class_path,
            "traceback": f"{class_path}: {error}",
            "extra_info": error.extra if isinstance(error, SwerexError) else {},
        }
    }
    return AsciiJSONResponse(content, status_code=511)


def create_swerex_app(home: str, api_key: str, workspace: str | None = None) -> Starlette:
    """The app; every route but ``/`` asks for ``api_key`` as X-API-Key (never empty: unlike
    SWE-ReX's own server, no key is not an open service)."""
    service = SwerexService(home, api_key, workspace)

    def authorized(request: Request) -> bool:
        given = request.headers.get("x-api-key", "")
        return hmac.compare_digest(given.encode(), service.api_key.encode())

    def json_route(name: str, call: Any, with_id: bool = False) -> Route:
        async def endpoint(request: Request) -> Response:
            if not authorized(request):
                return AsciiJSONResponse({"detail": "Invalid API Key"}, status_code=401)
            raw = await request.body()  # close sends no body at all
            body = json.loads(raw) if raw.strip() else {}
            args: tuple[Any, ...] = (body or {},) if call.__code__.co_argcount > 1 else ()
            if with_id:
                args += (request.headers.get("x-request-id"),)
            try:
                result = await asyncio.to_thread(call, *args)
            except Exception as error:  # every error goes back to the client as SWE-ReX's
                return _transfer(error)
            return AsciiJSONResponse(result)

        return Route(f"/{name}", endpoint, methods=["POST"])

    async def is_alive(request: Request) -> Response:
        if not authorized(request):
            return AsciiJSONResponse({"detail": "Invalid API Key"}, status_code=401)
        return AsciiJSONResponse({"is_alive": True, "message": ""})

    async def read_file(request: Request) -> Response:
        if not authorized(request):
            return AsciiJSONResponse({"detail": "Invalid API Key"}, status_code=401)
        body = await request.json()
        try:
            data = Path(body["path"]).read_text(
                encoding=body.get("encoding"), errors=body.get("errors")
            )
        except Exception as error:
            return _transfer(error)
        return AsciiJSONResponse({"content": data})

    async def write_file(request: Request) -> Response:
        if not authorized(request):
            return AsciiJSONResponse({"detail": "Invalid API Key"}, status_code=401)
        body = await request.json()
        try:
            path = Path(body["path"])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body["content"])
        except Exception as error:
            return _transfer(error)
        return AsciiJSONResponse({})

    async def upload(request: Request) -> Response:
        if not authorized(request):
            return AsciiJSONResponse({"detail": "Invalid API Key"}, status_code=401)
        form = await request.form()
        try:
            upload = form["file"]
            data = await upload.read() if hasattr(upload, "read") else str(upload).encode()
            target = Path(str(form["target_path"]))
            target.parent.mkdir(parents=True, exist_ok=True)
            if str(form.get("unzip", "false")).lower() == "true":
                _unzip(bytes(data), target)
            else:
                target.write_bytes(bytes(data))
        except Exception as error:
            return _transfer(error)
        finally:
            await form.close()
        return AsciiJSONResponse({})

    async def root(request: Request) -> Response:
        return AsciiJSONResponse({"message": "settled swerex"})

    routes = [
        Route("/", root, methods=["GET"]),
        Route("/is_alive", is_alive, methods=["GET"]),
        json_route("create_session", service.create_session),
        json_route("run_in_session", service.run_in_session, with_id=True),
        json_route("close_session", service.close_session),
        json_route("execute", service.execute),
        Route("/read_file", read_file, methods=["POST"]),
        Route("/write_file", write_file, methods=["POST"]),
        Route("/upload", upload, methods=["POST"]),
        json_route("close", service.close),
    ]
    app = Starlette(routes=routes)
    app.state.swerex = service
    return app


def _unzip(data: bytes, target: Path) -> None:
    """Extract a directory sent as a zip, refusing members that would land outside target."""
    root = target.resolve()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for member in archive.namelist():
            dest = (root / member).resolve()
            if dest != root and root not in dest.parents:
                raise _exc("SwerexException", f"zip member {member!r} escapes {target}")
        archive.extractall(root)


def announce(url: str, home: str, workspace: str | None, key_said: str) -> None:
    """The lines `settled serve --swerex` says on stderr as it starts (never the key)."""
    say(f"listening on {url} (home {home})")
    if workspace:
        say(f"workspace {workspace}: each SWE-ReX session works in it")
    else:
        say("workspace: a new directory for each SWE-ReX session (none was given)")
    say(key_said)


def serve_swerex(
    home: str, sock: socket.socket, api_key: str, workspace: str | None = None
) -> None:
    """Serve SWE-ReX's protocol on uvicorn over the bound `sock` until interrupted (`settled
    serve --swerex`); refusals of peers are said on stderr."""
    import uvicorn

    from settled import oomguard
    from settled.server import signals_end_serving
    from settled.server.peering import gated

    app = create_swerex_app(home, api_key, workspace or os.environ.get("SETTLED_SWEREX_WORKSPACE"))
    oomguard.protect_self()  # never the kernel's choice under memory pressure, where it can
    config = uvicorn.Config(app, log_level="warning", http=gated(say))
    with signals_end_serving():  # SIGINT/SIGTERM end the serving and return, so cleanup runs
        uvicorn.Server(config).run(sockets=[sock])


def say(message: str) -> None:
    print(f"settled serve --swerex: {message}", file=sys.stderr, flush=True)
