"""`settled serve --swerex` as a real process, driven by swe-rex's own RemoteRuntime over loopback.

Each test starts the server (`python -m settled serve --swerex --port 0`) on a home and a
workspace of its own, reads what it says on stderr, and ends it with SIGTERM. What the server
did is checked in the home itself (a Runtime on it: tasks, sessions, receipts), never in the
server's memory.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

swerex = pytest.importorskip("swerex")

from swerex.exceptions import (  # noqa: E402
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
    SwerexException,
)
from swerex.runtime.abstract import (  # noqa: E402
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    CloseResponse,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime  # noqa: E402

from settled.runtime import Runtime  # noqa: E402

KEY = "sekrit-key-0123456789"
START_S = 30.0
MiB = 1 << 20


@dataclass
class Served:
    """One `settled serve --swerex` process: its URL, home, workspace and stderr."""

    process: subprocess.Popen[bytes]
    url: str
    home: Path
    workspace: Path
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def client(self, key: str = KEY) -> RemoteRuntime:
        return RemoteRuntime(host=self.url, auth_token=key, timeout=120)

    def stop(self) -> str:
        """SIGTERM, wait; what the server said on stderr."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return self.text()


def _start(tmp_path: Path, *args: str, key: str | None = KEY, **env: str) -> Served:
    home, workspace = tmp_path / "home", tmp_path / "ws"
    log = tmp_path / f"swerex-{len(list(tmp_path.glob('swerex-*.log')))}.log"
    workspace.mkdir(exist_ok=True)
    environ = {k: v for k, v in os.environ.items() if k != "SETTLED_SWEREX_API_KEY"}
    environ.update(SETTLED_HOME=str(home), **env)
    if key is not None:
        environ["SETTLED_SWEREX_API_KEY"] = key
    command = [sys.executable, "-m", "settled", "serve", "--swerex", "--host", "127.0.0.1",
               "--port", "0", "--swerex-workspace", str(workspace), *args]  # fmt: skip
    with open(log, "ab") as sink:
        process = subprocess.Popen(
            command, env=environ, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink
        )
    served = Served(process, "", home, workspace, log)
    give_up = time.monotonic() + START_S
    while time.monotonic() < give_up and process.poll() is None:
        lines = served.text().splitlines()
        said = [line for line in lines if "listening on " in line]
        if said and any("key: " in line or "made one in " in line for line in lines):
            served.url = said[0].split("listening on ")[1].split()[0]
            break
        time.sleep(0.05)
    if not served.url:
        served.stop()
        raise AssertionError(f"the server never said where it listens: {served.text()}")
    return served


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    server = _start(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def _drive(make: Callable[[], Awaitable[Any]], seconds: float = 180) -> Any:
    return asyncio.run(asyncio.wait_for(make(), seconds))


async def _post(url: str, route: str, body: Any, request_id: str) -> tuple[int, Any]:
    headers = {"X-API-Key": KEY, "X-Request-ID": request_id}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/{route}", json=body, headers=headers) as answer,
    ):
        return answer.status, await answer.json()


def _sessions(home: Path, task: str) -> list[dict[str, Any]]:
    with Runtime(str(home)) as runtime:
        return [runtime.session_status(s.session) for s in runtime.store.list_sessions(task)]


# -- a stateful session, and execute beside it -------------------------------------------


def test_swerex_client_drives_a_stateful_session(served: Served, tmp_path: Path) -> None:
    async def drive() -> dict[str, Any]:
        rt = served.client()
        assert (await rt.is_alive()).is_alive
        await rt.create_session(CreateBashSessionRequest(session="s1"))
        await rt.run_in_session(BashAction(session="s1", command="mkdir -p sub && cd sub"))
        await rt.run_in_session(BashAction(session="s1", command="export FOO=bar42"))
        obs = await rt.run_in_session(BashAction(session="s1", command="pwd; echo $FOO"))
        assert obs.output.splitlines() == [str(served.workspace / "sub"), "bar42"]
        obs = await rt.run_in_session(BashAction(session="s1", command="exit 3", check="silent"))
        assert obs.exit_code == 3
        with pytest.raises(NonZeroExitCodeError):
            await rt.run_in_session(BashAction(session="s1", command="false"))
        with pytest.raises(CommandTimeoutError):
            await rt.run_in_session(BashAction(session="s1", command="sleep 30", timeout=1))
        await rt.run_in_session(BashInterruptAction(session="s1"))  # SWE-agent's next step
        obs = await rt.run_in_session(BashAction(session="s1", command="echo $FOO; pwd"))
        assert obs.output.splitlines() == ["bar42", str(served.workspace / "sub")]
        target = served.workspace / "f.txt"
        await rt.write_file(WriteFileRequest(path=str(target), content="hello"))
        assert (await rt.read_file(ReadFileRequest(path=str(target)))).content == "hello"
        src = tmp_path / "srcdir"
        (src / "d").mkdir(parents=True)
        (src / "d" / "x.txt").write_text("x")
        up = served.workspace / "up"
        await rt.upload(UploadRequest(source_path=str(src), target_path=str(up)))
        assert (up / "d" / "x.txt").read_text() == "x"
        u1 = served.workspace / "u1"
        await rt.upload(UploadRequest(source_path=str(target), target_path=str(u1)))
        assert u1.read_text() == "hello"
        await rt.close_session(CloseBashSessionRequest(session="s1"))
        await rt.close()
        status, closes = await _get(served.url, "settled/closes")
        assert status == 200
        return dict(closes)

    closes = _drive(drive)
    [entry] = closes["tasks"]
    assert entry["complete"] is True and closes["open"] is None
    with Runtime(str(served.home)) as runtime:
        assert runtime.task_status(entry["task"])["complete"] is True


async def _get(url: str, route: str) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{url}/{route}", headers={"X-API-Key": KEY}) as answer,
    ):
        return answer.status, await answer.json()


def test_execute_runs_while_bash_sessions_are_open_in_their_one_task(served: Served) -> None:
    """Issue 37.1: execute beside open sessions on --swerex-workspace was WorkspaceOverlap (a
    task per bash session and one for execute, on one workspace). Now the runtime is one task:
    every session's actions and every execute are keyed sessions of it, sharing its files."""

    async def drive() -> dict[str, Any]:
        rt = served.client()
        await rt.create_session(CreateBashSessionRequest(session="a"))
        await rt.create_session(CreateBashSessionRequest(session="b"))
        await rt.run_in_session(BashAction(session="a", command="echo from-a > shared.txt"))
        out = await rt.execute(Command(command=["cat", "shared.txt"]))
        assert (out.stdout, out.exit_code) == ("from-a\n", 0)
        obs = await rt.run_in_session(BashAction(session="b", command="cat shared.txt"))
        assert obs.output == "from-a\n"
        out = await rt.execute(Command(command="echo out; echo err >&2; exit 4", shell=True))
        assert (out.stdout, out.stderr, out.exit_code) == ("out\n", "err\n", 4)
        with pytest.raises(NonZeroExitCodeError):
            await rt.execute(Command(command=["false"], check=True))
        sub = served.workspace / "sub"
        sub.mkdir()
        out = await rt.execute(Command(command=["pwd"], cwd=str(sub)))
        assert out.stdout == f"{sub}\n"
        out = await rt.execute(Command(command=["pwd"], cwd=str(served.workspace.parent)))
        assert out.stdout == f"{served.workspace.parent}\n"  # outside: entered by the shell
        with pytest.raises(CommandTimeoutError):
            await rt.execute(Command(command=["sleep", "30"], timeout=1))
        body = Command(command="echo $RANDOM >> count; cat count", shell=True).model_dump()
        first = await _post(served.url, "execute", body, "exec-retry")
        again = await _post(served.url, "execute", body, "exec-retry")
        assert first == again and first[0] == 200
        assert (served.workspace / "count").read_text() == first[1]["stdout"]  # ran once
        status, closed = await _post(served.url, "close", None, "close-1")
        assert status == 200
        return dict(closed)

    closed = _drive(drive)
    [entry] = closed["settled"]["tasks"]
    keys = sorted(s["key"] for s in _sessions(served.home, entry["task"]))
    assert keys == sorted(
        ["swerex:1:a:0", "swerex:2:b:0", *(f"swerex:execute:{n}" for n in range(7))]
    )


def test_a_retried_action_runs_once_and_answers_the_same(served: Served) -> None:
    async def drive() -> None:
        rt = served.client()
        await rt.create_session(CreateBashSessionRequest(session="r"))
        marker = served.workspace / "count"
        body = BashAction(session="r", command=f"echo x >> {marker}; echo $RANDOM").model_dump()
        answers = [await _post(served.url, "run_in_session", body, "req-1") for _ in range(2)]
        assert answers[0] == answers[1] and answers[0][0] == 200
        assert marker.read_text() == "x\n"
        slow = BashAction(session="r", command=f"sleep 1; echo y >> {marker}; echo $RANDOM")
        both = await asyncio.gather(  # a retry while the first try still runs
            *(_post(served.url, "run_in_session", slow.model_dump(), "req-2") for _ in range(2))
        )
        assert both[0] == both[1] and both[0][0] == 200
        assert marker.read_text() == "x\ny\n"
        create = CreateBashSessionRequest(session="s", startup_source=[str(marker)]).model_dump()
        made = [await _post(served.url, "create_session", create, "create-1") for _ in range(2)]
        assert made[0] == made[1] and made[0][0] == 200  # a retried create is answered again
        status, refused = await _post(served.url, "create_session", create, "create-2")
        assert status == 511 and refused["swerexception"]["class_path"].endswith(
            "SessionExistsError"
        )
        await rt.close()

    _drive(drive)


# -- output: whole, or capped with a marker; the state report never lost -----------------


def test_four_mib_of_output_come_back_whole_and_the_next_action_keeps_cd_and_export(
    served: Served,
) -> None:
    """Issue 37.2: output past 1 MiB was cut at 1,048,576 bytes, exit 0, no marker, and the
    state trailer with it, so the next action lost its cd and export."""

    async def drive() -> None:
        rt = served.client()
        await rt.create_session(CreateBashSessionRequest(session="big"))
        command = (
            "mkdir -p deep && cd deep && export KEPT='a b'; head -c 4194304 /dev/zero | tr '\\0' x"
        )
        obs = await rt.run_in_session(BashAction(session="big", command=command))
        assert obs.exit_code == 0 and obs.output == "x" * (4 * MiB)
        obs = await rt.run_in_session(BashAction(session="big", command='pwd; echo "$KEPT"'))
        assert obs.output.splitlines() == [str(served.workspace / "deep"), "a b"]
        out = await rt.execute(
            Command(command="head -c 4194304 /dev/zero | tr '\\0' y", shell=True)
        )
        assert out.stdout == "y" * (4 * MiB)
        await rt.close()

    _drive(drive)


def test_output_past_the_cap_shows_head_marker_and_tail_and_keeps_the_state(
    tmp_path: Path,
) -> None:
    server = _start(tmp_path, SETTLED_SWEREX_OUTPUT_CAP=str(64 * 1024))
    try:

        async def drive() -> None:
            rt = server.client()
            await rt.create_session(CreateBashSessionRequest(session="c"))
            command = (
                "mkdir -p d && cd d && export KEPT=yes; "
                "printf 'HEAD'; head -c 2097152 /dev/zero | tr '\\0' m; printf 'TAIL'"
            )
            obs = await rt.run_in_session(BashAction(session="c", command=command))
            total = 4 + 2 * MiB + 4
            half = 32 * 1024
            assert obs.output.startswith("HEAD") and obs.output.endswith("TAIL")
            marker = f"[settled: omitted stdout bytes {half}..{total - half} of {total} "
            assert marker in obs.output
            assert len(obs.output) < 2 * half + 400
            obs = await rt.run_in_session(BashAction(session="c", command="pwd; echo $KEPT"))
            assert obs.output.splitlines() == [str(server.workspace / "d"), "yes"]
            await rt.close()

        _drive(drive)
    finally:
        server.stop()


def test_output_cannot_forge_the_state_and_values_are_carried_as_data(served: Served) -> None:
    """A report printed on stdout (the old trailer's form, or the new one with a guessed
    nonce) is output, not state; exported values full of shell syntax come back as text."""
    planted = served.workspace / "planted.txt"
    fake_old = '\n__SETTLED_SWEREX_0123456789abcdef01234567\n/etc\ndeclare -x P="$(touch pwned)"\n'
    fake_new = "settled-swerex-state-" + "0" * 32 + "\0/etc\0P\0x\0settled-swerex-end-" + "0" * 32
    planted.write_text(fake_old + fake_new + "\0")

    async def drive() -> None:
        rt = served.client()
        await rt.create_session(CreateBashSessionRequest(session="f"))
        value = "$(touch pwned2)`touch pwned3`\nline2 'q' \"dq\" \\ end"
        quoted = "'" + value.replace("'", "'\\''") + "'"
        await rt.run_in_session(BashAction(session="f", command=f"export V={quoted}"))
        obs = await rt.run_in_session(BashAction(session="f", command=f"cat {planted}"))
        assert "settled-swerex-state-" in obs.output  # shown as the output it is
        obs = await rt.run_in_session(
            BashAction(session="f", command='pwd; printf "%s" "$V"; echo; echo "[$P]"')
        )
        assert obs.output == f"{served.workspace}\n{value}\n[]\n"
        await rt.close()

    _drive(drive)
    assert not list(served.workspace.glob("pwned*"))


def test_a_working_directory_that_is_gone_is_said_and_the_session_goes_on(
    served: Served,
) -> None:
    async def drive() -> None:
        rt = served.client()
        await rt.create_session(CreateBashSessionRequest(session="g"))
        await rt.run_in_session(BashAction(session="g", command="mkdir gone && cd gone"))
        await rt.execute(Command(command=["rmdir", "gone"]))
        obs = await rt.run_in_session(BashAction(session="g", command="pwd"))
        assert obs.output.endswith(f"{served.workspace}\n") and "is gone" in obs.output
        await rt.close()

    _drive(drive)


# -- errors as SWE-ReX raises them ------------------------------------------------------


def test_errors_reach_the_client_as_the_types_swe_rex_raises(served: Served) -> None:
    """Issue 37.3: a missing file was a generic SwerexException; SWE-ReX's server sends
    Python's own errors as builtins.<name>, and its client raises that very type."""

    async def drive() -> None:
        rt = served.client()
        with pytest.raises(FileNotFoundError, match="No such file"):
            await rt.read_file(ReadFileRequest(path=str(served.workspace / "missing")))
        with pytest.raises(IsADirectoryError):
            await rt.read_file(ReadFileRequest(path=str(served.workspace)))
        with pytest.raises(IsADirectoryError):
            await rt.write_file(WriteFileRequest(path=str(served.workspace), content="x"))
        with pytest.raises(SessionDoesNotExistError):
            await rt.run_in_session(BashAction(session="nobody", command="true"))
        with pytest.raises(SessionDoesNotExistError):
            await rt.close_session(CloseBashSessionRequest(session="nobody"))
        await rt.create_session(CreateBashSessionRequest(session="once"))
        with pytest.raises(SessionExistsError):
            await rt.create_session(CreateBashSessionRequest(session="once"))
        syntax = BashAction(session="once", command="touch ran; echo (", check="silent")
        with pytest.raises(BashIncorrectSyntaxError, match="syntax error near unexpected"):
            await rt.run_in_session(syntax)  # as SWE-ReX: checked first, whatever `check` says
        assert not (served.workspace / "ran").exists()  # nothing of it ran
        with pytest.raises(FileNotFoundError, match="no-such-program"):
            await rt.execute(Command(command=["no-such-program"]))
        with pytest.raises(FileNotFoundError):
            await rt.execute(Command(command=["pwd"], cwd=str(served.workspace / "nowhere")))
        status, bad = await _post(served.url, "run_in_session", {"session": "once"}, "no-cmd")
        assert status == 511 and "has no 'command'" in bad["swerexception"]["message"]
        await rt.close()

    _drive(drive)


def test_a_workspace_held_by_another_task_is_refused_without_naming_a_flag(
    served: Served,
) -> None:
    """Issue 37.6: what an HTTP caller reads names no CLI flag."""
    with Runtime(str(served.home)) as runtime:
        other = runtime.new_task(str(served.workspace)).task
        try:

            async def drive() -> str:
                with pytest.raises(SwerexException) as refused:
                    await served.client().create_session(CreateBashSessionRequest(session="x"))
                return str(refused.value)

            message = _drive(drive)
        finally:
            runtime.close_task(other)
    assert other in message and "held by open task" in message and "--" not in message


# -- what the server says: at start, at each task, at close -----------------------------


def test_the_server_says_where_it_listens_its_home_workspace_and_key(tmp_path: Path) -> None:
    """Issue 37.4: the start is said on stderr (listening address, home, workspace, where the
    key is), and the key never is."""
    with_env = _start(tmp_path)
    said = with_env.stop()
    assert f"listening on {with_env.url} (home {with_env.home})" in said
    assert f"workspace {with_env.workspace}:" in said
    assert "key: from SETTLED_SWEREX_API_KEY" in said and KEY not in said
    made = _start(tmp_path, key=None)
    try:
        line = next(x for x in made.text().splitlines() if "made one in " in x)
        key_file = line.split("made one in ")[1].split(" (mode")[0]
        key = Path(key_file).read_text().strip()
        assert (Path(key_file).stat().st_mode & 0o777) == 0o600 and len(key) == 64

        async def alive() -> bool:
            return bool(await made.client(key).is_alive())

        assert _drive(alive)
    finally:
        said = made.stop()
    assert key not in said and f"listening on {made.url}" in said
    assert not Path(key_file).exists()  # the made key dies with the server


def test_a_bad_output_cap_is_refused_before_the_server_starts(tmp_path: Path) -> None:
    environ = {**os.environ, "SETTLED_HOME": str(tmp_path / "home"), "SETTLED_SWEREX_API_KEY": KEY,
               "SETTLED_SWEREX_OUTPUT_CAP": "12"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "settled", "serve", "--swerex", "--port", "0"],
        env=environ, capture_output=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 2 and b"listening" not in done.stderr
    assert b"SETTLED_SWEREX_OUTPUT_CAP='12'" in done.stderr


def test_close_answers_each_task_with_its_close_receipt_digest(served: Served) -> None:
    """Issue 37.5: the close closes the task with a checkpoint and its answer carries the
    task's id and close receipt digest. SWE-ReX's CloseResponse has no fields and its client
    drops extra ones, so the record is also at GET /settled/closes and on stderr."""

    async def drive() -> tuple[Any, Any, Any, Any]:
        rt = served.client()
        await rt.create_session(CreateBashSessionRequest(session="k"))
        await rt.run_in_session(BashAction(session="k", command="echo kept > kept.txt"))
        first = await _post(served.url, "close", None, "close-a")
        again = await _post(served.url, "close", None, "close-a")  # a retry: the same answer
        listed = await _get(served.url, "settled/closes")
        await rt.create_session(CreateBashSessionRequest(session="k"))  # a new runtime's task
        answer = await rt.close()
        return first, again, listed, answer

    first, again, listed, answer = _drive(drive)
    assert first == again and first[0] == 200
    assert isinstance(answer, CloseResponse)
    tasks = first[1]["settled"]["tasks"]
    [entry] = tasks
    assert listed[1]["tasks"][0] == entry and len(listed[1]["tasks"]) == 1
    with Runtime(str(served.home)) as runtime:
        receipt = runtime.close_task(entry["task"]).to_json()  # a repeated close: same receipt
        assert receipt["digest"] == entry["close_receipt"] and entry["complete"] is True
        assert receipt["checkpoint"]["manifest"] == entry["checkpoint"]
        assert entry["workspace"] == str(served.workspace)
        assert runtime.task_status(entry["task"])["complete"] is True
    said = served.stop()
    assert (
        f"task {entry['task']} closed: complete true, close receipt {entry['close_receipt']}"
        in said
    )
    assert said.count(" closed: complete true") == 2 and "still open" not in said


def test_a_task_left_open_is_said_when_the_server_stops(served: Served) -> None:
    async def drive() -> Any:
        await served.client().create_session(CreateBashSessionRequest(session="o"))
        return (await _get(served.url, "settled/closes"))[1]

    listed = _drive(drive)
    said = served.stop()
    task = re.findall(r"task (t_[0-9a-f]+) opened", said)[0]
    assert listed == {"tasks": [], "open": {"task": task, "workspace": str(served.workspace)}}
    assert f"task {task} is still open (no SWE-ReX close came)" in said
    with Runtime(str(served.home)) as runtime:
        runtime.close_task(task)


# -- read_file, write_file, upload: commands inside the task's boundary ------------------


def _outside(tmp_path: Path) -> tuple[Path, Path, dict[str, bytes]]:
    """A file and a directory on the host outside the workspace, and every byte they hold."""
    secret, directory = tmp_path / "outside" / "secret.txt", tmp_path / "outside" / "dir"
    directory.mkdir(parents=True)
    secret.write_bytes(b"host secret\n")
    (directory / "kept.txt").write_bytes(b"kept\n")
    return secret, directory, _tree(tmp_path / "outside")


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_planted_symlink_takes_no_file_call_outside_what_commands_reach(
    served: Served, tmp_path: Path
) -> None:
    """The hole: read_file, write_file and upload ran as the server (root) on the host, so a
    link a command left in the workspace let them read or write any host file. Inside the
    boundary the link is followed in the command's view, where the host's files are not."""
    secret, directory, before = _outside(tmp_path)
    src = tmp_path / "srcdir"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "planted.txt").write_text("planted")
    (src / "kept.txt").write_text("overwritten")
    ws = served.workspace

    async def drive() -> list[str]:
        rt = served.client()
        plant = f"ln -s {secret} file-link && ln -s {directory} dir-link"
        assert (await rt.execute(Command(command=plant, shell=True))).exit_code == 0
        outcomes, link = [], ws / "file-link"
        calls = [
            rt.write_file(WriteFileRequest(path=str(link), content="pwned")),
            rt.write_file(WriteFileRequest(path=str(ws / "dir-link" / "new.txt"), content="x")),
            rt.upload(UploadRequest(source_path=str(src / "kept.txt"), target_path=str(link))),
            rt.upload(UploadRequest(source_path=str(src), target_path=str(ws / "dir-link"))),
        ]  # fmt: skip
        for call in calls:  # each lands in the task's view (or fails there), never on the host
            try:
                await call
                outcomes.append("done")
            except OSError as exc:  # the link's target is not in the view
                outcomes.append(type(exc).__name__)
        for name in ("file-link", "dir-link/kept.txt"):
            try:
                read = await rt.read_file(ReadFileRequest(path=str(ws / name)))
                assert "host secret" not in read.content and read.content != "kept\n"
            except FileNotFoundError:
                pass
        await rt.close()
        return outcomes

    outcomes = _drive(drive)
    assert _tree(tmp_path / "outside") == before  # every outside byte unchanged
    assert len(outcomes) == 4, outcomes  # each answered: done, or the view's own error


def test_a_file_call_sees_paths_as_the_task_s_commands_do(served: Served, tmp_path: Path) -> None:
    """A path outside the workspace is the task's own (its /tmp, its HOME): a later command
    sees what a write left there, the host does not; a file, a directory (zipped by SWE-ReX's
    client) and text round-trip exactly."""
    src = tmp_path / "srcdir"
    (src / "d" / "e").mkdir(parents=True)
    (src / "d" / "e" / "x.txt").write_text("x\n")
    (src / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "run.sh").chmod(0o755)
    private = tmp_path / "private"

    async def drive() -> None:
        rt = served.client()
        await rt.write_file(WriteFileRequest(path=str(private / "a.txt"), content="é\r\nline"))
        seen = await rt.execute(Command(command=["cat", str(private / "a.txt")]))
        assert seen.stdout == "é\r\nline"
        read = await rt.read_file(ReadFileRequest(path=str(private / "a.txt")))
        assert read.content == "é\nline"  # Path.read_text's universal newlines, as SWE-ReX
        home = (await rt.execute(Command(command="echo -n $HOME", shell=True))).stdout
        await rt.write_file(WriteFileRequest(path=f"{home}/.note", content="mine"))
        assert (await rt.execute(Command(command=["cat", f"{home}/.note"]))).stdout == "mine"
        await rt.upload(UploadRequest(source_path=str(src), target_path=str(private / "up")))
        listed = await rt.execute(
            Command(command=f"cd {private}/up && cat d/e/x.txt && ./run.sh", shell=True)
        )
        assert listed.stdout == "x\nran\n", listed
        await rt.upload(UploadRequest(source_path=str(src / "run.sh"), target_path="rel/r.sh"))
        (served.workspace / "-").write_text("dash")  # a file named `-`, not head's stdin
        assert (await rt.read_file(ReadFileRequest(path="-"))).content == "dash"
        await rt.close()

    _drive(drive)
    assert not private.exists()  # the task's view, not the host
    assert (served.workspace / "rel" / "r.sh").read_text() == "#!/bin/sh\necho ran\n"


def test_file_calls_raise_python_s_own_errors(served: Served, tmp_path: Path) -> None:
    """Read-only in the view (the system's directories) is PermissionError; a host path the
    test names there is removed again should a regression write it as the server's user."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("f")
    system = Path("/usr", f"settled-test-{os.getpid()}-{time.time_ns()}")

    async def drive() -> None:
        rt = served.client()
        with pytest.raises(FileNotFoundError, match="No such file"):
            await rt.read_file(ReadFileRequest(path="no/such/file"))
        with pytest.raises(PermissionError, match="Read-only file system"):
            await rt.write_file(WriteFileRequest(path=str(system), content="x"))
        (served.workspace / "plain").write_text("p")
        with pytest.raises(FileExistsError):  # as Path.mkdir(parents=True) of a file says
            await rt.write_file(WriteFileRequest(path="plain/x", content="x"))
        with pytest.raises(NotADirectoryError):  # a directory uploaded onto a file
            await rt.upload(UploadRequest(source_path=str(tmp_path / "d"), target_path="plain"))
        await rt.execute(Command(command="ln -s /nowhere/at/all gone", shell=True))
        with pytest.raises(FileNotFoundError):  # through a link that leads nowhere in the view
            await rt.write_file(WriteFileRequest(path="gone", content="x"))
        await rt.close()

    try:
        _drive(drive)
    finally:
        written = system.exists()
        system.unlink(missing_ok=True)
    assert not written


def test_a_retried_write_with_the_same_request_id_runs_once(served: Served) -> None:
    target = served.workspace / "once.txt"

    async def drive() -> list[tuple[int, Any]]:
        rt = served.client()
        body = WriteFileRequest(path=str(target), content="first").model_dump()
        answers = [await _post(served.url, "write_file", body, "write-1")]
        await rt.execute(Command(command=f"echo changed > {target}", shell=True))
        answers.append(await _post(served.url, "write_file", body, "write-1"))  # a retry
        read = ReadFileRequest(path=str(target)).model_dump()
        answers.append(await _post(served.url, "read_file", read, "read-1"))
        await rt.close()
        return answers

    first, retried, read = _drive(drive)
    assert first == retried == (200, {})
    assert read == (200, {"content": "changed\n"})  # the retry wrote nothing again
    with Runtime(str(served.home)) as runtime:
        [task] = runtime.store.list_tasks()
        keys = sorted(s.key for s in runtime.store.list_sessions(task.task))
    assert [k for k in keys if k.startswith("swerex:file-")] == [
        "swerex:file-read:1",
        "swerex:file-write:0",
    ]


def test_a_read_past_the_answer_s_cap_is_refused_not_cut(tmp_path: Path) -> None:
    server = _start(tmp_path, SETTLED_SWEREX_OUTPUT_CAP="4096")
    (server.workspace / "at-cap").write_bytes(b"a" * 4096)
    (server.workspace / "past-cap").write_bytes(b"b" * 4097)

    async def drive() -> str:
        rt = server.client()
        whole = (await rt.read_file(ReadFileRequest(path="at-cap"))).content
        with pytest.raises(SwerexException, match="larger than the answer's cap of 4096 bytes"):
            await rt.read_file(ReadFileRequest(path="past-cap"))
        await rt.close()
        return whole

    try:
        assert _drive(drive) == "a" * 4096
    finally:
        server.stop()


# -- the rest of the protocol ------------------------------------------------------------


def test_a_wrong_api_key_is_refused(served: Served) -> None:
    async def drive() -> None:
        assert not (await served.client("wrong").is_alive()).is_alive
        with pytest.raises(aiohttp.ClientResponseError):
            await served.client("wrong").create_session(CreateBashSessionRequest(session="z"))

    _drive(drive)


def test_a_zip_member_outside_the_target_is_refused(served: Served, tmp_path: Path) -> None:
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
            async with http.post(f"{served.url}/upload", data=form, headers=headers) as r:
                return r.status

    assert _drive(drive) == 511
    assert not (tmp_path / "escaped.txt").exists()


def test_cd_outside_the_workspace_persists(served: Served, tmp_path: Path) -> None:
    async def drive() -> None:
        rt = served.client()
        await rt.create_session(CreateBashSessionRequest(session="o"))
        await rt.run_in_session(BashAction(session="o", command=f"cd {tmp_path}"))
        obs = await rt.run_in_session(BashAction(session="o", command="pwd"))
        assert obs.output.strip() == str(tmp_path)
        await rt.close()

    _drive(drive)


def test_a_file_that_is_not_utf8_is_read_with_surrogateescape(served: Served) -> None:
    """The answer is ASCII JSON: a lone surrogate in it is `\\udcff`, not a failed answer."""
    data = served.workspace / "latin1.txt"
    data.write_bytes(b"caf\xe9 \xff\n")

    async def drive() -> str:
        rt = served.client()
        request = ReadFileRequest(path=str(data), encoding="utf-8", errors="surrogateescape")
        content = (await rt.read_file(request)).content
        await rt.close()
        return content

    assert _drive(drive).encode("utf-8", "surrogateescape") == b"caf\xe9 \xff\n"
