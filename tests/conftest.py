"""Shared fixtures: a runtime with its own home, a task with its own workspace, and boundaries.

Every session a test starts is settled before the test ends: the `rt` fixture cancels whatever is
still live and waits for its receipt, and kills (by their unique marker) any escapee a pgroup
session could not contain. Boundaries the machine lacks are skipped with the reason printed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pg
import pytest
import s3
from s3 import s3_env, s3_url, s3_url_unversioned, weed  # noqa: F401 (fixtures)

from settled.boundary import availability
from settled.records import TaskRecord
from settled.runtime import Runtime
from settled.states import LIVE_STATES

EVIDENCE_BOUNDARIES = ("cgroup2+pidns", "cgroup2", "pidns", "subreaper")
# A descendant that leaves the process group (setsid) and holds stdout; the main process exits
# only once it has escaped, so the owner cannot catch it still inside the group.
ESCAPEE = (
    "setsid sh -c 'touch escaped; exec sleep 600' & "
    "while [ ! -e escaped ]; do sleep 0.01; done; echo escaped"
)
MARKER_ENV = "TEST_SESSION_MARKER"
# A Python for commands: the distribution's, which every session's view holds (a venv's or a
# pyenv's interpreter lies outside the view, so it does not exist for a command).
COMMAND_PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "python3"


def _skip_unavailable(kind: str) -> None:
    reason = availability()[kind]
    if reason is not None:
        if os.environ.get("CI") and kind in ("cgroup2+pidns", "cgroup2", "pidns"):
            pytest.fail(f"CI must exercise the {kind} boundary, but: {reason}")
        pytest.skip(f"boundary {kind} unavailable on this machine: {reason}")


@pytest.fixture(params=EVIDENCE_BOUNDARIES)
def boundary(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    _skip_unavailable(kind)
    return kind


def proc_files(*names: str) -> Iterator[tuple[int, list[bytes]]]:
    """(pid, [contents of /proc/PID/NAME for each name]) of every process whose files could all
    be read (one that ended meanwhile is passed over)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            contents = []
            for name in names:
                with open(f"/proc/{entry}/{name}", "rb") as handle:
                    contents.append(handle.read())
        except OSError:
            continue
        yield int(entry), contents


def kill_marked(marker: str, command: bytes = b"") -> list[int]:
    """End any process whose command line or environment carries this test's marker
    (and, if given, whose command line contains `command`)."""
    killed = []
    needle = marker.encode()
    for pid, (cmdline, environ) in proc_files("cmdline", "environ"):
        if pid == os.getpid() or b"multiprocessing" in cmdline:
            continue  # pytest's own resource tracker, shared by every test of this run
        if (needle in cmdline or needle in environ) and command in cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


@pytest.fixture
def marker(request: pytest.FixtureRequest) -> str:
    return f"settled-test-{os.getpid()}-{abs(hash(request.node.nodeid)) % 10**8}"


@pytest.fixture(autouse=True)
def _ends_what_it_starts(
    tmp_path: Path, marker: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Every test: its processes carry its marker; journals under its tmp_path are stopped and
    anything still carrying the marker is killed when it ends."""
    monkeypatch.setenv(MARKER_ENV, marker)  # inherited by every owner and journal
    monkeypatch.setenv("SETTLED_INHERIT", MARKER_ENV)  # and passed to every command
    yield
    recover_homes(tmp_path)
    stop_journals(tmp_path)
    kill_marked(marker)
    release_pods(tmp_path)


@pytest.fixture(autouse=True, scope="session")
def _no_mount_outlives_the_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Homes made by module- and session-scoped fixtures let go of their pods too, once every
    test has run; then nothing may stay mounted under the run's temporary directory."""
    yield
    base = tmp_path_factory.getbasetemp()
    release_pods(base)
    with open("/proc/self/mountinfo") as handle:
        left = [line.split()[4] for line in handle if line.split()[4].startswith(str(base))]
    assert left == [], f"mounts left under {base}: {left}"


@pytest.fixture(autouse=True, scope="session")
def _no_task_cgroup_outlives_the_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A session's boundary cgroup (`settled/<task>/<session>` in the v2 hierarchy) is removed
    by its owner or by recovery; one a failed test left (its owner killed, its store stopped
    before recovery could reach it) is removed here once every test has run, with the task
    directories it leaves empty and the `settled` directory if this run made it. A cgroup
    of this run that still holds a process is a process that outlived its test: a failure."""
    root = _task_cgroup_root()
    existed = root is not None and root.is_dir()
    yield
    if root is None or not root.is_dir():
        return
    base = tmp_path_factory.getbasetemp()
    ours = {path.name for path in base.glob("**/sessions/s_*")}
    left = []
    for session in sorted(p for p in root.glob("t_*/s_*") if p.name in ours):
        with contextlib.suppress(OSError):
            session.rmdir()  # refused (EBUSY) while a process is in it
        if session.exists():
            left.append(str(session))
        with contextlib.suppress(OSError):
            session.parent.rmdir()  # its task's directory, once nothing else is in it
    if not existed:
        with contextlib.suppress(OSError):
            root.rmdir()
    assert left == [], f"session cgroups still holding processes: {left}"


def _task_cgroup_root() -> Path | None:
    """Where sessions' boundary cgroups go on this machine, None where there is none."""
    from settled.boundary import cgroup2
    from settled.errors import SettledError

    try:
        return Path(cgroup2.find_hierarchy(), cgroup2.ROOT_DIR_NAME)
    except (SettledError, OSError):
        return None


@contextlib.contextmanager
def mounted_tmpfs(at: Path, size: str = "64m") -> Iterator[Path]:
    """A fresh tmpfs mounted at ``at`` (made here, as root), unmounted whatever happens (lazily
    if something still holds it) and its mount point removed: the filesystem where a write to
    a page already mapped stamps nothing."""
    at.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(at)], check=True)
    try:
        yield at
    finally:
        if subprocess.run(["umount", str(at)], check=False).returncode != 0:
            subprocess.run(["umount", "--lazy", str(at)], check=True)
        with contextlib.suppress(OSError):
            at.rmdir()


def release_pods(root: Path) -> None:
    """Every home under `root` that made pods lets go of them (their mounts under run/pods
    would keep `root` from being removed); after its sessions ended, so that nothing of the
    pods outlives the test."""
    from settled.boundary import podns

    for pods in root.glob("**/run/pods"):
        podns.release_home(str(pods.parent.parent))


def recover_homes(root: Path) -> None:
    """A test that failed midway may leave a session whose owner it killed: recovery ends its
    boundary (and removes its cgroup) like it would for a user."""
    for identity in root.glob("**/home.id"):  # every home, wherever its store lives
        with contextlib.suppress(Exception), Runtime(str(identity.parent)) as runtime:
            runtime.recover()


REMOTE_ENV = "SETTLED_TEST_BACKENDS"  # "postgresql+s3": `rt` homes bind to the servers


@pytest.fixture
def rt(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Runtime]:
    """A Runtime on a fresh home: embedded backends, or, with SETTLED_TEST_BACKENDS=
    postgresql+s3, a schema of the test cluster and a prefix of the test bucket (CI runs the
    contract and crash suites both ways)."""
    home = os.path.join(str(tmp_path), "home")
    remote = os.environ.get(REMOTE_ENV)
    if remote == "postgresql+s3":
        request.getfixturevalue("pg_cluster")
        request.getfixturevalue("s3_env")  # the endpoint and credentials, for this test
        monkeypatch.setenv("SETTLED_STORE", pg.url_for_directory(home))
        monkeypatch.setenv("SETTLED_OBJECTS", f"s3://{s3.VERSIONED_BUCKET}/{s3.fresh_prefix()}")
    elif remote:
        pytest.fail(f"{REMOTE_ENV}={remote!r}: the one choice is postgresql+s3")
    runtime = Runtime(home)
    try:
        yield runtime
    finally:
        _settle_everything(runtime)
        runtime.close()


def small_owner_kib(runtime: Runtime) -> int:
    """What an owner may hold at its peak, whatever its output: 64 MiB on the embedded
    backends; on PostgreSQL + S3 it also holds psycopg (~27 MiB) and, to seal its logs, a boto3
    client (~27 MiB), a fixed cost that no output makes larger."""
    return (112 if runtime.backends.remote else 64) * 1024


def tamper_object(objects: Any, digest: str, change: Callable[[bytes], bytes]) -> None:
    """Change a stored object's bytes behind its store's back, where it lies: the local file
    (or, for an object in a local pack, its bytes in the pack, which only a change of the same
    size can be), or the only upload of its key in the bucket (with the store's own client)."""
    if hasattr(objects, "location_of"):
        where, offset, size = objects.location_of(digest)
        path = Path(where)
        path.chmod(0o600)
        if where == objects.path_of(digest):
            path.write_bytes(change(path.read_bytes()))
            return
        with open(path, "r+b") as handle:
            handle.seek(offset)
            new = change(handle.read(size))
            assert len(new) == size, "a packed object can only be changed in place"
            handle.seek(offset)
            handle.write(new)
        path.chmod(0o400)
        return
    key = objects.key_of(digest)
    client = objects.client()
    body = client.get_object(Bucket=objects.bucket, Key=key)["Body"].read()
    # Every upload of the key goes first: in a versioned bucket settled reads the upload its
    # checkpoint recorded (an older intact one would be read instead of the tampered bytes).
    listed = client.list_object_versions(Bucket=objects.bucket, Prefix=key)
    for version in listed.get("Versions", []) + listed.get("DeleteMarkers", []):
        if version["Key"] == key:
            client.delete_object(Bucket=objects.bucket, Key=key, VersionId=version["VersionId"])
    client.put_object(Bucket=objects.bucket, Key=key, Body=change(body))


def journal_pids(run_dir: Path) -> set[int]:
    """Live journal daemons serving this run directory (found by their command line)."""
    needle = b"\0" + os.fsencode(str(run_dir)) + b"\0"
    return {
        pid
        for pid, (cmdline,) in proc_files("cmdline")
        if b"settled.workspace.journal" in cmdline and needle in cmdline
    }


def stop_journals(root: Path) -> None:
    """Every home starts a journal daemon; a test ends the ones started under its tmp_path."""
    from settled.workspace.journal import lifecycle as journal_lifecycle

    for sock in root.glob("**/journal.sock"):
        journal_lifecycle.stop(str(sock))
    stop_launchers(root)
    stop_proxies(root)


def stop_proxies(root: Path) -> None:
    """A home's first `--network proxy` session starts its proxy; a test ends those it made."""
    from settled.netproxy import lifecycle as proxy_lifecycle
    from settled.netproxy.wire import SOCKET_NAME

    for sock in root.glob(f"**/{SOCKET_NAME}"):
        with contextlib.suppress(Exception):
            proxy_lifecycle.stop(str(sock.parent.parent))


def stop_launchers(root: Path) -> None:
    """A CLI call starts its home's warm launcher; a test ends the ones under its tmp_path."""
    from settled.owner import home_launcher

    for sock in root.glob(f"**/{home_launcher.SOCKET_NAME}"):
        with contextlib.suppress(Exception):
            home_launcher.stop(str(sock.parent))


def _settle_everything(runtime: Runtime) -> None:
    rows = [(r.session, r.state) for r in runtime.store.live_sessions()]
    for session, state in rows:
        if state in LIVE_STATES:
            runtime.cancel(session, "test teardown")
    deadline = time.monotonic() + 30
    for session, state in rows:
        if state in LIVE_STATES:
            remaining = max(0.1, deadline - time.monotonic())
            with contextlib.suppress(Exception):  # teardown goes on to kill by marker
                runtime.wait(session, timeout=remaining)


@pytest.fixture
def task(rt: Runtime, tmp_path: Path) -> TaskRecord:
    workspace = os.path.join(str(tmp_path), "workspace")
    os.makedirs(workspace)
    return rt.new_task(workspace)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[pg.Cluster]:
    """One PostgreSQL cluster for the test session (tests/pg.py); its base URL is exported in
    the environment for spawned children. Skipped where the binaries are missing, but not
    under CI=true: CI must run the contract on PostgreSQL."""
    reason = pg.missing_reason()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the PostgreSQL store tests, but: {reason}")
        pytest.skip(reason)
    cluster = pg.start_cluster()
    os.environ[pg.URL_ENV] = cluster.url()
    try:
        yield cluster
    finally:
        os.environ.pop(pg.URL_ENV, None)
        cluster.stop()
