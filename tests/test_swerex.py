"""settled's SWE-ReX protocol driven by swe-rex's own RemoteRuntime client over real loopback."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import uvicorn
from starlette.applications import Starlette

swerex = pytest.importorskip("swerex")

from swerex.exceptions import CommandTimeoutError, NonZeroExitCodeError  # noqa: E402
from swerex.runtime.abstract import (  # noqa: E402
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime  # noqa: E402

from settled.runtime import Runtime  # noqa: E402
from settled.server.swerex import SwerexService, create_swerex_app  # noqa: E402

KEY = "sekrit-key"
APPS: dict[str, Starlette] = {}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    app = create_swerex_app(str(tmp_path / "home"), KEY)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    APPS[f"http://127.0.0.1:{port}"] = app
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        app.state.swerex.close()
        server.should_exit = True
        thread.join(20)


def _client(url: str, key: str = KEY) -> RemoteRuntime:
    return RemoteRuntime(host=url, auth_token=key, timeout=60)


def test_swerex_client_drives_a_stateful_session(url: str, tmp_path: Path) -> None:
    service: SwerexService = APPS[url].state.swerex

    async def drive() -> None:
        rt = _client(url)
        assert (await rt.is_alive()).is_alive
        await rt.create_session(CreateBashSessionRequest(session="s1"))
        await rt.run_in_session(BashAction(session="s1", command="mkdir -p sub && cd sub"))
        await rt.run_in_session(BashAction(session="s1", command="export FOO=bar42"))
        obs = await rt.run_in_session(BashAction(session="s1", command="pwd; echo $FOO"))
        assert obs.output.strip().splitlines() == [obs.output.split()[0], "bar42"]
        assert obs.output.split()[0].endswith("/sub") and obs.exit_code == 0
        obs = await rt.run_in_session(BashAction(session="s1", command="exit 3", check="silent"))
        assert obs.exit_code == 3
        with pytest.raises(NonZeroExitCodeError):
            await rt.run_in_session(BashAction(session="s1", command="false"))
        with pytest.raises(CommandTimeoutError):
            await rt.run_in_session(BashAction(session="s1", command="sleep 30", timeout=1))
        await rt.run_in_session(BashInterruptAction(session="s1"))  # SWE-agent's next step
        obs = await rt.run_in_session(BashAction(session="s1", command="echo $FOO; pwd"))
        assert obs.output.split()[0] == "bar42" and obs.output.split()[1].endswith("/sub")
        out = await rt.execute(Command(command=["echo", "hi"]))
        assert out.stdout == "hi\n" and out.exit_code == 0
        target = tmp_path / "f.txt"
        await rt.write_file(WriteFileRequest(path=str(target), content="hello"))
        assert (await rt.read_file(ReadFileRequest(path=str(target)))).content == "hello"
        src = tmp_path / "srcdir"
        (src / "d").mkdir(parents=True)
        (src / "d" / "x.txt").write_text("x")
        await rt.upload(UploadRequest(source_path=str(src), target_path=str(tmp_path / "up")))
        assert (tmp_path / "up" / "d" / "x.txt").read_text() == "x"
        await rt.upload(UploadRequest(source_path=str(target), target_path=str(tmp_path / "u1")))
        assert (tmp_path / "u1").read_text() == "hello"
        await rt.create_session(CreateBashSessionRequest(session="s2"))
        tasks = [s.task for s in service.sessions.values()] + [service.exec_task]
        await rt.close_session(CloseBashSessionRequest(session="s1"))
        await rt.close()
        with Runtime(str(tmp_path / "home")) as runtime:
            for task in tasks:
                assert task is not None
                assert runtime.task_status(task)["complete"] is True

    asyncio.run(asyncio.wait_for(drive(), 120))


def test_a_retried_action_runs_once_and_answers_the_same(url: str, tmp_path: Path) -> None:
    service: SwerexService = APPS[url].state.swerex

    async def drive() -> None:
        rt = _client(url)
        await rt.create_session(CreateBashSessionRequest(session="r"))
        marker = Path(service.sessions["r"].cwd, "count")  # the session's workspace: its view's
        body = BashAction(session="r", command=f"echo x >> {marker}; echo $RANDOM").model_dump()
        headers = {"X-API-Key": KEY, "X-Request-ID": "req-1"}
        answers = []
        async with aiohttp.ClientSession() as http:
            for _ in range(2):
                async with http.post(f"{url}/run_in_session", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    answers.append(await r.json())
        assert answers[0] == answers[1]
        assert marker.read_text() == "x\n"
        await rt.close()

    asyncio.run(asyncio.wait_for(drive(), 120))


def test_a_wrong_api_key_is_refused(url: str) -> None:
    async def drive() -> None:
        assert not (await _client(url, "wrong").is_alive()).is_alive
        with pytest.raises(aiohttp.ClientResponseError):
            await _client(url, "wrong").create_session(CreateBashSessionRequest(session="z"))

    asyncio.run(asyncio.wait_for(drive(), 60))


def test_a_zip_member_outside_the_target_is_refused(url: str, tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("../escaped.txt", "x")

    async def drive() -> int:
        form = aiohttp.FormData()
        form.add_field("file", buffer.getvalue(), filename="z.zip")
        form.add_field("target_path", str(tmp_path / "in"))
        form.add_field("unzip", "true")
        async with aiohttp.ClientSession() as http:
            headers = {"X-API-Key": KEY}
            async with http.post(f"{url}/upload", data=form, headers=headers) as r:
                return r.status

    assert asyncio.run(asyncio.wait_for(drive(), 60)) == 511
    assert not (tmp_path / "escaped.txt").exists()


def test_cd_outside_the_workspace_persists(url: str, tmp_path: Path) -> None:
    async def drive() -> None:
        rt = _client(url)
        await rt.create_session(CreateBashSessionRequest(session="o"))
        await rt.run_in_session(BashAction(session="o", command=f"cd {tmp_path}"))
        obs = await rt.run_in_session(BashAction(session="o", command="pwd"))
        assert obs.output.strip() == str(tmp_path)
        await rt.close()

    asyncio.run(asyncio.wait_for(drive(), 60))


def test_a_file_that_is_not_utf8_is_read_with_surrogateescape(url: str, tmp_path: Path) -> None:
    """The answer is ASCII JSON: a lone surrogate in it is `\\udcff`, not a failed answer."""
    data = tmp_path / "latin1.txt"
    data.write_bytes(b"caf\xe9 \xff\n")

    async def drive() -> str:
        rt = _client(url)
        request = ReadFileRequest(path=str(data), encoding="utf-8", errors="surrogateescape")
        content = (await rt.read_file(request)).content
        await rt.close()
        return content

    content = asyncio.run(asyncio.wait_for(drive(), 60))
    assert content.encode("utf-8", "surrogateescape") == b"caf\xe9 \xff\n"


def _serve(tmp_path: Path, name: str, key: str | None) -> tuple[subprocess.Popen[bytes], Path]:
    """`settled serve --swerex --port 0` on a workspace; (the process, its stderr's file)."""
    log, workspace = tmp_path / f"{name}.log", tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    environ = {k: v for k, v in os.environ.items() if k != "SETTLED_SWEREX_API_KEY"}
    environ["SETTLED_HOME"] = str(tmp_path / "home")
    if key is not None:
        environ["SETTLED_SWEREX_API_KEY"] = key
    command = [sys.executable, "-m", "settled", "serve", "--swerex", "--host", "127.0.0.1",
               "--port", "0", "--swerex-workspace", str(workspace)]  # fmt: skip
    with open(log, "ab") as sink:
        process = subprocess.Popen(command, env=environ, stdin=subprocess.DEVNULL,
                                   stdout=sink, stderr=sink)  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process.poll() is None:
        if "key" in log.read_text():
            break
        time.sleep(0.05)
    return process, log


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def test_the_server_says_where_it_listens_its_home_workspace_and_key(tmp_path: Path) -> None:
    """Issue 37.4: the start is said on stderr (listening address, home, workspace, where the
    key is), and the key never is."""
    process, log = _serve(tmp_path, "env", KEY)
    _stop(process)
    said = log.read_text()
    assert f"(home {tmp_path / 'home'})" in said and "listening on http://127.0.0.1:" in said
    assert f"workspace {tmp_path / 'ws'}:" in said
    assert "key: from SETTLED_SWEREX_API_KEY" in said and KEY not in said
    process, log = _serve(tmp_path, "made", None)
    try:
        line = next(x for x in log.read_text().splitlines() if "made one in " in x)
        key = Path(line.split("made one in ")[1].split(" (mode")[0]).read_text().strip()
    finally:
        _stop(process)
    assert len(key) == 64 and key not in log.read_text()


def test_errors_reach_the_client_as_the_types_swe_rex_raises(url: str, tmp_path: Path) -> None:
    """Issue 37.3: a missing file was a generic SwerexException; SWE-ReX's server sends
    Python's own errors as builtins.<name>, and its client raises that very type."""

    async def drive() -> None:
        rt = _client(url)
        with pytest.raises(FileNotFoundError, match="No such file"):
            await rt.read_file(ReadFileRequest(path=str(tmp_path / "missing")))
        with pytest.raises(IsADirectoryError):
            await rt.read_file(ReadFileRequest(path=str(tmp_path)))
        with pytest.raises(IsADirectoryError):
            await rt.write_file(WriteFileRequest(path=str(tmp_path), content="x"))
        await rt.close()

    asyncio.run(asyncio.wait_for(drive(), 60))
