"""Space is budgeted, not discovered (issue 12, item 1).

A home on a small tmpfs (mounted here as root; skipped with the reason elsewhere, never on CI),
a command writing past it, admission below the reserve, recover and close on a full disk, and
ENOSPC / EIO injected at the fault points where settled writes. Every answer is a receipt that
says what was lost, or one line naming the disk: never a traceback, never a silent owner.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest
from conftest import _skip_unavailable, kill_marked, stop_journals

from settled.errors import HomeUnusable, KeyConflict, SpaceExhausted, StorageFailed
from settled.home import RESERVE_ENV, RESERVE_MAX, SpaceGuard, reserve_bytes
from settled.records import TaskRecord
from settled.runtime import Runtime

SETTLED = [sys.executable, "-m", "settled"]
MiB = 1 << 20
FLOOD = 40_000_000  # bytes of output: more than the 16 MiB filesystem holds


@pytest.fixture
def small_fs(tmp_path: Path, marker: str) -> Iterator[Path]:
    """A 16 MiB tmpfs at tmp_path/fs, unmounted at the end whatever happened."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("CI runs as root and must mount the small tmpfs")
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "fs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"cannot mount a tmpfs on CI: {done.stderr.strip()}")
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        for filler in (mount / "filler", mount / "ws" / "fill"):  # room for recovery first
            filler.unlink(missing_ok=True)
        with contextlib.suppress(Exception), Runtime(str(mount / "home")) as rt:
            _end_live_sessions(rt)  # a session a failed test left live
        stop_journals(mount)
        kill_marked(marker)
        _unmount(mount)


def _unmount(mount: Path) -> None:
    """A journal that was just told to stop may hold the mount for a moment: retry, then
    detach it lazily rather than leave it mounted."""
    for _ in range(50):
        if subprocess.run(["umount", str(mount)], capture_output=True, timeout=30).returncode == 0:
            return
        time.sleep(0.1)
    subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def _end_live_sessions(rt: Runtime) -> None:
    for record in rt.store.live_sessions():
        rt.cancel(record.session, "test teardown")
        with contextlib.suppress(Exception):
            rt.wait(record.session, timeout=20)
    rt.recover()


@pytest.fixture
def reserve_4mib(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setenv(RESERVE_ENV, str(4 * MiB))
    return 4 * MiB


def _cli(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SETTLED, *args],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "SETTLED_HOME": str(home), **env},
    )


def _one_line_error(done: subprocess.CompletedProcess[str], kind: str) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"settled: {kind}: "), lines[0]
    return lines[0]


def _fill(mount: Path, leave: int = 0) -> Path:
    """Fill the filesystem until at most `leave` bytes are free (0: until it refuses)."""
    filler = mount / "filler"
    with open(filler, "ab") as handle:
        chunk = b"\xff" * MiB
        try:
            while True:
                st = os.statvfs(mount)
                free = st.f_bavail * st.f_frsize
                if free <= leave:
                    break
                handle.write(chunk[: max(4096, min(MiB, free - leave))])
                handle.flush()
        except OSError:
            pass  # full
    return filler


def _task(rt: Runtime, tmp_path: Path) -> TaskRecord:
    workspace = tmp_path / "workspace"  # on the ordinary disk: only the home is small
    workspace.mkdir(exist_ok=True)
    return rt.new_task(str(workspace))


def _log(home: Path, session: str, stream: str = "stdout") -> bytes:
    return (home / "sessions" / session / f"{stream}.log").read_bytes()


def _await_gone(pid: int, seconds: float = 30.0) -> None:
    give_up = time.monotonic() + seconds
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < give_up:
        time.sleep(0.01)  # the owner was not our child: no pidfd wait needed for a test
    assert not os.path.exists(f"/proc/{pid}"), f"owner {pid} did not crash at its fault point"


def _b3(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


# -- the reserve -----------------------------------------------------------------------------


def test_the_reserve_is_max_of_64_mib_and_2_percent_capped_at_a_quarter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(RESERVE_ENV, raising=False)
    assert reserve_bytes(100 << 30) == 2 << 30  # 2% of 100 GiB
    assert reserve_bytes(1 << 30) == 64 * MiB
    assert reserve_bytes(16 * MiB) == 4 * MiB  # a small home keeps three quarters usable
    monkeypatch.setenv(RESERVE_ENV, "12345")
    assert reserve_bytes(1 << 30) == 12345


@pytest.mark.parametrize("text", ["-1", "1e9", "١٢٣", " 12", str(RESERVE_MAX + 1)])
def test_a_reserve_that_is_not_a_bounded_ascii_number_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setenv(RESERVE_ENV, text)
    with pytest.raises(HomeUnusable, match=RESERVE_ENV):
        reserve_bytes(1 << 30)


def test_admission_below_the_reserve_refuses_naming_free_bytes_reserve_and_path(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RESERVE_ENV, str(RESERVE_MAX))  # more than any disk here has free
    with pytest.raises(SpaceExhausted) as refused:
        rt.exec(task.task, shell="echo never", key="k")
    error = refused.value
    assert error.reserve == RESERVE_MAX and error.free is not None and error.free < RESERVE_MAX
    assert error.path == rt.home and rt.home in str(error) and str(error.free) in str(error)
    assert error.exit_code == 3
    assert rt.store.list_sessions(task.task) == [], "nothing was recorded"
    with pytest.raises(SpaceExhausted, match="task new refused"):
        rt.new_task()
    body = error.to_json()
    assert body["error"] == "SpaceExhausted" and body["reserve_bytes"] == RESERVE_MAX


def test_a_retry_below_the_reserve_still_returns_its_session(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Identity outlives transport: a retry of an admitted command or of `task new` creates
    nothing and needs no space, so the reserve never turns it into a refusal."""
    first = rt.exec(task.task, shell="echo once", key="k-retry")
    rt.wait(first.session, timeout=30)
    defaulted = rt.new_task(key="k-default")  # in a workspace settled makes
    monkeypatch.setenv(RESERVE_ENV, str(RESERVE_MAX))
    again = rt.exec(task.task, shell="echo once", key="k-retry")
    assert again.reused is True and again.session == first.session
    with pytest.raises(SpaceExhausted):
        rt.exec(task.task, shell="echo a new command", key="k-new")
    assert rt.new_task(task.workspace, key=task.key).task == task.task  # a retried task new
    assert rt.new_task(key="k-default").task == defaulted.task  # a retried `task new --key`
    with pytest.raises(SpaceExhausted):
        rt.new_task(key="a-new-task")


def test_a_conflicting_key_below_the_reserve_is_a_key_conflict_before_anything_is_paid(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Is this key a retry is asked first (store/admission.key_verdict): another command under
    an admitted key is refused as KeyConflict on a home below its reserve, never as
    SpaceExhausted, and without the liveness pass a new admission pays for."""
    first = rt.exec(task.task, shell="echo once", key="k-taken")
    rt.wait(first.session, timeout=30)
    monkeypatch.setenv(RESERVE_ENV, str(RESERVE_MAX))  # more than any disk here has free

    def no_pass(*args: object, **kwargs: object) -> None:
        raise AssertionError("a liveness pass was paid for a key that is refused")

    monkeypatch.setattr(rt.recovery, "detect", no_pass)
    with pytest.raises(KeyConflict) as refused:
        rt.exec(task.task, shell="echo another command", key="k-taken")
    assert refused.value.session == first.session and refused.value.exit_code != 3
    assert [s.session for s in rt.store.list_sessions(task.task)] == [first.session]
    with pytest.raises(SpaceExhausted):  # a new key on the same home still meets the reserve
        rt.exec(task.task, shell="echo another command", key="k-new")


def test_the_cli_refuses_below_the_reserve_with_exit_3_and_one_line(
    tmp_path: Path, rt: Runtime, task: TaskRecord
) -> None:
    done = _cli(Path(rt.home), "exec", "--task", task.task, "--", "true",
                **{RESERVE_ENV: str(RESERVE_MAX)})  # fmt: skip
    assert done.returncode == 3, done.stderr
    line = _one_line_error(done, "SpaceExhausted")
    assert rt.home in line and str(RESERVE_MAX) in line
    as_json = _cli(Path(rt.home), "task", "new", "--json", **{RESERVE_ENV: str(RESERVE_MAX)})
    assert as_json.returncode == 3
    assert json.loads(as_json.stdout)["reserve_bytes"] == RESERVE_MAX


def test_http_answers_507_insufficient_storage_below_the_reserve(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    from starlette.testclient import TestClient

    from settled.server import TokenTable, create_app
    from settled.server.auth import FULL_ACCESS

    token = "t" * 40
    app = create_app(rt.home, TokenTable([(token, FULL_ACCESS)]))
    monkeypatch.setenv(RESERVE_ENV, str(RESERVE_MAX))
    with TestClient(app, headers={"Authorization": f"Bearer {token}"}) as client:
        answer = client.post(
            f"/v1/tasks/{task.task}/sessions", json={"key": "k", "shell": "echo never"}
        )
    assert answer.status_code == 507, answer.text
    body = answer.json()
    assert body["error"] == "SpaceExhausted" and body["reserve_bytes"] == RESERVE_MAX
    assert body["path"] == rt.home


def test_a_space_guard_refuses_for_good_once_the_reserve_is_reached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    monkeypatch.setenv(RESERVE_ENV, str(max(0, free - 1000)))
    guard = SpaceGuard(str(tmp_path))
    granted = guard.room(600)
    assert granted <= 600
    assert guard.room(1 << 20) < 1 << 20 and guard.refused is not None
    assert "reserve" in guard.refused and str(tmp_path) in guard.refused
    monkeypatch.setenv(RESERVE_ENV, "0")
    assert guard.room(10) == 0, "a log never resumes after a hole"


# -- a command writing past a small home -----------------------------------------------------


@pytest.mark.timeout(120)
def test_a_command_writing_past_the_home_keeps_draining_and_its_receipt_names_the_dropped_bytes(
    small_fs: Path, tmp_path: Path, reserve_4mib: int
) -> None:
    _skip_unavailable("cgroup2")
    home = small_fs / "home"
    with Runtime(str(home)) as rt:
        task = _task(rt, tmp_path)
        command = f"head -c {FLOOD} /dev/zero; echo done >&2"
        admission = rt.exec(task.task, shell=command, key="flood", boundary="cgroup2")
        view = rt.wait(admission.session, timeout=90)
        receipt = view["receipt"]
        assert view["state"] == "settled" and receipt["death"]["proven"] is True
        assert receipt["exit"]["code"] == 0, "the command never blocked on a full pipe"
        out = receipt["output"]["stdout"]
        assert out["drained"] == FLOOD, "every byte was drained"
        assert out["dropped"] > 0 and out["cursor"] + out["dropped"] == FLOOD
        assert out["complete"] is False and "reserve" in out["dropped_reason"]
        stored = _log(home, admission.session)
        assert len(stored) == out["cursor"] and _b3(stored) == out["digest"]
        assert stored == b"\0" * len(stored), "the stored bytes are a prefix of the output"
        free = os.statvfs(home).f_bavail * os.statvfs(home).f_frsize
        assert free >= reserve_4mib - MiB, "the reserve was left for receipts and the store"
        err = receipt["output"]["stderr"]
        assert err["drained"] == 5 and err["cursor"] + err["dropped"] == 5
        with pytest.raises(SpaceExhausted):  # the home is at its reserve now
            rt.exec(task.task, shell="true", key="after")
    closed = _cli(home, "close", task.task, "--json")
    assert closed.returncode == 0, closed.stderr
    outcome = json.loads(closed.stdout)["outcome"]
    assert outcome["complete"] is True
    [loss] = [x for x in outcome["output_incomplete"] if x["stream"] == "stdout"]
    assert loss["session"] == admission.session and loss["dropped"] == out["dropped"]
    explained = json.loads(_cli(home, "explain", task.task, "--json").stdout)
    assert "Output incomplete" in explained["words"] and explained["output_incomplete"]
    text = _cli(home, "wait", admission.session)
    assert "INCOMPLETE" in text.stdout and "Traceback" not in text.stderr


@pytest.mark.timeout(150)
def test_recover_and_close_on_a_full_disk_give_a_receipt_or_one_line_never_a_traceback(
    small_fs: Path, tmp_path: Path, reserve_4mib: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _skip_unavailable("cgroup2")
    home = small_fs / "home"
    with Runtime(str(home)) as rt:
        task = _task(rt, tmp_path)
        monkeypatch.setenv("SETTLED_FAULT", "owner.mid_drain:crash")
        with contextlib.suppress(Exception):
            rt.exec(task.task, shell="head -c 3000000 /dev/zero; sleep 30", key="lost",
                    boundary="cgroup2")  # fmt: skip
        monkeypatch.delenv("SETTLED_FAULT")
        [record] = rt.store.list_sessions(task.task)
    assert record.owner is not None
    _await_gone(record.owner.pid)  # the fault fires mid-drain, after exec returned
    filler = _fill(small_fs)  # now nothing more fits
    outcomes = []
    for verb in (["recover"], ["close", task.task]):
        done = _cli(home, *verb, "--json")
        assert "Traceback" not in done.stderr, done.stderr
        if done.returncode != 0:
            assert done.returncode in (3, 1), (verb, done.returncode, done.stderr)
            kind = "SpaceExhausted" if done.returncode == 3 else "StorageFailed"
            line = _one_line_error(done, kind)
            assert str(home) in line or str(small_fs) in line, line
        outcomes.append(done.returncode)
    filler.unlink()  # space again: both converge
    assert _cli(home, "recover").returncode == 0
    closed = _cli(home, "close", task.task, "--json")
    assert closed.returncode == 0, closed.stderr
    with Runtime(str(home)) as rt:
        receipt = rt.store.get_session(record.session).receipt
        assert receipt is not None and receipt["death"]["proven"] is True
        stored = _log(home, record.session)
        assert receipt["output"]["stdout"]["cursor"] == len(stored)
        assert receipt["output"]["stdout"]["digest"] == _b3(stored)
        assert receipt["output"]["stdout"]["closed"].startswith("in place"), "no copy was made"


def test_the_store_on_a_full_disk_raises_space_exhausted_not_a_sqlite_error(
    small_fs: Path,
) -> None:
    from settled.store import open_store

    home = small_fs / "home"
    home.mkdir()
    store = open_store(str(home))
    try:
        _fill(small_fs)
        with pytest.raises(SpaceExhausted) as refused:
            for n in range(20_000):  # each insert grows the WAL until the disk refuses it
                store.create_task(f"k{n}", "/" + "w" * 4000)
        assert str(home) in str(refused.value)
        assert "Traceback" not in str(refused.value)
    finally:
        store.close()


@pytest.mark.parametrize(("code", "kind"), [(10, StorageFailed), (13, SpaceExhausted)])
def test_a_store_that_cannot_open_on_a_failing_disk_is_a_storage_error_not_a_bad_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, kind: type[Exception]
) -> None:
    """Opening the WAL on a full disk can fail with SQLite's I/O error: that is the disk's
    failure (exit 1 or 3, retry when there is space), not a home the user must fix (exit 2)."""
    import sqlite3

    from settled.store import open_store
    from settled.store.sqlite import SQLiteStore

    def failing_wal(self: SQLiteStore) -> None:
        error = sqlite3.OperationalError("disk I/O error")
        error.sqlite_errorcode = code  # type: ignore[attr-defined]
        raise error

    monkeypatch.setattr(SQLiteStore, "_enable_wal", failing_wal)
    home = tmp_path / "home"
    home.mkdir()
    with pytest.raises(kind) as refused:
        open_store(str(home))
    assert not isinstance(refused.value, HomeUnusable)
    assert "opening the store" in str(refused.value) and str(home) in str(refused.value)


def test_a_home_that_cannot_be_created_on_a_full_disk_is_space_exhausted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mkdir on a full disk answers ENOSPC: the user frees space, they need not move the home."""
    import errno

    from settled.home import prepare_home

    def full_disk(path: str, mode: int = 0o777, exist_ok: bool = False) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(os, "makedirs", full_disk)
    with pytest.raises(SpaceExhausted) as refused:
        prepare_home(str(tmp_path / "home"))
    assert "creating the settled home" in str(refused.value)


# -- ENOSPC and EIO at the fault points ------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("action", "name"), [("enospc", "ENOSPC"), ("eio", "EIO")])
def test_a_log_write_that_fails_keeps_draining_and_the_receipt_counts_every_byte(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch, action: str, name: str
) -> None:
    _skip_unavailable("cgroup2")
    monkeypatch.setenv("SETTLED_FAULT", f"owner.log_write:{action}")
    admission = rt.exec(task.task, shell="head -c 5000000 /dev/zero", key=action,
                        boundary="cgroup2")  # fmt: skip
    monkeypatch.delenv("SETTLED_FAULT")
    receipt = rt.wait(admission.session, timeout=45)["receipt"]
    assert receipt["death"]["proven"] is True and receipt["exit"]["code"] == 0
    out = receipt["output"]["stdout"]
    assert (out["cursor"], out["dropped"], out["drained"]) == (0, 5_000_000, 5_000_000)
    assert out["complete"] is False
    assert name in out["dropped_reason"] and "injected" in out["dropped_reason"]
    assert _log(Path(rt.home), admission.session) == b""
    result = rt.close_task(task.task)
    assert result.complete
    words = rt.explain(task.task)["words"]
    assert f"session {admission.session} stdout stored 0 bytes and 5000000 more" in words


@pytest.mark.timeout(60)
def test_a_failed_fsync_is_named_in_the_receipt_and_nothing_after_it_is_stored(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    _skip_unavailable("cgroup2")
    monkeypatch.setenv("SETTLED_FAULT", "owner.log_sync:eio")
    admission = rt.exec(task.task, shell="printf abc", key="sync", boundary="cgroup2")
    monkeypatch.delenv("SETTLED_FAULT")
    receipt = rt.wait(admission.session, timeout=45)["receipt"]
    out = receipt["output"]["stdout"]
    assert out["complete"] is False and "fsync failed" in out["dropped_reason"]
    assert "EIO" in out["dropped_reason"]
    assert out["cursor"] + out["dropped"] == out["drained"] == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("action", ["enospc", "eio"])
def test_an_owner_that_cannot_write_its_receipt_leaves_the_reason_unknown_carries(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    _skip_unavailable("cgroup2")
    monkeypatch.setenv("SETTLED_FAULT", f"owner.receipt_write:{action}")
    admission = rt.exec(task.task, shell="printf out", key=action, boundary="cgroup2")
    monkeypatch.delenv("SETTLED_FAULT")
    # Read by status, not `wait`: a wait that meets the gone owner recovers it itself (issue 39)
    give_up = time.monotonic() + 45
    while (view := rt.session_status(admission.session))["state"] != "unknown":
        assert time.monotonic() < give_up, view
        time.sleep(0.05)
    assert view["state"] == "unknown", view
    assert "could not write its receipt" in view["reason"]
    strerror = os.strerror(28 if action == "enospc" else 5)
    assert strerror in view["reason"], view["reason"]
    status = _cli(Path(rt.home), "status", admission.session, "--json")
    assert json.loads(status.stdout)["reason"] == view["reason"]
    [result] = rt.recover(task.task)
    assert result["state"] == "settled", result
    record = rt.store.get_session(admission.session)
    assert record.receipt is not None and record.receipt["death"]["proven"] is True
    assert "could not write its receipt" in (record.unknown_why or "")
    assert record.receipt["owner"]["last_words"]["reason"] == view["reason"]
    assert record.receipt["output"]["stdout"]["cursor"] == 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("action", "code", "kind"), [("enospc", 3, "SpaceExhausted"),
                                                      ("eio", 1, "StorageFailed")])  # fmt: skip
def test_a_checkpoint_blob_write_that_fails_makes_close_one_line_then_a_retry_completes(
    tmp_path: Path, action: str, code: int, kind: str
) -> None:
    home, workspace = tmp_path / "home", tmp_path / "ws"
    workspace.mkdir()
    (workspace / "file").write_text("data\n")
    task = json.loads(_cli(home, "task", "new", "--workspace", str(workspace), "--json").stdout)
    failed = _cli(home, "close", task["task"], "--json",
                  SETTLED_FAULT=f"checkpoint.blob_write:{action}")  # fmt: skip
    assert failed.returncode == code, failed.stderr
    line = _one_line_error(failed, kind)
    assert str(home) in line
    assert json.loads(failed.stdout)["error"] == kind
    retried = _cli(home, "close", task["task"], "--json")
    assert retried.returncode == 0, retried.stderr
    assert json.loads(retried.stdout)["outcome"]["complete"] is True


def test_every_write_fault_point_is_listed(tmp_path: Path) -> None:
    listed = _cli(tmp_path / "home", "close", "--list-fault-points").stdout.split()
    for name in ("owner.log_write", "owner.log_sync", "owner.receipt_write",
                 "checkpoint.blob_write"):  # fmt: skip
        assert name in listed


@pytest.mark.timeout(150)
def test_a_command_that_fills_the_disk_itself_still_gets_an_honest_outcome(
    small_fs: Path, reserve_4mib: int
) -> None:
    """The workspace shares the small filesystem: the command fills it to the last block, then
    writes output. Either the receipt fits (and names the dropped bytes) or the session is
    unknown with the reason its owner recorded; once space returns, recovery settles it."""
    _skip_unavailable("cgroup2")
    home, workspace = small_fs / "home", small_fs / "ws"
    workspace.mkdir()
    command = f"head -c {FLOOD} /dev/zero > fill; head -c 3000000 /dev/zero; echo end"
    with Runtime(str(home)) as rt:
        task = rt.new_task(str(workspace))
        admission = rt.exec(task.task, shell=command, key="fill", boundary="cgroup2")
        view = rt.wait(admission.session, timeout=90)
        if view["state"] == "settled":
            out = view["receipt"]["output"]["stdout"]
            assert out["dropped"] > 0 and out["complete"] is False, out
            assert out["cursor"] + out["dropped"] == out["drained"] == 3_000_004
        else:
            assert view["state"] == "unknown", view
            assert "could not write its receipt" in view["reason"], view
            assert "No space left on device" in view["reason"]
            shown = _cli(home, "status", admission.session)
            assert "reason: the owner could not write its receipt" in shown.stdout
        (workspace / "fill").unlink()
        rt.recover()
        record = rt.store.get_session(admission.session)
        assert record.state == "settled" and record.receipt is not None
        assert record.receipt["death"]["proven"] is True
