"""The OpenAPI 3.1 document of the HTTP service, written by hand to say what is served.

Owns the description of every route in ``settled.server.app.routes``: its method, parameters,
body, status codes, headers and media types. ``tests/test_server.py`` walks the app's routes and
checks each one (with its methods) is here, and that nothing here is not served.

Must never: describe a route, parameter or status code the app does not serve, or import the
app (the app imports this).
"""

from __future__ import annotations

from typing import Any

from settled import __version__, grammar
from settled.identity import BOUNDARY_POLICIES, ISOLATION_POLICIES, NETWORK_POLICIES
from settled.requests import MAX_IGNORE_PATTERNS

VERSION = "1"
JSON = "application/json"


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(description: str, schema: str = "Object") -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": _ref(schema)}}}


def _error(description: str) -> dict[str, Any]:
    return _json(description, "Error")


NO_NUL = "^[^\\x00]*$"  # every string: UTF-8 without NUL (settled.grammar)
ID_SCHEMA = {"type": "string", "pattern": f"^[A-Za-z0-9_-]{{1,{grammar.MAX_ID_CHARS}}}$"}
CURSOR_SCHEMA = {"type": "integer", "minimum": 0, "maximum": grammar.MAX_CURSOR}


def _text(max_bytes: int, min_length: int = 0, pattern: str = NO_NUL) -> dict[str, Any]:
    """A string schema; ``maxLength`` counts characters and the server counts UTF-8 bytes,
    so a value of non-ASCII characters may be refused (413) below ``maxLength``."""
    schema: dict[str, Any] = {"type": "string", "maxLength": max_bytes, "pattern": pattern}
    if min_length:
        schema["minLength"] = min_length
    return schema


def _seconds(hi: float) -> dict[str, Any]:
    return {"type": ["number", "null"], "minimum": 0, "maximum": hi}


def _seconds_text(hi: int) -> dict[str, Any]:
    """A query parameter of seconds: ``[0-9]+(.[0-9]+)?`` (no exponent) within ``[0, hi]``."""
    h = str(hi)
    assert len(h) == 4 and h.endswith("00"), "the pattern below is written for 1000..9900"
    pattern = (
        f"^0*([0-9]{{1,3}}|[0-{int(h[0]) - 1}][0-9]{{3}}|{h[0]}[0-{int(h[1]) - 1}][0-9]{{2}})"
        f"(\\.[0-9]{{1,9}})?$|^0*{h}(\\.0{{1,9}})?$"
    )
    return {"type": "string", "pattern": pattern, "maxLength": 24}


def _path_param(name: str, what: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": what,
        "schema": ID_SCHEMA,
    }


def _query(name: str, what: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": what, "schema": schema}


def _body(schema: str, required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": {JSON: {"schema": _ref(schema)}}}


def _cursor_header(what: str) -> dict[str, Any]:
    return {"description": what, "schema": CURSOR_SCHEMA}


TASK = _path_param("task", "a task id (t_...)")
SESSION = _path_param("session", "a session id")
STREAM = _query(
    "stream", "which stream", {"type": "string", "enum": ["stdout", "stderr"], "default": "stdout"}
)
FROM = _query("from", "byte cursor to start at", {**CURSOR_SCHEMA, "default": 0})
AUTH_ERRORS = {
    "400": _error("a path or query parameter outside its grammar (names the field)"),
    "401": _error("missing or unknown bearer token"),
    "404": _error("unknown, or outside this token's scope (the same answer)"),
}
SPACE_ERRORS = {  # SpaceExhausted: names free_bytes, reserve_bytes and the path
    "507": _error("SpaceExhausted: the home's filesystem is below its reserve, or full"),
}
CURSOR_ERRORS = {
    "400": _error("bad stream, cursor or flag"),
    "416": {
        "description": "the cursor is beyond what exists (body names the cursor and the end; "
        "`Content-Range: bytes */<end>`)",
        "content": {JSON: {"schema": _ref("Error")}},
    },
}


def _operation(summary: str, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
    if "requestBody" in extra:  # every body is read under one size limit
        responses = {
            **responses,
            "413": _error("request body over 1 MiB, or a field over its length"),
        }
    return {"summary": summary, "security": [{"bearer": []}], "responses": responses, **extra}


def _tasks() -> dict[str, Any]:
    return {
        "/v1/tasks": {
            "post": _operation(
                "Create a task (a scoped token may not); a repeated key returns the same task",
                {
                    "201": _json("the task", "Task"),
                    "400": _error("bad body or workspace"),
                    "401": AUTH_ERRORS["401"],
                    "403": _error("this token is scoped to tasks and cannot create one"),
                    **SPACE_ERRORS,
                },
                requestBody=_body("TaskRequest", required=False),
            )
        },
        "/v1/tasks/{task}": {
            "get": _operation(
                "The task's computed status",
                {"200": _json("task status"), **AUTH_ERRORS},
                parameters=[TASK],
            )
        },
        "/v1/tasks/{task}/sessions": {
            "post": _operation(
                "Admit a command idempotently by key (the key is required over HTTP)",
                {
                    "201": _json("a new session, launched once", "Admission"),
                    "200": _json("same key and digest: the existing session", "Admission"),
                    "400": _error("bad body, boundary or cwd"),
                    **AUTH_ERRORS,
                    "403": _error(
                        "a task-scoped token asked to loosen the sandbox (isolation none, a "
                        "granted host path, another user, a limit above its task's)"
                    ),
                    "409": _error(
                        "KeyConflict (names existing_digest and requested_digest) or "
                        "AdmissionSealed"
                    ),
                    "423": _error("AdmissionFrozen: names the unknown session recovery awaits"),
                    "500": _error("OwnerLaunchFailed: retry with the same key"),
                    **SPACE_ERRORS,
                },
                parameters=[TASK],
                requestBody=_body("SessionRequest"),
            )
        },
        "/v1/tasks/{task}/close": {
            "post": _operation(
                "Run (or resume) the close join; a repeated close answers the same receipt",
                {
                    "200": _json("the close receipt"),
                    "400": _error("bad body"),
                    **AUTH_ERRORS,
                    "409": {
                        "description": "not complete: what it is blocked on, or the "
                        "workspace is not the directory bound at task new (WorkspaceReplaced)",
                        "content": {JSON: {"schema": {"anyOf": [_ref("Blocked"), _ref("Error")]}}},
                    },
                    **SPACE_ERRORS,
                },
                parameters=[TASK],
                requestBody=_body("CloseRequest", required=False),
            )
        },
        "/v1/tasks/{task}/explain": {
            "get": _operation(
                "Which receipts allow (or block) success",
                {"200": _json("explain"), **AUTH_ERRORS},
                parameters=[TASK],
            )
        },
    }


def _sessions() -> dict[str, Any]:
    wait = _query(
        "wait",
        "wait up to this many seconds for the receipt",
        _seconds_text(int(grammar.MAX_HTTP_WAIT_S)),
    )
    follow = _query(
        "follow",
        "keep the response open to the final cursor",
        {"type": "string", "enum": ["0", "1", "true", "false"]},
    )
    max_bytes = _query(
        "max",
        "at most this many bytes (not with follow)",
        {"type": "integer", "minimum": 1, "maximum": grammar.MAX_CURSOR},
    )
    raw_headers = {
        "Settled-From": _cursor_header("the cursor the body starts at"),
        "Settled-Cursor": _cursor_header(
            "the cursor after the body; absent on a follow that started before the final "
            "cursor was known (then it is Settled-From plus the bytes received)"
        ),
        "Settled-Final-Cursor": _cursor_header("the stream's final cursor, once known"),
    }
    return {
        "/v1/sessions/{session}": {
            "get": _operation(
                "Status view; the process receipt inside it once settled",
                {
                    "200": _json("status (settled, or no wait asked)", "SessionStatus"),
                    "202": _json("wait ran out: the session goes on", "SessionStatus"),
                    "400": _error("bad wait"),
                    **AUTH_ERRORS,
                },
                parameters=[SESSION, wait],
            )
        },
        "/v1/sessions/{session}/output": {
            "get": _operation(
                "Raw bytes from a cursor",
                {
                    "200": {
                        "description": "raw bytes",
                        "headers": raw_headers,
                        "content": {
                            "application/octet-stream": {
                                "schema": {"type": "string", "format": "binary"}
                            }
                        },
                    },
                    **AUTH_ERRORS,
                    **CURSOR_ERRORS,
                },
                parameters=[SESSION, STREAM, FROM, follow, max_bytes],
            )
        },
        "/v1/sessions/{session}/events": {
            "get": _operation(
                "Server-Sent Events: `id: <cursor after the chunk>`, `data: <base64 of up to 64 "
                "KiB>`; `Last-Event-ID` resumes (overrides `from`); `event: end` carries the "
                "process receipt; `event: error` names lost bytes",
                {
                    "200": {
                        "description": "an event stream",
                        "content": {"text/event-stream": {"schema": {"type": "string"}}},
                    },
                    **AUTH_ERRORS,
                    **CURSOR_ERRORS,
                },
                parameters=[
                    SESSION,
                    STREAM,
                    FROM,
                    {
                        "name": "Last-Event-ID",
                        "in": "header",
                        "required": False,
                        "schema": CURSOR_SCHEMA,
                    },
                ],
            )
        },
        "/v1/sessions/{session}/merged": {
            "get": _operation(
                "Both streams in the owner's stored order (its read order across the two "
                "pipes) from a merged cursor: chunks tagged with stream, stream cursor, merged "
                "cursor and `ordered` (false: a tail no index ordered, stdout then stderr)",
                {
                    "200": _json("merged chunks and the merged cursor to resume from"),
                    **AUTH_ERRORS,
                    **CURSOR_ERRORS,
                },
                parameters=[SESSION, FROM, max_bytes],
            )
        },
        "/v1/sessions/{session}/signal": {
            "post": _operation(
                "TERM, KILL or INT: each is a cancel; the owner escalates TERM, grace, KILL",
                {
                    "202": _json("cancel requested of a live session"),
                    "200": _json("the session is not live: nothing delivered"),
                    "400": _error("unknown signal"),
                    **AUTH_ERRORS,
                },
                parameters=[SESSION],
                requestBody=_body("SignalRequest"),
            )
        },
        "/v1/recover": {
            "post": _operation(
                "Inspect sessions whose owner died (this token's tasks, or one task)",
                {
                    "200": _json("recovery results"),
                    "400": _error("bad body"),
                    **AUTH_ERRORS,
                    **SPACE_ERRORS,
                },
                requestBody=_body("RecoverRequest", required=False),
            )
        },
    }


LIVE_EVENT = {  # one event of /v1/events, as its fields
    "type": "object",
    "required": ["event", "id", "data"],
    "properties": {
        "event": {"type": "string", "enum": ["snapshot", "tasks"]},
        "id": {"type": "string", "pattern": "^[0-9a-f]{8}-[0-9]{1,19}$"},
        "data": {"type": "string", "contentMediaType": JSON},
    },
}


def _live() -> dict[str, Any]:
    """The live view of `/ui`: a task's clocks, and the stream of every visible task's."""
    follow = _query(
        "follow",
        "keep the stream open and send every change as it is seen (without it: the snapshot, "
        "or the changes since Last-Event-ID, then the end)",
        {"type": "string", "enum": ["0", "1", "true", "false"]},
    )
    resume = {
        "name": "Last-Event-ID",
        "in": "header",
        "required": False,
        "description": "an id this stream sent (`<instance>-<n>`): resume with every task "
        "changed since; an id of another server instance gets a snapshot",
        "schema": {"type": "string", "pattern": "^([0-9a-f]{8}-[0-9]{1,19})?$"},
    }
    return {
        "/v1/tasks/{task}/clocks": {
            "get": _operation(
                "Each session's transport, process, output and workspace clocks (state, when "
                "settled, which receipt by kind and digest, in words), the task's state and "
                "its close receipt once recorded",
                {"200": _json("the task's clocks"), **AUTH_ERRORS},
                parameters=[TASK],
            )
        },
        "/v1/events": {
            "get": _operation(
                "Server-Sent Events of the tasks this token sees (the newest 50, and every task "
                "a scoped token names) with their clocks: `event: snapshot` {tasks, order, "
                "reset, woken_by, poll_s}, then `event: tasks` {tasks} per change; ids count "
                "only this token's changes; keep-alive comments every 15 s",
                {
                    "200": {
                        "description": "an event stream",
                        "content": {"text/event-stream": {"schema": LIVE_EVENT}},
                    },
                    "400": _error("a malformed Last-Event-ID or follow"),
                    "401": AUTH_ERRORS["401"],
                },
                parameters=[follow, resume],
            )
        },
    }


def _page() -> dict[str, Any]:
    """`/ui`: static files, served without a token; every call the page makes needs one."""
    files = {"/ui": "text/html", "/ui/app.js": "text/javascript", "/ui/app.css": "text/css"}
    return {
        path: {
            "get": {
                "summary": f"The page of the four clocks ({path}); no token needed, no data in it",
                "security": [],
                "responses": {
                    "200": {
                        "description": "a static file",
                        "content": {media: {"schema": {"type": "string"}}},
                    }
                },
            }
        }
        for path, media in files.items()
    }


def _open() -> dict[str, Any]:
    return {
        "/healthz": {
            "get": {
                "summary": "Liveness; no token needed",
                "security": [],
                "responses": {"200": _json("ok")},
            }
        },
        "/openapi.json": {
            "get": _operation(
                "This document", {"200": _json("OpenAPI 3.1"), "401": AUTH_ERRORS["401"]}
            )
        },
    }


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """The server reads an optional field sent as null as the field left out."""
    kind = schema["type"]
    kinds = [kind] if isinstance(kind, str) else list(kind)
    out = {**schema, "type": kinds if "null" in kinds else [*kinds, "null"]}
    if "enum" in out and None not in out["enum"]:
        out["enum"] = [*out["enum"], None]
    return out


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    required = required or []
    optional = {k: v if k in required else _nullable(v) for k, v in props.items()}
    schema: dict[str, Any] = {
        "type": "object",
        "properties": optional,
        "additionalProperties": False,
    }
    if required:
        schema["required"] = required
    return schema


def _schemas() -> dict[str, Any]:
    g = grammar
    s, b = {"type": "string"}, {"type": "boolean"}
    key = _text(g.MAX_KEY_BYTES, 1, "^[^\\x00-\\x1f\\x7f-\\x9f]*$")
    user = _text(g.MAX_USER_BYTES, 1)
    path = _text(g.MAX_PATH_BYTES, 1)
    arg = _text(g.MAX_ARG_BYTES)
    env_name = {"type": "string", "pattern": "^[^\\x00=]+$", "maxLength": g.MAX_ENV_NAME_BYTES}
    grant = {
        "type": "array",
        "items": {**path, "pattern": "^/[^\\x00]*$"},
        "maxItems": g.MAX_WRITABLE,
    }
    walls = {  # grants and limits: a session's own, or a task's defaults
        "writable": grant,
        "readable": grant,
        "memory": {"type": "integer", "minimum": g.MIN_MEMORY, "maximum": g.MAX_MEMORY},
        "pids": {"type": "integer", "minimum": 1, "maximum": g.MAX_PIDS},
        "cpus": {"type": "number", "minimum": g.MIN_CPUS, "maximum": g.MAX_CPUS},
        "network": {"type": "string", "enum": list(NETWORK_POLICIES)},
        "allow_hosts": {  # netpolicy's patterns; the server checks each one's grammar
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 261},
            "maxItems": 256,
        },
    }
    return {
        "Object": {"type": "object"},
        "Error": {
            "type": "object",
            "required": ["error", "message"],
            "properties": {"error": s, "message": s, "field": s},
        },
        "Task": {"type": "object", "required": ["task", "key", "workspace", "state"]},
        "TaskRequest": _obj(
            {
                "workspace": path,
                "key": key,
                "user": user,
                "shared_workspace": b,
                "ignore": {  # gitignore patterns after the workspace's .settledignore
                    "type": "array",
                    "items": {"type": "string", "minLength": 1, "maxLength": 4096},
                    "maxItems": MAX_IGNORE_PATTERNS,
                },
                **walls,
            }
        ),
        "SessionRequest": _obj(
            {
                "argv": {
                    "type": "array",
                    "items": arg,
                    "minItems": 1,
                    "maxItems": g.MAX_ARGV_ITEMS,
                },
                "shell": arg,
                "key": key,
                "timeout": _seconds(g.MAX_TIMEOUT_S),
                "grace": _seconds(g.MAX_GRACE_S),
                "cwd": _text(g.MAX_PATH_BYTES),
                "env": {
                    "type": "object",
                    "propertyNames": env_name,
                    "additionalProperties": arg,
                    "maxProperties": g.MAX_ENV_ITEMS,
                },
                "inherited": {  # names of env the caller took from its own environment
                    "type": "array",
                    "items": env_name,
                    "maxItems": g.MAX_ENV_ITEMS,
                },
                "service": b,
                "boundary": {"type": "string", "enum": list(BOUNDARY_POLICIES)},
                "isolation": {"type": "string", "enum": list(ISOLATION_POLICIES)},
                "user": user,
                **walls,
            },
            ["key"],
        )
        | {  # exactly one of a command line and a shell string
            "oneOf": [
                {"required": ["argv"], "properties": {"argv": {"type": "array"}}},
                {"required": ["shell"], "properties": {"shell": {"type": "string"}}},
            ]
        },
        "Admission": {
            "type": "object",
            "required": ["session", "task", "key", "digest", "reused", "state"],
        },
        "SessionStatus": {"type": "object", "required": ["session", "task", "state"]},
        "CloseRequest": _obj(
            {"final": _text(g.MAX_FINAL_BYTES), "deadline": _seconds(g.MAX_DEADLINE_S)}
        ),
        "Blocked": {"type": "object", "required": ["complete", "blocked_on"]},
        "SignalRequest": _obj(
            {
                "signal": {"type": "string", "enum": ["TERM", "KILL", "INT"]},
                "reason": _text(g.MAX_REASON_BYTES),
            },
            ["signal"],
        ),
        "RecoverRequest": _obj({"task": ID_SCHEMA}),
    }


def document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "settled",
            "version": VERSION,
            "x-settled-version": __version__,  # what `settled probe URL` reports it probed
            "description": "Run commands for coding agents; output replayable by cursor.",
        },
        "paths": {**_open(), **_tasks(), **_sessions(), **_live(), **_page()},
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
