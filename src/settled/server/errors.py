"""How settled's typed errors answer over HTTP: one status code per error type, JSON bodies.

Owns the table from error type to HTTP status (the HTTP twin of the CLI's exit codes) and the
JSON body of every error: ``{"error": <type name>, "message": <text naming the value and the way
out>, ...}`` plus the fields a client needs (both digests of a key conflict, the session that
froze a task, the cursor and end of an out-of-range read).

Must never: guess a status from a message, leak what a token may not see (a task outside the
token's scope answers with the very body an unknown task does), or turn an unexpected exception
into anything but a logged 500.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from settled.errors import (
    AdmissionFrozen,
    AdmissionSealed,
    BadInput,
    BoundaryUnavailable,
    CursorOutOfRange,
    HomeUnusable,
    KeyConflict,
    LogElsewhere,
    NotSettled,
    OwnerLaunchFailed,
    ReceiptTampered,
    SettledError,
    SpaceExhausted,
    StaleWrite,
    StoreUnreachable,
    TaskFrozen,
    UnknownHost,
    UnknownSession,
    UnknownTask,
    WorkspaceReplaced,
    WrongHost,
)
from settled.grammar import TooLarge
from settled.server.jsonbody import AsciiJSONResponse

log = logging.getLogger("settled.server")


class NotPermitted(SettledError):
    """The token is valid but its scope does not allow this (e.g. a scoped token creating a
    task); answered 403."""


class BodyTooLarge(TooLarge):
    """A request body over the limit; answered 413 before it is parsed (or read further)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__("body", f"<{size} bytes>", f"is over {limit} bytes; a command is not data")


# First match wins: subclasses before their bases.
STATUS_OF: tuple[tuple[type[SettledError], int], ...] = (
    (HomeUnusable, 500),
    (UnknownTask, 404),
    (UnknownSession, 404),
    (KeyConflict, 409),
    (AdmissionSealed, 409),
    (WrongHost, 409),
    (LogElsewhere, 409),
    (TaskFrozen, 409),
    (UnknownHost, 404),
    (StaleWrite, 409),
    (WorkspaceReplaced, 409),  # the close is blocked until the bound directory is back
    (AdmissionFrozen, 423),
    (NotSettled, 202),
    (NotPermitted, 403),
    (TooLarge, 413),  # a body, or a field over its length: BodyTooLarge among them
    (BoundaryUnavailable, 400),
    (BadInput, 400),
    (OwnerLaunchFailed, 500),
    (StoreUnreachable, 503),  # the authority store (PostgreSQL) does not answer: try again
    (ReceiptTampered, 500),  # the server's own evidence is damaged: nothing is decided from it
    (SpaceExhausted, 507),  # Insufficient Storage: below the home's reserve, or the disk is full
    (SettledError, 500),
)


def status_of(exc: SettledError) -> int:
    for kind, status in STATUS_OF:
        if isinstance(exc, kind):
            return status
    return 500


# The CLI flag a shared error message names, as the request field an HTTP caller sets instead
# (bodies.py's TASK_FIELDS, SESSION_FIELDS and the `from` query): one vocabulary per face.
FIELD_OF_FLAG: dict[str, str] = {
    "--shared-workspace": "shared_workspace", "--workspace": "workspace", "--ignore": "ignore",
    "--allow-host": "allow_hosts", "--network": "network", "--isolation": "isolation",
    "--user": "user", "--cwd": "cwd", "--env": "env", "--inherit": "inherited",
    "--writable": "writable", "--readable": "readable", "--from": "from",
}  # fmt: skip
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]*(?![\w-])")


def in_http_words(message: str) -> str:
    """`message` with each CLI flag it names spelled as the request field it stands for
    (`pass --shared-workspace` reads `pass shared_workspace`); a flag with no field stays."""
    return _FLAG.sub(lambda m: f"`{FIELD_OF_FLAG[m[0]]}`" if m[0] in FIELD_OF_FLAG else m[0],
                     message)  # fmt: skip


def error_body(exc: SettledError) -> dict[str, Any]:
    body: dict[str, Any] = dict(exc.to_json())
    if isinstance(body.get("message"), str):
        body["message"] = in_http_words(body["message"])
    if isinstance(exc, AdmissionFrozen | AdmissionSealed):
        body["task"] = exc.task
    if isinstance(exc, AdmissionFrozen):
        body["session"] = exc.session
    if isinstance(exc, AdmissionSealed):
        body["state"] = exc.state
    if isinstance(exc, UnknownTask | TaskFrozen):
        body["task"] = exc.task
    if isinstance(exc, WrongHost):
        body.update(task=exc.task, host=exc.host, host_name=exc.host_name)
    if isinstance(exc, UnknownSession):
        body["session"] = exc.session
    if isinstance(exc, OwnerLaunchFailed):
        body["retry"] = "retry with the same key: it returns this session, it never relaunches"
    return body


def settled_error(exc: SettledError) -> AsciiJSONResponse:
    status = status_of(exc)
    if status >= 500:
        log.error("%s: %s", exc.kind, exc)
    return AsciiJSONResponse(error_body(exc), status_code=status)


def cursor_error(exc: CursorOutOfRange) -> AsciiJSONResponse:
    body = {
        "error": "CursorOutOfRange",
        "message": f"{exc}; read from a cursor in [0, {exc.end}]",
        "cursor": exc.cursor,
        "end": exc.end,
        "stream": exc.stream,
    }
    return AsciiJSONResponse(body, status_code=416, headers={"Content-Range": f"bytes */{exc.end}"})


async def on_settled_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SettledError)
    return settled_error(exc)


async def on_cursor_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, CursorOutOfRange)
    return cursor_error(exc)


async def on_http_exception(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    body = {"error": "HTTPError", "message": exc.detail}
    return AsciiJSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def on_unexpected(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    body = {"error": "InternalError", "message": f"{type(exc).__name__}: {exc}"}
    return AsciiJSONResponse(body, status_code=500)


EXCEPTION_HANDLERS: dict[Any, Any] = {
    SettledError: on_settled_error,
    CursorOutOfRange: on_cursor_error,
    HTTPException: on_http_exception,
    Exception: on_unexpected,
}
