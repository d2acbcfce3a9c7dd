"""Parsing what a request carries: JSON bodies and query parameters, refused with BadInput.

Owns the shape of every request body of the HTTP contract (DESIGN.md) and of the output query
parameters. Unknown body fields are refused by name (a typo such as ``"timout"`` must not
silently run a command without its timeout); every value is checked against its field's
grammar (``settled.grammar``: bounds, UTF-8 without NUL, lengths) and handed to the Runtime,
which checks it again and validates its meaning. A body is read under a size limit as it
arrives (a ``Content-Length`` over it is refused before a byte is read).

Must never: touch the Runtime, guess a missing invocation key (the client must know the key
before its first attempt, or a retry after a lost response could not reuse it), or coerce types
(``"5"`` is not a number of seconds).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from settled import grammar
from settled.errors import BadInput
from settled.requests import ExecRequest, TaskRequest, refuse_unknown
from settled.server.errors import BodyTooLarge

MAX_BODY_BYTES = 1 << 20
STREAMS = ("stdout", "stderr")
SIGNALS = ("TERM", "KILL", "INT")
TASK_FIELDS = TaskRequest.fields()
SESSION_FIELDS = ExecRequest.fields()
CLOSE_FIELDS = frozenset({"final", "deadline"})
SIGNAL_FIELDS = frozenset({"signal", "reason"})
RECOVER_FIELDS = frozenset({"task"})


def _declared_length(request: Request) -> None:
    declared = request.headers.get("content-length", "")
    if (
        grammar.INTEGER.fullmatch(declared)
        and len(declared) < 20
        and int(declared) > MAX_BODY_BYTES
    ):
        raise BodyTooLarge(int(declared), MAX_BODY_BYTES)


async def _read_bounded(request: Request) -> bytes:
    _declared_length(request)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge(size, MAX_BODY_BYTES)
        parts.append(part)
    return b"".join(parts)


async def json_body(request: Request, allowed: frozenset[str]) -> dict[str, Any]:
    """The request's JSON object ({} for an empty body); unknown fields are refused, and so
    are NaN and Infinity (not JSON numbers)."""
    raw = await _read_bounded(request)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw, parse_constant=grammar.reject_constant)
    except RecursionError:
        raise BadInput("request body is not JSON this server reads: nested too deep") from None
    except ValueError as exc:
        raise BadInput(f"request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadInput(f"request body must be a JSON object, not {type(body).__name__}")
    refuse_unknown(body, allowed)
    return body


def close_request(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "final": grammar.optional_text("final", body.get("final"), grammar.MAX_FINAL_BYTES),
        "deadline": grammar.optional_seconds(
            "deadline", body.get("deadline"), grammar.MAX_DEADLINE_S
        ),
    }


def signal_request(body: dict[str, Any]) -> tuple[str, str | None]:
    name = body.get("signal")
    if not isinstance(name, str) or name.upper().removeprefix("SIG") not in SIGNALS:
        raise grammar.BadText("signal", name, f"is not one of {', '.join(SIGNALS)}")
    reason = grammar.optional_text("reason", body.get("reason"), grammar.MAX_REASON_BYTES)
    return name.upper().removeprefix("SIG"), reason


def recover_request(body: dict[str, Any]) -> str | None:
    task = body.get("task")
    return None if task is None else grammar.check_id("task", task)


# -- query parameters ---------------------------------------------------------------------


def query_stream(request: Request) -> str:
    return grammar.check_choice("stream", request.query_params.get("stream", "stdout"), STREAMS)


def cursor_value(text: str, what: str) -> int:
    return grammar.parse_int(what, text, 0, grammar.MAX_CURSOR)


def query_cursor(request: Request) -> int:
    """``Last-Event-ID`` (a reconnecting SSE client) overrides ``from``."""
    resume = request.headers.get("last-event-id")
    if resume is not None and resume.strip():
        return cursor_value(resume.strip(), "Last-Event-ID")
    return cursor_value(request.query_params.get("from", "0"), "from")


def query_flag(request: Request, name: str) -> bool:
    value = request.query_params.get(name, "0")
    if value.lower() not in ("0", "1", "true", "false", ""):
        raise grammar.BadText(name, value, "must be 1 or 0")
    return value.lower() in ("1", "true")


def query_max(request: Request) -> int | None:
    text = request.query_params.get("max")
    if text is None:
        return None
    return grammar.parse_int("max", text, 1, grammar.MAX_CURSOR)


def query_wait(request: Request, limit: float) -> float:
    text = request.query_params.get("wait")
    return 0.0 if text is None else grammar.parse_seconds("wait", text, limit)
