"""A read-back that reads: every object a checkpoint's manifest reaches is checked, or the receipt
says what it trusted; damage found at a close is healed from the workspace when it can be; and
`settled verify` audits a checkpoint like `restic check [--read-data]`.

Issue 10's probes, with real files: an object in `<home>/objects` damaged (overwritten after a
chmod) or deleted after the checkpoint that published it, then reused by the next one.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from settled.records import TaskRecord
from settled.runtime import Runtime
from settled.workspace import verified
from settled.workspace.checkpoint import CheckpointUnverified
from settled.workspace.manifest import FILE, read_manifest
from settled.workspace.verified import Verified, VerifiedRecord, key_of

SETTLED = [sys.executable, "-m", "settled.cli"]


def blob_of(rt: Runtime, manifest_id: str, path: str) -> str:
    entry = {e.path: e for e in read_manifest(rt.workspace.objects, manifest_id).entries}[path]
    assert entry.digest is not None
    return entry.digest


def damage(rt: Runtime, digest: str, data: bytes) -> None:
    path = rt.workspace.objects.path_of(digest)
    os.chmod(path, 0o600)
    Path(path).write_bytes(data)


def close(rt: Runtime, task: TaskRecord) -> dict[str, Any]:
    result = rt.close_task(task.task)
    assert result.complete, result.blocked_on
    assert result.receipt is not None
    return result.receipt


def restored(rt: Runtime, target: str, dest: Path) -> dict[str, bytes]:
    result = rt.restore(target, str(dest))
    assert result.complete
    return {str(p.relative_to(dest)): p.read_bytes() for p in dest.rglob("*") if p.is_file()}


def verify_cli(rt: Runtime, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SETTLED, "--home", rt.home, "verify", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def make_files(task: TaskRecord) -> Path:
    ws = Path(task.workspace)
    (ws / "d").mkdir()
    (ws / "a.txt").write_bytes(b"alpha")
    (ws / "d" / "b.txt").write_bytes(b"beta")
    (ws / "d" / "copy.txt").write_bytes(b"alpha")
    time.sleep(0.05)  # older than the scan's racy cutoff: the next scans reuse their digests
    return ws


# -- the read-back of a close (and of any full scan) checks the whole closure ------------------


def test_a_reused_blob_damaged_since_its_checkpoint_is_found_and_healed_by_a_full_checkpoint(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    ws = make_files(task)
    first = rt.checkpoint(task.task)
    alpha = blob_of(rt, first["manifest"], "a.txt")
    damage(rt, alpha, b"ALPHA")  # same size: only a re-hash can tell
    (ws / "d" / "b.txt").write_bytes(b"beta, changed")
    second = rt.checkpoint(task.task, incremental=False)
    read_back = second["read_back"]
    assert read_back["verified"]  # before issue 10's fix: verified, and the restore failed
    assert restored(rt, second["manifest"], tmp_path / "dest") == {
        "a.txt": b"alpha", "d/b.txt": b"beta, changed", "d/copy.txt": b"alpha",
    }  # fmt: skip
    assert read_back["scope"] == "closure"
    healed = read_back["healed"]
    assert healed["problems"] == [
        {"object": alpha, "problem": "damaged", "paths": ["a.txt", "d/copy.txt"],
         "detail": healed["problems"][0]["detail"]},
    ]  # fmt: skip
    [moved] = healed["quarantined"]
    assert moved["object"] == alpha and Path(moved["moved_to"]).read_bytes() == b"ALPHA"
    assert healed["rescan"]["same_tree"] is True


def test_a_reused_blob_deleted_since_its_checkpoint_is_published_again_by_the_close(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    make_files(task)
    first = rt.checkpoint(task.task)
    beta = blob_of(rt, first["manifest"], "d/b.txt")
    os.unlink(rt.workspace.objects.path_of(beta))
    checkpoint = close(rt, task)["checkpoint"]
    assert checkpoint["read_back"]["verified"]  # before the fix: verified, the restore failed
    assert restored(rt, task.task, tmp_path / "dest")["d/b.txt"] == b"beta"
    healed = checkpoint["read_back"]["healed"]
    assert healed["problems"] == [{"object": beta, "problem": "missing", "paths": ["d/b.txt"]}]
    assert healed["quarantined"] == []


def test_a_damaged_object_the_workspace_no_longer_holds_is_named_with_its_paths(
    rt: Runtime, task: TaskRecord
) -> None:
    ws = make_files(task)
    first = rt.checkpoint(task.task)
    beta = blob_of(rt, first["manifest"], "d/b.txt")
    fact = rt.workspace.final_scan(task)  # the close's final scan: d/b.txt as it was
    damage(rt, beta, b"BETA")
    (ws / "d" / "b.txt").write_bytes(b"since rewritten")  # the bytes are gone from the workspace
    with pytest.raises(CheckpointUnverified) as raised:
        rt.workspace.checkpoint(task, fact, [])
    [problem] = raised.value.problems
    assert (problem.object, problem.problem, problem.paths) == (beta, "damaged", ("d/b.txt",))
    message = str(raised.value)
    assert beta in message and "d/b.txt" in message and "no longer holds them" in message
    quarantine = Path(rt.workspace.objects.root, "quarantine")
    [kept] = list(quarantine.iterdir())
    assert kept.read_bytes() == b"BETA" and str(kept) in message  # evidence, not deleted
    latest = rt.store.latest_checkpoint(task.task)
    assert latest is not None and latest[0]["manifest"] == first["manifest"]  # no new receipt


def test_a_damaged_reused_tree_is_healed_from_the_workspace(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    ws = make_files(task)
    first = rt.checkpoint(task.task)
    tree = {e.path: e.tree for e in read_manifest(rt.workspace.objects, first["manifest"]).entries}
    assert tree["d"] is not None
    damage(rt, tree["d"], b"{}")
    (ws / "a.txt").write_bytes(b"alpha, changed")  # d is reused as it was
    checkpoint = close(rt, task)["checkpoint"]
    [problem] = checkpoint["read_back"]["healed"]["problems"]
    assert (problem["object"], problem["problem"], problem["paths"]) == (
        tree["d"],
        "damaged",
        ["d"],
    )
    assert restored(rt, task.task, tmp_path / "dest")["d/b.txt"] == b"beta"


def test_a_close_checks_every_object_its_manifest_reaches(rt: Runtime, task: TaskRecord) -> None:
    ws = Path(task.workspace)
    for d in range(4):
        (ws / f"d{d}" / "sub").mkdir(parents=True)
        (ws / f"d{d}" / "sub" / "f").write_bytes(b"%d" % d)
        (ws / f"d{d}" / "g").write_bytes(b"shared")
    rt.checkpoint(task.task)
    rt.wait(rt.exec(task.task, shell="echo new > d2/g", key="w").session, timeout=30)
    checkpoint = close(rt, task)["checkpoint"]
    manifest = read_manifest(rt.workspace.objects, checkpoint["manifest"])
    trees = {e.tree for e in manifest.entries if e.tree is not None}
    blobs = {e.digest for e in manifest.entries if e.type == FILE}
    read_back = checkpoint["read_back"]
    assert read_back["scope"] == "closure" and read_back["trusted_subtrees"] == 0
    assert read_back["objects_reached"] == 1 + len(trees) + len(blobs)
    assert read_back["objects_reached"] == read_back["rehashed"] + read_back["trusted"]
    assert "healed" not in read_back and read_back["trusted_from"] is None


def test_objects_unchanged_since_they_hashed_right_are_trusted_and_a_touched_one_is_not(
    rt: Runtime, task: TaskRecord
) -> None:
    make_files(task)
    time.sleep(0.05)  # the files are not racy for the scan's stat cache
    first = rt.checkpoint(task.task)
    time.sleep(0.05)  # and the objects not racy for the verified-object record
    rt.checkpoint(task.task, incremental=False)  # re-hashes what was racy at the first
    again = rt.checkpoint(task.task, incremental=False)["read_back"]
    assert (again["rehashed"], again["trusted"]) == (1, again["objects_reached"] - 1)
    os.chmod(rt.workspace.objects.path_of(blob_of(rt, first["manifest"], "a.txt")), 0o444)
    touched = rt.checkpoint(task.task, incremental=False)["read_back"]
    assert (touched["rehashed"], touched["blobs_verified"]) == (2, 1)


def test_a_rehash_racy_with_the_copy_it_read_is_not_recorded(
    rt: Runtime, task: TaskRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Objects a checkpoint has just published changed within the re-hash's clock slack: a
    row for them could vouch for nothing, so none is written (the next read-back re-hashes
    them and records them, by then safely old). The first read-back is made racy by a slack
    of a minute, not by trusting the machine to re-hash within 20 ms of publishing (under
    load it did not, and the objects were rightly recorded)."""
    make_files(task)
    with monkeypatch.context() as slow:  # undoes its own patch only, not the fixtures'
        slow.setattr(verified, "CLOCK_SLACK_NS", 60 * 10**9)
        first = rt.checkpoint(task.task)["read_back"]
    assert first["rehashed"] == first["objects_reached"]
    with sqlite3.connect(Path(rt.home) / "index.db") as db:
        assert db.execute("SELECT count(*) FROM verified_objects").fetchone()[0] == 0
    time.sleep(0.05)
    again = rt.checkpoint(task.task, incremental=False)["read_back"]
    assert (again["rehashed"], again["trusted"]) == (again["objects_reached"], 0)
    with sqlite3.connect(Path(rt.home) / "index.db") as db:
        rows = db.execute("SELECT ctime_ns, mtime_ns, verified_at_ns FROM verified_objects")
        recorded = rows.fetchall()
    # every object of the first checkpoint is recorded; the new manifest only if it was old
    # enough by its re-hash; and no row vouches for a copy changed within the slack
    assert again["objects_reached"] - 1 <= len(recorded) <= again["objects_reached"]
    slack = verified.CLOCK_SLACK_NS
    assert all(max(ctime, mtime) < at - slack for ctime, mtime, at in recorded)


def test_losing_the_verified_object_record_costs_rehashing_not_a_wrong_answer(
    rt: Runtime, task: TaskRecord
) -> None:
    make_files(task)
    rt.checkpoint(task.task)
    time.sleep(0.05)  # the objects not racy for the verified-object record
    rt.checkpoint(task.task, incremental=False)  # re-hashes them, and records them now
    with sqlite3.connect(Path(rt.home) / "index.db") as db:
        assert db.execute("SELECT count(*) FROM verified_objects").fetchone()[0] > 0
    with Runtime(rt.home) as fresh:
        with sqlite3.connect(Path(rt.home) / "index.db") as db:
            db.execute("DELETE FROM verified_objects")
        read_back = fresh.checkpoint(task.task, incremental=False)["read_back"]
    assert read_back["verified"] and read_back["trusted"] == 0
    assert read_back["rehashed"] == read_back["objects_reached"]


def test_objects_and_their_directories_are_private(rt: Runtime, task: TaskRecord) -> None:
    make_files(task)
    manifest = rt.checkpoint(task.task)["manifest"]
    root = Path(rt.workspace.objects.root)
    assert os.stat(rt.workspace.objects.path_of(manifest)).st_mode & 0o777 == 0o400
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode & 0o777
        assert mode == (0o700 if path.is_dir() else 0o400), (path, oct(mode))
    for db in Path(rt.home).glob("index.db*"):  # the nodes and the verified-object record
        assert db.stat().st_mode & 0o777 == 0o600, db


# -- settled verify ---------------------------------------------------------------------------


def test_verify_checks_every_object_of_a_tasks_last_checkpoint(
    rt: Runtime, task: TaskRecord
) -> None:
    make_files(task)
    manifest = rt.checkpoint(task.task)["manifest"]
    done = verify_cli(rt, task.task, "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["manifest"] == manifest and result["verified"] is True
    assert (result["objects"], result["trees"], result["blobs"]) == (5, 2, 2)
    assert result["problems"] == []
    with_data = json.loads(verify_cli(rt, manifest, "--read-data", "--json").stdout)
    assert with_data["verified"] and with_data["read_data"]
    assert with_data["bytes_read"] == result["bytes_read"] + len(b"alpha") + len(b"beta")


def test_verify_names_each_missing_or_damaged_object_with_its_paths_and_exits_3(
    rt: Runtime, task: TaskRecord
) -> None:
    make_files(task)
    manifest = rt.checkpoint(task.task)["manifest"]
    alpha, beta = blob_of(rt, manifest, "a.txt"), blob_of(rt, manifest, "d/b.txt")
    os.unlink(rt.workspace.objects.path_of(alpha))
    damage(rt, beta, b"BETA")
    presence = verify_cli(rt, task.task, "--json")
    assert presence.returncode == 3
    assert json.loads(presence.stdout)["problems"] == [
        {"object": alpha, "problem": "missing", "paths": ["a.txt", "d/copy.txt"]}
    ]  # a same-size overwrite needs --read-data
    data = verify_cli(rt, task.task, "--read-data")
    assert data.returncode == 3
    *problems, summary = data.stdout.splitlines()
    assert sorted(problems, key=lambda line: line.split()[0] != alpha)[0] == (
        f"{alpha} missing: a.txt, d/copy.txt"
    )
    [damaged] = [line for line in problems if line.startswith(beta)]
    assert damaged.startswith(f"{beta} damaged (reads back as ") and damaged.endswith("): d/b.txt")
    assert summary.endswith("2 problems: NOT verified")


def test_verify_exits_2_for_an_unknown_task_or_manifest_and_a_task_without_a_checkpoint(
    rt: Runtime, task: TaskRecord
) -> None:
    unknown = "blake3:" + "0" * 64
    for target in (unknown, "t_nonexistent", task.task, "not-a-digest"):
        done = verify_cli(rt, target)
        assert done.returncode == 2, (target, done.stdout, done.stderr)
    assert "no checkpoint yet" in verify_cli(rt, task.task).stderr
    assert "unknown manifest" in verify_cli(rt, unknown).stderr


def test_a_rehash_racy_with_the_objects_last_change_vouches_for_nothing(tmp_path: Path) -> None:
    path = tmp_path / "object"
    path.write_bytes(b"bytes")
    st = os.lstat(path)
    racy, settled = "blake3:" + "1" * 64, "blake3:" + "2" * 64
    record = VerifiedRecord(str(tmp_path / "index.db"))
    record.record(
        [
            (racy, Verified.of(st, st.st_ctime_ns + 1_000_000)),  # re-hashed 1 ms after it
            (settled, Verified.of(st, st.st_ctime_ns + 100_000_000)),
        ]
    )
    for reader in (record, VerifiedRecord(str(tmp_path / "index.db"))):  # memo, then the file
        known = reader.known([racy, settled])
        assert known[racy] is None and known[settled] == key_of(st)
    assert Verified.of(st, st.st_ctime_ns + 100_000_000).vouches_for(os.lstat(path))
    os.chmod(path, 0o600)
    assert not Verified.of(st, st.st_ctime_ns + 100_000_000).vouches_for(os.lstat(path))


def test_a_pack_verified_whole_is_one_row_and_vouches_for_its_members_until_it_changes(
    rt: Runtime, task: TaskRecord
) -> None:
    """A read-back that re-hashed every member of a pack records the pack (one row), not each
    object; the next trusts every member by the pack's stamp, and a change to the pack (its
    ctime) makes it re-hash them all."""
    ws = Path(task.workspace)
    for i in range(40):  # past the publish's grouping threshold: one pack
        (ws / f"f{i:02d}.txt").write_bytes(b"file %d\n" % i)
    time.sleep(0.05)  # the files are not racy for the scan's stat cache
    first = rt.checkpoint(task.task)
    time.sleep(0.05)  # and its pack not racy for the verified-object record
    with sqlite3.connect(Path(rt.home) / "index.db") as db:  # whether the first read-back's
        db.execute("DELETE FROM verified_objects")  # re-hash was racy depends on the load:
        db.execute("DELETE FROM verified_packs")  # forgotten, the next re-hashes them all
    second = rt.checkpoint(task.task, incremental=False)["read_back"]
    assert second["rehashed"] == second["objects_reached"]
    with sqlite3.connect(Path(rt.home) / "index.db") as db:
        assert db.execute("SELECT count(*) FROM verified_packs").fetchone()[0] == 1
        assert db.execute("SELECT count(*) FROM verified_objects").fetchone()[0] == 0
    third = rt.checkpoint(task.task, incremental=False)["read_back"]
    assert (third["rehashed"], third["trusted"]) == (1, third["objects_reached"] - 1)
    location = rt.workspace.objects.location_of(blob_of(rt, first["manifest"], "f07.txt"))
    assert location is not None and location[0].endswith(".pack")
    os.chmod(location[0], 0o444)  # the pack's ctime moves: its row vouches for nothing now
    fourth = rt.checkpoint(task.task, incremental=False)["read_back"]
    assert fourth["verified"] and (fourth["rehashed"], fourth["trusted"]) == (
        fourth["objects_reached"],
        0,
    )


def test_an_incremental_checkpoint_reusing_a_subtree_whose_blob_is_gone_is_not_called_verified(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    """Issue 36, item 8: before, it said ``verified: true`` and its restore then failed."""
    ws = make_files(task)
    first = rt.checkpoint(task.task)
    beta = blob_of(rt, first["manifest"], "d/b.txt")
    os.unlink(rt.workspace.objects.path_of(beta))
    (ws / "a.txt").write_bytes(b"alpha, changed")  # only the root changes: d is reused
    second = rt.checkpoint(task.task)
    read_back = second["read_back"]
    assert (read_back["scope"], read_back["trusted_subtrees"]) == ("since_parent", 1)
    assert read_back["verified"] is False and read_back["problems_found"] == 0
    assert first["manifest"] in read_back["unchecked"]
    full = rt.checkpoint(task.task, incremental=False)  # the closure: found and healed
    assert full["read_back"]["verified"] is True
    assert [p["object"] for p in full["read_back"]["healed"]["problems"]] == [beta]
    assert restored(rt, full["manifest"], tmp_path / "dest")["d/b.txt"] == b"beta"
