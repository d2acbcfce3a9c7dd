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

from settled import grammar, netpolicy
from settled.errors import BadInput
from settled.identity import BOUNDARY_POLICIES, ISOLATION_POLICIES, NETWORK_POLICIES
from settled.server.errors import BodyTooLarge

MAX_BODY_BYTES = 1 << 20
STREAMS = ("stdout", "stderr")
SIGNALS = ("TERM", "KILL", "INT")
WALL_FIELDS = frozenset(
    {"writable", "readable", "memory", "pids", "cpus", "network", "allow_hosts"}
)
TASK_FIELDS = frozenset({"workspace", "key", "user", "shared_workspace", "ignore"}) | WALL_FIELDS
SESSION_FIELDS = frozenset(
    {
        "argv", "shell", "key", "timeout", "grace", "cwd", "env", "inherited", "service",
        "boundary", "isolation", "user",
    }
) | WALL_FIELDS  # fmt: skip
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
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadInput(
            f"unknown field(s) {grammar.shown(', '.join(map(repr, unknown)))}; "
            f"this endpoint takes {', '.join(sorted(allowed))}"
        )
    return body


def task_request(body: dict[str, Any]) -> dict[str, Any]:
    workspace = body.get("workspace")
    return {
        "workspace": None if workspace is None else grammar.check_path("workspace", workspace),
        "key": grammar.optional_key("key", body.get("key")),
        "user": _user(body),
        "shared_workspace": body.get("shared_workspace") is not None
        and grammar.check_bool("shared_workspace", body["shared_workspace"]),
        "ignore": _ignore(body),
        **walls(body),
    }


MAX_IGNORE_PATTERNS = 1024


def _ignore(body: dict[str, Any]) -> list[str]:
    """Extra gitignore patterns (strings, at most MAX_IGNORE_PATTERNS); compiled at task new."""
    patterns = body.get("ignore")
    if patterns is None:
        return []
    if not isinstance(patterns, list) or len(patterns) > MAX_IGNORE_PATTERNS:
        raise BadInput(f"ignore must be a list of at most {MAX_IGNORE_PATTERNS} patterns")
    return [grammar.check_text("ignore", p, 4096, 1) for p in patterns]


def _user(body: dict[str, Any]) -> str | None:
    user = body.get("user")
    return None if user is None else grammar.check_user_text("user", user)


def session_request(body: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for ``Runtime.exec`` (after the task)."""
    if body.get("key") is None:
        raise BadInput(
            "`key` is required over HTTP: choose it before the first attempt and send the same "
            "key on every retry, so a retry after a lost response returns the same session"
        )
    key = grammar.check_key("key", body["key"])
    shell, argv = body.get("shell"), body.get("argv")
    if (shell is None) == (argv is None):
        raise BadInput("give exactly one of `shell` (a string) or `argv` (a list of strings)")
    return {
        "argv": None if argv is None else list(grammar.check_argv("argv", argv)),
        "shell": grammar.optional_text("shell", shell, grammar.MAX_ARG_BYTES),
        "key": key,
        "timeout": grammar.optional_seconds("timeout", body.get("timeout"), grammar.MAX_TIMEOUT_S),
        "grace": grammar.optional_seconds("grace", body.get("grace"), grammar.MAX_GRACE_S),
        "cwd": grammar.optional_text("cwd", body.get("cwd"), grammar.MAX_PATH_BYTES) or ".",
        "env": _env(body),
        "inherited": _inherited(body),
        "service": body.get("service") is not None
        and grammar.check_bool("service", body["service"]),
        "boundary": _choice(body, "boundary", BOUNDARY_POLICIES),
        "isolation": _choice(body, "isolation", ISOLATION_POLICIES),
        "user": _user(body),
        **walls(body),
    }


def _inherited(body: dict[str, Any]) -> list[str]:
    """Names of `env` the caller took from its own environment: recorded, never resolved here
    (a server hands a command none of its own variables)."""
    names = body.get("inherited")
    if names is None:
        return []
    if not isinstance(names, list):
        raise grammar.BadText("inherited", names, "must be a list of variable names")
    return [name for name, _ in grammar.check_env("inherited", ((n, "") for n in names))]


def walls(body: dict[str, Any]) -> dict[str, Any]:
    """The grants (`writable`, `readable`: absolute paths) and limits (`memory` in bytes,
    `pids`, `cpus`) of a session or a task's defaults; absent ones are empty or None."""
    paths = {k: body.get(k) for k in ("writable", "readable")}
    memory, pids, cpus = body.get("memory"), body.get("pids"), body.get("cpus")
    return {
        **{k: [] if v is None else list(grammar.check_paths(k, v)) for k, v in paths.items()},
        "memory": None if memory is None else grammar.check_memory("memory", memory),
        "pids": None if pids is None else grammar.check_pids("pids", pids),
        "cpus": None if cpus is None else grammar.check_cpus("cpus", cpus),
        "network": None
        if body.get("network") is None
        else grammar.check_choice("network", body["network"], NETWORK_POLICIES),
        "allow_hosts": None
        if body.get("allow_hosts") is None
        else list(netpolicy.check_patterns("allow_hosts", body["allow_hosts"])),
    }


def _choice(body: dict[str, Any], name: str, choices: tuple[str, ...]) -> str:
    value = body.get(name)
    return "auto" if value is None else grammar.check_choice(name, value, choices)


def _env(body: dict[str, Any]) -> dict[str, str] | None:
    env = body.get("env")
    if env is None:
        return None
    if not isinstance(env, dict):
        raise grammar.BadText("env", env, "must be an object of NAME: VALUE strings")
    return dict(grammar.check_env("env", env.items()))


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
