"""Sparse files stay sparse: holes found with SEEK_DATA/SEEK_HOLE at scan time, recorded as the
file's extents in its tree entry, never read, never stored, recreated as holes by restore; the
file's digest still names its whole content (holes as zeros), so verify and restore check every
byte, and a 10 GiB file with a few KiB of data costs its data, not its size.

Real files on the test's own directory; a filesystem that does not report holes is skipped,
naming it (/tmp here is ext4, which does).
"""

from __future__ import annotations

import filecmp
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import blake3
import pytest

from settled.canonical import canonical_bytes
from settled.errors import BadInput
from settled.objects.hashing import DEFAULT_ALGORITHM, digest_bytes
from settled.objects.local import LocalObjectStore
from settled.records import TaskRecord
from settled.runtime import Runtime
from settled.workspace.index import Index
from settled.workspace.manifest import (
    FILE,
    ROOT,
    Entry,
    ManifestInvalid,
    read_manifest,
    tree_bytes,
    write_manifest,
)
from settled.workspace.readback import read_back
from settled.workspace.restore import BlobCorrupt, restore
from settled.workspace.scan import scan
from settled.workspace.scanerrors import HolesOverBudget, TornRead
from settled.workspace.sparse import HOLES_BUDGET_ENV, MAX_EXTENTS, MIN_HOLE, unallocated
from settled.workspace.verify import verify_manifest

KIB: Final = 1 << 10
MIB: Final = 1 << 20
GIB: Final = 1 << 30


def reports_holes(directory: Path) -> bool:
    """Whether the filesystem of ``directory`` reports a hole to SEEK_DATA (overlayfs and some
    others call everything data)."""
    probe = directory / ".hole-probe"
    with open(probe, "wb") as f:
        f.truncate(MIB)
        f.seek(MIB - 4 * KIB)
        f.write(b"x" * 4 * KIB)
        f.flush()
        os.fsync(f.fileno())
        try:
            first_data = os.lseek(f.fileno(), 0, os.SEEK_DATA)
        except OSError:
            first_data = 0
    probe.unlink()
    return first_data > 0


@pytest.fixture(autouse=True)
def _holes(tmp_path: Path) -> None:
    if not reports_holes(tmp_path):
        fs = subprocess.run(
            ["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        pytest.skip(f"the filesystem of {tmp_path} ({fs}) does not report holes to SEEK_DATA")


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "objects")


def sparse_file(path: Path, size: int, pieces: dict[int, bytes]) -> bytes:
    """A file of ``size`` bytes holding ``pieces`` at their offsets and holes elsewhere; returns
    its logical content only when it is small (else b"")."""
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, data in pieces.items():
            f.seek(offset)
            f.write(data)
    if size > 64 * MIB:
        return b""
    return path.read_bytes()


def checkpoint(store: LocalObjectStore, workspace: Path, previous: Index | None = None) -> str:
    index = scan(workspace, previous, store=store).index
    return write_manifest(store, index.algorithm, index.root)


def entry_of(store: LocalObjectStore, manifest_id: str, path: str) -> Entry:
    return {e.path: e for e in read_manifest(store, manifest_id).entries}[path]


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def stored_bytes(store: LocalObjectStore) -> int:
    """Bytes the object store's files hold (their sizes: what was written)."""
    return sum(p.stat().st_size for p in Path(store.root).rglob("*") if p.is_file())


def aged() -> None:
    time.sleep(0.05)  # older than the next scan's racy cutoff: the stat cache vouches for it


# -- checkpoint and restore --------------------------------------------------------------------


def test_a_file_with_holes_is_recorded_as_extents_and_restored_with_its_holes(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    head, middle = os.urandom(128 * KIB), os.urandom(64 * KIB)
    size = 128 * KIB + MIB + 64 * KIB + 2 * MIB  # data, 1 MiB hole, data, trailing hole
    content = sparse_file(ws / "f", size, {0: head, 128 * KIB + MIB: middle})
    manifest_id = checkpoint(store, ws)

    entry = entry_of(store, manifest_id, "f")
    assert entry.size == size
    assert entry.digest == digest_bytes(DEFAULT_ALGORITHM, content)  # the logical content
    assert entry.extents == (
        (0, 128 * KIB, digest_bytes(DEFAULT_ALGORITHM, head)),
        (128 * KIB + MIB, 64 * KIB, digest_bytes(DEFAULT_ALGORITHM, middle)),
    )
    assert not store.has(entry.digest)  # no object holds the holes
    assert all(store.has(digest) for _, _, digest in entry.extents)

    result = restore(store, manifest_id, tmp_path / "out")
    assert result.bytes_written == len(head) + len(middle)
    restored = tmp_path / "out" / "f"
    assert restored.read_bytes() == content
    assert allocated(restored) <= len(head) + len(middle) + 64 * KIB  # its data, not its size
    assert os.lseek(os.open(restored, os.O_RDONLY), 0, os.SEEK_HOLE) == 128 * KIB
    assert verify_manifest(store, manifest_id, read_data=True).ok


def test_a_ten_gib_sparse_file_costs_its_data_through_checkpoint_restore_and_verify(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    ws = Path(task.workspace)
    pieces = {0: b"start" * 200, 3 * GIB + 12345: os.urandom(3000), 10 * GIB - 100: b"e" * 100}
    sparse_file(ws / "disk.img", 10 * GIB, pieces)
    objects = rt.workspace.objects
    assert isinstance(objects, LocalObjectStore)
    before = stored_bytes(objects)

    receipt = rt.checkpoint(task.task)
    assert receipt["read_back"]["verified"]
    grown = stored_bytes(objects) - before
    assert grown < 256 * KIB  # each extent is a block or two: ~16 KiB, plus tree and manifest
    assert receipt["scan"]["stats"]["bytes_read"] < 64 * KIB
    assert receipt["scan"]["stats"]["sparse_files"] == 1

    out = tmp_path / "restored"
    result = rt.restore(task.task, str(out))
    assert result.complete and result.bytes_written < 64 * KIB
    restored = out / "disk.img"
    assert restored.stat().st_size == 10 * GIB
    assert allocated(restored) < 256 * KIB
    with open(restored, "rb") as f:
        for offset, data in pieces.items():
            f.seek(offset)
            assert f.read(len(data)) == data

    audit = rt.verify(task.task, read_data=True)
    assert audit["verified"] and audit["problems"] == []
    assert audit["bytes_read"] < 256 * KIB  # the extents (read twice) and the trees, never holes


def test_a_dense_file_is_recorded_exactly_as_before(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    dense = os.urandom(3 * MIB)
    (ws / "dense").write_bytes(dense)
    holes = {0: b"a" * 4096, 64 * KIB: b"b" * 4096, 128 * KIB: b"c" * 4096}  # 60 KiB apart
    small_hole = sparse_file(ws / "small-holes", 132 * KIB, holes)
    zeros = bytes(2 * MIB)
    (ws / "written-zeros").write_bytes(zeros)  # zeros that were written are data
    manifest_id = checkpoint(store, ws)

    for name, content in (("dense", dense), ("small-holes", small_hole), ("written-zeros", zeros)):
        entry = entry_of(store, manifest_id, name)
        assert entry.extents is None, name
        assert entry.digest == digest_bytes(DEFAULT_ALGORITHM, content)
        assert store.has(entry.digest)
        assert set(entry.tree_form()) == {
            "name",
            "type",
            "mode",
            "size",
            "uid",
            "gid",
            "digest",
            "mtime",
        }
    restore(store, manifest_id, tmp_path / "out")
    assert (tmp_path / "out" / "written-zeros").read_bytes() == zeros
    assert allocated(tmp_path / "out" / "written-zeros") >= len(zeros)  # restored dense


def test_a_file_that_is_one_hole_stores_nothing_and_restores_as_one_hole(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    sparse_file(ws / "hole", 64 * MIB, {})
    result = scan(ws, store=store)
    assert result.stats.bytes_read == 0
    manifest_id = write_manifest(store, result.index.algorithm, result.index.root)
    entry = entry_of(store, manifest_id, "hole")
    assert entry.extents == ()
    hasher = blake3.blake3()
    hasher.update(bytes(64 * MIB))
    assert entry.digest == f"blake3:{hasher.hexdigest()}"
    assert result.blobs == frozenset()  # the tree is the only object written

    restore(store, manifest_id, tmp_path / "out")
    restored = tmp_path / "out" / "hole"
    assert restored.stat().st_size == 64 * MIB and allocated(restored) == 0
    assert verify_manifest(store, manifest_id, read_data=True).ok


def test_equal_content_hashes_equal_sparse_or_dense_and_a_change_between_checkpoints_shows(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    content = sparse_file(ws / "f", 4 * MIB, {0: b"x" * 8192, 3 * MIB: b"y" * 8192})
    aged()
    first = scan(ws, store=store)
    first_id = write_manifest(store, first.index.algorithm, first.index.root)
    sparse_entry = entry_of(store, first_id, "f")
    assert sparse_entry.extents is not None

    again = scan(ws, first.index, store=store)  # the stat cache vouches for the sparse row
    assert again.stats.entries_reused == 1 and again.stats.bytes_read == 0
    assert again.index.root.tree == first.index.root.tree

    (ws / "f").write_bytes(content)  # the same bytes, now dense
    dense_scan = scan(ws, again.index, store=store, only=[ROOT])
    dense_id = write_manifest(store, dense_scan.index.algorithm, dense_scan.index.root)
    dense_entry = entry_of(store, dense_id, "f")
    assert dense_entry.extents is None
    assert dense_entry.digest == sparse_entry.digest  # one content, one digest
    assert dense_scan.index.root.tree != first.index.root.tree  # but the layout is recorded
    assert read_back(store, dense_id, record=None).ok

    restore(store, first_id, tmp_path / "sparse-out")
    restore(store, dense_id, tmp_path / "dense-out")
    assert (tmp_path / "sparse-out" / "f").read_bytes() == content
    assert (tmp_path / "dense-out" / "f").read_bytes() == content
    assert allocated(tmp_path / "sparse-out" / "f") < 64 * KIB
    assert allocated(tmp_path / "dense-out" / "f") >= 4 * MIB


def test_a_fragmented_file_keeps_at_most_max_extents_and_its_largest_holes(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    pieces, offset = {}, 0
    for i in range(MAX_EXTENTS + 100):
        pieces[offset] = i.to_bytes(4, "big") * 1024
        offset += 4 * KIB + (MIB if i % 10 == 9 else MIN_HOLE + 60 * KIB)
    sparse_file(ws / "f", offset, pieces)
    manifest_id = checkpoint(store, ws)
    entry = entry_of(store, manifest_id, "f")
    assert entry.extents is not None
    assert 1 < len(entry.extents) <= MAX_EXTENTS
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(entry.extents, entry.extents[1:], strict=False)]
    assert min(gaps) >= MIB  # the small holes went into data, the 1 MiB ones stayed holes
    restore(store, manifest_id, tmp_path / "out")
    assert filecmp.cmp(ws / "f", tmp_path / "out" / "f", shallow=False)


# -- a sparse file that changes while it is read --------------------------------------------


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process that keeps writing into the data of ``ws/busy`` (a 2 GiB sparse file) until
    the test ends it."""
    (tmp_path / "ws").mkdir()
    target = tmp_path / "ws" / "busy"
    sparse_file(target, 2 * GIB, {0: b"a" * 4096, GIB: b"b" * 4096})
    code = (
        "import os, sys\n"
        "fd = os.open(sys.argv[1], os.O_WRONLY)\n"
        "i = 0\n"
        "while True:\n"
        "    os.pwrite(fd, i.to_bytes(8, 'big'), 0)\n"
        "    i += 1\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(target)])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


# -- the holes' budget ----------------------------------------------------------------------


def test_a_scan_hashes_holes_up_to_its_budget_and_refuses_the_file_that_would_pass_it(
    store: LocalObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget is the scan's, over every file it hashes: two files of 600 MiB of holes pass
    a budget of 2 GiB, and the second of them is refused under 1 GiB, named, with no digest."""
    ws = tmp_path / "ws"
    ws.mkdir()
    for name in ("a.img", "b.img"):
        sparse_file(ws / name, 600 * MIB, {0: b"data" * 1024})
    monkeypatch.setenv(HOLES_BUDGET_ENV, str(2 * GIB))
    stats = scan(ws, None, store=store).stats
    holes = sum(unallocated(os.stat(ws / name)) for name in ("a.img", "b.img"))
    assert stats.hole_bytes == holes and holes > 1100 * MIB
    monkeypatch.setenv(HOLES_BUDGET_ENV, str(GIB))
    with pytest.raises(HolesOverBudget, match=r"'b.img' is 600.0 MiB .* budget of 1.0 GiB") as got:
        scan(ws, None, store=store)
    assert HOLES_BUDGET_ENV in str(got.value)


def test_an_unchanged_sparse_file_vouched_for_by_the_stat_cache_costs_no_budget(
    store: LocalObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    sparse_file(ws / "a.img", 600 * MIB, {0: b"data"})
    aged()
    first = scan(ws, None, store=store)
    monkeypatch.setenv(HOLES_BUDGET_ENV, "0")  # no hole may be hashed now
    again = scan(ws, first.index, store=store)
    assert again.stats.hole_bytes == 0 and again.index.root.tree == first.index.root.tree
    (ws / "a.img").unlink()
    sparse_file(ws / "a.img", 600 * MIB, {0: b"changed"})
    with pytest.raises(HolesOverBudget, match=r"'a\.img'"):
        scan(ws, again.index, store=store)


def test_the_links_of_a_sparse_file_cost_its_holes_once(
    store: LocalObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    sparse_file(ws / "a.img", 600 * MIB, {0: b"data"})
    for n in range(4):
        os.link(ws / "a.img", ws / f"link{n}.img")
    aged()
    monkeypatch.setenv(HOLES_BUDGET_ENV, str(GIB))
    result = scan(ws, None, store=store)
    assert result.stats.links_reused == 4 and result.stats.hole_bytes < 600 * MIB
    first = result.index.by_path["a.img"]
    assert all(result.index.by_path[f"link{n}.img"].extents == first.extents for n in range(4))


def test_the_budget_refuses_a_file_of_terabytes_of_holes_at_once(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    """The attack it answers: `truncate -s 8T` costs its maker nothing and its hash ~8 min of
    both CPUs here. With the default budget the scan refuses it without hashing a byte."""
    ws = tmp_path / "ws"
    ws.mkdir()
    sparse_file(ws / "huge.img", 8 << 40, {})
    started = time.monotonic()
    with pytest.raises(HolesOverBudget, match=r"'huge.img' is 8.0 TiB with 0 bytes on disk"):
        scan(ws, None, store=store)
    assert time.monotonic() - started < 30  # refused, not hashed (that would be minutes)


@pytest.mark.parametrize("value", ["1e9", "-1", "lots"])
def test_a_budget_that_is_not_a_number_of_bytes_is_refused_naming_the_variable(
    store: LocalObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    monkeypatch.setenv(HOLES_BUDGET_ENV, value)
    with pytest.raises(BadInput, match=f"{HOLES_BUDGET_ENV}='{re.escape(value)}'"):
        scan(ws, None, store=store)


def test_a_close_refuses_a_commands_terabytes_of_holes_and_completes_once_they_are_gone(
    rt: Runtime, task: TaskRecord
) -> None:
    """A command leaves an 8 TiB file of holes: the close stops at its scan, naming the file
    and the budget (not ~8 min of hashing), and nothing is published; with the file gone, the
    close resumes and completes."""
    admission = rt.exec(task.task, shell="truncate -s 8T huge.img && echo made")
    view = rt.wait(admission.session, timeout=60)
    assert view["receipt"]["exit"]["code"] == 0
    with pytest.raises(HolesOverBudget, match=r"huge\.img"):
        rt.close_task(task.task)
    assert rt.store.get_task(task.task).state != "complete"
    (Path(task.workspace) / "huge.img").unlink()
    result = rt.close_task(task.task)
    assert result.receipt is not None and result.receipt["outcome"]["all_commands_succeeded"]


def test_a_sparse_file_written_during_the_scan_is_a_torn_read_never_a_digest(
    store: LocalObjectStore, tmp_path: Path, writer: subprocess.Popen[bytes]
) -> None:
    with pytest.raises(TornRead, match="'busy' changed while it was read"):
        scan(tmp_path / "ws", store=store)
    writer.kill()
    writer.wait(timeout=10)
    manifest_id = checkpoint(store, tmp_path / "ws")  # once nothing writes: recorded
    entry = entry_of(store, manifest_id, "busy")
    assert entry.extents is not None and [e[0] for e in entry.extents] == [0, GIB]


# -- damage is found -------------------------------------------------------------------------


def damage(store: LocalObjectStore, digest: str, data: bytes) -> None:
    path = store.path_of(digest)
    os.chmod(path, 0o600)
    Path(path).write_bytes(data)


def test_verify_read_back_and_restore_find_a_damaged_extent(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    tail = os.urandom(8192)
    sparse_file(ws / "f", 8 * MIB, {0: b"h" * 8192, 5 * MIB: tail})
    manifest_id = checkpoint(store, ws)
    extent = entry_of(store, manifest_id, "f").extents
    assert extent is not None
    damaged = extent[1][2]
    damage(store, damaged, bytes(len(tail)))  # same size: only reading the data tells

    assert verify_manifest(store, manifest_id).ok
    audit = verify_manifest(store, manifest_id, read_data=True)
    assert [(p.object, p.problem, p.paths) for p in audit.problems] == [
        (damaged, "damaged", ("f",))
    ]
    assert [(p.object, p.paths) for p in read_back(store, manifest_id, record=None).problems] == [
        (damaged, ("f",))
    ]
    (tmp_path / "out").mkdir()
    with pytest.raises(BlobCorrupt, match=f"{damaged} for 'f'"):
        restore(store, manifest_id, tmp_path / "out" / "dest")
    assert os.listdir(tmp_path / "out") == []


def _forged(store: LocalObjectStore, extents: list[list[object]], digest: str, size: int) -> str:
    """A manifest whose one file ``f`` has the given extents, digest and size."""
    form = {"name": "f", "type": FILE, "mode": 0o644, "size": size, "uid": 0, "gid": 0}
    form.update(digest=digest, extents=extents)
    tree = canonical_bytes(
        {"v": "settled.tree/v2", "algorithm": DEFAULT_ALGORITHM, "entries": [form]}
    )
    tree_id = store.put_bytes(tree)
    root = Entry(ROOT, "dir", 0o755, 0, tree=tree_id, uid=0, gid=0)
    return write_manifest(store, DEFAULT_ALGORITHM, root)


def test_a_sparse_digest_that_its_extents_and_holes_do_not_hash_to_is_found(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    data = b"d" * 4096
    blob = store.put_bytes(data)
    lie = digest_bytes(DEFAULT_ALGORITHM, b"something else")
    manifest_id = _forged(store, [[MIB, 4096, blob]], lie, 4 * MIB)

    assert verify_manifest(store, manifest_id).ok  # the objects are all there, at their sizes
    audit = verify_manifest(store, manifest_id, read_data=True)
    assert [(p.object, p.problem, p.paths) for p in audit.problems] == [(lie, "damaged", ("f",))]
    with pytest.raises(BlobCorrupt, match=f"{lie} for 'f'"):
        restore(store, manifest_id, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("extents", "size", "why"),
    [
        ([[0, 4 * MIB, "BLOB"]], 4 * MIB, "without a hole"),
        ([[MIB, 4096, "BLOB"], [MIB, 4096, "BLOB"]], 4 * MIB, "overlaps"),
        ([[0, 4096, "BLOB"], [4096, 4096, "BLOB"]], 4 * MIB, "touches"),
        ([[MIB, 0, "BLOB"]], 4 * MIB, "is empty"),
        ([[3 * MIB, 2 * MIB, "BLOB"]], 4 * MIB, "past its size"),
        ([[-1, 4096, "BLOB"]], 4 * MIB, "overlaps"),
        ([[MIB, 4096]], 4 * MIB, "extents are not"),
    ],
)
def test_impossible_extents_are_refused_when_a_tree_is_read(
    store: LocalObjectStore, extents: list[list[object]], size: int, why: str
) -> None:
    blob = store.put_bytes(b"d" * 4096)
    shaped = [[blob if part == "BLOB" else part for part in extent] for extent in extents]
    digest = digest_bytes(DEFAULT_ALGORITHM, b"x")
    manifest_id = _forged(store, shaped, digest, size)
    with pytest.raises(ManifestInvalid, match=why):
        read_manifest(store, manifest_id)


def test_a_sparse_entry_round_trips_through_its_tree_and_its_index_row(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    sparse_file(ws / "f", 2 * MIB, {MIB: b"q" * 4096})
    index = scan(ws, store=store).index
    entry = index.by_path["f"]
    assert entry.extents is not None
    assert tree_bytes(DEFAULT_ALGORITHM, [entry]) == tree_bytes(
        DEFAULT_ALGORITHM,
        [entry_of(store, write_manifest(store, index.algorithm, index.root), "f")],
    )
    node = index.node(ROOT)
    assert node is not None
    reread = Index(index.algorithm, 0, index.root, index.reader)  # rows parsed from the node
    assert reread.by_path["f"] == entry


def test_a_damaged_extent_is_found_by_a_full_checkpoint_and_healed_from_the_workspace(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    ws = Path(task.workspace)
    content = sparse_file(ws / "f", 8 * MIB, {0: b"h" * 8192, 5 * MIB: os.urandom(8192)})
    aged()
    first = rt.checkpoint(task.task)
    objects = rt.workspace.objects
    assert isinstance(objects, LocalObjectStore)
    extents = entry_of(objects, first["manifest"], "f").extents
    assert extents is not None
    damaged = extents[1][2]
    damage(objects, damaged, bytes(8192))  # same size: only a re-hash can tell

    second = rt.checkpoint(task.task, incremental=False)
    assert second["read_back"]["verified"]
    healed = second["read_back"]["healed"]
    assert [(p["object"], p["paths"]) for p in healed["problems"]] == [(damaged, ["f"])]
    assert [q["object"] for q in healed["quarantined"]] == [damaged]
    restore(objects, second["manifest"], tmp_path / "out")
    assert (tmp_path / "out" / "f").read_bytes() == content
