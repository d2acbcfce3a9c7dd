"""Sandbox providers over real kernel namespaces: a command sandbox made by `unshare` (its own
PID, mount and network namespaces, its init's pid the sandbox id), entered with `nsenter`,
destroyed by killing that init. Sessions run inside it, `task destroy` is the provider's
evidence, and a provider that fails, lies or hangs is no evidence at all. The default `local`
provider is what every other test file runs on."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import _settle_everything, _skip_unavailable, kill_marked
from test_grammar import run_cli

from settled.boundary.sandbox import open_sandbox
from settled.errors import BadInput, BoundaryUnavailable, SandboxFailed, StaleWrite, TaskFrozen
from settled.records import TaskRecord
from settled.runtime import Runtime
from settled.store.sqlite import SCHEMA_VERSION, SQLiteStore

NSENTER, UNSHARE = shutil.which("nsenter"), shutil.which("unshare")
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root"),
    pytest.mark.skipif(not (NSENTER and UNSHARE), reason="needs nsenter and unshare"),
]

# The provider's commands, as an operator would write them: one small program, four verbs.
HELPER = r'''
import json, os, signal, subprocess, sys, time

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

def ours(pid):
    """The init we made: `sleep infinity` in a PID namespace other than ours (pid reuse)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        return cmd == b"sleep\0infinity\0" and (
            os.readlink(f"/proc/{pid}/ns/pid") != os.readlink("/proc/self/ns/pid"))
    except OSError:
        return False

verb = sys.argv[1]
if verb == "create":
    if os.environ.get("SANDBOX_CREATE_FAILS"):
        print("no capacity left", file=sys.stderr)
        sys.exit(5)
    child = subprocess.Popen(
        ["unshare", "--pid", "--mount", "--net", "--fork", "--kill-child", "--mount-proc",
         "sleep", "infinity"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child.pid}/task/{child.pid}/children") as f:
                kids = f.read().split()
        except OSError:
            kids = []
        if kids and ours(int(kids[0])):  # exec'd, so its /proc is mounted
            print(json.dumps({"sandbox": kids[0], "unshare": child.pid, "task": sys.argv[2]}))
            sys.exit(0)
        time.sleep(0.01)
    child.kill()
    sys.exit("the namespace init did not start")
pid = int(sys.argv[2])
if verb == "destroy":
    if ours(pid):
        os.kill(pid, signal.SIGKILL)
    while alive(pid):  # blocks until it is gone: the configured timeout bounds it
        time.sleep(0.01)
    print(json.dumps({"destroyed": True, "pid": pid}))
elif verb == "inspect":
    print(json.dumps({"exists": alive(pid)}))
elif verb == "destroy-fails":
    print("the sandbox service is down", file=sys.stderr)
    sys.exit(3)
elif verb == "destroy-lies":
    print(json.dumps({"destroyed": False}))
elif verb == "destroy-hangs":
    print("waiting for the sandbox service", file=sys.stderr, flush=True)
    time.sleep(600)
'''


def _config(tmp_path: Path, destroy: str = "destroy", **extra: Any) -> str:
    helper = tmp_path / "sandbox_helper.py"
    helper.write_text(HELPER)
    run = [sys.executable, "-I", str(helper)]
    config = {
        "create": [*run, "create", "{task}"],
        "enter": [str(NSENTER), "-t", "{sandbox}", "-p", "-m", "-n", "--"],
        "destroy": [*run, destroy, "{sandbox}"],
        "inspect": [*run, "inspect", "{sandbox}"],
        "timeout_s": 30,
        **extra,
    }
    path = tmp_path / f"sandbox-{destroy}.json"
    path.write_text(json.dumps(config))
    return str(path)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _end_sandboxes(home: str) -> None:
    """Kill every sandbox init the home recorded and wait until each is gone."""
    with sqlite3.connect(os.path.join(home, "settled.db")) as db:
        rows = db.execute("SELECT sandbox FROM tasks WHERE sandbox IS NOT NULL").fetchall()
    for (text,) in rows:
        facts = json.loads(text)
        if facts.get("provider") != "command":
            continue
        pid = int(facts["sandbox"])
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while not _gone(pid):
            assert time.monotonic() < deadline, f"sandbox init {pid} did not end"
            time.sleep(0.01)


@pytest.fixture
def sandboxed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Runtime]:
    """A Runtime whose tasks each get a namespace sandbox; every sandbox ends with the test."""
    _skip_unavailable("cgroup2")
    monkeypatch.setenv("SETTLED_SANDBOX", "command:" + _config(tmp_path))
    home = os.path.join(str(tmp_path), "home")
    runtime = Runtime(home)
    try:
        yield runtime
    finally:
        try:
            _settle_everything(runtime)
        finally:
            runtime.close()
            _end_sandboxes(home)


def _task(rt: Runtime, tmp_path: Path, name: str = "workspace") -> TaskRecord:
    workspace = tmp_path / name
    workspace.mkdir()
    return rt.new_task(str(workspace))


def _wait_until(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _running(rt: Runtime, session: str) -> None:
    _wait_until(lambda: rt.store.get_session(session).command_pid is not None)


def _kill_owner(rt: Runtime, session: str) -> None:
    record = rt.store.get_session(session)
    assert record.owner is not None
    os.kill(record.owner.pid, signal.SIGKILL)

    def dead() -> bool:
        facts = rt.owner_facts(rt.store.get_session(session))
        return facts is not None and not facts.alive

    _wait_until(dead)


def _init_of(task: TaskRecord) -> int:
    assert task.sandbox is not None
    return int(task.sandbox["sandbox"])


def test_a_session_runs_inside_the_sandbox(sandboxed: Runtime, tmp_path: Path) -> None:
    task = _task(sandboxed, tmp_path)
    assert task.sandbox is not None and task.sandbox["provider"] == "command"
    assert sandboxed.task_record(task.task).sandbox == task.sandbox  # recorded, not recomputed
    init = _init_of(task)
    probe = "readlink /proc/self/ns/pid /proc/self/ns/net; cat /proc/self/net/dev; pwd; echo $$"
    admission = sandboxed.exec(task.task, shell=probe, key="probe")
    view = sandboxed.wait(admission.session, timeout=30)
    receipt = view["receipt"]
    assert receipt["exit"]["code"] == 0, receipt["exit"]
    lines = sandboxed.read(admission.session, "stdout").decode().splitlines()
    assert lines[0] == os.readlink(f"/proc/{init}/ns/pid") != os.readlink("/proc/self/ns/pid")
    assert lines[1] == os.readlink(f"/proc/{init}/ns/net") != os.readlink("/proc/self/ns/net")
    interfaces = [line.split(":")[0].strip() for line in lines[2:] if ":" in line]
    assert interfaces == ["lo"], lines
    assert lines[-2] == task.workspace  # entered in its cwd inside the sandbox
    assert int(lines[-1]) > 1  # a pid of the sandbox's namespace, where init is 1
    assert receipt["command_digest"] == admission.digest  # the command's own, not the enter's
    assert receipt["isolation"]["sandbox"]["sandbox"] == str(init)
    assert "sandbox's" in receipt["isolation"]["missing"]["all"]
    assert receipt["isolation"]["network"]["namespace"] == "the sandbox's"
    assert receipt["death"]["proven"] is True


def test_task_destroy_kills_a_sleep_inside_and_the_receipt_names_the_provider(
    sandboxed: Runtime, tmp_path: Path, marker: str
) -> None:
    task = _task(sandboxed, tmp_path)
    admission = sandboxed.exec(task.task, shell="sleep 300", key="sleep")
    _running(sandboxed, admission.session)
    code, out, err = run_cli(["task", "destroy", "--home", sandboxed.home, task.task])
    assert code == 0, (out, err)
    assert out.startswith(f"sandbox of {task.task} destroyed by provider command: ")
    assert '"destroyed": true' in out.splitlines()[0]
    assert _gone(_init_of(task))
    view = sandboxed.wait(admission.session, timeout=30)
    death = view["receipt"]["death"]
    # Recovery took the session with the provider's word, or its owner saw the command die
    # first; either way nothing of it runs.
    assert death["proven"] is True
    if death["source"] != "owner":
        assert (death["boundary"], death["source"]) == ("sandbox", "provider"), death
    assert kill_marked(marker, b"sleep 300") == []


def test_a_lost_owner_stays_unknown_until_the_provider_destroys_its_sandbox(
    sandboxed: Runtime, tmp_path: Path, marker: str
) -> None:
    task = _task(sandboxed, tmp_path)
    admission = sandboxed.exec(task.task, shell="echo started; sleep 300", key="lost")
    _running(sandboxed, admission.session)
    _wait_until(lambda: sandboxed.store.get_session(admission.session).stdout_durable > 0)
    _kill_owner(sandboxed, admission.session)
    [still] = sandboxed.recover(task.task)
    assert still["state"] == "unknown" and "still exists" in still["why"], still
    result = sandboxed.destroy_task(task.task)
    assert result["provider"] == "command"
    assert result["sandbox"]["confirmation"]["destroyed"] is True
    [settled] = result["sessions"]
    assert settled["state"] == "settled" and "provider destroyed" in settled["evidence"]
    record = sandboxed.store.get_session(admission.session)
    assert record.receipt is not None
    death = record.receipt["death"]
    assert (death["boundary"], death["source"], death["proven"]) == ("sandbox", "provider", True)
    assert record.receipt["exit"]["reason"] == "owner_lost"
    assert record.receipt["output"]["drain"] == "incomplete"
    assert record.receipt["output"]["stdout"]["cursor"] == len(b"started\n")
    assert kill_marked(marker, b"sleep 300") == [], "nothing of it runs, nothing relaunched"
    assert [s.session for s in sandboxed.store.list_sessions(task.task)] == [admission.session]


@pytest.mark.parametrize(
    ("destroy", "timeout_s", "why"),
    [
        ("destroy-fails", 30, "exited 3; stderr: the sandbox service is down"),
        ("destroy-lies", 30, 'did not confirm: it printed {"destroyed": false}'),
        ("destroy-hangs", 1, "timed out after 1 s and was killed; stderr: waiting for"),
    ],
)
def test_a_destroy_that_fails_lies_or_hangs_is_no_evidence(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    marker: str,
    destroy: str,
    timeout_s: int,
    why: str,
) -> None:
    _skip_unavailable("cgroup2")
    home = os.path.join(str(tmp_path), "home")
    monkeypatch.setenv("SETTLED_SANDBOX", "command:" + _config(tmp_path))
    with Runtime(home) as rt:
        task = _task(rt, tmp_path)
        admission = rt.exec(task.task, shell="sleep 300", key="s")
        _running(rt, admission.session)
        _kill_owner(rt, admission.session)
    bad = _config(tmp_path, destroy, timeout_s=timeout_s)
    monkeypatch.setenv("SETTLED_SANDBOX", "command:" + bad)
    try:
        with Runtime(home) as rt:
            with pytest.raises(SandboxFailed) as raised:
                rt.destroy_task(task.task)
            assert why in str(raised.value) and "\n" not in str(raised.value)
            assert rt.store.get_session(admission.session).state == "unknown"
            assert rt.session_status(admission.session)["state"] == "unknown"
            code, _out, err = run_cli(["task", "destroy", "--home", home, task.task])
            assert code == 1 and err.startswith("settled: SandboxFailed: ") and err.count("\n") == 1
        assert not _gone(_init_of(task)), "the sandbox still runs: nothing claimed otherwise"
        assert kill_marked(marker, destroy.encode()) == [], "a timed-out command is killed"
    finally:
        _end_sandboxes(home)
        kill_marked(marker, b"sleep 300")
    monkeypatch.setenv("SETTLED_SANDBOX", "command:" + _config(tmp_path))
    with Runtime(home) as rt:  # the init is gone now: the provider's inspection is evidence
        [result] = rt.recover(task.task)
        assert result["state"] == "settled", result
        death = rt.store.get_session(admission.session).receipt["death"]  # type: ignore[index]
        assert (death["boundary"], death["source"]) == ("sandbox", "provider")


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (None, "cannot be read"),
        ("{not json", "not JSON"),
        ('["create"]', "must be a JSON object"),
        ('{"enter": ["x"], "destroy": ["x"], "inspect": ["x"]}', "missing field 'create'"),
        ('{"create": [], "enter": ["x"], "destroy": ["x"], "inspect": ["x"]}', "'create'"),
        ('{"create": ["x"], "enter": ["x"], "destroy": ["x"], "inspect": [1]}', "'inspect'"),
        (
            '{"create": ["x", "{sandbox}"], "enter": ["x"], "destroy": ["x"], "inspect": ["x"]}',
            "field 'create' names unknown placeholder {sandbox}",
        ),
        (
            '{"create": ["x"], "enter": ["nsenter", "-t", "{pid}"], "destroy": ["x"], '
            '"inspect": ["x"]}',
            "field 'enter' names unknown placeholder {pid}",
        ),
        (
            '{"create": ["x"], "enter": ["x"], "destroy": ["x"], "inspect": ["x"], "timeout_s": 0}',
            "timeout_s",
        ),
        (
            '{"create": ["x"], "enter": ["x"], "destroy": ["x"], "inspect": ["x"], "kind": 1}',
            "unknown field 'kind'",
        ),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str | None, field: str
) -> None:
    path = tmp_path / "sandbox.json"
    if config is not None:
        path.write_text(config)
    with pytest.raises(BadInput, match=field.replace("{", r"\{").replace("}", r"\}")):
        open_sandbox(f"command:{path}")
    monkeypatch.setenv("SETTLED_SANDBOX", f"command:{path}")
    with pytest.raises(BadInput, match="sandbox config"):
        Runtime(os.path.join(str(tmp_path), "home"))


@pytest.mark.parametrize("spec", ["docker", "command:", "", "Local"])
def test_an_unknown_provider_is_refused(spec: str) -> None:
    with pytest.raises(BadInput, match="is not one of local, command:"):
        open_sandbox(spec)


def test_local_stays_the_default_and_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SETTLED_SANDBOX", raising=False)
    with Runtime(os.path.join(str(tmp_path), "home")) as rt:
        assert rt.sandbox.name == "local"
        task = _task(rt, tmp_path)
        assert task.sandbox is not None and task.sandbox["provider"] == "local"
        assert "enter" not in task.sandbox
        view = rt.wait(rt.exec(task.task, shell="echo local", key="k").session, 30)
        assert view["receipt"]["exit"]["code"] == 0
        assert "sandbox" not in view["receipt"]["isolation"]


def test_a_failed_create_leaves_no_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SETTLED_SANDBOX", "command:" + _config(tmp_path))
    monkeypatch.setenv("SANDBOX_CREATE_FAILS", "1")
    with Runtime(os.path.join(str(tmp_path), "home")) as rt:
        with pytest.raises(SandboxFailed, match="exited 5; stderr: no capacity left"):
            rt.new_task(key="k")
        assert rt.store.find_task("k") is None
        assert os.listdir(os.path.join(rt.home, "workspaces")) == []  # the one it made, gone
        workspace = tmp_path / "mine"
        workspace.mkdir()
        with pytest.raises(SandboxFailed):
            rt.new_task(str(workspace), key="k2")
        assert rt.store.find_task("k2") is None and workspace.is_dir()


def test_what_settled_cannot_honour_inside_a_sandbox_is_refused(
    sandboxed: Runtime, tmp_path: Path
) -> None:
    task = _task(sandboxed, tmp_path)
    for kwargs, words in [
        ({"isolation": "strict"}, "--isolation strict"),
        ({"user": "1000:1000"}, "--user"),
        ({"writable": [str(tmp_path)]}, "--writable"),
        ({"network": "none"}, "--network none"),
    ]:
        with pytest.raises(BadInput, match=words):
            sandboxed.exec(task.task, shell="true", **kwargs)  # type: ignore[arg-type]
    for kind in ("pidns", "cgroup2+pidns"):
        with pytest.raises(BoundaryUnavailable, match="sandbox's own"):
            sandboxed.exec(task.task, shell="true", boundary=kind)
    assert sandboxed.store.list_sessions(task.task) == []


def test_a_task_of_another_provider_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = os.path.join(str(tmp_path), "home")
    monkeypatch.delenv("SETTLED_SANDBOX", raising=False)
    with Runtime(home) as rt:
        task = _task(rt, tmp_path)
    monkeypatch.setenv("SETTLED_SANDBOX", "command:" + _config(tmp_path))
    with Runtime(home) as rt:
        with pytest.raises(BadInput, match="has a local sandbox"):
            rt.exec(task.task, shell="true")
        with pytest.raises(SandboxFailed, match="no sandbox of provider 'command'"):
            rt.destroy_task(task.task)


def test_the_store_records_a_sandbox_once_and_migrates_a_v6_home(tmp_path: Path) -> None:
    path = os.path.join(str(tmp_path), "settled.db")
    store = SQLiteStore(path)
    made, _ = store.create_task("k", "/w")
    assert made.sandbox is None
    facts = {"provider": "command", "sandbox": "42", "enter": ["x", "42"]}
    assert store.record_sandbox(made.task, facts).sandbox == facts
    with pytest.raises(StaleWrite, match="recorded already"):
        store.record_sandbox(made.task, {"provider": "other"})
    assert store.get_task(made.task).sandbox == facts
    store.close()
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE tasks DROP COLUMN sandbox")
        db.execute("ALTER TABLE tasks DROP COLUMN ignore_rules")  # v8's, after v6
        db.execute("DROP TABLE hidden_sets")  # v9's
        db.execute("ALTER TABLE tasks DROP COLUMN defaults")  # v10's
        db.execute("ALTER TABLE tasks DROP COLUMN workspace_identity")  # v11's
        db.execute("DROP TABLE log_seals")  # v12's
        db.execute("UPDATE meta SET value='6' WHERE key='schema_version'")
    store = SQLiteStore(path)
    assert store.get_task(made.task).sandbox is None and SCHEMA_VERSION == 12
    store.close()


def test_a_vanished_hosts_session_settles_only_once_the_provider_destroys_its_sandbox(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host A runs a sleep in a namespace sandbox and vanishes (its owner is killed, its home
    deleted). Host B, sharing the store and the provider: `recover --host A` freezes the task
    and leaves the session unknown while the provider says the sandbox exists; `task destroy`
    from B, confirmed by the provider, settles it with the provider's evidence."""
    _skip_unavailable("cgroup2")
    monkeypatch.setenv("SETTLED_SANDBOX", "command:" + _config(tmp_path))
    monkeypatch.setenv("SETTLED_STORE", f"sqlite://{tmp_path}/shared/store.db")
    monkeypatch.setenv("SETTLED_OBJECTS", f"file://{tmp_path}/shared/objects")
    a = Runtime(str(tmp_path / "A"))
    b = Runtime(str(tmp_path / "B"))
    init = None
    try:
        task = _task(a, tmp_path)
        init = _init_of(task)
        admission = a.exec(task.task, shell="sleep 300", key="sleep")
        _running(a, admission.session)
        _kill_owner(a, admission.session)
        a.close()
        shutil.rmtree(tmp_path / "A")

        vanished = b.recover_host(task.host or "")
        (unknown,) = vanished["sessions"]
        assert unknown["state"] == "unknown" and "still exists" in unknown["why"]
        assert not _gone(init)  # nothing was taken for evidence: the sleep still runs
        with pytest.raises(TaskFrozen):
            b.store.admit(task.task, "again", "sha256:" + "0" * 64, {})

        destroyed = b.destroy_task(task.task)
        assert destroyed["sandbox"]["confirmation"]["destroyed"] is True
        assert [s["state"] for s in destroyed["sessions"]] == ["settled"]
        receipt = b.store.get_session(admission.session).receipt
        assert receipt is not None
        assert receipt["death"]["boundary"] == "sandbox"
        assert receipt["death"]["source"] == "provider" and receipt["death"]["proven"]
        assert receipt["output"]["drain"] == "incomplete"
        assert receipt["output"]["stdout"]["complete"] is False
        assert _gone(init)
        assert len(b.store.list_sessions(task.task)) == 1  # never relaunched
    finally:
        b.close()
        if init is not None and not _gone(init):
            os.kill(init, signal.SIGKILL)
