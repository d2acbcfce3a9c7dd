"""Parsing what a request carries: JSON bodies and query parameters, refused with BadInput.

Owns the shape of every request body of the HTTP contract (DESIGN.md) and of the output query
parameters. Unknown body fields are refused by name (a typo such as ``"timout"`` must not
silently run a command without its timeout); values of the right type are handed to the
Runtime, which validates their meaning.

Must never: touch the Runtime, guess a missing invocation key (the client must know the key
before its first attempt, or a retry after a lost response could not reuse it), or coerce types
(``"5"`` is not a number of seconds).
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request

from settled.errors import BadInput
from settled.server.errors import BodyTooLarge

MAX_BODY_BYTES = 1 << 20
STREAMS = ("stdout", "stderr")
SIGNALS = ("TERM", "KILL", "INT")
TASK_FIELDS = frozenset({"workspace", "key", "user", "shared_workspace"})
SESSION_FIELDS = frozenset(
    {
        "argv", "shell", "key", "timeout", "grace", "cwd", "env", "service", "boundary",
        "isolation", "user", "writable",
    }
)  # fmt: skip
CLOSE_FIELDS = frozenset({"final", "deadline"})
SIGNAL_FIELDS = frozenset({"signal", "reason"})
RECOVER_FIELDS = frozenset({"task"})


async def _read_bounded(request: Request) -> bytes:
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge(
                f"request body is over {MAX_BODY_BYTES} bytes; a command is not data"
            )
        parts.append(part)
    return b"".join(parts)


async def json_body(request: Request, allowed: frozenset[str]) -> dict[str, Any]:
    """The request's JSON object ({} for an empty body); unknown fields are refused."""
    raw = await _read_bounded(request)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadInput(f"request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadInput(f"request body must be a JSON object, not {type(body).__name__}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadInput(
            f"unknown field(s) {', '.join(map(repr, unknown))}; "
            f"this endpoint takes {', '.join(sorted(allowed))}"
        )
    return body


def _optional(body: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise BadInput(f"`{name}` must be {what}, got {json.dumps(value)}")
    return value


def _seconds(body: dict[str, Any], name: str) -> float | None:
    value = _optional(body, name, (int, float), "a number of seconds")
    if value is not None and (not math.isfinite(value) or value < 0):
        raise BadInput(f"`{name}` {value!r} must be a finite number of seconds >= 0")
    return None if value is None else float(value)


def task_request(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "workspace": _optional(body, "workspace", str, "a directory path on the server"),
        "key": _optional(body, "key", str, "a string"),
        "user": _optional(body, "user", str, "UID[:GID] or a user name"),
        "shared_workspace": bool(_optional(body, "shared_workspace", bool, "true or false")),
    }


def session_request(body: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for ``Runtime.exec`` (after the task)."""
    key = _optional(body, "key", str, "a string")
    if not key:
        raise BadInput(
            "`key` is required over HTTP: choose it before the first attempt and send the same "
            "key on every retry, so a retry after a lost response returns the same session"
        )
    shell = _optional(body, "shell", str, "a shell command string")
    argv = _argv(body)
    if (shell is None) == (argv is None):
        raise BadInput("give exactly one of `shell` (a string) or `argv` (a list of strings)")
    return {
        "argv": argv,
        "shell": shell,
        "key": key,
        "timeout": _seconds(body, "timeout"),
        "grace": _seconds(body, "grace"),
        "cwd": _optional(body, "cwd", str, "a path relative to the workspace") or ".",
        "env": _env(body),
        "service": bool(_optional(body, "service", bool, "true or false")),
        "boundary": _optional(body, "boundary", str, "a boundary policy") or "auto",
        "isolation": _optional(body, "isolation", str, "auto, strict or none") or "auto",
        "user": _optional(body, "user", str, "UID[:GID] or a user name"),
        "writable": _writable(body),
    }


def _writable(body: dict[str, Any]) -> list[str]:
    paths = body.get("writable")
    if paths is None:
        return []
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise BadInput(f"`writable` must be a list of absolute paths, got {json.dumps(paths)}")
    return paths


def _argv(body: dict[str, Any]) -> list[str] | None:
    argv = body.get("argv")
    if argv is None:
        return None
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise BadInput(f"`argv` must be a non-empty list of strings, got {json.dumps(argv)}")
    return argv


def _env(body: dict[str, Any]) -> dict[str, str] | None:
    env = body.get("env")
    if env is None:
        return None
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise BadInput(f"`env` must be an object of string values, got {json.dumps(env)}")
    return env


def close_request(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "final": _optional(body, "final", str, "a string"),
        "deadline": _seconds(body, "deadline"),
    }


def signal_request(body: dict[str, Any]) -> tuple[str, str | None]:
    name = body.get("signal")
    if not isinstance(name, str) or name.upper().removeprefix("SIG") not in SIGNALS:
        raise BadInput(f"`signal` {json.dumps(name)} is not one of {', '.join(SIGNALS)}")
    return name.upper().removeprefix("SIG"), _optional(body, "reason", str, "a string")


# -- query parameters ---------------------------------------------------------------------


def query_stream(request: Request) -> str:
    stream = request.query_params.get("stream", "stdout")
    if stream not in STREAMS:
        raise BadInput(f"stream {stream!r} is not one of {', '.join(STREAMS)}")
    return stream


def cursor_value(text: str, what: str) -> int:
    if not text.isdigit():
        raise BadInput(f"{what} {text!r} must be a byte cursor: an integer >= 0")
    return int(text)


def query_cursor(request: Request) -> int:
    """``Last-Event-ID`` (a reconnecting SSE client) overrides ``from``."""
    resume = request.headers.get("last-event-id")
    if resume is not None and resume.strip():
        return cursor_value(resume.strip(), "Last-Event-ID")
    return cursor_value(request.query_params.get("from", "0"), "from")


def query_flag(request: Request, name: str) -> bool:
    value = request.query_params.get(name, "0").lower()
    if value not in ("0", "1", "true", "false", ""):
        raise BadInput(f"{name}={value!r} must be 1 or 0")
    return value in ("1", "true")


def query_max(request: Request) -> int | None:
    text = request.query_params.get("max")
    if text is None:
        return None
    value = cursor_value(text, "max")
    if value == 0:
        raise BadInput("max=0 asks for nothing; give a number of bytes > 0 or leave it out")
    return value


def query_wait(request: Request, limit: float) -> float:
    text = request.query_params.get("wait")
    if text is None:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        raise BadInput(f"wait={text!r} must be a number of seconds") from None
    if not math.isfinite(value) or not 0 <= value <= limit:
        raise BadInput(f"wait={text!r} must be between 0 and {limit:g} seconds")
    return value
