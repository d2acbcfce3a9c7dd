"""settled.client against the real HTTP service (`settled.server.serve` in a subprocess), with
real transport faults: a TCP proxy on 127.0.0.1 that cuts connections mid-stream or drops the
reply to an admission after forwarding it, and a server killed with SIGKILL and restarted.

Every server, proxy and command a test starts carries the test marker (conftest ends them).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from conftest import ESCAPEE

from settled.client import (
    AsyncClient,
    Blocked,
    Client,
    ClientError,
    KeyConflict,
    NotFound,
    NotSettled,
    Retry,
    Unauthorized,
)

try:
    from settled.server import create_app, serve  # noqa: F401 - the server must exist
except ImportError as exc:  # pragma: no cover - only before the server package landed
    pytest.skip(
        f"settled.server (create_app, serve) is not importable: {exc}", allow_module_level=True
    )

TOKEN = "test-token-" + "x" * 16
SERVE = (
    "import sys; from settled.server import serve; "
    "sys.exit(serve(sys.argv[1], port=int(sys.argv[2])))"
)
PATIENT = Retry(attempts=40, first=0.05, cap=0.5)  # rides out a server restart (~20 s)


def block(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * 2048  # 64 KiB, different per block


def slow_writer(blocks: int, pause: float) -> str:
    """A command writing `blocks` distinct 64 KiB blocks, `pause` s apart (binary, no lines)."""
    return (
        'python3 -c "import sys, time, hashlib\n'
        f"for i in range({blocks}):\n"
        "    sys.stdout.buffer.write(hashlib.sha256(str(i).encode()).digest() * 2048)\n"
        "    sys.stdout.flush()\n"
        f'    time.sleep({pause})"'
    )


def expected(blocks: int) -> bytes:
    return b"".join(block(i) for i in range(blocks))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Server:
    """`serve()` over a home in tmp_path, as a subprocess that can be killed and restarted on
    the same port."""

    def __init__(self, tmp_path: Path) -> None:
        self.home = str(tmp_path / "home")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp_path / "server.stderr", "ab")  # noqa: SIM115 - closed in stop()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "SETTLED_TOKEN": TOKEN}
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVE, self.home, str(self.port)], env=env, stderr=self.log
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "the server exited; see server.stderr"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            time.sleep(0.05)
        raise AssertionError("the server did not answer /healthz within 30 s")

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


class Proxy:
    """A TCP proxy on 127.0.0.1 to the server. `cut_after`: every connection is cut once that
    many reply bytes went through. `drop_first_reply`: the first connection's request reaches
    the server, and the connection is closed as soon as the reply starts, before any of it
    reaches the client."""

    def __init__(self, upstream: int, cut_after: int | None = None, drop_first_reply: bool = False):
        self.upstream, self.cut_after, self.drop_first_reply = upstream, cut_after, drop_first_reply
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.cuts = 0
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
            with self._lock:
                number = self.connections
                self.connections += 1
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
            limit = 0 if self.drop_first_reply and number == 0 else self.cut_after
            threading.Thread(target=self._pump, args=(upstream, client, limit), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while data := source.recv(65536):
                if limit is not None and sent + len(data) > limit:
                    sink.sendall(data[: limit - sent])
                    self.cuts += 1
                    break
                sink.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    running = Server(tmp_path)
    running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def workspace(tmp_path: Path) -> str:
    path = tmp_path / "workspace"
    path.mkdir()
    return str(path)


@pytest.fixture
def client(server: Server) -> Iterator[Client]:
    with Client(server.url, TOKEN) as http:
        yield http


def sessions_in(home: str, task: str) -> list[Any]:
    from settled.runtime import Runtime

    with Runtime(home) as rt:
        return rt.store.list_sessions(task)


@pytest.mark.timeout(10)
def test_every_exec_takes_task_argv_shell_in_that_order() -> None:
    from settled.runtime import Runtime

    for exec_ in (Runtime.exec, Client.exec, AsyncClient.exec):
        names = list(inspect.signature(exec_).parameters)
        assert names[:4] == ["self", "task", "argv", "shell"], exec_.__qualname__


@pytest.mark.timeout(60)
def test_exec_wait_and_stream_every_byte_over_sse(client: Client, workspace: str) -> None:
    task = client.new_task(workspace)["task"]
    admitted = client.exec(task, ["python3", "-c", PRINT_ALL_BYTES])  # argv comes first
    assert admitted.reused is False and admitted.key.startswith("k_") and admitted.attempts == 1
    done = client.wait(admitted.session, timeout=30)
    assert done["state"] == "settled" and done["receipt"]["exit"]["code"] == 0
    chunks = client.stream(admitted.session)
    assert b"".join(chunks) == bytes(range(256)) * 8192
    assert chunks.cursor == 256 * 8192 and chunks.receipt is not None
    assert client.output(admitted.session, start=256 * 8192 - 3) == (
        bytes([253, 254, 255]),
        256 * 8192,
    )


PRINT_ALL_BYTES = "import sys; sys.stdout.buffer.write(bytes(range(256)) * 8192)"


@pytest.mark.timeout(60)
def test_the_same_key_is_reused_and_another_command_under_it_conflicts(
    client: Client, workspace: str, server: Server
) -> None:
    task = client.new_task(workspace)["task"]
    first = client.exec(task, shell="echo one >> launched", key="k-same")
    again = client.exec(task, shell="echo one >> launched", key="k-same")
    assert again.session == first.session and again.reused is True
    with pytest.raises(KeyConflict) as conflict:
        client.exec(task, shell="echo two >> launched", key="k-same")
    assert conflict.value.existing_digest == first.digest
    assert conflict.value.requested_digest not in (None, first.digest)
    assert first.digest in str(conflict.value) and str(conflict.value.requested_digest) in str(
        conflict.value
    )
    client.wait(first.session, timeout=30)
    assert Path(workspace, "launched").read_text() == "one\n"
    assert len(sessions_in(server.home, task)) == 1


@pytest.mark.timeout(90)
def test_a_client_and_a_runtime_raise_the_same_error_classes_with_the_same_fields(
    client: Client, workspace: str, server: Server
) -> None:
    from settled import errors
    from settled.runtime import Runtime

    task = client.new_task(workspace)["task"]
    first = client.exec(task, argv=["true"], key="k-one")
    client.wait(first.session, timeout=30)
    caught: dict[str, list[Any]] = {"conflict": [], "sealed": []}
    with Runtime(server.home) as rt:
        for face in (rt, client):
            with pytest.raises(errors.KeyConflict) as conflict:
                face.exec(task, argv=["false"], key="k-one")
            caught["conflict"].append(conflict.value)
        client.close_task(task, deadline=30)
        for face in (rt, client):
            with pytest.raises(errors.AdmissionSealed) as sealed:
                face.exec(task, argv=["true"], key="k-two")
            caught["sealed"].append(sealed.value)
    (local, remote), (local_sealed, remote_sealed) = caught["conflict"], caught["sealed"]
    assert isinstance(remote, ClientError) and isinstance(remote, KeyConflict)
    assert remote.status == 409 and not isinstance(local, ClientError)
    for name in ("task", "key", "session", "existing_digest"):
        assert getattr(remote, name) == getattr(local, name), name
    assert remote.requested_digest not in (None, remote.existing_digest)  # its env is the caller's
    assert remote.to_json().keys() == local.to_json().keys()
    assert remote.kind == local.kind == "KeyConflict"
    assert remote.exit_code == local.exit_code == errors.EXIT_CONFLICT
    assert isinstance(remote_sealed, ClientError)
    assert (remote_sealed.task, remote_sealed.state) == (local_sealed.task, local_sealed.state)


@pytest.mark.timeout(90)
def test_close_returns_the_receipt_and_explain_names_what_allowed_it(
    client: Client, workspace: str
) -> None:
    task = client.new_task(workspace)["task"]
    admitted = client.exec(task, shell="echo done > result")
    client.wait(admitted.session, timeout=30)
    receipt = client.close_task(task, final="wrote result", deadline=30)
    assert receipt["kind"] == "close" and receipt["outcome"]["complete"] is True
    assert receipt["final"] == "wrote result"
    explained = client.explain(task)
    assert explained["complete"] is True
    assert explained["allowed_by"]["checkpoint_receipt"] == receipt["checkpoint"]["digest"]


@pytest.mark.timeout(90)
def test_a_blocked_close_raises_blocked_naming_authority_and_obligation(
    client: Client, workspace: str, marker: str
) -> None:
    from conftest import kill_marked

    task = client.new_task(workspace)["task"]
    admitted = client.exec(task, shell=ESCAPEE, boundary="pgroup", grace=0.2)
    try:
        assert client.wait(admitted.session, timeout=30)["state"] == "unknown"
        with pytest.raises(Blocked) as blocked:
            client.close_task(task, deadline=5)
        assert blocked.value.blocked_on["authority"] == "recovery"
        assert blocked.value.blocked_on["session"] == admitted.session
        assert "recovery" in str(blocked.value)
    finally:
        # the process group could not end the setsid escapee, and the receipt claims nothing;
        # the session's own pids cgroup (a resource wall) may have ended it at the owner's end
        kill_marked(marker, b"sleep")


@pytest.mark.timeout(60)
def test_a_wrong_token_is_unauthorized_and_an_unknown_session_not_found(
    client: Client, server: Server
) -> None:
    with Client(server.url, "not-the-token-at-all") as stranger, pytest.raises(Unauthorized):
        stranger.status("s_0")
    with pytest.raises(NotFound) as missing:
        client.status("s_missing")
    assert "s_missing" in str(missing.value)


@pytest.mark.timeout(60)
def test_wait_gives_up_at_its_timeout_and_signal_stops_the_session(
    client: Client, workspace: str
) -> None:
    task = client.new_task(workspace)["task"]
    admitted = client.exec(task, argv=["sleep", "300"])
    started = time.monotonic()
    with pytest.raises(NotSettled):
        client.wait(admitted.session, timeout=0.5)
    assert time.monotonic() - started < 3
    client.signal(admitted.session, "TERM")
    done = client.wait(admitted.session, timeout=30)
    assert done["receipt"]["exit"]["reason"] == "cancelled"


@pytest.mark.timeout(90)
def test_the_async_client_admits_waits_streams_and_closes(server: Server, workspace: str) -> None:
    async def main() -> None:
        async with AsyncClient(server.url, TOKEN) as http:
            task = (await http.new_task(workspace))["task"]
            admitted = await http.exec(task, shell=slow_writer(8, 0.01))
            again = await http.exec(task, shell=slow_writer(8, 0.01), key=admitted.key)
            assert again.session == admitted.session and again.reused
            got = b"".join([chunk async for chunk in http.stream(admitted.session)])
            assert got == expected(8)
            async with AsyncClient(proxy.url, TOKEN, retry=PATIENT) as cut:
                resumed = cut.stream(admitted.session)
                assert b"".join([chunk async for chunk in resumed]) == expected(8)
            assert proxy.cuts >= 2
            assert (await http.wait(admitted.session, timeout=30))["state"] == "settled"
            raw = http.stream(admitted.session, start=65536, via="output")
            assert b"".join([chunk async for chunk in raw]) == expected(8)[65536:]
            receipt = await http.close_task(task, deadline=30)
            assert receipt["outcome"]["complete"] is True

    proxy = Proxy(server.port, cut_after=150_000)
    try:
        anyio.run(main)
    finally:
        proxy.close()


# -- transport faults --------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("via", ["events", "output"])
def test_a_stream_cut_mid_flight_resumes_with_every_byte_exactly_once(
    client: Client, server: Server, workspace: str, via: str
) -> None:
    task = client.new_task(workspace)["task"]
    admitted = client.exec(task, shell=slow_writer(24, 0.03))
    proxy = Proxy(server.port, cut_after=200_000)
    try:
        with Client(proxy.url, TOKEN, retry=PATIENT) as cut:
            chunks = cut.stream(admitted.session, via=via)
            got = b"".join(chunks)
        assert proxy.cuts >= 3, "the proxy must really have cut connections"
        assert got == expected(24)  # nothing doubled, nothing skipped
        assert chunks.cursor == len(got) == 24 * 65536
        assert chunks.receipt is not None and chunks.receipt["exit"]["code"] == 0
    finally:
        proxy.close()


@pytest.mark.timeout(90)
def test_an_admission_whose_reply_was_lost_is_retried_and_launches_once(
    server: Server, workspace: str
) -> None:
    with Client(server.url, TOKEN) as direct:
        task = direct.new_task(workspace)["task"]
    proxy = Proxy(server.port, drop_first_reply=True)
    try:
        with Client(proxy.url, TOKEN) as lossy:
            admitted = lossy.exec(task, shell="echo launched >> launches")
            assert admitted.attempts == 2 and admitted.reused is True
            lossy.wait(admitted.session, timeout=30)
        assert proxy.connections >= 2
    finally:
        proxy.close()
    [only] = sessions_in(server.home, task)
    assert only.session == admitted.session
    assert Path(workspace, "launches").read_text() == "launched\n"


@pytest.mark.timeout(120)
def test_streams_resume_from_their_cursor_across_a_server_kill_and_restart(
    server: Server, workspace: str
) -> None:
    with Client(server.url, TOKEN) as direct:
        task = direct.new_task(workspace)["task"]
        sessions = [direct.exec(task, shell=slow_writer(30, 0.1)).session for _ in range(2)]
    got: dict[str, bytes] = {}
    receipts: dict[str, Any] = {}
    started = threading.Barrier(3)

    def read(session: str) -> None:
        with Client(server.url, TOKEN, retry=PATIENT) as http:
            chunks = http.stream(session)
            parts = [next(chunks)]
            started.wait()
            parts.extend(chunks)
            got[session], receipts[session] = b"".join(parts), chunks.receipt

    readers = [threading.Thread(target=read, args=(s,)) for s in sessions]
    for reader in readers:
        reader.start()
    started.wait(timeout=30)
    server.kill()  # owners are detached: the sessions go on without the server
    time.sleep(0.5)
    server.start()
    for reader in readers:
        reader.join(timeout=90)
    for session in sessions:
        assert got[session] == expected(30), f"{session}: a byte was lost or doubled"
        assert receipts[session]["exit"]["code"] == 0  # the command ran through the restart


@pytest.mark.timeout(60)
def test_a_shared_workspace_is_asked_for_over_http_and_both_closes_say_so(
    client: Client, server: Server, workspace: str
) -> None:
    first = client.new_task(workspace)["task"]
    with pytest.raises(ClientError) as caught:
        client.new_task(workspace)
    assert caught.value.status == 400 and caught.value.body["error"] == "WorkspaceOverlap"
    assert first in str(caught.value)
    second = client.new_task(workspace, shared_workspace=True)
    assert second["shared_workspace"] is True

    async def close_async() -> dict[str, Any]:
        async with AsyncClient(server.url, TOKEN) as http:
            third = await http.new_task(workspace, shared_workspace=True)
            assert third["shared_workspace"] is True
            return await http.close_task(third["task"])

    third_receipt = anyio.run(close_async)
    assert set(third_receipt["workspace"]["shared_with"]) == {first, second["task"]}
    receipt = client.close_task(first)
    assert set(receipt["workspace"]["shared_with"]) == {second["task"], third_receipt["task"]}


@pytest.mark.timeout(60)
def test_new_task_binds_ignore_patterns_and_refuses_a_bad_one(
    client: Client, workspace: str
) -> None:
    task = client.new_task(workspace, ignore=["cache/"])
    assert task["ignore_rules"]["patterns"] == ["cache/"]
    with pytest.raises(ClientError, match="ignore pattern"):
        client.new_task(workspace, key="bad-pattern", ignore=["\\"])


def test_run_mirrors_settled_run_exit_code_and_both_streams(
    server: Server, client: Client, workspace: str
) -> None:
    done = client.run(workspace, shell="echo out; echo err >&2; exit 3", key="run-1")
    assert (done.exit_code, done.stdout, done.stderr) == (3, b"out\n", b"err\n")
    assert done.receipt is not None and done.receipt["exit"]["code"] == 3
    again = client.run(workspace, shell="echo out; echo err >&2; exit 3", key="run-1")
    assert again.session == done.session and again.reused
    late = client.run(done.task, shell="sleep 30", timeout=0.5, grace=0.5)
    assert late.exit_code == 124 and late.task == done.task


def test_close_closes_the_connection_not_a_task(server: Server) -> None:
    http = Client(server.url, TOKEN)
    http.close()
    with pytest.raises(RuntimeError):
        http._http.get("/healthz")


@pytest.mark.timeout(60)
def test_inherit_resolves_in_the_caller_and_the_server_records_it(
    client: Client, workspace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CALLERS_OWN", "from the caller")
    task = client.new_task(workspace)["task"]
    admitted = client.exec(task, ["env"], key="inherit-1", inherit=["CALLERS_OWN"])
    view = client.wait(admitted.session, timeout=30)
    seen, _cursor = client.output(admitted.session, "stdout")
    assert b"CALLERS_OWN=from the caller" in seen
    assert b"SETTLED_" not in seen  # nothing of the server's own environment
    assert view["receipt"]["exit"]["code"] == 0
