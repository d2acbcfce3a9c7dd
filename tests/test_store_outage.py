"""Owners outlive a PostgreSQL outage (issue 39, item 1): a real cluster of the test's own is
restarted, killed, stopped and cut off while real owners run real commands, and every exit
status is recorded.

Each kind runs SETTLED_FAULT_LOOPS rounds (default 3; CI sets 20) of ten commands and checks:
no false complete (every receipt is the owner's, exit 0, its last line in the log), no duplicate
launch (each command counts its starts in the workspace), no lost exit status (no `owner_lost`),
and a close that converges with no manual step. The cluster is the test's own (never the shared
`pg_cluster`), resumed and stopped in a `finally`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pg
import pytest

from settled.errors import AdmissionFrozen, StoreUnreachable
from settled.owner.liveness import HostedOwners
from settled.records import TaskRecord
from settled.recovery import Recovery
from settled.runtime import Runtime
from settled.sessions import SessionWatch
from settled.store.postgres import PostgresStore, open_postgres

T = TypeVar("T")
pytestmark = pytest.mark.skipif(pg.missing_reason() is not None, reason=str(pg.missing_reason()))

LOOPS = int(os.environ.get("SETTLED_FAULT_LOOPS") or 3)
COMMANDS = 10
SCHEMA = "outage"


# -- the cluster's faults --------------------------------------------------------------------


def _postmaster(cluster: pg.Cluster) -> int:
    pid = pg._postmaster_pid(cluster.data)
    assert pid is not None, "no postmaster"
    return pid


def _cluster_pids(cluster: pg.Cluster) -> list[int]:
    """The postmaster and every process it started (its backends and workers)."""
    master = _postmaster(cluster)
    found = [master]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == master:
                    found.append(int(entry))
    return found


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _start(cluster: pg.Cluster) -> None:
    """Start the cluster again as pg.py started it; a start the server refuses is named with
    the tail of its log."""
    options = (
        f"-p {cluster.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories="
        f"{cluster.root} -c max_connections=300 -c fsync=off -c full_page_writes=off"
    )
    log = os.path.join(cluster.root, "server.log")
    try:
        pg._as_postgres(
            os.path.join(pg.PG_BIN, "pg_ctl"), "-D", cluster.data, "-l", log, "-o", options,
            "-w", "-t", "60", "start",
        )  # fmt: skip
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n{Path(log).read_text()[-2000:]}") from None


def restart_fast(cluster: pg.Cluster) -> None:
    """A graceful restart: the server ends every session and comes back (pg_ctl -m fast)."""
    pg._as_postgres(
        os.path.join(pg.PG_BIN, "pg_ctl"), "-D", cluster.data, "-l",
        os.path.join(cluster.root, "server.log"), "-m", "fast", "-w", "-t", "60", "restart",
    )  # fmt: skip


def kill_and_restart(cluster: pg.Cluster, down_s: float = 0.0) -> None:
    """The postmaster and its backends SIGKILLed (crash recovery at the next start)."""
    pids = _cluster_pids(cluster)
    _signal_all(pids, signal.SIGKILL)
    give_up = time.monotonic() + 20
    while any(pg._alive(pid) and not _zombie(pid) for pid in pids):
        assert time.monotonic() < give_up, "the killed cluster did not go"
        time.sleep(0.02)
    for pid in pids:  # a zombie of ours (this process may be a subreaper) holds its pid
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    # its postmaster is gone (a zombie of some reaper still holds its pid): its lock files go
    Path(cluster.data, "postmaster.pid").unlink(missing_ok=True)
    Path(cluster.root, f".s.PGSQL.{cluster.port}.lock").unlink(missing_ok=True)
    time.sleep(down_s)
    _start(cluster)


def stall(cluster: pg.Cluster, seconds: float) -> None:
    """Every process of the cluster SIGSTOPped for `seconds`, then resumed."""
    pids = _cluster_pids(cluster)
    _signal_all(pids, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        _signal_all(pids, signal.SIGCONT)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _hba(cluster: pg.Cluster) -> Path:
    return Path(cluster.data, "pg_hba.conf")


@contextlib.contextmanager
def cut_off(cluster: pg.Cluster) -> Iterator[None]:
    """The server refuses every TCP connection (the owners') and ends those it has, while its
    local socket (the test's) still serves: a store out for the owners alone."""
    original = _hba(cluster).read_text()
    _hba(cluster).write_text("local all all trust\nhost all all 127.0.0.1/32 reject\n")
    pg._as_postgres(os.path.join(pg.PG_BIN, "pg_ctl"), "-D", cluster.data, "reload")
    try:
        import psycopg

        _until(lambda: not _tcp_accepted(cluster), 10.0)  # the reload took effect
        with psycopg.connect(_local_url(cluster, "postgres"), autocommit=True) as admin:
            for _ in range(2):  # and again, for a connection that was mid-handshake
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE client_addr IS NOT NULL AND pid <> pg_backend_pid()"
                )
                time.sleep(0.2)
        yield
    finally:
        _hba(cluster).write_text(original)
        pg._as_postgres(os.path.join(pg.PG_BIN, "pg_ctl"), "-D", cluster.data, "reload")


def _tcp_accepted(cluster: pg.Cluster) -> bool:
    import psycopg

    try:
        psycopg.connect(cluster.url(), connect_timeout=5).close()
    except psycopg.OperationalError:
        return False
    return True


def _local_url(cluster: pg.Cluster, database: str = pg.DATABASE) -> str:
    query = urllib.parse.urlencode(
        {"host": cluster.root, "port": cluster.port, "options": f"-csearch_path={SCHEMA}"}
    )
    return f"postgresql://{pg.PG_USER}@/{database}?{query}"


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def cluster() -> Iterator[pg.Cluster]:
    own = pg.start_cluster()
    try:
        yield own
    finally:
        with contextlib.suppress(Exception):
            _signal_all(_cluster_pids(own), signal.SIGCONT)
        own.stop()


@pytest.fixture
def rt(cluster: pg.Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Runtime]:
    """A home bound to the test's own cluster (its objects stay local)."""
    url = f"{cluster.url()}?options=-csearch_path%3D{SCHEMA}"
    monkeypatch.setenv("SETTLED_STORE", url)
    monkeypatch.delenv("SETTLED_OBJECTS", raising=False)
    runtime = Runtime(str(tmp_path / "home"))
    try:
        yield runtime
    finally:
        with contextlib.suppress(Exception):
            runtime.recover()
        runtime.close()


def _until(check: Callable[[], bool], seconds: float) -> None:
    give_up = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < give_up, "not within the bound"
        time.sleep(0.05)


def _retrying(call: Callable[[], T], seconds: float = 30.0) -> T:
    """A caller's call made again while the store is out or the task is frozen: with this
    file's short lease, on a loaded machine an owner that has not renewed yet can be judged
    unknown by another admission's look, freezing the task until its first renewal revives
    the session (the fence, states.py), as a client retrying with its key would see."""
    give_up = time.monotonic() + seconds
    while True:
        try:
            return call()
        except (StoreUnreachable, AdmissionFrozen):
            if time.monotonic() > give_up:
                raise
            time.sleep(0.1)


# -- one round -------------------------------------------------------------------------------


def _launch(
    rt: Runtime, tmp_path: Path, name: str, sleep_s: float | None
) -> tuple[TaskRecord, list[str]]:
    """Ten commands; each ends `sleep_s` after its start, or (None) once the file `go` is in
    its workspace."""
    workspace = tmp_path / name
    workspace.mkdir()
    task = _retrying(lambda: rt.new_task(str(workspace)))
    sessions = []
    wait = f"sleep {sleep_s}" if sleep_s is not None else "until [ -e go ]; do sleep 0.05; done"
    for i in range(COMMANDS):
        command = f"echo x >> launches-{i}; {wait}; echo done-{i}"
        admitted = _retrying(lambda i=i, c=command: rt.exec(task.task, shell=c, key=f"k{i}"))
        sessions.append(admitted.session)
    return task, sessions


def _every_exit_status_recorded(
    rt: Runtime, task: TaskRecord, sessions: list[str], *, fenced: frozenset[str] = frozenset()
) -> None:
    """No lost exit status, no duplicate launch, no false complete; the close converges."""
    for i, session in enumerate(sessions):
        view = _retrying(lambda s=session: rt.wait(s, timeout=120))
        receipt = view.get("receipt")
        owner_log = Path(rt.home, "sessions", session, "owner.log")
        assert view["state"] == "settled" and receipt is not None, (
            view["state"],
            owner_log.read_bytes()[-3000:] if owner_log.exists() else None,
        )
        launches = Path(task.workspace, f"launches-{i}").read_text().count("x")
        assert launches == 1, f"{session}: the command ran {launches} times"
        log = Path(rt.home, "sessions", session, "stdout.log").read_bytes()
        assert receipt["output"]["stdout"]["cursor"] == len(log)
        if session in fenced:
            assert receipt["death"]["source"] != "owner", receipt["death"]
            continue
        assert receipt["death"]["source"] == "owner", (session, receipt["death"])
        assert (receipt["exit"]["reason"], receipt["exit"]["code"]) == ("exited", 0), receipt
        assert log == f"done-{i}\n".encode(), log
    result = _retrying(lambda: rt.close_task(task.task, deadline=30))
    assert result.complete, result.blocked_on
    assert result.receipt is not None
    assert result.receipt["outcome"]["all_commands_succeeded"] is (not fenced)


def _rounds(
    rt: Runtime, tmp_path: Path, kind: str, fault: Callable[[], None], sleep_s: float
) -> None:
    for round_ in range(LOOPS):
        task, sessions = _launch(rt, tmp_path, f"{kind}{round_}", sleep_s)
        fault()
        _every_exit_status_recorded(rt, task, sessions)


# -- the faults ------------------------------------------------------------------------------


@pytest.mark.timeout(120 + 90 * LOOPS)
def test_a_graceful_restart_loses_no_exit_status(
    rt: Runtime, cluster: pg.Cluster, tmp_path: Path
) -> None:
    _rounds(rt, tmp_path, "fast", lambda: restart_fast(cluster), sleep_s=1.0)


@pytest.mark.timeout(120 + 90 * LOOPS)
def test_a_killed_postmaster_restarted_within_the_lease_loses_no_exit_status(
    rt: Runtime, cluster: pg.Cluster, tmp_path: Path
) -> None:
    _rounds(rt, tmp_path, "kill", lambda: kill_and_restart(cluster, down_s=0.5), sleep_s=1.0)


@pytest.mark.timeout(120 + 90 * LOOPS)
def test_a_stopped_cluster_resumed_within_the_lease_loses_no_exit_status(
    rt: Runtime, cluster: pg.Cluster, tmp_path: Path
) -> None:
    """SIGSTOP of the postmaster and its backends: open connections hang, new ones wait."""
    _rounds(rt, tmp_path, "stop", lambda: stall(cluster, 3.0), sleep_s=1.0)


@pytest.mark.timeout(120 + 90 * LOOPS)
def test_a_restart_while_the_receipts_are_written_loses_no_exit_status(
    rt: Runtime, cluster: pg.Cluster, tmp_path: Path
) -> None:
    """The cluster is stopped as the commands end, so that each owner's settle and receipt
    are in flight, then killed and started again: every write is retried, none doubled."""

    def during_receipts() -> None:
        time.sleep(0.9)  # the commands sleep 1 s after their launch
        pids = _cluster_pids(cluster)
        _signal_all(pids, signal.SIGSTOP)
        time.sleep(0.6)  # every command has ended; its owner waits on the stopped server
        kill_and_restart(cluster)

    _rounds(rt, tmp_path, "receipt", during_receipts, sleep_s=1.0)


# -- an outage longer than the lease: the fence --------------------------------------------


LEASE_S = 4.0  # short, yet long enough for a loaded machine to start ten owners


def _cut_off_past_the_lease(
    rt: Runtime, cluster: pg.Cluster, tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[TaskRecord, list[str], PostgresStore, Recovery]:
    """Launch, cut the owners off for longer than their lease: the test's local connection
    (`store`) and a recovery over it still reach the server."""
    monkeypatch.setenv("SETTLED_LEASE_S", str(LEASE_S))
    task, sessions = _launch(rt, tmp_path, name, sleep_s=None)
    store = open_postgres(_local_url(cluster), pooled=False)
    watch = SessionWatch(store, HostedOwners(rt.host, rt.home))
    recovery = Recovery(store, watch, lambda: rt.sandbox, rt.home, rt.host)
    return task, sessions, store, recovery


def _read_as_unknown_elsewhere(store: PostgresStore, sessions: list[str]) -> list[str]:
    """What a reader on another host (the lease alone) says of each session."""
    elsewhere = SessionWatch(store, HostedOwners("h_another_host"))
    return [elsewhere.status(session)["state"] for session in sessions]


@pytest.mark.timeout(120 + 60 * LOOPS)
def test_past_the_lease_an_owner_back_before_recovery_has_its_late_receipt_taken(
    rt: Runtime, cluster: pg.Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for round_ in range(LOOPS):
        task, sessions, store, _ = _cut_off_past_the_lease(
            rt, cluster, tmp_path, f"late{round_}", monkeypatch
        )
        try:
            with cut_off(cluster):
                Path(task.workspace, "go").touch()  # the commands end while the store is out
                time.sleep(2.5 * LEASE_S)  # the commands end; their owners wait to write
                assert set(_read_as_unknown_elsewhere(store, sessions)) == {"unknown"}
                for session in sessions:  # a detector that judged by the lease alone
                    record = store.get_session(session)
                    store.mark_unknown(session, record.generation, "lease lapsed (test)")
            _every_exit_status_recorded(rt, task, sessions)
            assert all(store.get_session(s).generation == 1 for s in sessions)
        finally:
            store.close()


@pytest.mark.timeout(120 + 60 * LOOPS)
def test_past_the_lease_a_recovery_that_took_over_first_stands_and_fences_the_owner(
    rt: Runtime, cluster: pg.Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for round_ in range(LOOPS):
        task, sessions, store, recovery = _cut_off_past_the_lease(
            rt, cluster, tmp_path, f"took{round_}", monkeypatch
        )
        try:
            with cut_off(cluster):
                Path(task.workspace, "go").touch()  # the commands end while the store is out
                time.sleep(2.5 * LEASE_S)
                for session in sessions:  # a detector that judged by the lease alone
                    record = store.get_session(session)
                    store.mark_unknown(session, record.generation, "lease lapsed (test)")
                # This host's recovery leaves an owner alive by its local beat (the store was
                # out, not the owner): the one that takes over first here judges by the lease
                # alone, as a detector of another host with a provider that inspects it does.
                by_lease = Recovery(
                    store, SessionWatch(store, HostedOwners(rt.host)), lambda: rt.sandbox,
                    rt.home, rt.host,
                )  # fmt: skip
                assert recovery.recover(task.task) == [], "an owner alive by its beat is left"
                results = by_lease.recover(task.task)  # takes over, inspects, writes
                assert sorted(r["session"] for r in results) == sorted(sessions), results
                recovered = {s: store.get_session(s) for s in sessions}
            assert all(r.state == "settled" and r.generation == 2 for r in recovered.values())
            for session in sessions:  # each owner, back, is refused and leaves fenced
                log = Path(rt.home, "sessions", session, "owner.log")
                _until(lambda log=log: b"owner fenced" in log.read_bytes(), 60.0)
            _every_exit_status_recorded(rt, task, sessions, fenced=frozenset(sessions))
            for session, before in recovered.items():  # its late writes changed nothing
                after = _retrying(lambda s=session: rt.store.get_session(s))
                assert after.receipt == before.receipt and after.generation == 2
        finally:
            store.close()


def test_a_restart_costs_a_pooled_store_no_error_on_its_idle_connections(
    rt: Runtime, cluster: pg.Cluster, tmp_path: Path
) -> None:
    """Every idle pooled connection a restart broke fails at its first use; the store runs
    that read or write again on the next one, so a caller (the service, a reader) sees no
    StoreUnreachable for it. A write is run again only when it failed before its COMMIT."""
    store = rt.store
    assert isinstance(store, PostgresStore)
    workspace = tmp_path / "pooled"
    workspace.mkdir()
    task = rt.new_task(str(workspace))
    with contextlib.ExitStack() as held:  # fill the pool: every connection in use at once
        for _ in range(4):
            held.enter_context(store._connection())  # the pool's own connections
    restart_fast(cluster)
    for _ in range(3):
        assert store.get_task(task.task).task == task.task  # reads: no error
    other = tmp_path / "pooled-2"
    other.mkdir()
    assert rt.new_task(str(other)).task != task.task  # a write: no error
