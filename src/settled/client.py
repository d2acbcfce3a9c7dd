"""The Python client of the settled HTTP API: `Client` (sync) and `AsyncClient`, same methods.

Owns: speaking the HTTP contract of DESIGN.md over httpx (paths, JSON keys, the bearer token, the
`Settled-Cursor` header, the SSE stream whose `id:` is the cursor after each chunk) and the two
promises a client can keep over a lossy network. An admission retried after a transport failure
(connect error, read timeout, a connection dropped before the reply, 502/503/504) carries the
same invocation key and the same body, so the server answers "200 reused" instead of launching
again. An output stream resumes from its last acknowledged cursor after a dropped connection and
yields every byte exactly once.

Must never: launch twice (every retry reuses the key and the body; a 409 is raised, never
retried); yield a byte twice or skip one (each chunk is checked against the cursor it claims);
retry without bound; decide what the server decides (state, receipts and completion are
returned as the server computed them).

Layout: the I/O-free parts (request bodies, reply and error decoding, SSE decoding, cursor
accounting, backoff) come first and are shared; then the sync driver (`Client`, `OutputStream`)
and its async twin (`AsyncClient`, `AsyncOutputStream`), written out in full rather than
generated, which is why this one module is longer than most.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import anyio
import httpx

from settled import errors
from settled.environment import caller_policy, from_caller
from settled.exitcodes import command_exit_code
from settled.requests import ExecRequest, TaskRequest

CURSOR_HEADER = "Settled-Cursor"
RETRY_STATUSES = frozenset({502, 503, 504})
RETRYABLE = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
SIGNALS = ("TERM", "KILL", "INT")
STREAMS = ("stdout", "stderr")
SERVER_CLOSE_DEADLINE_S = 600.0  # the server's default close deadline (close/join.py)
LONG_POLL_S = 20.0  # one `?wait=` long poll; wait() chains them up to its timeout
TASK_ID = re.compile(r"t_[0-9a-f]{16}")  # identity.new_id("t"): run() reads anything else as a path


# -- errors ------------------------------------------------------------------------------------


class ClientError(Exception):
    """Base of every error this client raises on purpose; `status` and `body` when the server
    answered, None when it never did. What the server refused in settled's own words is raised
    as settled.errors' class of that name (KeyConflict, AdmissionSealed, WrongHost, TaskFrozen,
    NotSettled, AdmissionFrozen, CursorOutOfRange), through a subclass that is also a
    ClientError: `except settled.errors.KeyConflict` catches it from a Runtime and from a
    Client alike, and `except ClientError` still catches everything this client raises. Its
    attributes are the settled.errors class's, read from the reply's body (None where the
    server did not send one)."""

    def __init__(
        self, message: str, status: int | None = None, body: dict[str, Any] | None = None
    ) -> None:
        Exception.__init__(self, message)  # not the settled.errors class's own __init__
        self.status, self.body = status, body or {}


def _from_body(name: str) -> Any:
    """An attribute of a settled.errors class, as the server's reply body carries it."""
    return property(lambda self: self.body.get(name))


class UsageError(ClientError, ValueError):
    """The call itself is malformed; nothing was sent."""


class Unauthorized(ClientError):
    """401/403: the bearer token is missing, wrong, or scoped to another task."""


class NotFound(ClientError):
    """404: no such task or session (or not visible to this token)."""


class KeyConflict(ClientError, errors.KeyConflict):
    """409: the key is bound to another command in this task; nothing was launched."""

    task = _from_body("task")
    key = _from_body("key")
    session = _from_body("session")
    existing_digest = _from_body("existing_digest")
    requested_digest = _from_body("requested_digest")


class AdmissionSealed(ClientError, errors.AdmissionSealed):
    """409: the task is sealed (closing or closed); no new command may start in it."""

    task = _from_body("task")
    state = _from_body("state")


class WrongHost(ClientError, errors.WrongHost):
    """409: the task runs on another host (`body["host"]`); send its execs and close there."""

    task = _from_body("task")
    host = _from_body("host")
    host_name = _from_body("host_name")
    here = _from_body("here")


class TaskFrozen(ClientError, errors.TaskFrozen):
    """409: the task's host was declared vanished; nothing more may start in it."""

    task = _from_body("task")
    why = _from_body("why")


class Blocked(ClientError):
    """409 on close: the task is not complete; `blocked_on` names the authority and obligation."""

    @property
    def blocked_on(self) -> dict[str, Any]:
        blocked: dict[str, Any] = self.body.get("blocked_on") or {}
        return blocked


class NotSettled(ClientError, errors.NotSettled):
    """wait() ran out before the session settled; the session goes on."""


class AdmissionFrozen(ClientError, errors.AdmissionFrozen):
    """423: recovery is inspecting a session of this task whose owner vanished; retry later
    (or run recovery) with the same key."""

    task = _from_body("task")
    session = _from_body("session")


class CursorOutOfRange(ClientError, errors.CursorOutOfRange):
    """416: the cursor is beyond what the stream holds (`body["end"]` bytes)."""

    cursor = _from_body("cursor")
    end = _from_body("end")
    stream = _from_body("stream")


class TransportFailed(ClientError):
    """Every bounded retry failed to get an answer; the message names the last failure. For an
    admission, retry with the same key: it returns the same session if one was admitted."""


class StreamError(ClientError):
    """The server's stream contradicts the cursor already acknowledged (a gap or an overrun)."""


# -- retry policy ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Retry:
    """Bounded exponential backoff: `attempts` tries in all, delays `first * factor**n` up to
    `cap` seconds, each scaled by a random factor in [0.5, 1] so clients do not retry in step."""

    attempts: int = 10
    first: float = 0.1
    factor: float = 2.0
    cap: float = 2.0


class _Attempts:
    """Counts consecutive failures of one logical call; `failed()` gives the next delay or raises
    TransportFailed once the policy (or the caller's deadline) is exhausted."""

    def __init__(self, policy: Retry, what: str, deadline: float | None = None) -> None:
        self.policy, self.what, self.deadline = policy, what, deadline
        self.failures = 0
        self.tries = 1

    def reset(self) -> None:
        self.failures = 0

    def failed(self, cause: BaseException | httpx.Response | str) -> float:
        self.failures += 1
        delay = min(self.policy.cap, self.policy.first * self.policy.factor ** (self.failures - 1))
        delay *= 0.5 + random.random() / 2
        late = self.deadline is not None and time.monotonic() + delay > self.deadline
        if self.failures >= self.policy.attempts or late:
            raise TransportFailed(
                f"{self.what}: gave up after {self.tries} tries; last: {_describe(cause)}"
            )
        self.tries += 1
        return delay


def _describe(cause: BaseException | httpx.Response | str) -> str:
    if isinstance(cause, httpx.Response):
        return f"HTTP {cause.status_code} {cause.reason_phrase}"
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    return cause


# -- requests and replies (no I/O) -------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    method: str
    path: str
    body: dict[str, Any] | None = None
    params: dict[str, str] | None = None
    timeout: float | None = None

    @property
    def what(self) -> str:
        return f"{self.method} {self.path}"


@dataclass(frozen=True)
class Admission:
    """The server's answer to an admission: `reused` is True when the key already named this
    command (the retry case); `attempts` is how many requests it took to get the answer."""

    session: str
    task: str
    key: str
    digest: str
    reused: bool
    state: str
    attempts: int
    raw: dict[str, Any] = field(repr=False)


def _with_inherited(
    env: Mapping[str, str] | None, names: Sequence[str], whole: bool, clean: bool
) -> tuple[Mapping[str, str] | None, list[str]]:
    """The explicit env with the caller's chosen variables under it (explicit wins), and the
    names that came from the caller: by default its PATH too (settled.environment's policy,
    applied here since a server never hands a command its own)."""
    names = caller_policy(names, whole, clean, os.environ)
    if not names and not whole:
        return env, []
    caller = from_caller(names, whole, os.environ)
    explicit = dict(env or {})
    return {**caller.env, **explicit}, [n for n in caller.inherited if n not in explicit]


def new_key() -> str:
    """An invocation key, the same shape the CLI makes (DESIGN.md identity)."""
    return "k_" + os.urandom(8).hex()


@dataclass(frozen=True)
class RunResult:
    """What `run()` returns, as `settled run` shows it: `exit_code` is the code the CLI exits
    with (settled.exitcodes: the command's own, 128 + signal, 124 timeout, 127 never started,
    117 unknown); `stdout`/`stderr` are every stored byte of each stream; `receipt` is the
    process receipt (None when the session is unknown without one); `view` is the status."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    receipt: dict[str, Any] | None
    session: str
    task: str
    key: str
    reused: bool
    view: dict[str, Any] = field(repr=False)


def _run_target(workspace_or_task: str, key: str) -> tuple[str | None, str]:
    """(workspace, task key) for a path; (None, task id) for a task id. The task key is derived
    from the run's key, so a run retried with its key finds the same task and session."""
    if TASK_ID.fullmatch(workspace_or_task):
        return None, workspace_or_task
    return workspace_or_task, f"{key}/task"


def _run_result(admission: Admission, view: dict[str, Any], out: bytes, err: bytes) -> RunResult:
    receipt = view.get("receipt")
    return RunResult(
        exit_code=command_exit_code(receipt),
        stdout=out,
        stderr=err,
        receipt=receipt,
        session=admission.session,
        task=admission.task,
        key=admission.key,
        reused=admission.reused,
        view=view,
    )


def _seg(value: str) -> str:
    if not value:
        raise UsageError("an empty task or session id cannot name a resource")
    return quote(value, safe="")


def _task_call(request: TaskRequest) -> _Call:
    return _Call("POST", "/v1/tasks", request.to_json())


def _admission_call(task: str, request: ExecRequest) -> _Call:
    """The admission body: exactly the keys given, so every retry sends the same digest."""
    argv, shell = request.argv, request.shell
    if (shell is None) == (argv is None):
        raise UsageError("exec needs exactly one of shell (a string) or argv (a list of strings)")
    if argv is not None and (
        isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv)
    ):
        raise UsageError(f"argv must be a non-empty list of strings, got {argv!r}")
    return _Call("POST", f"/v1/tasks/{_seg(task)}/sessions", request.to_json())


def _signal_call(session: str, name: str, reason: str | None) -> _Call:
    signal = name.upper().removeprefix("SIG")
    if signal not in SIGNALS:
        raise UsageError(f"signal {name!r} is not one of {', '.join(SIGNALS)}")
    body = {"signal": signal} if reason is None else {"signal": signal, "reason": reason}
    return _Call("POST", f"/v1/sessions/{_seg(session)}/signal", body)


def _close_call(task: str, final: str | None, deadline: float | None, margin: float) -> _Call:
    body = {k: v for k, v in (("final", final), ("deadline", deadline)) if v is not None}
    waits = SERVER_CLOSE_DEADLINE_S if deadline is None else deadline
    return _Call("POST", f"/v1/tasks/{_seg(task)}/close", body, timeout=waits + margin)


def _output_call(session: str, stream: str, start: int, follow: bool) -> _Call:
    if stream not in STREAMS:
        raise UsageError(f"stream {stream!r} is not stdout or stderr")
    if start < 0:
        raise UsageError(f"cursor {start} is negative")
    params = {"stream": stream, "from": str(start)}
    if follow:
        params["follow"] = "1"
    return _Call("GET", f"/v1/sessions/{_seg(session)}/output", params=params)


def _events_call(session: str, stream: str, start: int) -> _Call:
    if stream not in STREAMS:
        raise UsageError(f"stream {stream!r} is not stdout or stderr")
    params = {"stream": stream, "from": str(start)}
    return _Call("GET", f"/v1/sessions/{_seg(session)}/events", params=params)


def _body(response: httpx.Response) -> dict[str, Any]:
    """The JSON object of a reply; an error detail nested by the framework is unwrapped."""
    try:
        data = json.loads(response.content or b"{}")
    except ValueError:
        return {"message": response.text[:500]}
    if not isinstance(data, dict):
        return {"value": data}
    for wrapper in ("detail", "error"):
        if isinstance(data.get(wrapper), dict):
            return {**data, **data[wrapper]}
    return data


_BY_KIND: dict[str, type[ClientError]] = {
    "KeyConflict": KeyConflict,
    "AdmissionSealed": AdmissionSealed,
    "WrongHost": WrongHost,
    "TaskFrozen": TaskFrozen,
    "UnknownHost": NotFound,
    "UnknownTask": NotFound,
    "UnknownSession": NotFound,
    "NotSettled": NotSettled,
    "AdmissionFrozen": AdmissionFrozen,
    "CursorOutOfRange": CursorOutOfRange,
}


def _error(call: _Call, response: httpx.Response) -> ClientError:
    body = _body(response)
    status = response.status_code
    message = str(body.get("message") or body.get("detail") or response.reason_phrase)
    kind = body.get("error") if isinstance(body.get("error"), str) else None
    if status in (401, 403):
        return Unauthorized(f"{call.what}: {status} {message}", status, body)
    if status == 409 and "blocked_on" in body:
        return Blocked(_blocked_words(call, body["blocked_on"]), status, body)
    if kind == "KeyConflict" or (status == 409 and "existing_digest" in body):
        return KeyConflict(_conflict_words(body, message), status, body)
    if kind in _BY_KIND:
        return _BY_KIND[kind](f"{call.what}: {message}", status, body)
    if status == 404:
        return NotFound(f"{call.what}: not found ({message})", status, body)
    return ClientError(f"{call.what}: HTTP {status}: {message}", status, body)


def _blocked_words(call: _Call, blocked: Any) -> str:
    if not isinstance(blocked, dict):
        return f"{call.what}: blocked on {blocked!r}"
    return f"{call.what}: not complete; {blocked.get('authority')} owes {blocked.get('obligation')}"


def _conflict_words(body: dict[str, Any], message: str) -> str:
    existing, requested = body.get("existing_digest"), body.get("requested_digest")
    if existing is None and requested is None:
        return f"key conflict: {message}"
    return (
        f"key {body.get('key')!r} in task {body.get('task')} is bound to session "
        f"{body.get('session')} with digest {existing}; this request has digest {requested}. "
        "Use a new key for a new command."
    )


def _json(call: _Call, response: httpx.Response) -> dict[str, Any]:
    if response.status_code >= 400:
        raise _error(call, response)
    return _body(response)


def _admission(data: dict[str, Any], key: str, attempts: int) -> Admission:
    return Admission(
        session=data["session"],
        task=data.get("task", ""),
        key=data.get("key", key),
        digest=data.get("digest", ""),
        reused=bool(data.get("reused", False)),
        state=data.get("state", ""),
        attempts=attempts,
        raw=data,
    )


def _settled(view: dict[str, Any]) -> bool:
    """As Runtime.wait: a receipt is there, or the session is unknown (no receipt may come).
    wait() looks once more at an unknown view: a projection that read the record just before
    the owner wrote its receipt and exited shows unknown for an instant."""
    state = view.get("state")
    return (state == "settled" and "receipt" in view) or state == "unknown"


class _Poll:
    """wait()'s schedule: long polls (`?wait=S`, the server answers when the receipt is there
    or S runs out) of at most LONG_POLL_S, short pauses between them, never past the deadline."""

    def __init__(self, session: str, timeout: float | None, margin: float) -> None:
        self.session, self.timeout, self.margin = session, timeout, margin
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.pause = 0.02

    def call(self) -> _Call:
        left = LONG_POLL_S if self.deadline is None else self.deadline - time.monotonic()
        left = max(0.0, min(LONG_POLL_S, left))
        params = {"wait": f"{left:.3f}"}
        path = f"/v1/sessions/{_seg(self.session)}"
        return _Call("GET", path, params=params, timeout=left + self.margin)

    def next_pause(self, view: dict[str, Any]) -> float:
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            raise NotSettled(
                f"session {self.session} is still {view.get('state')} after {self.timeout} s; "
                "it goes on (wait again, or stream its output)"
            )
        pause = self.pause if self.deadline is None else min(self.pause, self.deadline - now)
        self.pause = min(self.pause * 1.5, 0.5)
        return max(0.0, pause)


# -- output streams (no I/O) -------------------------------------------------------------------


@dataclass
class _Event:
    event: str = "message"
    id: str | None = None
    data: list[str] = field(default_factory=list)


class _SSEDecoder:
    """Bytes in, complete Server-Sent Events out; an event cut off by a dropped connection is
    never dispatched (so its bytes are never acknowledged). Lines end in LF, CRLF or CR."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._scan = 0  # where the search for the next line end resumes
        self._event = _Event()

    def feed(self, data: bytes) -> list[_Event]:
        buffer = self._buffer
        buffer += data
        events: list[_Event] = []
        line_start = 0
        while True:
            match = _EOL.search(buffer, self._scan)
            if match is None or (match.group() == b"\r" and match.end() == len(buffer)):
                self._scan = len(buffer) if match is None else match.start()
                break  # no complete line yet (a final CR may be half of a CRLF)
            event = self._line(bytes(buffer[line_start : match.start()]).decode("utf-8", "replace"))
            if event is not None:
                events.append(event)
            line_start = self._scan = match.end()
        del buffer[:line_start]
        self._scan -= line_start
        return events

    def _line(self, line: str) -> _Event | None:
        if not line:
            event, self._event = self._event, _Event()
            return event if event.data or event.event != "message" else None
        if line.startswith(":"):
            return None  # a comment, e.g. a keep-alive
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event.event = value
        elif name == "data":
            self._event.data.append(value)
        elif name == "id":
            self._event.id = value
        return None


_EOL = re.compile(rb"\r\n|\r|\n")


class _Resume:
    """The cursor accounting of one stream: `cursor` is the first byte not yet yielded. A chunk
    that overlaps is trimmed, one that would leave a gap is refused, and the stream is done when
    the receipt's final cursor equals the cursor."""

    def __init__(self, session: str, stream: str, start: int) -> None:
        if stream not in STREAMS:
            raise UsageError(f"stream {stream!r} is not stdout or stderr")
        if start < 0:
            raise UsageError(f"cursor {start} is negative")
        self.session, self.stream, self.cursor = session, stream, start
        self.receipt: dict[str, Any] | None = None
        self.done = False

    def chunk(self, end: int, data: bytes) -> bytes:
        begin = end - len(data)
        if begin > self.cursor:
            raise StreamError(
                f"{self.session} {self.stream}: the server sent bytes {begin}..{end} but the "
                f"client has only {self.cursor}; bytes {self.cursor}..{begin} would be skipped"
            )
        fresh = data[self.cursor - begin :] if end > self.cursor else b""
        self.cursor = max(self.cursor, end)
        return fresh

    def event(self, event: _Event) -> bytes:
        if event.event == "end":
            self.end(json.loads("\n".join(event.data) or "{}"))
            return b""
        if event.event == "error":
            problem = json.loads("\n".join(event.data) or "{}")
            raise StreamError(
                f"{self.session} {self.stream} at cursor {self.cursor}: the server says "
                f"{problem.get('error')}: {problem.get('message')}",
                body=problem,
            )
        if event.event not in ("message", "chunk", "data"):
            return b""  # an event this client does not know; its bytes are not output
        if event.id is None or not event.id.isdigit():
            raise StreamError(f"{self.session} {self.stream}: an output event without a cursor id")
        return self.chunk(int(event.id), base64.b64decode("".join(event.data)))

    def end(self, receipt: dict[str, Any]) -> None:
        """The session settled: done once every byte up to its final cursor was yielded."""
        self.receipt = receipt
        final = _final_cursor(receipt, self.stream)
        if final is not None and final < self.cursor:
            raise StreamError(
                f"{self.session} {self.stream}: final cursor {final} is before the {self.cursor} "
                "bytes already yielded"
            )
        self.done = final is None or final == self.cursor


def _final_cursor(receipt: dict[str, Any], stream: str) -> int | None:
    receipt = receipt.get("receipt", receipt)  # a status view carries the receipt inside
    try:
        return int(receipt["output"][stream]["cursor"])
    except (KeyError, TypeError, ValueError):
        return None


class _Retryable(Exception):
    """A 502/503/504 on a stream: retried like a dropped connection."""


class _StreamPlan:
    """What one output stream asks for and accepts, whichever way it is carried: the request
    for the current cursor (SSE with `Last-Event-ID`, or the raw endpoint with `from=`), and the
    bytes a response adds."""

    def __init__(self, resume: _Resume, via: str) -> None:
        if via not in ("events", "output"):
            raise UsageError(f"via {via!r} is not 'events' or 'output'")
        self.resume, self.via = resume, via
        self._decoder = _SSEDecoder()

    @property
    def done(self) -> bool:
        return self.resume.done

    def request(self) -> tuple[_Call, dict[str, str]]:
        state, cursor = self.resume, self.resume.cursor
        self._decoder = _SSEDecoder()
        if self.via == "output":
            return _output_call(state.session, state.stream, cursor, follow=True), {}
        headers = {"Accept": "text/event-stream"}
        if cursor > 0:
            headers["Last-Event-ID"] = str(cursor)
        return _events_call(state.session, state.stream, cursor), headers

    def refuse(self, call: _Call, response: httpx.Response, body: bytes) -> None:
        if response.status_code in RETRY_STATUSES:
            raise _Retryable(_describe(response))
        if response.status_code >= 400:
            raise _error(call, httpx.Response(response.status_code, content=body))

    def feed(self, data: bytes) -> list[bytes]:
        if self.via == "output":
            return [self.resume.chunk(self.resume.cursor + len(data), data)]
        chunks = []
        for event in self._decoder.feed(data):
            chunks.append(self.resume.event(event))
            if self.resume.done:
                break
        return [c for c in chunks if c]

    def settled(self, view: dict[str, Any]) -> None:
        """The raw endpoint has no end event: the status view says where the stream ends."""
        if "receipt" in view:
            self.resume.end(view["receipt"])
        elif view.get("state") == "unknown":
            self.resume.done = True


class _Base:
    def __init__(self, base_url: str | None, token: str | None, retry: Retry, timeout: float):
        url = base_url or os.environ.get("SETTLED_URL")
        if not url:
            raise UsageError("no server address: pass base_url= or set SETTLED_URL")
        self.base_url, self.retry, self.timeout = url.rstrip("/"), retry, timeout
        token = token if token is not None else os.environ.get("SETTLED_TOKEN")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}


# -- the sync client ---------------------------------------------------------------------------


class Client(_Base):
    """A synchronous client (base_url or SETTLED_URL; token or SETTLED_TOKEN). `retry` bounds
    every retry; `timeout` is the per-request timeout (a stream silent for longer reconnects
    from its cursor). `close()` (or leaving `with Client(...)`) closes the connection, as every
    Python client does; a task is closed with `close_task()`."""

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        *,
        retry: Retry | None = None,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, token, retry or Retry(), timeout)
        self._http = httpx.Client(
            base_url=self.base_url, headers=self.headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        """Close the HTTP connection pool (never a task or a session: see `close_task`)."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _send(self, call: _Call, deadline: float | None = None) -> tuple[httpx.Response, int]:
        """One logical request: the same bytes sent again after every transport failure."""
        attempts = _Attempts(self.retry, call.what, deadline)
        while True:
            try:
                response = self._http.request(
                    call.method,
                    call.path,
                    json=call.body,
                    params=call.params,
                    timeout=call.timeout or self.timeout,
                )
            except RETRYABLE as exc:
                time.sleep(attempts.failed(exc))
                continue
            if response.status_code not in RETRY_STATUSES:
                return response, attempts.tries
            time.sleep(attempts.failed(response))

    def _call(self, call: _Call, deadline: float | None = None) -> dict[str, Any]:
        return _json(call, self._send(call, deadline)[0])

    def new_task(
        self,
        workspace: str | None,
        key: str | None = None,
        *,
        shared_workspace: bool = False,
        ignore: Sequence[str] = (),
        writable: Sequence[str] | None = None,
        readable: Sequence[str] | None = None,
        memory: int | None = None,
        pids: int | None = None,
        cpus: float | None = None,
        network: str | None = None,
        allow_hosts: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Create a task over `workspace` (None: a new directory the server makes; a key
        already used returns its task); one that overlaps another open task's workspace is
        refused unless `shared_workspace`. The grants and limits are defaults of every
        command of the task."""
        request = TaskRequest(workspace=workspace, key=key or new_key(),
                              shared_workspace=shared_workspace, ignore=ignore,
                              writable=writable, readable=readable, memory=memory, pids=pids,
                              cpus=cpus, network=network, allow_hosts=allow_hosts)  # fmt: skip
        return self._call(_task_call(request))

    def task_status(self, task: str) -> dict[str, Any]:
        """The task's computed status and a row per session."""
        return self._call(_Call("GET", f"/v1/tasks/{_seg(task)}"))

    def recover(self, task: str | None = None) -> dict[str, Any]:
        """Settle the sessions whose owner is gone (of `task`, else of every task the token
        sees) from their boundary's evidence: `{"sessions": [...]}`, what each became."""
        return self._call(_Call("POST", "/v1/recover", {"task": task} if task else {}))

    def exec(
        self,
        task: str,
        argv: Sequence[str] | None = None,
        shell: str | None = None,
        key: str | None = None,
        timeout: float | None = None,
        grace: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        service: bool = False,
        boundary: str | None = None,
        isolation: str | None = None,
        user: str | None = None,
        writable: Sequence[str] | None = None,
        inherit: Sequence[str] = (),
        inherit_env: bool = False,
        clean_env: bool = False,
        readable: Sequence[str] | None = None,
        memory: int | None = None,
        pids: int | None = None,
        cpus: float | None = None,
        network: str | None = None,
        allow_hosts: Sequence[str] | None = None,
    ) -> Admission:
        """Admit a command; retried with the same key and body until the server answers.
        `inherit` names variables of this process's environment to pass (`inherit_env`: all
        but settled's own; its PATH unless `clean_env`); they travel in `env`, named in
        `inherited`, so the server records
        them and never adds its own. `writable`/`readable` grant host directories, `memory`
        (bytes), `pids` and `cpus` limit the command (else its task's defaults)."""
        key = key or new_key()
        env, inherited = _with_inherited(env, inherit, inherit_env, clean_env)
        request = ExecRequest(key=key, argv=argv, shell=shell, timeout=timeout, grace=grace,
                              cwd=cwd, env=None if env is None else dict(env),
                              inherited=inherited, service=service,
                              boundary=boundary, isolation=isolation, user=user,
                              writable=writable, readable=readable, memory=memory, pids=pids,
                              cpus=cpus, network=network, allow_hosts=allow_hosts)  # fmt: skip
        call = _admission_call(task, request)
        response, tries = self._send(call)
        return _admission(_json(call, response), key, tries)

    def status(self, session: str) -> dict[str, Any]:
        """The session's computed status and, once settled, its process receipt."""
        return self._call(_Call("GET", f"/v1/sessions/{_seg(session)}"))

    def wait(self, session: str, timeout: float | None = None) -> dict[str, Any]:
        """Until the session has its receipt (or is unknown); NotSettled after `timeout` s."""
        poll = _Poll(session, timeout, self.timeout)
        while True:
            view = self._call(poll.call(), poll.deadline)
            if _settled(view):
                return self.status(session) if view["state"] == "unknown" else view
            time.sleep(poll.next_pause(view))

    def output(self, session: str, stream: str = "stdout", start: int = 0) -> tuple[bytes, int]:
        """One read of the bytes stored from `start`: the bytes and the next cursor."""
        call = _output_call(session, stream, start, follow=False)
        response = self._send(call)[0]
        return _raw_reply(call, response, start)

    def merged(self, session: str, start: int = 0, size: int | None = None) -> dict[str, Any]:
        """One read of both streams in the owner's stored order from merged cursor `start`:
        `chunks` (stream, stream_cursor, at, ordered, base64 data), the merged `cursor` to
        resume from, and `final` once both streams are settled (poll until then to follow)."""
        params = {"from": str(start)} if size is None else {"from": str(start), "max": str(size)}
        return self._call(_Call("GET", f"/v1/sessions/{_seg(session)}/merged", params=params))

    def stream(
        self, session: str, stream: str = "stdout", start: int = 0, *, via: str = "events"
    ) -> OutputStream:
        """Every byte of `stream` from `start` to its final cursor, resumed after drops.
        `via="events"` reads SSE (`Last-Event-ID`), `via="output"` the raw endpoint (`from=`)."""
        return OutputStream(self, _StreamPlan(_Resume(session, stream, start), via))

    def signal(self, session: str, name: str, reason: str | None = None) -> dict[str, Any]:
        """Ask the session's owner to stop it (TERM, KILL or INT; delivered as a cancel)."""
        return self._call(_signal_call(session, name, reason))

    def close_task(
        self, task: str, final: str | None = None, deadline: float | None = None
    ) -> dict[str, Any]:
        """Run (or resume) the close join: the close receipt, or Blocked with `blocked_on`."""
        return self._call(_close_call(task, final, deadline, self.timeout))

    def run(
        self,
        workspace_or_task: str,
        argv: Sequence[str] | None = None,
        shell: str | None = None,
        *,
        key: str | None = None,
        timeout: float | None = None,
        wait_timeout: float | None = None,
        **exec_options: Any,
    ) -> RunResult:
        """What `settled run` does, in one call: admit the command (in the task named by its id,
        or in a new task over the workspace path), wait for its process receipt, read both
        streams whole. `timeout` is the command's deadline in seconds (the owner stops it: exit
        code 124); `wait_timeout` bounds this call only (NotSettled, the command goes on).
        The same `key` again returns the same session's result instead of running twice;
        `exec_options` are `exec()`'s (grace, cwd, env, boundary, ...)."""
        key = key or new_key()
        workspace, task = _run_target(workspace_or_task, key)
        if workspace is not None:
            task = self.new_task(workspace, task)["task"]
        admission = self.exec(task, argv, shell, key=key, timeout=timeout, **exec_options)
        view = self.wait(admission.session, wait_timeout)
        out, err = (b"".join(self.stream(admission.session, s, via="output")) for s in STREAMS)
        return _run_result(admission, view, out, err)

    def explain(self, task: str) -> dict[str, Any]:
        """Which receipts allowed (or block) the task's success, in words and as data."""
        return self._call(_Call("GET", f"/v1/tasks/{_seg(task)}/explain"))


def _raw_reply(call: _Call, response: httpx.Response, start: int) -> tuple[bytes, int]:
    if response.status_code >= 400:
        raise _error(call, response)
    data = response.content
    return data, int(response.headers.get(CURSOR_HEADER, start + len(data)))


class OutputStream(Iterator[bytes]):
    """Byte chunks in order, each byte once; `cursor` is the next byte, `receipt` is set once
    the stream reached its final cursor. `close()` stops reading (never the session)."""

    def __init__(self, client: Client, plan: _StreamPlan) -> None:
        self._client, self._plan = client, plan
        self._chunks = self._run()

    @property
    def cursor(self) -> int:
        return self._plan.resume.cursor

    @property
    def receipt(self) -> dict[str, Any] | None:
        return self._plan.resume.receipt

    def __next__(self) -> bytes:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()

    def _run(self) -> Generator[bytes, None, None]:
        plan, client = self._plan, self._client
        attempts = _Attempts(client.retry, f"stream {plan.resume.session} {plan.resume.stream}")
        while not plan.done:
            before = plan.resume.cursor
            try:
                yield from self._connection()
                if plan.done:
                    return
                failure: BaseException | str = "the stream ended before its final cursor"
            except _QuietTimeout:
                continue  # connected and silent: reconnect from the cursor at once
            except (*RETRYABLE, _Retryable) as exc:
                failure = exc
            if plan.resume.cursor > before:
                attempts.reset()
            time.sleep(attempts.failed(failure))

    def _connection(self) -> Iterator[bytes]:
        plan, http = self._plan, self._client._http
        call, headers = plan.request()
        with http.stream("GET", call.path, params=call.params, headers=headers) as response:
            plan.refuse(call, response, response.read() if response.status_code >= 400 else b"")
            try:
                for data in response.iter_bytes():
                    yield from plan.feed(data)
                    if plan.done:
                        return
            except httpx.ReadTimeout as exc:
                raise _QuietTimeout from exc
        if plan.via == "output":
            plan.settled(self._client.status(plan.resume.session))


class _QuietTimeout(Exception):
    """A read timeout after the response began: the stream is silent, not broken."""


# -- the async client --------------------------------------------------------------------------


class AsyncClient(_Base):
    """The asynchronous twin of `Client` (any anyio backend): the same methods, awaited;
    `stream()` returns an async iterator. `await close()` (or `aclose()`, or leaving
    `async with`) closes the connection; a task is closed with `close_task()`."""

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        *,
        retry: Retry | None = None,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, token, retry or Retry(), timeout)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=self.headers, timeout=timeout, transport=transport
        )

    async def close(self) -> None:
        """Close the HTTP connection pool (never a task or a session: see `close_task`)."""
        await self._http.aclose()

    async def aclose(self) -> None:
        """`close()` under the name httpx and contextlib.aclosing use."""
        await self.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def _send(self, call: _Call, deadline: float | None = None) -> tuple[httpx.Response, int]:
        attempts = _Attempts(self.retry, call.what, deadline)
        while True:
            try:
                response = await self._http.request(
                    call.method,
                    call.path,
                    json=call.body,
                    params=call.params,
                    timeout=call.timeout or self.timeout,
                )
            except RETRYABLE as exc:
                await anyio.sleep(attempts.failed(exc))
                continue
            if response.status_code not in RETRY_STATUSES:
                return response, attempts.tries
            await anyio.sleep(attempts.failed(response))

    async def _call(self, call: _Call, deadline: float | None = None) -> dict[str, Any]:
        return _json(call, (await self._send(call, deadline))[0])

    async def new_task(
        self,
        workspace: str | None,
        key: str | None = None,
        *,
        shared_workspace: bool = False,
        ignore: Sequence[str] = (),
        writable: Sequence[str] | None = None,
        readable: Sequence[str] | None = None,
        memory: int | None = None,
        pids: int | None = None,
        cpus: float | None = None,
        network: str | None = None,
        allow_hosts: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Create a task over `workspace` (None: a new directory the server makes; a key
        already used returns its task); one that overlaps another open task's workspace is
        refused unless `shared_workspace`. The grants and limits are defaults of every
        command of the task."""
        request = TaskRequest(workspace=workspace, key=key or new_key(),
                              shared_workspace=shared_workspace, ignore=ignore,
                              writable=writable, readable=readable, memory=memory, pids=pids,
                              cpus=cpus, network=network, allow_hosts=allow_hosts)  # fmt: skip
        return await self._call(_task_call(request))

    async def task_status(self, task: str) -> dict[str, Any]:
        """The task's computed status and a row per session."""
        return await self._call(_Call("GET", f"/v1/tasks/{_seg(task)}"))

    async def recover(self, task: str | None = None) -> dict[str, Any]:
        """Settle the sessions whose owner is gone (of `task`, else of every task the token
        sees) from their boundary's evidence: `{"sessions": [...]}`, what each became."""
        return await self._call(_Call("POST", "/v1/recover", {"task": task} if task else {}))

    async def exec(
        self,
        task: str,
        argv: Sequence[str] | None = None,
        shell: str | None = None,
        key: str | None = None,
        timeout: float | None = None,
        grace: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        service: bool = False,
        boundary: str | None = None,
        isolation: str | None = None,
        user: str | None = None,
        writable: Sequence[str] | None = None,
        inherit: Sequence[str] = (),
        inherit_env: bool = False,
        clean_env: bool = False,
        readable: Sequence[str] | None = None,
        memory: int | None = None,
        pids: int | None = None,
        cpus: float | None = None,
        network: str | None = None,
        allow_hosts: Sequence[str] | None = None,
    ) -> Admission:
        """Admit a command; retried with the same key and body until the server answers.
        `inherit` names variables of this process's environment to pass (`inherit_env`: all
        but settled's own; its PATH unless `clean_env`); they travel in `env`, named in
        `inherited`, so the server records
        them and never adds its own. `writable`/`readable` grant host directories, `memory`
        (bytes), `pids` and `cpus` limit the command (else its task's defaults)."""
        key = key or new_key()
        env, inherited = _with_inherited(env, inherit, inherit_env, clean_env)
        request = ExecRequest(key=key, argv=argv, shell=shell, timeout=timeout, grace=grace,
                              cwd=cwd, env=None if env is None else dict(env),
                              inherited=inherited, service=service,
                              boundary=boundary, isolation=isolation, user=user,
                              writable=writable, readable=readable, memory=memory, pids=pids,
                              cpus=cpus, network=network, allow_hosts=allow_hosts)  # fmt: skip
        call = _admission_call(task, request)
        response, tries = await self._send(call)
        return _admission(_json(call, response), key, tries)

    async def status(self, session: str) -> dict[str, Any]:
        """The session's computed status and, once settled, its process receipt."""
        return await self._call(_Call("GET", f"/v1/sessions/{_seg(session)}"))

    async def wait(self, session: str, timeout: float | None = None) -> dict[str, Any]:
        """Until the session has its receipt (or is unknown); NotSettled after `timeout` s."""
        poll = _Poll(session, timeout, self.timeout)
        while True:
            view = await self._call(poll.call(), poll.deadline)
            if _settled(view):
                return await self.status(session) if view["state"] == "unknown" else view
            await anyio.sleep(poll.next_pause(view))

    async def output(
        self, session: str, stream: str = "stdout", start: int = 0
    ) -> tuple[bytes, int]:
        """One read of the bytes stored from `start`: the bytes and the next cursor."""
        call = _output_call(session, stream, start, follow=False)
        return _raw_reply(call, (await self._send(call))[0], start)

    def stream(
        self, session: str, stream: str = "stdout", start: int = 0, *, via: str = "events"
    ) -> AsyncOutputStream:
        """Every byte of `stream` from `start` to its final cursor, resumed after drops."""
        return AsyncOutputStream(self, _StreamPlan(_Resume(session, stream, start), via))

    async def signal(self, session: str, name: str, reason: str | None = None) -> dict[str, Any]:
        """Ask the session's owner to stop it (TERM, KILL or INT; delivered as a cancel)."""
        return await self._call(_signal_call(session, name, reason))

    async def close_task(
        self, task: str, final: str | None = None, deadline: float | None = None
    ) -> dict[str, Any]:
        """Run (or resume) the close join: the close receipt, or Blocked with `blocked_on`."""
        return await self._call(_close_call(task, final, deadline, self.timeout))

    async def run(
        self,
        workspace_or_task: str,
        argv: Sequence[str] | None = None,
        shell: str | None = None,
        *,
        key: str | None = None,
        timeout: float | None = None,
        wait_timeout: float | None = None,
        **exec_options: Any,
    ) -> RunResult:
        """`Client.run`, awaited: admit, wait for the process receipt, read both streams."""
        key = key or new_key()
        workspace, task = _run_target(workspace_or_task, key)
        if workspace is not None:
            task = (await self.new_task(workspace, task))["task"]
        admission = await self.exec(task, argv, shell, key=key, timeout=timeout, **exec_options)
        view = await self.wait(admission.session, wait_timeout)
        streams = [await self._read_whole(admission.session, name) for name in STREAMS]
        return _run_result(admission, view, streams[0], streams[1])

    async def _read_whole(self, session: str, stream: str) -> bytes:
        return b"".join([chunk async for chunk in self.stream(session, stream, via="output")])

    async def explain(self, task: str) -> dict[str, Any]:
        """Which receipts allowed (or block) the task's success, in words and as data."""
        return await self._call(_Call("GET", f"/v1/tasks/{_seg(task)}/explain"))


class AsyncOutputStream(AsyncIterator[bytes]):
    """The async twin of `OutputStream`; `aclose()` stops reading (never the session)."""

    def __init__(self, client: AsyncClient, plan: _StreamPlan) -> None:
        self._client, self._plan = client, plan
        self._chunks = self._run()

    @property
    def cursor(self) -> int:
        return self._plan.resume.cursor

    @property
    def receipt(self) -> dict[str, Any] | None:
        return self._plan.resume.receipt

    async def __anext__(self) -> bytes:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()

    async def _run(self) -> AsyncGenerator[bytes, None]:
        plan, client = self._plan, self._client
        attempts = _Attempts(client.retry, f"stream {plan.resume.session} {plan.resume.stream}")
        while not plan.done:
            before = plan.resume.cursor
            try:
                async for chunk in self._connection():
                    yield chunk
                if plan.done:
                    return
                failure: BaseException | str = "the stream ended before its final cursor"
            except _QuietTimeout:
                continue
            except (*RETRYABLE, _Retryable) as exc:
                failure = exc
            if plan.resume.cursor > before:
                attempts.reset()
            await anyio.sleep(attempts.failed(failure))

    async def _connection(self) -> AsyncIterator[bytes]:
        plan, http = self._plan, self._client._http
        call, headers = plan.request()
        async with http.stream("GET", call.path, params=call.params, headers=headers) as response:
            body = await response.aread() if response.status_code >= 400 else b""
            plan.refuse(call, response, body)
            try:
                async for data in response.aiter_bytes():
                    for chunk in plan.feed(data):
                        yield chunk
                    if plan.done:
                        return
            except httpx.ReadTimeout as exc:
                raise _QuietTimeout from exc
        if plan.via == "output":
            plan.settled(await self._client.status(plan.resume.session))
