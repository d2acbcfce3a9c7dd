"""Many hosts on one store: two homes stand for two hosts sharing one store and one object store.

Each home is a host: a task is bound to the host that created it, its execs and close run only
there (WrongHost elsewhere), and its receipts, sealed logs and checkpoints are read from any host,
even after the home that ran it is deleted. The backends come from `shared_backends`
(tests/hosts.py): an SQLite store and an object directory outside both homes always, PostgreSQL +
S3 where those servers run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import COMMAND_PYTHON, MARKER_ENV, tamper_object

from settled import netpolicy
from settled.backends import BackendMismatch, bind, credential_names, read_binding
from settled.errors import LogElsewhere, TaskFrozen, UnknownHost, WrongHost
from settled.identity import CommandSpec
from settled.runtime import Runtime
from settled.states import SETTLED, UNKNOWN
from settled.storepass import password_of

pytestmark = pytest.mark.timeout(120)


SHARED = ("sqlite+dir", "sqlite+s3", "postgresql+s3")


@pytest.fixture(params=SHARED)
def backends(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, str]:
    """The store and objects both hosts share, set in the environment as a user would (with
    the S3 endpoint and credentials where the objects are in a bucket)."""
    store, objects = str(request.param).split("+")
    urls = {"SETTLED_STORE": f"sqlite://{tmp_path}/shared/store.db"}
    if store == "postgresql":
        import pg

        request.getfixturevalue("pg_cluster")
        urls["SETTLED_STORE"] = pg.url_for_directory(str(tmp_path))
    if objects == "s3":
        urls["SETTLED_OBJECTS"] = request.getfixturevalue("s3_url")
        urls.update(request.getfixturevalue("s3_env"))
    else:
        urls["SETTLED_OBJECTS"] = f"file://{tmp_path}/shared/objects"
    for name, value in urls.items():
        monkeypatch.setenv(name, value)
    return urls


@pytest.fixture
def hosts(tmp_path: Path, backends: dict[str, str]) -> Iterator[tuple[Runtime, Runtime]]:
    a = Runtime(str(tmp_path / "A"))
    b = Runtime(str(tmp_path / "B"))
    try:
        yield a, b
    finally:
        for runtime in (a, b):
            for record in runtime.store.live_sessions():
                if runtime.store.get_task(record.task).host == runtime.host:
                    runtime.destroy_task(record.task)
            runtime.close()


def sealed_facts(runtime: Runtime, task: str, session: str, within: float = 60.0) -> dict[str, Any]:
    """The session's recorded seals once both streams have one: its owner seals them right
    after its receipt, so a waiter that woke at the receipt may look a moment early."""
    give_up = time.monotonic() + within
    while True:
        seals = runtime.store.log_seals(task, session).get(session, {})
        if set(seals) == {"stdout", "stderr"} or time.monotonic() > give_up:
            return seals
        time.sleep(0.05)


def _workspace(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    path.mkdir()
    return str(path)


def test_each_home_is_a_host_and_a_task_is_bound_to_the_one_that_made_it(
    hosts: tuple[Runtime, Runtime], tmp_path: Path
) -> None:
    a, b = hosts
    assert a.host != b.host
    task = a.new_task(_workspace(tmp_path, "w"))
    assert task.host == a.host
    listed = {h["host"]: h for h in b.hosts()}
    assert set(listed) == {a.host, b.host}
    assert listed[b.host]["this"] and not listed[a.host]["this"]
    assert listed[a.host]["home"] == str(tmp_path / "A")


def test_a_task_closed_on_a_is_read_explained_and_restored_on_b_after_a_is_deleted(
    hosts: tuple[Runtime, Runtime], tmp_path: Path, backends: dict[str, str]
) -> None:
    a, b = hosts
    workspace = _workspace(tmp_path, "w")
    Path(workspace, "kept.txt").write_text("before\n")
    task = a.new_task(workspace)
    script = (
        "import os, sys; sys.stdout.buffer.write(bytes(range(256)) * 40000 + b'tail-no-newline');"
        "sys.stderr.buffer.write(os.urandom(65536)); open('made.bin', 'wb').write(b'm' * 9000)"
    )
    admitted = a.exec(task.task, [COMMAND_PYTHON, "-c", script])
    a.wait(admitted.session, timeout=60)
    stdout = b"".join(a.follow(admitted.session, "stdout", 0, timeout=30))
    stderr = b"".join(a.follow(admitted.session, "stderr", 0, timeout=30))
    closed = a.close_task(task.task)
    assert closed.complete and closed.receipt is not None
    a.release_pods()  # host A is gone, with its mounts,
    shutil.rmtree(a.home)  # its logs, journal and objects

    assert b"".join(b.follow(admitted.session, "stdout", 0, timeout=30)) == stdout
    assert b.read(admitted.session, "stderr", 0, 1 << 20) == stderr
    assert b.read(admitted.session, "stdout", 10_000_000, 100) == stdout[10_000_000:10_000_100]
    receipt = b.session_status(admitted.session)["receipt"]
    assert "sealed" not in receipt["output"]["stdout"]  # a fact of its own, after the receipt
    seals = b.store.log_seals(task.task, admitted.session)[admitted.session]
    assert seals["stdout"]["chunks"] == 3  # 10.24 MB in 4 MiB chunks
    assert seals["stdout"]["digest"] == receipt["output"]["stdout"]["digest"]
    assert b.explain(task.task)["complete"]
    restored = b.restore(task.task, str(tmp_path / "restored"))
    assert b.close_task(task.task).receipt == closed.receipt  # a repeated close, from anywhere
    checkpoint = closed.receipt["checkpoint"]
    assert restored.manifest_id == checkpoint["manifest"]
    version = checkpoint["manifest_version"]  # the upload the read-back re-hashed
    assert (
        version.startswith("v:")
        if "s3" in backends["SETTLED_OBJECTS"]
        else version == checkpoint["manifest"]
    )
    assert Path(tmp_path, "restored", "made.bin").read_bytes() == b"m" * 9000
    assert Path(tmp_path, "restored", "kept.txt").read_text() == "before\n"
    assert b.verify(task.task, read_data=True)["verified"]


def test_exec_cancel_and_close_from_another_host_are_wrong_host_and_reads_are_not(
    hosts: tuple[Runtime, Runtime], tmp_path: Path
) -> None:
    a, b = hosts
    task = a.new_task(_workspace(tmp_path, "w"))
    running = a.exec(task.task, ["sleep", "60"])
    for attempt in (
        lambda: b.exec(task.task, ["true"]),
        lambda: b.exec(task.task, ["sleep", "60"], key=running.key),  # a retry, too
        lambda: b.cancel(running.session),
        lambda: b.close_task(task.task),
        lambda: b.destroy_task(task.task),
        lambda: b.recover(task.task),
    ):
        with pytest.raises(WrongHost) as refused:
            attempt()
        assert refused.value.host == a.host and refused.value.host_name
        assert f"recover --host {a.host}" in str(refused.value)
    assert b.session_status(running.session)["state"] == "running"  # by its lease, from B
    assert b.task_status(task.task)["host"] == a.host
    with pytest.raises(LogElsewhere, match=a.host):
        b.read(running.session, "stdout")
    a.cancel(running.session, "done")
    assert b.wait(running.session, timeout=30)["state"] == SETTLED  # woken without a pidfd


def test_the_cli_binds_a_home_with_store_and_objects_flags_and_exits_4_naming_the_owner(
    hosts: tuple[Runtime, Runtime], tmp_path: Path, backends: dict[str, str]
) -> None:
    a, _b = hosts
    task = a.new_task(_workspace(tmp_path, "w"))
    env = {k: v for k, v in os.environ.items() if k not in ("SETTLED_STORE", "SETTLED_OBJECTS")}
    password = password_of(backends["SETTLED_STORE"])
    if password is not None:  # the binding never records it (issue 39): libpq's variable
        env["PGPASSWORD"] = password
    flags = ["--store", backends["SETTLED_STORE"], "--objects", backends["SETTLED_OBJECTS"]]
    home_c = str(tmp_path / "C")

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "settled", *argv], capture_output=True, text=True,
            timeout=60, env=env,
        )  # fmt: skip

    listed = cli("--home", home_c, *flags, "hosts", "--json")
    assert listed.returncode == 0, listed.stderr
    assert {h["home"] for h in json.loads(listed.stdout)["hosts"]} >= {a.home, home_c}
    run = cli("--home", home_c, "exec", "--task", task.task, "--json", "--", "true")  # bound now
    assert run.returncode == 4, run.stderr
    assert json.loads(run.stdout)["error"] == "WrongHost"
    assert a.host in run.stderr and "\n" not in run.stderr.strip()


def test_recover_host_freezes_its_tasks_and_never_relaunches_an_unknown_session(
    hosts: tuple[Runtime, Runtime], tmp_path: Path
) -> None:
    a, b = hosts
    task = a.new_task(_workspace(tmp_path, "w"))
    running = a.exec(task.task, ["sleep", "60"])
    with pytest.raises(UnknownHost):
        b.recover_host("h_nosuchhost")
    result = b.recover_host(a.host)
    assert result["frozen_tasks"] == [task.task]
    (session,) = result["sessions"]
    assert session["state"] == UNKNOWN and "cannot be inspected from here" in session["why"]
    assert b.task_status(task.task)["frozen"].startswith(f"host {a.host} was declared vanished")
    with pytest.raises(TaskFrozen):
        a.exec(task.task, ["true"])
    # A was not gone after all: its owner is fenced, its receipt refused; on A, its own
    # boundary still proves the sleep dead (the task is A's), and nothing ran twice.
    deadline = time.monotonic() + 30
    while a.store.get_session(running.session).state != UNKNOWN and time.monotonic() < deadline:
        time.sleep(0.05)
    destroyed = a.destroy_task(task.task)
    assert [s["state"] for s in destroyed["sessions"]] == [SETTLED]
    assert len(a.store.list_sessions(task.task)) == 1


def test_two_hosts_may_use_the_same_workspace_path_one_host_may_not(
    hosts: tuple[Runtime, Runtime], tmp_path: Path
) -> None:
    a, b = hosts
    path = _workspace(tmp_path, "w")
    a.new_task(path)
    assert b.new_task(path).host == b.host  # another host's path is another directory
    with pytest.raises(Exception, match="overlaps"):
        a.new_task(path)


def test_a_home_is_bound_once_and_another_store_is_refused_by_name(tmp_path: Path) -> None:
    home = str(tmp_path / "home")
    os.makedirs(home)
    bound = bind(home, store=f"sqlite://{tmp_path}/elsewhere.db")
    assert read_binding(home) == bound
    assert bind(home) == bound  # later opens read it, whatever the environment says
    with pytest.raises(BackendMismatch, match=r"elsewhere\.db"):
        bind(home, store=f"sqlite://{tmp_path}/other.db")
    with pytest.raises(BackendMismatch):
        bind(home, objects="s3://bucket/prefix")


def test_the_remote_backends_credentials_are_never_inherited_by_a_command() -> None:
    from settled.backends import Backends

    remote = Backends("postgresql://u:secret@db:5432/settled", "s3://bucket/p")
    environ = {
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_ACCESS_KEY_ID": "k",
        "PGPASSWORD": "p",
        "APP_DB": "postgresql://u:secret@db:5432/settled",
        "PATH": "/bin",
    }
    assert credential_names(remote, environ) == [
        "APP_DB",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "PGPASSWORD",
    ]
    local = Backends("sqlite:///h/settled.db", "file:///h/objects")
    assert credential_names(local, environ) == []


def test_a_sealed_log_whose_chunk_was_changed_is_refused_never_served(
    hosts: tuple[Runtime, Runtime], tmp_path: Path, backends: dict[str, str]
) -> None:
    from settled.log.seal import SealBroken

    a, b = hosts
    task = a.new_task(_workspace(tmp_path, "w"))
    admitted = a.exec(task.task, ["sh", "-c", "seq 1 200000"])
    a.wait(admitted.session, timeout=60)
    seals = sealed_facts(a, task.task, admitted.session)
    assert {k: seals["stderr"][k] for k in ("manifest", "chunks")} == {
        "manifest": None,
        "chunks": 0,
    }
    manifest = json.loads(b.workspace.objects.read(seals["stdout"]["manifest"]))
    tamper_object(
        b.workspace.objects, manifest["chunks"][0][2], lambda b: b.replace(b"1000\n", b"1001\n")
    )
    a.release_pods()
    shutil.rmtree(a.home)
    assert b.read(admitted.session, "stderr") == b""  # an empty stream is sealed as empty
    with pytest.raises(SealBroken, match="damaged"):
        b.read(admitted.session, "stdout")
    assert not Path(b.home, "sealed", admitted.session, "stdout.log").exists()  # none half-built


@pytest.mark.parametrize("inherit_env", [False, True], ids=["explicit", "inherit-env"])
def test_a_command_never_sees_the_object_stores_credentials(
    hosts: tuple[Runtime, Runtime], tmp_path: Path, backends: dict[str, str], inherit_env: bool
) -> None:
    """Neither by default (nothing is inherited) nor with --inherit-env (the home's
    credentials and settled's own variables are withheld and named in the receipt)."""
    a, _b = hosts
    task = a.new_task(_workspace(tmp_path, "w"))
    admitted = a.exec(task.task, ["env"], env={"MINE": "passed"}, inherit_env=inherit_env)
    receipt = a.wait(admitted.session, timeout=60)["receipt"]
    seen = a.read(admitted.session, "stdout").decode()
    assert "MINE=passed" in seen
    for name, value in backends.items():
        if name != "AWS_REGION":  # where the bucket is, not a credential
            assert value not in seen, name
    removed = set(receipt["isolation"]["env_removed"])
    spec = CommandSpec.from_json(a.store.get_session(admitted.session).spec)
    if inherit_env:
        assert {n for n in backends if n.startswith("AWS_") and n != "AWS_REGION"} <= removed
        assert {n for n in backends if n.startswith("SETTLED_")} <= removed
        assert set(spec.env_removed) == removed and "MINE" not in spec.inherited
    else:
        assert removed == set() and spec.inherited == (MARKER_ENV,)  # SETTLED_INHERIT's
        proxy = {name for name, _ in netpolicy.proxy_env()}  # --network proxy, the default
        base = {"PATH", "HOME", "LANG", "MINE", MARKER_ENV}
        assert {name for name, _ in spec.env} == base | proxy


def test_a_store_or_objects_url_settled_cannot_use_is_refused_naming_it_without_a_password(
    tmp_path: Path,
) -> None:
    from settled.backends import BadBackend

    home = str(tmp_path / "home")
    os.makedirs(home)
    for store, named in (
        ("mysql://u:hunter2@db/x", "mysql://u:***@db/x"),
        ("postgresql://u:hunter2@db:5432", "no database"),
        ("sqlite://relative/path.db", "ABSOLUTE"),
    ):
        with pytest.raises(BadBackend, match=re.escape(named)) as refused:
            bind(home, store=store)
        assert "hunter2" not in str(refused.value)
    for objects in ("s3://", "ftp://host/x", "file://relative"):
        with pytest.raises(BadBackend, match=re.escape(objects)):
            bind(home, objects=objects)
    assert read_binding(home) is None  # nothing recorded for a refused request


def test_every_view_of_a_session_sealed_on_a_reads_on_b_and_an_unsealed_one_is_log_elsewhere(
    hosts: tuple[Runtime, Runtime], tmp_path: Path
) -> None:
    """Merged (the README's `--from 4096` too), one stream, `--follow` and `--view` of a
    sealed session read on host B from its sealed copy, checked against the receipt; a session
    still running on A (its logs unsealed) is one LogElsewhere line and exit 3 in every view,
    never an internal error or an empty exit 0."""
    a, b = hosts
    task = a.new_task(_workspace(tmp_path, "w"))
    script = (
        "import sys\nfor i in range(20000):\n    print(f'out {i}', flush=True)\n"
        "    if i % 100 == 0: print(f'err {i}', file=sys.stderr, flush=True)"
    )
    done = a.exec(task.task, [COMMAND_PYTHON, "-c", script])
    a.wait(done.session, timeout=60)
    assert set(sealed_facts(a, task.task, done.session)) == {"stdout", "stderr"}
    running = a.exec(task.task, ["sh", "-c", "echo started; exec sleep 60"])
    stdout, stderr = a.read(done.session, "stdout", 0, 1 << 24), a.read(done.session, "stderr")

    def logs(home: str, *argv: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "settled", "--home", home, "logs", *argv],
            capture_output=True, timeout=60,
        )  # fmt: skip

    merged = logs(b.home, done.session)
    assert merged.returncode == 0, merged.stderr
    on_a = logs(a.home, done.session)  # the owner's order, read on A
    in_order = on_a.stdout
    assert merged.stdout == in_order  # its index is sealed with stdout
    assert (b"not recorded" in merged.stderr) == (b"not recorded" in on_a.stderr)
    readme = logs(b.home, done.session, "--from", "4096")
    assert (readme.returncode, readme.stdout) == (0, in_order[4096:])
    for argv, expected in (
        (["--stream", "stdout"], stdout),
        (["--stream", "stderr", "--from", "7"], stderr[7:]),
        (["--follow"], in_order),
        (["--stream", "stdout", "--follow", "--from", "4096"], stdout[4096:]),
    ):
        read = logs(b.home, done.session, *argv)
        assert (read.returncode, read.stdout) == (0, expected), (argv, read.stderr)
    view = logs(b.home, done.session, "--view", "300")
    assert view.returncode == 0 and b"out 19999" in view.stdout and b"omitted" in view.stdout
    assert b"".join(b.follow(done.session, "stderr")) == stderr
    assert b.stream_log(done.session, "stdout").stored_length() == len(stdout)

    a.follow(running.session, "stdout", 0, timeout=0.5).__next__()  # it printed: it runs
    for argv in ([], ["--from", "4096"], ["--stream", "stdout"], ["--stream", "stderr"],
                 ["--follow"], ["--view", "100"]):  # fmt: skip
        elsewhere = logs(b.home, running.session, *argv)
        assert elsewhere.returncode == 3, (argv, elsewhere.stderr)
        assert b"no sealed copy" in elsewhere.stderr and a.host.encode() in elsewhere.stderr
        assert len(elsewhere.stderr.strip().splitlines()) == 1 and not elsewhere.stdout, argv
    for read in (
        lambda: b.read_merged(running.session),
        lambda: b.follow_merged(running.session),
        lambda: b.view(running.session, "stdout", 100),
        lambda: b.stream_log(running.session, "stderr"),
    ):
        with pytest.raises(LogElsewhere):
            read()


def test_recovery_seals_a_lost_owners_logs_and_host_b_reads_them(
    hosts: tuple[Runtime, Runtime], tmp_path: Path
) -> None:
    """An owner killed (-9) mid-run leaves no seal; recovery's receipt is followed by its
    seal of the logs at the bytes on disk, so host B reads what the command printed."""
    a, b = hosts
    task = a.new_task(_workspace(tmp_path, "w"))
    running = a.exec(task.task, ["sh", "-c", "echo before-the-kill; exec sleep 60"])
    deadline = time.monotonic() + 30
    while a.store.get_session(running.session).stdout_durable == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    owner = a.store.get_session(running.session).owner
    assert owner is not None
    os.kill(owner.pid, 9)
    while a.store.get_session(running.session).state != SETTLED:
        assert time.monotonic() < deadline + 30
        a.recover(task.task)
        time.sleep(0.1)
    receipt = a.store.get_session(running.session).receipt
    assert receipt is not None and receipt["death"]["source"] == "recovery"
    seals = a.store.log_seals(task.task, running.session)[running.session]
    assert seals["stdout"]["digest"] == receipt["output"]["stdout"]["digest"]
    assert b.read(running.session, "stdout") == b"before-the-kill\n"
    assert b.read_merged(running.session)[0].data == b"before-the-kill\n"


def test_the_http_log_endpoints_of_host_b_serve_a_sealed_session_and_409_an_unsealed_one(
    hosts: tuple[Runtime, Runtime], tmp_path: Path
) -> None:
    """The service reads through the same Runtime path: raw output, the merged view and the
    events of a session sealed on A are served by B's server; a session running on A is 409
    LogElsewhere in each."""
    from test_server import Server

    a, b = hosts
    task = a.new_task(_workspace(tmp_path, "w"))
    done = a.exec(task.task, ["sh", "-c", "seq 1 5000; echo oops >&2"])
    a.wait(done.session, timeout=60)
    assert set(sealed_facts(a, task.task, done.session)) == {"stdout", "stderr"}
    running = a.exec(task.task, ["sleep", "60"])
    stdout = a.read(done.session, "stdout", 0, 1 << 20)
    server = Server(Path(b.home), tmp_path / "server-b.log", None, {})
    try:
        with server.client() as client:
            output = f"/v1/sessions/{done.session}/output"
            assert client.get(output).content == stdout
            assert client.get(output, params={"from": 4096}).content == stdout[4096:]
            assert client.get(output, params={"stream": "stderr"}).content == b"oops\n"
            assert client.get(output, params={"follow": 1}).content == stdout
            merged = client.get(f"/v1/sessions/{done.session}/merged").json()
            assert merged["final"] and merged["cursor"] == len(stdout) + 5
            events = client.get(f"/v1/sessions/{done.session}/events")
            assert events.status_code == 200 and "data:" in events.text, events.text[:200]
            for path in ("output", "merged", "events"):
                refused = client.get(f"/v1/sessions/{running.session}/{path}")
                assert refused.status_code == 409, (path, refused.text)
                assert refused.json()["error"] == "LogElsewhere"
    finally:
        server.stop()
