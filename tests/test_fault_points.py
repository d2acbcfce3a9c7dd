"""The fault points of recovery and the server, and an owner armed through the warm launcher.

Each test crashes a real process (a `settled recover` CLI, a `settled serve` process, an owner
forked by the zygote) with SIGKILL at one named point, then does what a real caller would do (a
retried recovery, the same request to a restarted server) and proves convergence: no relaunch,
no lost byte, proven death, the same close receipt.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import httpx
import pytest
from conftest import _skip_unavailable, kill_marked

from settled.errors import AdmissionFrozen, OwnerLaunchFailed
from settled.faults import ALL_POINTS, RECOVERY_POINTS, SERVER_POINTS
from settled.records import TaskRecord
from settled.runtime import Runtime

TOKEN = "fault-points-token-0123456789abcdef"
SLOW_OUTPUT = "i=0; while [ $i -lt 40 ]; do printf 'line%02d\\n' $i; i=$((i+1)); sleep 0.02; done"


def _wait_until(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _owner_dead(rt: Runtime, session: str) -> bool:
    facts = rt.owner_facts(rt.store.get_session(session))
    return facts is not None and not facts.alive


def _cli(home: str, *args: str, fault: str | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "SETTLED_HOME": home}
    if fault:
        env["SETTLED_FAULT"] = f"{fault}:crash"
    return subprocess.run(
        [sys.executable, "-m", "settled.cli", *args], env=env, capture_output=True, timeout=120
    )


def _log(rt: Runtime, session: str) -> bytes:
    path = Path(rt.stream_log(session, "stdout").path)
    return path.read_bytes() if path.exists() else b""


def _assert_output_intact(rt: Runtime, session: str) -> dict[str, Any]:
    record = rt.store.get_session(session)
    assert record.state == "settled" and record.receipt is not None, record.state
    assert record.receipt["death"]["proven"] is True
    stdout = record.receipt["output"]["stdout"]
    data = _log(rt, session)[: stdout["cursor"]]
    assert len(data) == stdout["cursor"] >= record.stdout_durable, "no durable byte lost"
    assert stdout["digest"] == "blake3:" + blake3.blake3(data).hexdigest()
    return record.receipt


def test_every_new_point_is_listed_once() -> None:
    assert len(set(ALL_POINTS)) == len(ALL_POINTS)
    assert set(RECOVERY_POINTS) | set(SERVER_POINTS) <= set(ALL_POINTS)


def test_an_owner_forked_by_the_warm_launcher_takes_its_callers_fault(
    tmp_path: Path, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zygote imported the fault points with its own environment; each owner it forks
    must crash where its caller armed it, and an unarmed caller's owner must not."""
    _skip_unavailable("cgroup2")
    with Runtime(str(tmp_path / "home"), launcher="warm") as rt:
        first = rt.exec(task.task, shell="true", key="warm-up")  # the zygote starts unarmed
        rt.wait(first.session, timeout=30)
        monkeypatch.setenv("SETTLED_FAULT", "owner.after_spawn:crash")
        try:
            session = rt.exec(task.task, shell="printf x; sleep 300", key="armed").session
        except OwnerLaunchFailed:
            session = rt.store.find_session(task.task, "armed").session  # type: ignore[union-attr]
        monkeypatch.delenv("SETTLED_FAULT")
        _wait_until(lambda: _owner_dead(rt, session))
        assert rt.store.get_session(session).receipt is None, "it crashed before any receipt"
        [recovered] = rt.recover(task.task)
        assert recovered["state"] == "settled", recovered
        later = rt.exec(task.task, shell="printf y", key="unarmed")
        assert rt.wait(later.session, timeout=30)["receipt"]["exit"]["code"] == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", RECOVERY_POINTS)
def test_a_crash_at_each_recovery_point_is_finished_by_a_retried_recovery(
    rt: Runtime, task: TaskRecord, point: str, marker: str
) -> None:
    _skip_unavailable("cgroup2")
    command = "echo x >> launches; printf out; sleep 300"
    admission = rt.exec(task.task, shell=command, key="k")
    owner = rt.store.get_session(admission.session).owner
    assert owner is not None
    os.kill(owner.pid, signal.SIGKILL)
    _wait_until(lambda: _owner_dead(rt, admission.session))
    crashed = _cli(rt.home, "recover", "--json", fault=point)
    assert crashed.returncode == -signal.SIGKILL, (crashed.stdout, crashed.stderr)
    assert f"crash at fault point {point}".encode() in crashed.stderr
    assert rt.store.get_session(admission.session).state == "unknown", "never settled by a crash"
    with pytest.raises(AdmissionFrozen):
        rt.exec(task.task, shell="echo never >> launches", key="other")
    assert rt.exec(task.task, shell=command, key="k").reused, "a retry never relaunches"
    [retried] = rt.recover(task.task)
    assert retried["state"] == "settled", retried
    receipt = _assert_output_intact(rt, admission.session)
    assert receipt["owner"]["lost_owner"]["pid"] == owner.pid, "no other owner ever claimed it"
    assert Path(task.workspace, "launches").read_text() == "x\n", "launched once"
    assert kill_marked(marker, b"sleep") == [], "recovery killed the command"
    assert rt.close_task(task.task, deadline=10).complete


# -- the server ---------------------------------------------------------------------------------


class _Server:
    """A `settled serve` process on a free port; `stop()` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, home: str, fault: str | None = None) -> None:
        env = {**os.environ, "SETTLED_HOME": home, "SETTLED_TOKEN": TOKEN}
        if fault:
            env["SETTLED_FAULT"] = f"{fault}:crash"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "settled.cli", "serve", "--port", "0"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert self.process.stderr is not None
        self.said = b""
        while b"listening on http://" not in self.said:
            line = self.process.stderr.readline()
            assert line, f"the server exited before listening: {self.said!r}"
            self.said += line
        url = self.said.split(b"listening on ")[1].split()[0].decode()
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
        )

    def crashed_at(self, point: str) -> bool:
        assert self.process.stderr is not None
        self.said += self.process.stderr.read()
        return self.process.wait(timeout=30) == -signal.SIGKILL and (
            f"crash at fault point {point}".encode() in self.said
        )

    def stop(self) -> None:
        self.http.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stderr is not None:
            self.process.stderr.close()


@pytest.fixture
def servers(rt: Runtime) -> Iterator[list[_Server]]:
    started: list[_Server] = []
    yield started
    for server in started:
        server.stop()


def _serve(rt: Runtime, servers: list[_Server], fault: str | None = None) -> _Server:
    servers.append(_Server(rt.home, fault))
    return servers[-1]


@pytest.mark.timeout(120)
def test_a_server_killed_after_an_admission_answers_the_retry_with_the_same_session(
    rt: Runtime, task: TaskRecord, servers: list[_Server]
) -> None:
    armed = _serve(rt, servers, "server.after_admission")
    body = {"key": "once", "shell": "echo x >> launches; printf out"}
    with pytest.raises(httpx.TransportError):
        armed.http.post(f"/v1/tasks/{task.task}/sessions", json=body)
    assert armed.crashed_at("server.after_admission")
    restarted = _serve(rt, servers)
    retried = restarted.http.post(f"/v1/tasks/{task.task}/sessions", json=body)
    assert retried.status_code == 200 and retried.json()["reused"] is True, retried.text
    session = retried.json()["session"]
    assert [s.session for s in rt.store.list_sessions(task.task)] == [session]
    rt.wait(session, timeout=30)
    _assert_output_intact(rt, session)
    assert Path(task.workspace, "launches").read_text() == "x\n", "launched once"


@pytest.mark.timeout(120)
def test_a_server_killed_mid_stream_resumes_on_restart_with_every_byte_once(
    rt: Runtime, task: TaskRecord, servers: list[_Server]
) -> None:
    session = rt.exec(task.task, shell=SLOW_OUTPUT, key="slow").session
    armed = _serve(rt, servers, "server.mid_stream")
    received = b""
    params = {"stream": "stdout", "from": "0", "follow": "1"}
    url = f"/v1/sessions/{session}/output"
    with pytest.raises(httpx.TransportError), armed.http.stream("GET", url, params=params) as reply:
        for data in reply.iter_raw():
            received += data  # the bytes before the drop count: the retry starts after them
    assert armed.crashed_at("server.mid_stream")
    restarted = _serve(rt, servers)
    params["from"] = str(len(received))
    rest = restarted.http.get(f"/v1/sessions/{session}/output", params=params)
    assert rest.status_code == 200, rest.text
    receipt = _assert_output_intact(rt, session)
    assert received + rest.content == _log(rt, session)[: receipt["output"]["stdout"]["cursor"]]
    assert received + rest.content == b"".join(b"line%02d\n" % i for i in range(40))


@pytest.mark.timeout(120)
def test_a_server_killed_before_the_close_response_answers_the_retry_with_the_same_receipt(
    rt: Runtime, task: TaskRecord, servers: list[_Server]
) -> None:
    rt.wait(rt.exec(task.task, shell="echo x >> launches", key="w").session, timeout=30)
    armed = _serve(rt, servers, "server.before_close_response")
    with pytest.raises(httpx.TransportError):
        armed.http.post(f"/v1/tasks/{task.task}/close", json={"deadline": 10})
    assert armed.crashed_at("server.before_close_response")
    restarted = _serve(rt, servers)
    retried = restarted.http.post(f"/v1/tasks/{task.task}/close", json={"deadline": 10})
    assert retried.status_code == 200, retried.text
    receipt = retried.json()
    assert receipt["outcome"]["complete"] is True
    assert rt.close_task(task.task).receipt == receipt, "every retried close: the same receipt"
    again = _cli(rt.home, "close", task.task, "--json")
    assert json.loads(again.stdout) == receipt
    assert Path(task.workspace, "launches").read_text() == "x\n"
