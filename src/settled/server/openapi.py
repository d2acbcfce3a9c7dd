"""The OpenAPI 3.1 document of the HTTP service, written by hand to say what is served.

Owns the description of every route in ``settled.server.app.routes``: its method, parameters,
body, status codes, headers and media types. ``tests/test_server.py`` walks the app's routes and
checks each one (with its methods) is here, and that nothing here is not served.

Must never: describe a route, parameter or status code the app does not serve, or import the
app (the app imports this).
"""

from __future__ import annotations

from typing import Any

from settled.identity import BOUNDARY_POLICIES, ISOLATION_POLICIES

VERSION = "1"
JSON = "application/json"


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(description: str, schema: str = "Object") -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": _ref(schema)}}}


def _error(description: str) -> dict[str, Any]:
    return _json(description, "Error")


def _path_param(name: str, what: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": what,
        "schema": {"type": "string"},
    }


def _query(name: str, what: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": what, "schema": schema}


def _body(schema: str, required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": {JSON: {"schema": _ref(schema)}}}


def _cursor_header(what: str) -> dict[str, Any]:
    return {"description": what, "schema": {"type": "integer", "minimum": 0}}


TASK = _path_param("task", "a task id (t_...)")
SESSION = _path_param("session", "a session id")
STREAM = _query(
    "stream", "which stream", {"type": "string", "enum": ["stdout", "stderr"], "default": "stdout"}
)
FROM = _query("from", "byte cursor to start at", {"type": "integer", "minimum": 0, "default": 0})
AUTH_ERRORS = {
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
        responses = {**responses, "413": _error("request body over 1 MiB")}
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
                    "409": _json("not complete: what it is blocked on", "Blocked"),
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
        {"type": "number", "minimum": 0, "maximum": 3600},
    )
    follow = _query(
        "follow",
        "keep the response open to the final cursor",
        {"type": "string", "enum": ["0", "1", "true", "false"]},
    )
    max_bytes = _query(
        "max", "at most this many bytes (not with follow)", {"type": "integer", "minimum": 1}
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
                        "schema": {"type": "integer", "minimum": 0},
                    },
                ],
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


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def _schemas() -> dict[str, Any]:
    s, n, b = {"type": "string"}, {"type": ["number", "null"], "minimum": 0}, {"type": "boolean"}
    return {
        "Object": {"type": "object"},
        "Error": {
            "type": "object",
            "required": ["error", "message"],
            "properties": {"error": s, "message": s},
        },
        "Task": {"type": "object", "required": ["task", "key", "workspace", "state"]},
        "TaskRequest": _obj({"workspace": s, "key": s, "user": s, "shared_workspace": b}),
        "SessionRequest": _obj(
            {
                "argv": {"type": "array", "items": s, "minItems": 1},
                "shell": s,
                "key": s,
                "timeout": n,
                "grace": n,
                "cwd": s,
                "env": {"type": "object", "additionalProperties": s},
                "service": b,
                "boundary": {"type": "string", "enum": list(BOUNDARY_POLICIES)},
                "isolation": {"type": "string", "enum": list(ISOLATION_POLICIES)},
                "user": s,
                "writable": {"type": "array", "items": s},
            },
            ["key"],
        ),
        "Admission": {
            "type": "object",
            "required": ["session", "task", "key", "digest", "reused", "state"],
        },
        "SessionStatus": {"type": "object", "required": ["session", "task", "state"]},
        "CloseRequest": _obj({"final": s, "deadline": n}),
        "Blocked": {"type": "object", "required": ["complete", "blocked_on"]},
        "SignalRequest": _obj(
            {"signal": {"type": "string", "enum": ["TERM", "KILL", "INT"]}, "reason": s}, ["signal"]
        ),
        "RecoverRequest": _obj({"task": s}),
    }


def document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "settled",
            "version": VERSION,
            "description": "Run commands for coding agents; output replayable by cursor.",
        },
        "paths": {**_open(), **_tasks(), **_sessions()},
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
