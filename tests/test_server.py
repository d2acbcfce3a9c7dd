"""The HTTP service over a real network: a real uvicorn server process on 127.0.0.1 (ephemeral
port), a real httpx client, real sessions.

Each test is one behaviour, named for what must hold. Every server is a subprocess stopped in a
fixture finalizer (SIGTERM, then SIGKILL); every session a test starts is settled before it
ends (the finalizer cancels what is still live and waits for its receipt), and conftest's
autouse fixture stops the journals under tmp_path and kills anything carrying the test marker.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import httpx
import pytest
from starlette.routing import Route

from settled.boundary import availability
from settled.home import log_path
from settled.runtime import Runtime
from settled.server import TokenTable, create_app
from settled.server.auth import FULL_ACCESS
from settled.server.openapi import document
from settled.states import LIVE_STATES

TOKEN = "test-token-full-access-0123456789"
SCOPED = "test-token-scoped-abcdefghijklmn"
MIB = 1 << 20
START_S = 30.0


# -- a server process -------------------------------------------------------------------------


class Server:
    """`settled.server.serve` in a subprocess; its stderr goes to a file we read the port from."""

    def __init__(
        self, home: Path, log: Path, tokens_file: Path | None, env: dict[str, str]
    ) -> None:
        self.home, self.log = home, log
        code = (
            "import sys; from settled.server import serve; "
            "sys.exit(serve(sys.argv[1], port=0, tokens_file=sys.argv[2] or None))"
        )
        env = {**os.environ, "SETTLED_TOKEN": TOKEN, **env}
        with open(log, "ab") as sink:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code, str(home), str(tokens_file or "")],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=sink,
            )
        self.url = self._await_listening()
        self._await_ready()

    def _await_listening(self) -> str:
        give_up = time.monotonic() + START_S
        while time.monotonic() < give_up:
            for line in self.log.read_text(errors="replace").splitlines():
                if "listening on http://" in line and f"home {self.home}" in line:
                    return line.split("listening on ")[1].split()[0]
            if self.process.poll() is not None:
                raise AssertionError(f"server exited {self.process.returncode}: {self.text()}")
            time.sleep(0.02)
        raise AssertionError(f"server did not start in {START_S} s: {self.text()}")

    def _await_ready(self) -> None:
        give_up = time.monotonic() + START_S
        while time.monotonic() < give_up:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/healthz", timeout=5).status_code == 200:
                    return
            time.sleep(0.02)
        raise AssertionError(f"server never answered /healthz: {self.text()}")

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def client(self, token: str | None = TOKEN, timeout: float = 30.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


def settle_all(home: Path) -> None:
    """Cancel every live session in the home and wait for its receipt (bounded); through the
    Runtime's own reads, so it serves every store (tests/test_ui.py uses it too)."""
    if not home.exists():
        return
    with Runtime(str(home)) as rt:
        live = [
            s["session"]
            for t in rt.list_tasks(1000)
            for s in rt.task_status(t["task"])["sessions"]
            if s["state"] in LIVE_STATES
        ]
        for session in live:
            with contextlib.suppress(Exception):
                rt.cancel(session, "test teardown")
        give_up = time.monotonic() + 30
        for session in live:
            with contextlib.suppress(Exception):
                rt.wait(session, timeout=max(0.1, give_up - time.monotonic()))


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    path = tmp_path / "workspace"
    path.mkdir()
    return path


@pytest.fixture
def start_server(tmp_path: Path, home: Path) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def start(tokens_file: Path | None = None, **env: str) -> Server:
        server = Server(home, tmp_path / f"server-{len(started)}.log", tokens_file, env)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()
        if home.exists():
            settle_all(home)


@pytest.fixture
def server(start_server: Callable[..., Server]) -> Server:
    return start_server()


# -- helpers ----------------------------------------------------------------------------------


def new_task(client: httpx.Client, workspace: Path) -> str:
    answer = client.post("/v1/tasks", json={"workspace": str(workspace)})
    assert answer.status_code == 201, answer.text
    task: str = answer.json()["task"]
    return task


def admit(client: httpx.Client, task: str, key: str, **command: Any) -> httpx.Response:
    return client.post(f"/v1/tasks/{task}/sessions", json={"key": key, **command})


def run(client: httpx.Client, task: str, key: str, **command: Any) -> str:
    answer = admit(client, task, key, **command)
    assert answer.status_code == 201, answer.text
    session: str = answer.json()["session"]
    return session


def receipt_of(client: httpx.Client, session: str, wait: float = 60) -> dict[str, Any]:
    answer = client.get(f"/v1/sessions/{session}", params={"wait": wait})
    assert answer.status_code == 200, answer.text
    view = answer.json()
    assert view["state"] == "settled", view
    receipt: dict[str, Any] = view["receipt"]
    return receipt


def stored(home: Path, session: str, stream: str = "stdout") -> bytes:
    return Path(log_path(str(home), session, stream)).read_bytes()


def blake(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


@dataclass
class Event:
    event: str
    id: str | None
    data: str


def sse_events(response: httpx.Response, until: Callable[[list[Event]], bool]) -> list[Event]:
    """Parse Server-Sent Events until `until(events)` holds or the response ends."""
    events: list[Event] = []
    kind, event_id, data = "message", None, []
    for line in response.iter_lines():
        if line == "":
            if data:
                events.append(Event(kind, event_id, "\n".join(data)))
                if until(events):
                    return events
            kind, event_id, data = "message", None, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            kind = value
        elif name == "id":
            event_id = value
        elif name == "data":
            data.append(value)
    return events


def ended(events: list[Event]) -> bool:
    return bool(events) and events[-1].event in ("end", "error")


def chunks_of(events: list[Event]) -> bytes:
    return b"".join(base64.b64decode(e.data) for e in events if e.event == "message")


SLOW_WRITER = "for i in $(seq 1 {n}); do head -c {size} /dev/urandom; sleep {pause}; done"


# -- auth ---------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_every_endpoint_but_healthz_answers_401_without_a_known_token(server: Server) -> None:
    for token in (None, "wrong-token-wrong-token-wrong"):
        with server.client(token) as client:
            for method, path in [
                ("POST", "/v1/tasks"),
                ("GET", "/v1/tasks/t_0000000000000000"),
                ("GET", "/v1/sessions/s_0000000000000000/output"),
                ("GET", "/openapi.json"),
                ("GET", "/no/such/path"),
            ]:
                answer = client.request(method, path)
                assert answer.status_code == 401, (token, path, answer.text)
                assert answer.headers["www-authenticate"].startswith("Bearer")
                assert answer.json()["error"] == "Unauthorized"
    with server.client(None) as client:
        assert client.get("/healthz").json() == {"ok": True}


@pytest.mark.timeout(90)
def test_a_scoped_token_sees_only_its_tasks_and_cannot_create_tasks(
    start_server: Callable[..., Server], home: Path, workspace: Path, tmp_path: Path
) -> None:
    with Runtime(str(home)) as rt:
        other_workspace = tmp_path / "other-workspace"
        other_workspace.mkdir()  # two open tasks never share one workspace unless asked
        mine, theirs = rt.new_task(str(workspace)).task, rt.new_task(str(other_workspace)).task
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [{"token": SCOPED, "tasks": [mine]}]}))
    server = start_server(tokens)
    with server.client() as full, server.client(SCOPED) as scoped:
        other = run(full, theirs, "k1", argv=["true"])
        receipt_of(full, other)
        own = run(scoped, mine, "k1", argv=["true"])
        assert receipt_of(scoped, own)["exit"]["code"] == 0
        assert scoped.get(f"/v1/tasks/{mine}").status_code == 200
        unknown_task = scoped.get("/v1/tasks/t_ffffffffffffffff").json()
        unknown_session = scoped.get("/v1/sessions/s_ffffffffffffffff").json()
        hidden = {
            f"/v1/tasks/{theirs}": ("GET", theirs, unknown_task, "t_ffffffffffffffff"),
            f"/v1/tasks/{theirs}/explain": ("GET", theirs, unknown_task, "t_ffffffffffffffff"),
            f"/v1/tasks/{theirs}/close": ("POST", theirs, unknown_task, "t_ffffffffffffffff"),
            f"/v1/tasks/{theirs}/sessions": ("POST", theirs, unknown_task, "t_ffffffffffffffff"),
            f"/v1/sessions/{other}": ("GET", other, unknown_session, "s_ffffffffffffffff"),
            f"/v1/sessions/{other}/output": ("GET", other, unknown_session, "s_ffffffffffffffff"),
            f"/v1/sessions/{other}/events": ("GET", other, unknown_session, "s_ffffffffffffffff"),
            f"/v1/sessions/{other}/signal": ("POST", other, unknown_session, "s_ffffffffffffffff"),
        }
        for path, (method, ident, unknown, fake) in hidden.items():
            body = {"key": "k2", "argv": ["true"]} if path.endswith("/sessions") else None
            body = {"signal": "TERM"} if path.endswith("/signal") else body
            answer = scoped.request(method, path, json=body)
            assert answer.status_code == 404, (path, answer.text)
            assert json.dumps(answer.json()).replace(ident, fake) == json.dumps(unknown), path
        refused = scoped.post("/v1/tasks", json={"workspace": str(workspace)})
        assert refused.status_code == 403, refused.text
        assert full.get(f"/v1/tasks/{theirs}").json()["counts"] == {"settled": 1}


@pytest.mark.timeout(60)
def test_a_body_over_the_limit_is_413_and_unknown_fields_are_400_by_name(
    server: Server, workspace: Path
) -> None:
    with server.client() as client:
        task = new_task(client, workspace)
        huge = admit(client, task, "huge", shell="true # " + "x" * (2 * MIB))
        assert huge.status_code == 413, huge.text
        typo = admit(client, task, "typo", argv=["true"], timout=5)
        assert typo.status_code == 400 and "'timout'" in typo.json()["message"]
        keyless = client.post(f"/v1/tasks/{task}/sessions", json={"argv": ["true"]})
        assert keyless.status_code == 400 and "key" in keyless.json()["message"]
        assert client.get(f"/v1/tasks/{task}").json()["sessions"] == []


# -- admission ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_an_exec_of_another_hosts_task_is_409_wrong_host_and_its_status_is_200(
    start_server: Callable[..., Server],
    tmp_path: Path,
    workspace: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shared = {
        "SETTLED_STORE": f"sqlite://{tmp_path}/shared/store.db",
        "SETTLED_OBJECTS": f"file://{tmp_path}/shared/objects",
    }
    server = start_server(**shared)  # host B serves; host A made the task
    for name, value in shared.items():
        monkeypatch.setenv(name, value)
    with Runtime(str(tmp_path / "A")) as host_a:
        task, owner = host_a.new_task(str(workspace)).task, host_a.host
    with server.client() as client:
        refused = admit(client, task, "build", argv=["true"])
        assert refused.status_code == 409, refused.text
        body = refused.json()
        assert body["error"] == "WrongHost" and body["host"] == owner and body["task"] == task
        assert client.get(f"/v1/tasks/{task}").status_code == 200


@pytest.mark.timeout(60)
def test_same_key_and_digest_is_200_with_the_same_session_and_another_digest_409(
    server: Server, workspace: Path
) -> None:
    with server.client() as client:
        task = new_task(client, workspace)
        first = admit(client, task, "build", argv=["true"])
        assert first.status_code == 201, first.text
        again = admit(client, task, "build", argv=["true"])
        assert again.status_code == 200, again.text
        assert again.json()["session"] == first.json()["session"]
        assert again.json()["reused"] is True
        conflict = admit(client, task, "build", argv=["false"])
        assert conflict.status_code == 409, conflict.text
        body = conflict.json()
        assert body["error"] == "KeyConflict"
        assert body["existing_digest"] == first.json()["digest"]
        assert body["requested_digest"] != body["existing_digest"]
        assert body["existing_digest"] in body["message"]
        assert body["requested_digest"] in body["message"]
        receipt_of(client, first.json()["session"])


@pytest.mark.timeout(60)
def test_an_admission_whose_response_was_lost_is_retried_into_the_same_session_launched_once(
    server: Server, workspace: Path
) -> None:
    with server.client() as client:
        task = new_task(client, workspace)
        request = {"key": "append-once", "shell": "echo launched >> launches.txt"}
        body = json.dumps(request).encode()
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        raw = socket.create_connection((host, int(port)), timeout=10)
        raw.sendall(
            f"POST /v1/tasks/{task}/sessions HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        give_up = time.monotonic() + 20
        while not client.get(f"/v1/tasks/{task}").json()["sessions"]:
            assert time.monotonic() < give_up, "the first attempt never reached the store"
            time.sleep(0.01)
        raw.close()  # the reply is never read: the client saw a transport failure
        retry = admit(client, task, **request)
        assert retry.status_code == 200, retry.text
        assert retry.json()["reused"] is True
        sessions = client.get(f"/v1/tasks/{task}").json()["sessions"]
        assert [s["session"] for s in sessions] == [retry.json()["session"]]
        assert receipt_of(client, retry.json()["session"])["exit"]["code"] == 0
        assert (workspace / "launches.txt").read_text() == "launched\n"


# -- output -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_output_returns_raw_bytes_from_a_cursor_with_the_next_cursor_in_settled_cursor(
    server: Server, workspace: Path, home: Path
) -> None:
    payload = bytes(range(256)) * 4 + b"no newline at the end"
    (workspace / "payload.bin").write_bytes(payload)
    with server.client() as client:
        task = new_task(client, workspace)
        session = run(client, task, "cat", argv=["cat", "payload.bin"])
        receipt_of(client, session)
        url = f"/v1/sessions/{session}/output"
        whole = client.get(url)
        assert whole.content == payload == stored(home, session)
        assert whole.headers["content-type"] == "application/octet-stream"
        assert whole.headers["settled-cursor"] == str(len(payload))
        rest = client.get(url, params={"from": 1000})
        assert rest.content == payload[1000:]
        assert rest.headers["settled-from"] == "1000"
        assert rest.headers["settled-cursor"] == str(len(payload))
        page = client.get(url, params={"from": 7, "max": 100})
        assert page.content == payload[7:107]
        assert page.headers["settled-cursor"] == "107"
        assert page.headers["settled-final-cursor"] == str(len(payload))
        empty = client.get(url, params={"stream": "stderr"})
        assert empty.content == b"" and empty.headers["settled-cursor"] == "0"


@pytest.mark.timeout(60)
def test_a_cursor_beyond_the_end_is_416_naming_the_cursor_and_the_end(
    server: Server, workspace: Path
) -> None:
    with server.client() as client:
        task = new_task(client, workspace)
        session = run(client, task, "ten", shell="printf 0123456789")
        receipt_of(client, session)
        for path, params in [
            ("output", {"from": 11}),
            ("output", {"from": 11, "follow": 1}),
            ("events", {"from": 11}),
        ]:
            answer = client.get(f"/v1/sessions/{session}/{path}", params=params)
            assert answer.status_code == 416, (path, params, answer.text)
            body = answer.json()
            assert (body["error"], body["cursor"], body["end"]) == ("CursorOutOfRange", 11, 10)
            assert "11" in body["message"] and "10" in body["message"]
            assert answer.headers["content-range"] == "bytes */10"
        assert client.get(f"/v1/sessions/{session}/output", params={"from": 10}).content == b""


@pytest.mark.timeout(120)
def test_follow_streams_a_running_session_to_its_end_bit_for_bit(
    server: Server, workspace: Path, home: Path
) -> None:
    noise = os.urandom(3 * MIB + 12345)
    (workspace / "noise.bin").write_bytes(noise)
    expected = b"x" * (4 * MIB) + noise
    command = "sleep 0.5; head -c 4194304 /dev/zero | tr '\\0' x; sleep 0.3; cat noise.bin"
    with server.client(timeout=60) as client:
        task = new_task(client, workspace)
        session = run(client, task, "follow", shell=command)
        url = f"/v1/sessions/{session}/output"
        with client.stream("GET", url, params={"follow": 1}) as response:
            assert response.status_code == 200
            assert response.headers["settled-follow"] == "1"
            assert "settled-cursor" not in response.headers  # running: no final cursor yet
            got = b"".join(response.iter_raw())
        receipt = receipt_of(client, session)
    assert got == expected
    assert got == stored(home, session)
    assert receipt["output"]["stdout"]["cursor"] == len(expected)
    assert receipt["output"]["stdout"]["digest"] == blake(got)


@pytest.mark.timeout(120)
def test_sse_ids_are_cursors_and_last_event_id_resumes_with_exactly_the_missing_bytes(
    server: Server, workspace: Path, home: Path
) -> None:
    with server.client() as client:
        task = new_task(client, workspace)
        shell = SLOW_WRITER.format(n=30, size=100000, pause=0.05)
        session = run(client, task, "sse", shell=shell)
        url = f"/v1/sessions/{session}/events"
        with client.stream("GET", url) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            first = sse_events(response, lambda events: len(events) >= 5)
        cursor = 0
        for event in first:
            cursor += len(base64.b64decode(event.data))
            assert event.id == str(cursor)  # the id is the cursor after the chunk
            assert len(base64.b64decode(event.data)) <= 64 * 1024
        resume = {"Last-Event-ID": first[-1].id or ""}
        with client.stream("GET", url, params={"from": 999999999}, headers=resume) as response:
            rest = sse_events(response, ended)
        receipt = receipt_of(client, session)
    assert rest[-1].event == "end"
    assert json.loads(rest[-1].data) == receipt
    assert rest[-1].id == str(receipt["output"]["stdout"]["cursor"])
    data = chunks_of(first) + chunks_of(rest)
    assert data == stored(home, session)
    assert len(data) == 30 * 100000
    assert receipt["output"]["stdout"]["digest"] == blake(data)


@pytest.mark.timeout(90)
def test_a_vanished_reader_does_not_stop_the_session(
    server: Server, workspace: Path, home: Path
) -> None:
    with server.client() as client:
        task = new_task(client, workspace)
        shell = SLOW_WRITER.format(n=20, size=50000, pause=0.05) + "; echo done > finished.txt"
        session = run(client, task, "vanish", shell=shell)
        for path, params in [("output", {"follow": 1}), ("events", {})]:
            reader = server.client()
            with reader.stream("GET", f"/v1/sessions/{session}/{path}", params=params) as r:
                next(r.iter_raw())
            reader.close()  # mid-stream: the connection is gone
        receipt = receipt_of(client, session)
    assert receipt["exit"] == {**receipt["exit"], "code": 0, "reason": "exited"}
    assert receipt["output"]["stdout"]["cursor"] == 20 * 50000 == len(stored(home, session))
    assert (workspace / "finished.txt").read_text() == "done\n"


@pytest.mark.timeout(90)
def test_a_slow_reader_blocks_neither_the_command_nor_another_reader(
    server: Server, workspace: Path, home: Path
) -> None:
    with server.client() as client, server.client() as slow:
        task = new_task(client, workspace)
        session = run(client, task, "flood", shell="sleep 0.2; head -c 67108864 /dev/urandom")
        with slow.stream("GET", f"/v1/sessions/{session}/output", params={"follow": 1}) as r:
            assert r.status_code == 200  # opened, and never read while the command runs
            receipt = receipt_of(client, session, wait=60)
            other = client.get(f"/v1/sessions/{session}/output")
    assert receipt["output"]["stdout"]["cursor"] == 64 * MIB
    assert other.content == stored(home, session)
    assert receipt["output"]["stdout"]["digest"] == blake(other.content)


# -- the server dies, the sessions do not -------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(180)
def test_a_killed_server_leaves_owners_running_and_a_restart_resumes_every_stream(
    start_server: Callable[..., Server], workspace: Path, home: Path
) -> None:
    first = start_server()
    shell = SLOW_WRITER.format(n=40, size=40000, pause=0.1)
    with first.client() as client, contextlib.ExitStack() as readers:
        task = new_task(client, workspace)
        admissions = [admit(client, task, f"k{i}", shell=shell).json() for i in range(2)]
        sse_session, raw_session = (a["session"] for a in admissions)
        sse = readers.enter_context(first.client())
        events = readers.enter_context(sse.stream("GET", f"/v1/sessions/{sse_session}/events"))
        before_sse = sse_events(events, lambda got: len(got) >= 3)
        raw = readers.enter_context(first.client())
        url = f"/v1/sessions/{raw_session}/output"
        follow = readers.enter_context(raw.stream("GET", url, params={"follow": 1}))
        before_raw = next(follow.iter_raw())
        first.kill()  # SIGKILL mid-stream: no shutdown, no goodbye
    assert all(_alive(a["owner_pid"]) for a in admissions), "owners must outlive the server"
    second = start_server()
    with second.client() as client:
        for admission in admissions:
            assert client.get(f"/v1/sessions/{admission['session']}").json()["state"] in (
                "running",
                "settling",
                "settled",
            )
        resume = {"Last-Event-ID": before_sse[-1].id or ""}
        with client.stream("GET", f"/v1/sessions/{sse_session}/events", headers=resume) as r:
            after_sse = sse_events(r, ended)
        params = {"follow": 1, "from": len(before_raw)}
        with client.stream("GET", f"/v1/sessions/{raw_session}/output", params=params) as r:
            after_raw = b"".join(r.iter_raw())
        receipts = {a["session"]: receipt_of(client, a["session"]) for a in admissions}
    assert after_sse[-1].event == "end"
    got = {
        sse_session: chunks_of(before_sse) + chunks_of(after_sse),
        raw_session: before_raw + after_raw,
    }
    for session, data in got.items():
        receipt = receipts[session]
        assert data == stored(home, session), session
        assert len(data) == 40 * 40000
        assert receipt["output"]["stdout"]["digest"] == blake(data)
        assert receipt["death"]["source"] == "owner"  # the owner finished; no recovery needed
        assert receipt["exit"]["code"] == 0


@pytest.mark.timeout(90)
def test_a_task_whose_owner_vanished_answers_423_naming_the_session_until_recovered(
    start_server: Callable[..., Server], workspace: Path
) -> None:
    reasons = availability()
    if reasons["cgroup2"] is not None and reasons["pidns"] is not None:
        pytest.skip("recovery needs a boundary that gives evidence (cgroup2 or pidns)")
    server = start_server(SETTLED_RECOVER_EVERY_S="3600")  # only the POST below recovers
    with server.client() as client:
        task = new_task(client, workspace)
        lost = admit(client, task, "lost", argv=["sleep", "600"]).json()
        os.kill(lost["owner_pid"], signal.SIGKILL)
        give_up = time.monotonic() + 20
        while client.get(f"/v1/sessions/{lost['session']}").json()["state"] != "unknown":
            assert time.monotonic() < give_up, "the dead owner was never noticed"
            time.sleep(0.05)
        frozen = admit(client, task, "next", argv=["true"])
        assert frozen.status_code == 423, frozen.text
        assert frozen.json()["session"] == lost["session"]
        assert lost["session"] in frozen.json()["message"]
        recovered = client.post("/v1/recover", json={"task": task})
        assert recovered.status_code == 200, recovered.text
        assert {"session": lost["session"], "state": "settled"}.items() <= next(
            r for r in recovered.json()["sessions"] if r["session"] == lost["session"]
        ).items()
        assert receipt_of(client, lost["session"])["death"]["source"] == "recovery"
        after = admit(client, task, "next", argv=["true"])
        assert after.status_code == 201, after.text
        receipt_of(client, after.json()["session"])


@pytest.mark.timeout(60)
def test_a_command_never_sees_the_servers_token(server: Server, workspace: Path) -> None:
    with server.client() as client:
        task = new_task(client, workspace)
        session = run(client, task, "env", argv=["env"])
        receipt_of(client, session)
        environment = client.get(f"/v1/sessions/{session}/output").content
    assert b"PATH=" in environment
    assert TOKEN.encode() not in environment
    assert b"SETTLED_TOKEN" not in environment


# -- signal, close, explain ----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_signal_is_a_cancel_through_the_owner_and_an_unknown_signal_is_400(
    server: Server, workspace: Path
) -> None:
    with server.client() as client:
        task = new_task(client, workspace)
        session = run(client, task, "sleeper", argv=["sleep", "600"], grace=1)
        waited = client.get(f"/v1/sessions/{session}", params={"wait": 0.3})
        assert waited.status_code == 202 and waited.json()["state"] == "running"
        url = f"/v1/sessions/{session}/signal"
        bad = client.post(url, json={"signal": "HUP"})
        assert bad.status_code == 400 and "HUP" in bad.json()["message"]
        sent = client.post(url, json={"signal": "TERM"})
        assert sent.status_code == 202, sent.text
        assert sent.json()["delivered_as"] == "cancel"
        assert "owner" in sent.json()["escalation"]
        receipt = receipt_of(client, session)
        assert receipt["exit"]["reason"] == "cancelled"
        again = client.post(url, json={"signal": "KILL"})
        assert again.status_code == 200 and again.json()["delivered_as"].startswith("nothing")


@pytest.mark.timeout(90)
def test_close_over_http_returns_the_close_receipt_and_a_second_close_the_same(
    server: Server, workspace: Path
) -> None:
    with server.client(timeout=90) as client:
        task = new_task(client, workspace)
        session = run(client, task, "write", shell="echo hi > out.txt")
        receipt_of(client, session)
        first = client.post(f"/v1/tasks/{task}/close", json={"final": "wrote out.txt"})
        assert first.status_code == 200, first.text
        assert first.json()["kind"] == "close"
        assert first.json()["outcome"]["complete"] is True
        second = client.post(f"/v1/tasks/{task}/close", json={})
        assert second.status_code == 200
        assert second.json() == first.json()
        sealed = admit(client, task, "late", argv=["true"])
        assert sealed.status_code == 409 and sealed.json()["error"] == "AdmissionSealed"


@pytest.mark.timeout(90)
def test_a_close_receipt_naming_a_directory_that_is_not_utf8_answers_with_its_escape(
    server: Server, workspace: Path
) -> None:
    """The journal names the directory a command changed (``caf\\xe9``, latin-1) in the close
    receipt; the answer writes its byte as ``\\udce9`` (tests/test_any_name.py)."""
    os.mkdir(os.path.join(os.fsencode(workspace), b"caf\xe9"))
    with server.client(timeout=90) as client:
        task = new_task(client, workspace)
        receipt_of(client, run(client, task, "w", shell="printf y > \"$(printf 'caf\\351/n')\""))
        closed = client.post(f"/v1/tasks/{task}/close", json={})
        assert closed.status_code == 200, closed.text
        assert closed.json()["final_scan"]["journal"]["dirty_dirs"] == ["caf\udce9"]
        assert b'"dirty_dirs":["caf\\udce9"]' in closed.content


def test_a_close_of_a_replaced_workspace_is_409_naming_it_and_resumes_once_it_is_back(
    server: Server, workspace: Path, tmp_path: Path
) -> None:
    with server.client(timeout=90) as client:
        task = new_task(client, workspace)
        workspace.rename(tmp_path / "kept")
        workspace.mkdir()  # another directory at the workspace's path
        refused = client.post(f"/v1/tasks/{task}/close", json={})
        assert refused.status_code == 409, refused.text
        body = refused.json()
        assert body["error"] == "WorkspaceReplaced" and body["workspace"] == str(workspace)
        assert body["why"] == "another directory"
        assert body["found"]["ino"] == workspace.stat().st_ino
        workspace.rmdir()
        (tmp_path / "kept").rename(workspace)
        done = client.post(f"/v1/tasks/{task}/close", json={})
        assert done.status_code == 200, done.text
        assert done.json()["outcome"]["complete"] is True


@pytest.mark.timeout(90)
def test_explain_names_the_receipts_that_allow_success(server: Server, workspace: Path) -> None:
    with server.client(timeout=90) as client:
        task = new_task(client, workspace)
        session = run(client, task, "ok", argv=["true"])
        receipt = receipt_of(client, session)
        assert client.post(f"/v1/tasks/{task}/close").status_code == 200
        explained = client.get(f"/v1/tasks/{task}/explain")
        assert explained.status_code == 200
        body = explained.json()
        assert body["complete"] is True
        assert {"session": session, "digest": receipt["digest"]} in body["allowed_by"][
            "process_receipts"
        ]


# -- the document, and refusing to run open -----------------------------------------------------


@pytest.mark.timeout(60)
def test_the_openapi_document_covers_every_route_and_nothing_else(
    server: Server, home: Path
) -> None:
    doc = document()
    app = create_app(str(home), TokenTable([(TOKEN, FULL_ACCESS)]))
    served: dict[str, set[str]] = {}
    for route in app.routes:
        assert isinstance(route, Route)
        served[route.path] = {m.lower() for m in route.methods or ()} - {"head"}
    for path, methods in served.items():
        assert path in doc["paths"], path
        assert set(doc["paths"][path]) == methods, path
        for method in methods:
            assert doc["paths"][path][method]["responses"], (path, method)
    assert set(doc["paths"]) == set(served)
    with server.client() as client:
        assert client.get("/openapi.json").json() == doc
    assert doc["openapi"].startswith("3.1")


@pytest.mark.timeout(60)
def test_serve_refuses_to_start_without_a_token(home: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SETTLED_TOKEN"}
    code = "import sys; from settled.server import serve; sys.exit(serve(sys.argv[1], port=0))"
    done = subprocess.run(
        [sys.executable, "-c", code, str(home)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "no token configured" in done.stderr


# -- secrets (issue 10): what a command started through the service can read ----------------


def _grep_token(server: Server, workspace: Path, key: str, **command: Any) -> str:
    half = len(TOKEN) // 2  # never whole on a command line, so grep does not find itself
    probe = (
        f"T={TOKEN[:half]}; T=${{T}}{TOKEN[half:]}; "
        'printf %s "$T" | grep -l -a -F -f - /proc/[0-9]*/environ /proc/[0-9]*/cmdline '
        '2>/dev/null; env | grep -c -F -e "$T"; echo END'
    )
    with server.client() as client:
        task = new_task(client, workspace)
        session = run(client, task, key, shell=probe, **command)
        receipt_of(client, session)
        return client.get(f"/v1/sessions/{session}/output").text


def test_a_command_of_the_service_cannot_find_its_token_anywhere(
    server: Server, workspace: Path
) -> None:
    assert _grep_token(server, workspace, "k-grep") == "0\nEND\n"


def test_the_token_is_wiped_from_the_servers_environ_even_for_an_unisolated_command(
    server: Server, workspace: Path
) -> None:
    """With no isolation the command sees every process's /proc, the server's included: the
    server's original environment block no longer holds the token's bytes."""
    environ = Path(f"/proc/{server.process.pid}/environ").read_bytes()
    assert TOKEN.encode() not in environ and b"SETTLED_TOKEN=" in environ
    out = _grep_token(server, workspace, "k-none", isolation="none", boundary="subreaper")
    assert out == "0\nEND\n"


def test_the_tokens_file_is_hidden_from_every_session(
    start_server: Callable[..., Server], tmp_path: Path, workspace: Path
) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [{"token": SCOPED, "tasks": "*"}]}))
    server = start_server(tokens)
    with server.client(SCOPED) as client:
        task = new_task(client, workspace)
        session = run(client, task, "k-cat", shell=f"cat {tokens}; echo END")
        receipt = receipt_of(client, session)
        assert client.get(f"/v1/sessions/{session}/output").text == "END\n"
    assert receipt["isolation"]["host"] == "allow-list"  # outside the view: no file there
    assert not any(e["path"] == str(tokens) for e in receipt["isolation"]["view"])


def test_a_scoped_token_cannot_loosen_the_sandbox_of_its_task(
    start_server: Callable[..., Server], home: Path, workspace: Path, tmp_path: Path
) -> None:
    with Runtime(str(home)) as rt:
        task = rt.new_task(str(workspace)).task
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [{"token": SCOPED, "tasks": [task]}]}))
    server = start_server(tokens)
    with server.client(SCOPED) as scoped, server.client() as full:
        for key, loosened in (
            ("k-none", {"isolation": "none"}),
            ("k-host", {"writable": ["/"]}),
            ("k-read", {"readable": [str(tmp_path)]}),
            ("k-memory", {"memory": 1 << 30}),  # its task has no default to stay under
            ("k-root", {"user": "0"}),
        ):
            answer = admit(scoped, task, key, argv=["true"], **loosened)
            assert answer.status_code == 403, answer.text
        assert scoped.get(f"/v1/tasks/{task}").json()["sessions"] == []
        assert admit(scoped, task, "k-ok", argv=["true"], isolation="strict").status_code == 201
        assert admit(full, task, "k-full", argv=["true"], isolation="none").status_code == 201


def test_a_tasks_walls_sent_over_http_are_the_defaults_of_its_commands(
    server: Server, home: Path, workspace: Path
) -> None:
    """`POST /v1/tasks` takes the grants, limits and network of every command of the task
    (openapi's TaskRequest), as `settled task new` and the MCP tool do: one TaskRequest."""
    body = {"workspace": str(workspace), "memory": 1 << 30, "pids": 64, "network": "none"}
    with server.client() as client:
        answer = client.post("/v1/tasks", json=body)
        assert answer.status_code == 201, answer.text
    with Runtime(str(home)) as rt:
        defaults = rt.task_record(answer.json()["task"]).defaults
    assert defaults == {"memory": 1 << 30, "pids": 64, "network": "none"}


def test_an_answer_holding_a_lone_surrogate_is_ascii_json_with_the_same_values() -> None:
    """A byte of a file name that is not UTF-8 (os.fsdecode's U+DCFF) is answered as `\\udcff`;
    Starlette's own JSONResponse raised UnicodeEncodeError while writing it."""
    from settled.server.jsonbody import AsciiJSONResponse

    payload = {"path": "caf\udce9/\u202e\x1b", "name": "é 中"}
    body = AsciiJSONResponse(payload).body
    assert body == b'{"path":"caf\\udce9/\\u202e\\u001b","name":"\\u00e9 \\u4e2d"}'
    assert json.loads(body) == payload


def test_http_errors_name_the_request_fields_not_the_cli_flags(
    server: Server, workspace: Path
) -> None:
    """An HTTP caller is told what to set in its request (`shared_workspace`, `cwd`), never
    a flag it has no way to pass."""
    from settled.server.bodies import SESSION_FIELDS, TASK_FIELDS
    from settled.server.errors import FIELD_OF_FLAG, in_http_words

    assert set(FIELD_OF_FLAG.values()) <= TASK_FIELDS | SESSION_FIELDS | {"from"}
    assert in_http_words("pass --shared-workspace, not --home") == (
        "pass `shared_workspace`, not --home"  # a flag no request has stays as it was
    )
    with server.client() as client:
        task = new_task(client, workspace)
        again = client.post("/v1/tasks", json={"workspace": str(workspace)})
        assert again.status_code == 400 and again.json()["error"] == "WorkspaceOverlap"
        message = again.json()["message"]
        assert "`shared_workspace`" in message and "--" not in message, message
        outside = admit(client, task, "k-cwd", argv=["true"], cwd="../..")
        assert outside.status_code == 400 and outside.json()["message"].startswith("`cwd` '../..'")
