"""`settled serve --swerex`: SWE-ReX's remote runtime protocol, so SWE-agent uses settled unchanged.

Owns: the HTTP face of the SWE-ReX service: routes, bodies and auth as the installed ``swerex``
package has them (``swerex.server`` and ``swerex.runtime.remote.RemoteRuntime``): POST JSON
endpoints, an ``X-API-Key`` header, errors as HTTP 511 ``{"swerexception": _ExceptionTransfer}``
which the client re-raises as the class it names. As SWE-ReX's own server does, an error of
Python's own (``FileNotFoundError`` from read_file, ``IsADirectoryError`` from write_file, ...)
is sent as ``builtins.<name>``, so the client raises that very type; settled's own errors are
sent as ``swerex.exceptions.SwerexException`` with their message. Unlike SWE-ReX's own server,
there is always a key (server/swerex_key.py makes one when none is given), and every connection
passes the peer gate first (server/peering.py): a process inside one of settled's sessions is
refused (403) before any route runs, key or not. What each call does to settled is
server/swerex_service.py's; the script of a bash action, server/swerex_shell.py's; read_file,
write_file and upload, commands inside the task's boundary, server/swerex_files.py's.

The close: SWE-ReX's ``CloseResponse`` has no fields and its client drops any it is sent, so
the close's answer carries ``{"settled": {"tasks": [{task, workspace, complete, close_receipt,
checkpoint}]}}`` for a reader of the raw answer, and the same record stays readable with the key
at ``GET /settled/closes`` (every task this server closed) and is said on stderr.

Must never: serve without a key; answer a route before the peer gate; name a CLI flag in an
error an HTTP caller reads.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from settled.server import swerex_files
from settled.server.jsonbody import AsciiJSONResponse
from settled.server.swerex_output import output_cap
from settled.server.swerex_service import SwerexError, SwerexService, swerex_error

__all__ = [
    "SwerexError",
    "SwerexService",
    "announce",
    "create_swerex_app",
    "output_cap",
    "say",
    "serve_swerex",
]


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


Call = Callable[[dict[str, Any], "str | None"], dict[str, Any]]


def create_swerex_app(
    home: str,
    api_key: str,
    workspace: str | None = None,
    *,
    cap: int | None = None,
    tell: Callable[[str], None] | None = None,
) -> Starlette:
    """The app; every route but ``/`` asks for ``api_key`` as X-API-Key (never empty: unlike
    SWE-ReX's own server, no key is not an open service). `cap`: the per-stream output cap of
    an answer (default swerex_service.DEFAULT_OUTPUT_CAP); `tell`: where a task opened or
    closed is said (the server's stderr)."""
    service = SwerexService(
        home, api_key, workspace, cap=cap or output_cap({}), say=tell or (lambda message: None)
    )

    def authorized(request: Request) -> bool:
        given = request.headers.get("x-api-key", "")
        return hmac.compare_digest(given.encode(), service.api_key.encode())

    def refused() -> Response:
        return AsciiJSONResponse({"detail": "Invalid API Key"}, status_code=401)

    def json_route(name: str, call: Call) -> Route:
        async def endpoint(request: Request) -> Response:
            if not authorized(request):
                return refused()
            try:
                raw = await request.body()  # close sends no body at all
                body = json.loads(raw) if raw.strip() else {}
                if not isinstance(body, dict):
                    raise swerex_error("SwerexException", f"{name}: the body is not a JSON object")
                request_id = request.headers.get("x-request-id")
                result = await asyncio.to_thread(call, body, request_id)
            except Exception as error:  # every error goes back to the client as SWE-ReX's
                return _transfer(error)
            return AsciiJSONResponse(result)

        return Route(f"/{name}", endpoint, methods=["POST"])

    async def is_alive(request: Request) -> Response:
        if not authorized(request):
            return refused()
        return AsciiJSONResponse({"is_alive": True, "message": ""})

    async def closes(request: Request) -> Response:
        if not authorized(request):
            return refused()
        with service.lock:
            tasks, task = list(service.closed), service.task
        now = {"task": task[0], "workspace": task[1]} if task is not None else None
        return AsciiJSONResponse({"tasks": tasks, "open": now})

    async def upload(request: Request) -> Response:
        """SWE-ReX's multipart upload (no X-Request-ID from its client; one is used if sent)."""
        if not authorized(request):
            return refused()
        form = await request.form()
        try:
            upload = form["file"]
            size = getattr(upload, "size", None)
            if size is not None and size > swerex_files.MAX_FILE_BYTES:
                swerex_files.refuse_size(size, "upload")
            data = await upload.read() if hasattr(upload, "read") else str(upload).encode()
            target = str(form["target_path"])
            unzip = str(form.get("unzip", "false")).lower() == "true"
            request_id = request.headers.get("x-request-id")
            await asyncio.to_thread(
                swerex_files.upload, service, bytes(data), target, unzip, request_id
            )
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
        json_route("run_in_session", service.run_in_session),
        json_route("close_session", lambda body, _id: service.close_session(body)),
        json_route("execute", service.execute),
        json_route("read_file", lambda body, rid: swerex_files.read_file(service, body, rid)),
        json_route("write_file", lambda body, rid: swerex_files.write_file(service, body, rid)),
        Route("/upload", upload, methods=["POST"]),
        json_route("close", lambda _body, request_id: service.close(request_id)),
        Route("/settled/closes", closes, methods=["GET"]),
    ]
    app = Starlette(routes=routes)
    app.state.swerex = service
    return app


# -- serving ---------------------------------------------------------------------------


def announce(url: str, home: str, workspace: str | None, key_said: str) -> None:
    """The lines `settled serve --swerex` says on stderr as it starts (never the key)."""
    say(f"listening on {url} (home {home})")
    if workspace:
        say(f"workspace {workspace}: one task on it for the SWE-ReX runtime, opened at its "
            "first create_session or execute, closed with a checkpoint by its close")  # fmt: skip
    else:
        say("workspace: a new directory for each SWE-ReX runtime's task (none was given)")
    say(key_said)


def serve_swerex(
    home: str,
    sock: socket.socket,
    api_key: str,
    workspace: str | None = None,
    cap: int | None = None,
) -> None:
    """Serve SWE-ReX's protocol on uvicorn over the bound `sock` until interrupted (`settled
    serve --swerex`); refusals of peers, tasks opened and closed are said on stderr, and so is
    a task still open when the serving ends."""
    import uvicorn

    from settled import oomguard
    from settled.server import signals_end_serving
    from settled.server.peering import gated

    workspace = workspace or os.environ.get("SETTLED_SWEREX_WORKSPACE")
    cap = cap if cap is not None else output_cap(os.environ)
    app = create_swerex_app(home, api_key, workspace, cap=cap, tell=say)
    oomguard.protect_self()  # never the kernel's choice under memory pressure, where it can
    config = uvicorn.Config(app, log_level="warning", http=gated(say))
    with signals_end_serving():  # SIGINT/SIGTERM end the serving and return, so cleanup runs
        uvicorn.Server(config).run(sockets=[sock])
    left: tuple[str, str] | None = app.state.swerex.task
    if left is not None:
        say(f"task {left[0]} is still open (no SWE-ReX close came); close it with "
            f"`settled close {left[0]} --home {home}`")  # fmt: skip


def say(message: str) -> None:
    print(f"settled serve --swerex: {message}", file=sys.stderr, flush=True)
