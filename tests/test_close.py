"""The close join and the workspace service: completion is derived from receipts, never stored.

Each test is one of issue 3's probes, run with real processes, a real journal and real files.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ESCAPEE, tamper_object

from settled.errors import AdmissionSealed, StaleWrite
from settled.faults import ALL_POINTS, CHECKPOINT_POINTS, CLOSE_POINTS
from settled.records import TaskRecord
from settled.runtime import Runtime
from settled.workspace.journal import lifecycle as journal_lifecycle
from settled.workspace.manifest import read_manifest
from settled.workspace.scan import CLOCK_SLACK_NS, COARSE_FS_SLACK_NS

SETTLED = [sys.executable, "-m", "settled.cli"]


def manifest_of(rt: Runtime, receipt: dict[str, Any]) -> dict[str, Any]:
    manifest = read_manifest(rt.workspace.objects, receipt["checkpoint"]["manifest"])
    return {entry.path: entry for entry in manifest.entries}


def close(rt: Runtime, task: TaskRecord, **kw: Any) -> dict[str, Any]:
    result = rt.close_task(task.task, **kw)
    assert result.complete, result.blocked_on
    assert result.receipt is not None
    return result.receipt


def test_close_names_required_failed_timed_out_and_service_sessions(
    rt: Runtime, task: TaskRecord
) -> None:
    ok = rt.exec(task.task, shell="echo ok > ok.txt", key="ok")
    bad = rt.exec(task.task, shell="exit 3", key="bad")
    slow = rt.exec(task.task, shell="sleep 30", key="slow", timeout=0.5, grace=0.5)
    server = rt.exec(task.task, shell="sleep 600", key="server", service=True)
    receipt = close(rt, task, final="all done", deadline=20)
    commands = receipt["outcome"]["commands"]
    assert commands["succeeded"] == [f"{ok.session} (ok)"]
    assert commands["failed"] == [f"{bad.session} (bad)"]
    assert commands["timed_out"] == [f"{slow.session} (slow)"]
    assert commands["services_stopped"] == [f"{server.session} (server)"]
    assert receipt["outcome"]["complete"] is True
    assert receipt["outcome"]["all_commands_succeeded"] is False
    assert receipt["final"] == "all done"
    assert "ok.txt" in manifest_of(rt, receipt)


def test_a_required_session_past_the_deadline_is_cancelled(rt: Runtime, task: TaskRecord) -> None:
    stuck = rt.exec(task.task, shell="sleep 300", key="stuck", grace=0.5)
    receipt = close(rt, task, deadline=0.3)
    assert receipt["outcome"]["commands"]["cancelled"] == [f"{stuck.session} (stuck)"]
    session = rt.store.get_session(stuck.session)
    assert session.receipt is not None and session.receipt["death"]["proven"]


def test_a_file_written_just_before_exit_is_in_the_manifest_without_the_watcher(
    rt: Runtime, task: TaskRecord
) -> None:
    admission = rt.exec(task.task, shell="sleep 0.2; printf last > late.txt", key="late")
    rt.wait(admission.session, timeout=30)
    journal_lifecycle.stop(rt.workspace.socket())  # no watcher event can report it now
    Path(task.workspace, "after-the-watcher.txt").write_text("seen by the final scan")
    receipt = close(rt, task)
    entries = manifest_of(rt, receipt)
    assert {"late.txt", "after-the-watcher.txt"} <= set(entries)
    assert receipt["final_scan"]["journal"] == {"running": False}


def test_the_checkpoint_covers_every_terminal_mutation(rt: Runtime, task: TaskRecord) -> None:
    for i in range(3):
        rt.wait(rt.exec(task.task, shell=f"echo {i} > f{i}", key=f"w{i}").session, timeout=30)
    receipt = close(rt, task)
    seqs = [s["terminal_mutation"]["seq"] for s in receipt["sessions"]]
    assert all(isinstance(seq, int) for seq in seqs)
    assert seqs == sorted(seqs) and seqs[0] < seqs[-1]
    assert receipt["checkpoint"]["watermark"] >= max(seqs)
    assert receipt["checkpoint"]["read_back"] == {
        **receipt["checkpoint"]["read_back"],
        "verified": True,
        "id": receipt["checkpoint"]["manifest"],
    }


def test_a_symlink_pointing_outside_is_recorded_as_a_link_and_never_followed(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    secret = tmp_path / "outside-secret"
    secret.write_text("must never be read into a checkpoint")
    os.symlink(secret, Path(task.workspace, "escape"))
    receipt = close(rt, task)
    entry = manifest_of(rt, receipt)["escape"]
    assert entry.type == "symlink" and entry.target == str(secret)
    for digest in [e.digest for e in manifest_of(rt, receipt).values() if e.digest]:
        assert rt.workspace.objects.read(digest) != secret.read_bytes()


def _tree(root: Path) -> dict[str, tuple[str, int, bytes | str]]:
    found: dict[str, tuple[str, int, bytes | str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            st = path.lstat()
            rel = str(path.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                found[rel] = ("link", 0, os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                found[rel] = ("dir", stat.S_IMODE(st.st_mode), b"")
            else:
                found[rel] = ("file", stat.S_IMODE(st.st_mode), path.read_bytes())
    return found


def test_restore_reproduces_the_tree_bit_for_bit(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    ws = Path(task.workspace)
    (ws / "bin").mkdir()
    (ws / "bin" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (ws / "bin" / "run.sh").chmod(0o755)
    (ws / "data.bin").write_bytes(os.urandom(300_000))
    (ws / "empty").mkdir(mode=0o700)
    (ws / "empty").chmod(0o700)
    os.symlink("bin/run.sh", ws / "alias")
    rt.wait(rt.exec(task.task, shell="echo made > made-by-command", key="m").session, timeout=30)
    close(rt, task)
    dest = tmp_path / "restored"
    result = rt.restore(task.task, str(dest))
    assert result.complete
    assert _tree(dest) == _tree(ws)


def test_a_tampered_blob_is_refused_on_restore_naming_the_object(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    Path(task.workspace, "precious.txt").write_text("original content")
    receipt = close(rt, task)
    digest = manifest_of(rt, receipt)["precious.txt"].digest
    assert digest is not None
    tamper_object(rt.workspace.objects, digest, lambda _old: b"tampered content")
    dest = tmp_path / "restored"
    with pytest.raises(Exception, match=digest.split(":")[1][:16]):
        rt.restore(task.task, str(dest))
    assert not dest.exists(), "a refused restore leaves nothing at the destination"


def test_admission_is_sealed_once_close_begins(rt: Runtime, task: TaskRecord) -> None:
    close(rt, task)
    with pytest.raises(AdmissionSealed, match=task.task):
        rt.exec(task.task, shell="echo too late")
    assert rt.store.list_sessions(task.task) == []


def test_a_repeated_close_returns_the_same_receipt_and_runs_nothing_again(
    rt: Runtime, task: TaskRecord
) -> None:
    rt.exec(task.task, shell="echo once >> runs", key="once")
    first = close(rt, task)
    second = close(rt, task, final="a different final response")
    assert second == first
    assert Path(task.workspace, "runs").read_text() == "once\n"


def test_a_session_without_death_evidence_blocks_close_naming_it(
    rt: Runtime, task: TaskRecord, marker: str
) -> None:
    from conftest import kill_marked

    admission = rt.exec(task.task, shell=ESCAPEE, key="pg", boundary="pgroup", grace=0.2)
    rt.wait(admission.session, timeout=30)
    try:
        result = rt.close_task(task.task)
        assert not result.complete and result.blocked_on is not None
        assert result.blocked_on["authority"] == "recovery"
        assert result.blocked_on["session"] == admission.session
        explained = rt.explain(task.task)
        assert explained["complete"] is False and admission.session in explained["words"]
    finally:
        kill_marked(marker, b"sleep")


def test_explain_names_the_receipts_that_allowed_success(rt: Runtime, task: TaskRecord) -> None:
    admission = rt.exec(task.task, shell="true", key="t")
    before = rt.explain(task.task)
    assert before["complete"] is False and before["blocked_on"]["obligation"]
    receipt = close(rt, task)
    after = rt.explain(task.task)
    assert after["complete"] is True
    assert after["allowed_by"]["checkpoint_receipt"] == receipt["checkpoint"]["digest"]
    [process] = after["allowed_by"]["process_receipts"]
    assert process["session"] == admission.session


def test_a_checkpoint_from_a_fenced_generation_is_refused(rt: Runtime, task: TaskRecord) -> None:
    close(rt, task)
    stale = rt.store.get_task(task.task)
    fact = rt.store.close_steps(task.task)["final_scan"]
    old_generation = TaskRecord(**{**stale.to_json(), "generation": stale.generation - 1})
    with pytest.raises(StaleWrite, match="fenced"):
        rt.workspace.checkpoint(old_generation, fact, [])


def test_every_fault_point_is_listed(tmp_path: Path) -> None:
    done = subprocess.run(
        [*SETTLED, "close", "--list-fault-points"], capture_output=True, timeout=60,
        env={**os.environ, "SETTLED_HOME": str(tmp_path / "home")},
    )  # fmt: skip
    assert done.returncode == 0
    assert done.stdout.decode().split() == list(ALL_POINTS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", CHECKPOINT_POINTS + CLOSE_POINTS)
def test_a_crash_at_each_close_fault_point_is_finished_by_a_retried_close(
    tmp_path: Path, point: str
) -> None:
    home, ws = tmp_path / "home", tmp_path / "ws"
    ws.mkdir()
    env = {**os.environ, "SETTLED_HOME": str(home)}

    def settled(*args: str, fault: str | None = None) -> subprocess.CompletedProcess[bytes]:
        extra = {"SETTLED_FAULT": f"{fault}:crash"} if fault else {}
        return subprocess.run(
            [*SETTLED, *args], capture_output=True, timeout=90, env={**env, **extra}
        )

    task = json.loads(settled("task", "new", "--workspace", str(ws), "--json").stdout)["task"]
    settled("exec", "--task", task, "--key", "w", "--wait", "--", "echo run >> runs")
    crashed = settled("close", task, "--json", fault=point)
    assert crashed.returncode == -9, (point, crashed.stdout, crashed.stderr)
    retried = settled("close", task, "--json")
    assert retried.returncode == 0, retried.stderr
    receipt = json.loads(retried.stdout)
    assert receipt["kind"] == "close" and receipt["outcome"]["complete"] is True
    assert (ws / "runs").read_text() == "run\n", "no command is launched twice"
    again = settled("close", task, "--json")
    assert json.loads(again.stdout) == receipt
    with Runtime(str(home)) as rt:
        assert rt.explain(task)["complete"] is True
        assert "runs" in manifest_of(rt, receipt)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point", [p for p in ALL_POINTS if p.startswith("owner.")])
def test_each_owner_fault_point_kills_the_owner_there_and_leaves_it_unknown(
    rt: Runtime, task: TaskRecord, point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import _skip_unavailable

    from settled.errors import OwnerLaunchFailed

    _skip_unavailable("cgroup2")
    monkeypatch.setenv("SETTLED_FAULT", f"{point}:crash")
    try:
        admission = rt.exec(task.task, shell="printf x; sleep 0.3", boundary="cgroup2", key="f")
        session = admission.session
    except OwnerLaunchFailed:
        [record] = rt.store.list_sessions(task.task)
        session = record.session
    monkeypatch.delenv("SETTLED_FAULT")
    record = rt.store.get_session(session)
    assert record.owner is not None, "every owner point lies after the claim"
    deadline = time.monotonic() + 20
    while (facts := rt.owner_facts(rt.store.get_session(session))) and facts.alive:
        assert time.monotonic() < deadline, f"the owner survived {point}"
        time.sleep(0.01)
    view = rt.session_status(session)
    assert view["state"] == "unknown", (point, view["state"])
    assert record.receipt is None, "a crashed owner never leaves a receipt"
    [recovered] = rt.recover(task.task)  # the runtime ends what the crashed owner left
    assert recovered["state"] == "settled", recovered


def test_an_incremental_checkpoint_follows_the_change_and_matches_a_full_one(
    rt: Runtime, task: TaskRecord
) -> None:
    ws = Path(task.workspace)
    for d in range(20):
        (ws / f"d{d}").mkdir()
        for f in range(10):
            (ws / f"d{d}" / f"f{f}").write_text(f"{d}-{f}")
    first = rt.checkpoint(task.task)
    assert first["scan"]["mode"] == "full"
    # An object written within CLOCK_SLACK_NS of its read-back is not trusted later (the
    # racy-git rule; file times come from a coarse clock), and how many are depends on the
    # machine's load. A verify once that window has passed records every object unracily, so
    # the counts below do not depend on timing.
    # (An S3 store stamps whole seconds, like a coarse filesystem: 2 s more.)
    coarse = 0 if hasattr(rt.workspace.objects, "path_of") else COARSE_FS_SLACK_NS
    time.sleep((CLOCK_SLACK_NS + coarse) / 1e9 + 0.01)
    assert rt.verify(task.task)["verified"]
    rt.wait(rt.exec(task.task, shell="echo changed > d7/f3; echo new > d7/g", key="c").session)
    second = rt.checkpoint(task.task)
    assert second["scan"]["mode"] == "incremental"
    assert second["scan"]["stats"]["dirs_listed"] <= 2, second["scan"]["stats"]
    assert second["scan"]["stats"]["trees_built"] == 2  # d7 and the root; 19 subtrees reused
    read_back = second["read_back"]
    assert read_back["scope"] == "since_parent" and read_back["trees_verified"] == 2
    assert read_back["trusted_subtrees"] == 19 and read_back["trusted_from"] == first["manifest"]
    # the manifest, two new trees, d7's 11 blobs and the roots of the 19 subtrees it reuses
    assert read_back["objects_reached"] == 1 + 2 + 11 + 19
    assert read_back["objects_reached"] == read_back["rehashed"] + read_back["trusted"]
    assert second["parent"] == first["manifest"]
    full = rt.checkpoint(task.task, incremental=False)
    assert full["scan"]["mode"] == "full"
    assert (
        read_manifest(rt.workspace.objects, full["manifest"]).entries
        == read_manifest(rt.workspace.objects, second["manifest"]).entries
    )


def test_a_new_runtime_reads_the_stat_cache_back_and_stays_incremental(
    rt: Runtime, task: TaskRecord
) -> None:
    ws = Path(task.workspace)
    for d in range(5):
        (ws / f"d{d}").mkdir()
        (ws / f"d{d}" / "f").write_text(str(d))
    rt.checkpoint(task.task)
    (ws / "d3" / "f").write_text("changed")
    with Runtime(rt.home) as fresh:
        after = fresh.checkpoint(task.task)
    assert after["scan"]["mode"] == "incremental" and after["scan"]["stat_cache"] == "used"
    assert after["scan"]["stats"]["files_hashed"] == 1
    entries = {e.path: e for e in read_manifest(rt.workspace.objects, after["manifest"]).entries}
    restored = Path(task.workspace).parent / "restored"
    rt.restore(after["manifest"], str(restored))
    assert (restored / "d3" / "f").read_text() == "changed" and len(entries) == 11


def test_an_unreadable_stat_cache_costs_a_full_scan_not_a_wrong_checkpoint(
    rt: Runtime, task: TaskRecord
) -> None:
    ws = Path(task.workspace)
    (ws / "d").mkdir()
    (ws / "d" / "f").write_text("one")
    first = rt.checkpoint(task.task)
    latest = rt.store.latest_checkpoint(task.task)
    assert latest is not None and latest[1] is not None
    with sqlite3.connect(Path(rt.home) / "index.db") as db:  # the stat cache's root, damaged
        db.execute("UPDATE nodes SET data=CAST('{}' AS BLOB) WHERE ref=?", (latest[1],))
    (ws / "d" / "f").write_text("two")
    with Runtime(rt.home) as fresh:
        after = fresh.checkpoint(task.task)
    assert after["scan"]["mode"] == "full"
    assert after["scan"]["stat_cache"].startswith("unusable, scanned without it")
    assert after["manifest"] != first["manifest"]
    entries = {e.path: e for e in read_manifest(rt.workspace.objects, after["manifest"]).entries}
    assert entries["d/f"].size == 3 and after["scan"]["stats"]["files_hashed"] == 1


def test_without_a_trustworthy_journal_a_checkpoint_scans_everything(
    rt: Runtime, task: TaskRecord
) -> None:
    Path(task.workspace, "a").write_text("1")
    rt.checkpoint(task.task)
    journal_lifecycle.stop(rt.workspace.socket())
    Path(task.workspace, "b").write_text("2")  # no journal saw this
    after = rt.checkpoint(task.task)
    assert after["scan"]["mode"] == "full"
    assert "b" in {e.path for e in read_manifest(rt.workspace.objects, after["manifest"]).entries}


def test_task_status_is_computed_from_the_close_facts(
    rt: Runtime, task: TaskRecord, marker: str
) -> None:
    from conftest import kill_marked

    assert rt.task_status(task.task)["state"] == "open"
    admission = rt.exec(task.task, shell=ESCAPEE, boundary="pgroup", key="p")
    rt.wait(admission.session, timeout=30)
    try:
        rt.close_task(task.task)
        view = rt.task_status(task.task)
        assert view["state"] == "blocked" and view["complete"] is False
        assert view["blocked_on"]["session"] == admission.session
    finally:
        kill_marked(marker, b"sleep")


def test_every_step_of_the_table_has_one_function_that_performs_it() -> None:
    from settled.close.decide import STEPS
    from settled.close.join import PERFORM

    assert list(PERFORM) == [step.name for step in STEPS]


def test_only_the_last_close_step_waits_for_the_disk_and_every_step_is_recorded(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The steps before the last are committed without an fsync of the store's log (a power
    cut can lose only a tail of them, a state any crash there leaves); the last one is durable,
    which makes them all durable before the receipt is returned."""
    from settled.close.decide import STEPS
    from settled.store import open_store

    recorded: list[tuple[str, bool]] = []
    record = rt.store.record_close_step

    def spy(task_id: str, step: str, fact: dict[str, Any], **kw: Any) -> dict[str, Any]:
        recorded.append((step, kw.get("durable", True)))
        return record(task_id, step, fact, **kw)

    monkeypatch.setattr(rt.store, "record_close_step", spy)
    rt.exec(task.task, shell="echo once > once.txt", key="once")
    receipt = close(rt, task)
    names = [step.name for step in STEPS]
    assert recorded == [(name, name == names[-1]) for name in names]
    other = open_store(rt.home)
    try:
        assert sorted(other.close_steps(task.task)) == sorted(names)
        assert other.get_task(task.task).state == "complete"
    finally:
        other.close()
    assert "once.txt" in manifest_of(rt, receipt)
