"""The scanner: a stat cache that is never fooled, a walk that never leaves the workspace."""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from settled.objects import DurabilityError
from settled.objects.hashing import DEFAULT_ALGORITHM, digest_bytes
from settled.objects.local import LocalObjectStore
from settled.workspace import ignore, walk
from settled.workspace import scan as scan_module
from settled.workspace.index import Index
from settled.workspace.manifest import TYPES, Entry
from settled.workspace.nodecache import NodeCache
from settled.workspace.scan import ScanResult, scan
from settled.workspace.scanerrors import TornRead, WorkspaceUnreadable

SETTLE_S = 2 * scan_module.CLOCK_SLACK_NS / 1e9
WALKERS = (walk.NATIVE, walk.PYTHON)


@pytest.fixture(autouse=True, params=WALKERS)
def walker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs over both walkers: the C one and its pure Python twin."""
    monkeypatch.setenv("SETTLED_WALKER", request.param)
    return str(request.param)


def settle() -> None:
    """Let the clock pass the racy window, so a later scan may trust what this one saw."""
    time.sleep(SETTLE_S)


def make_tree(root: Path, files: int = 10) -> None:
    for i in range(files):
        sub = root / f"d{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i}.txt").write_bytes(b"content %d\n" % i)


def entry(result: ScanResult, path: str) -> Entry:
    return result.index.by_path[path]


def observed(result: ScanResult) -> list[Entry]:
    """Every entry with its content and stat, but not the stat-cache node it came from (a node
    carries the racy cutoff of the scan that listed it, so two scans' nodes differ)."""
    return [e._replace(node=None) for e in result.index.entries]


def cutoff(result: ScanResult) -> int:
    node = result.index.node(".")
    assert node is not None
    return node.trusted_before_ns


def test_unchanged_files_are_not_read_again(tmp_path: Path, walker: str) -> None:
    make_tree(tmp_path, files=20)
    settle()
    first = scan(tmp_path)
    second = scan(tmp_path, first.index)
    assert first.stats.walker == second.stats.walker == walker
    assert first.stats.files_hashed == 20
    assert (second.stats.files_hashed, second.stats.bytes_read) == (0, 0)
    assert second.stats.entries_reused == 20
    assert second.index.entries == first.index.entries


def test_the_stat_cache_is_trusted_when_the_stat_matches_and_is_old(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"real")
    settle()
    first = scan(tmp_path)
    bogus = entry(first, "f")._replace(digest=digest_bytes(DEFAULT_ALGORITHM, b"x"))
    cached = Index.from_entries(
        DEFAULT_ALGORITHM, [entry(first, "."), bogus], trusted_before_ns=cutoff(first)
    )
    assert entry(scan(tmp_path, cached), "f").digest == bogus.digest  # not re-read


def test_a_stat_match_at_or_after_the_previous_scan_start_is_rehashed(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"real")
    first = scan(tmp_path)
    real = entry(first, "f")
    bogus = real._replace(digest=digest_bytes(DEFAULT_ALGORITHM, b"x"))
    racy = Index.from_entries(
        DEFAULT_ALGORITHM, [entry(first, "."), bogus], trusted_before_ns=real.mtime_ns
    )
    again = scan(tmp_path, racy)
    assert entry(again, "f").digest == real.digest
    assert again.stats.files_hashed == 1 and again.stats.entries_reused == 0


def test_a_same_size_rewrite_with_the_same_mtime_is_detected(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"aaaa")
    settle()
    first = scan(tmp_path)
    old = os.stat(path)
    path.write_bytes(b"bbbb")
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == old.st_mtime_ns
    second = scan(tmp_path, first.index)
    assert entry(second, "f").digest == digest_bytes(DEFAULT_ALGORITHM, b"bbbb")


def test_an_mtime_set_backwards_like_touch_r_is_detected(tmp_path: Path) -> None:
    reference, path = tmp_path / "reference", tmp_path / "f"
    reference.write_bytes(b"older")
    os.utime(reference, ns=(10**18, 10**18))
    path.write_bytes(b"v1")
    settle()
    first = scan(tmp_path)
    path.write_bytes(b"v2")
    ref = os.stat(reference)
    os.utime(path, ns=(ref.st_atime_ns, ref.st_mtime_ns))  # what `touch -r reference f` does
    second = scan(tmp_path, first.index)
    assert entry(second, "f").mtime_ns < entry(first, "f").mtime_ns
    assert entry(second, "f").digest == digest_bytes(DEFAULT_ALGORITHM, b"v2")


def test_a_symlink_out_of_the_workspace_is_recorded_and_never_followed(tmp_path: Path) -> None:
    outside, workspace = tmp_path / "outside", tmp_path / "ws"
    outside.mkdir()
    workspace.mkdir()
    (outside / "secret").write_bytes(b"not yours")
    os.mkfifo(outside / "fifo")  # reading through this link would block the scan
    (workspace / "to_dir").symlink_to(outside)
    (workspace / "to_fifo").symlink_to(outside / "fifo")
    result = scan(workspace)
    assert {e.path: (e.type, e.target, e.digest) for e in result.index.entries} == {
        ".": ("dir", None, None),
        "to_dir": ("symlink", str(outside), None),
        "to_fifo": ("symlink", str(outside / "fifo"), None),
    }
    assert result.stats.bytes_read == 0


def test_a_fifo_is_recorded_and_never_opened(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe", 0o640)
    results: list[ScanResult] = []
    worker = threading.Thread(target=lambda: results.append(scan(tmp_path)), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the scan blocked: it opened the FIFO"
    pipe = entry(results[0], "pipe")
    assert (pipe.type, pipe.mode, pipe.size, pipe.digest) == ("fifo", 0o640, 0, None)


def test_a_directory_replaced_by_a_symlink_mid_walk_is_never_entered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside, workspace = tmp_path / "outside", tmp_path / "ws"
    (outside / "deep").mkdir(parents=True)
    (outside / "deep" / "secret").write_bytes(b"not yours")
    (workspace / "sub").mkdir(parents=True)
    real_list_dir = scan_module._Scanner.list_dir

    def list_then_swap(self: scan_module._Scanner, fd: int, rel: str) -> tuple[set[str], list[str]]:
        listed = real_list_dir(self, fd, rel)
        if rel == ".":  # "sub" was just recorded as a directory; now an attacker swaps it
            (workspace / "sub").rmdir()
            (workspace / "sub").symlink_to(outside)
        return listed

    monkeypatch.setattr(scan_module._Scanner, "list_dir", list_then_swap)
    result = scan(workspace)
    assert [(e.path, e.type) for e in result.index.entries] == [(".", "dir"), ("sub", "symlink")]
    assert result.stats.bytes_read == 0


def _append_during_first_reads(
    monkeypatch: pytest.MonkeyPatch, path: Path, times: int, reads: str
) -> None:
    """Append to ``path`` during the scanner's next ``times`` reads of it: the walker's
    read-ahead of small files (``reads="ahead"``: its second fstat sees the append), then
    each of its slow reads (``os.readv``). ``reads="slow"`` turns the read-ahead off."""
    real_readv = os.readv
    target = os.stat(path).st_ino
    left = [times]

    def readv(fd: int, buffers: list[bytearray]) -> int:
        if left[0] and os.fstat(fd).st_ino == target and os.lseek(fd, 0, os.SEEK_CUR) == 0:
            left[0] -= 1
            with open(path, "ab") as handle:
                handle.write(b"+more")
        return real_readv(fd, buffers)

    monkeypatch.setattr(os, "readv", readv)
    if reads == "slow":
        monkeypatch.setattr(walk, "READ_SMALL", -1)
        return
    real = walk.choose()

    def read_files(
        dir_fd: int, names: list[str], limit: int, workers: int
    ) -> list[walk.Read | None]:
        got = real.read_files(dir_fd, names, limit, workers)
        for i, read in enumerate(got):
            if read is not None and read[0].st_ino == target and left[0]:
                left[0] -= 1
                with open(path, "ab") as handle:
                    handle.write(b"+more")
                got[i] = (read[0], read[1], os.stat(path), read[3])  # as if it landed mid-read
        return got

    monkeypatch.setattr(scan_module, "choose", lambda: real._replace(read_files=read_files))


@pytest.mark.parametrize("reads", ["ahead", "slow"])
def test_a_file_appended_to_during_the_read_is_reread_never_torn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reads: str
) -> None:
    path = tmp_path / "log"
    path.write_bytes(b"start")
    store = LocalObjectStore(tmp_path.parent / f"{tmp_path.name}-objects")
    _append_during_first_reads(monkeypatch, path, times=1, reads=reads)
    result = scan(tmp_path, store=store)
    final = digest_bytes(DEFAULT_ALGORITHM, b"start+more")
    assert entry(result, "log").digest == final and entry(result, "log").size == 10
    assert result.stats.torn_retries == 1 and result.stats.blobs_written == 1
    assert store.has(final) and os.listdir(store.temp_dir) == []


@pytest.mark.parametrize("reads", ["ahead", "slow"])
def test_a_file_that_keeps_changing_fails_the_scan_with_torn_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reads: str
) -> None:
    path = tmp_path / "busy"
    path.write_bytes(b"start")
    _append_during_first_reads(monkeypatch, path, times=100, reads=reads)
    with pytest.raises(TornRead, match="'busy'"):
        scan(tmp_path)


@pytest.mark.parametrize("reads", ["ahead", "slow"])
def test_a_scan_reads_files_without_touching_their_atime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reads: str
) -> None:
    """Read as their owner, with O_NOATIME: a file read for the first time since it was
    written (relatime would stamp it) keeps its atime, so a first checkpoint dirties no inode."""
    workspace = tmp_path / "ws"
    make_tree(workspace, files=40)
    if reads == "slow":
        monkeypatch.setattr(walk, "READ_SMALL", -1)
    atime_ns = 1_000_000_000_000_000_000  # older than each file's mtime: relatime would move it
    files = sorted(p for p in workspace.rglob("*") if p.is_file())
    for path in files:
        os.utime(path, ns=(atime_ns, path.stat().st_mtime_ns))
    result = scan(workspace)
    assert result.stats.files_hashed == 40
    assert [p.stat().st_atime_ns for p in files] == [atime_ns] * len(files)


def _overlapped_reads(monkeypatch: pytest.MonkeyPatch, late: str) -> list[int]:
    """Scans read a listing's small files on a thread of their own while they hash (two CPUs
    assumed, whatever this machine has); ``late`` is appended to once, while that thread may
    still be reading. Returns the number of names of each batch started that way."""
    monkeypatch.setattr(scan_module, "workers", lambda: 2)
    real, started = walk.choose(), []

    def start_reads(dir_fd: int, names: list[str], limit: int) -> walk.Take:
        started.append(len(names))
        take = real.start_reads(dir_fd, names, limit)
        done = [0]

        def taking(upto: int) -> list[walk.Read | None]:
            got = take(upto)
            if late in names[done[0] : upto]:
                i = names.index(late) - done[0]
                with open(late, "ab", opener=lambda p, f: os.open(p, f, dir_fd=dir_fd)) as out:
                    out.write(b"+more")
                read = got[i]
                if read is not None:  # as if the append landed mid-read
                    got[i] = (read[0], read[1], os.stat(late, dir_fd=dir_fd), read[3])
            done[0] = max(done[0], min(upto, len(names)))
            return got

        return taking

    monkeypatch.setattr(scan_module, "choose", lambda: real._replace(start_reads=start_reads))
    return started


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_small_files_are_read_on_a_thread_while_hashed_and_judged_like_any_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace, store = tmp_path / "ws", LocalObjectStore(tmp_path / "objects")
    workspace.mkdir()
    for i in range(100):
        (workspace / f"f{i:03}").write_bytes(b"file %d\n" % i)
    threads = _threads()
    started = _overlapped_reads(monkeypatch, late="f090")
    result = scan(workspace, store=store)
    assert started == [100 - walk.READ_TAKE] and _threads() == threads
    assert result.stats.torn_retries == 1 and result.stats.files_hashed == 100
    assert entry(result, "f090").digest == digest_bytes(DEFAULT_ALGORITHM, b"file 90\n+more")
    monkeypatch.undo()
    monkeypatch.setattr(scan_module, "workers", lambda: 1)  # read in one batch, in turn
    assert observed(scan(workspace)) == observed(result)


def test_a_scan_that_fails_mid_listing_waits_for_the_reads_of_its_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory's fd is closed only once no read runs in it (its number could be reused
    by another open), and the scan leaves no thread behind."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    for i in range(100):
        (workspace / f"f{i:03}").write_bytes(b"file %d\n" % i)
    threads = _threads()
    started = _overlapped_reads(monkeypatch, late="f050")
    real_entry = scan_module._Scanner.entry

    def entry_failing(
        self: scan_module._Scanner, fd: int, name: str, *rest: Any, **named: Any
    ) -> Any:
        if name == "f020":  # while the thread reads the rest of the listing
            raise OSError(5, "injected", name)
        return real_entry(self, fd, name, *rest, **named)

    monkeypatch.setattr(scan_module._Scanner, "entry", entry_failing)
    with pytest.raises(OSError, match="injected"):
        scan(workspace)
    assert started == [100 - walk.READ_TAKE] and _threads() == threads


def test_publishing_writes_each_new_blob_once_during_the_read(tmp_path: Path) -> None:
    workspace, store = tmp_path / "ws", LocalObjectStore(tmp_path / "objects")
    make_tree(workspace, files=6)
    (workspace / "copy.txt").write_bytes(b"content 0\n")  # same content as d0/f0.txt
    result = scan(workspace, store=store)
    digests = {e.digest for e in result.index.entries if e.type == "file"}
    assert result.stats.files_hashed == 7 and result.stats.blobs_written == 6
    assert all(store.verify(d) for d in digests if d is not None)


def test_incremental_mode_relists_only_dirty_dirs_and_matches_a_full_scan(tmp_path: Path) -> None:
    make_tree(tmp_path, files=12)
    (tmp_path / "d2" / "gone").mkdir()
    (tmp_path / "d2" / "gone" / "x").write_bytes(b"x")
    (tmp_path / "quiet").mkdir()
    (tmp_path / "quiet" / "deep").mkdir()
    settle()
    before = scan(tmp_path)
    (tmp_path / "d0" / "f0.txt").write_bytes(b"changed")
    (tmp_path / "d1" / "new.txt").write_bytes(b"new")
    (tmp_path / "d2" / "gone" / "x").unlink()
    (tmp_path / "d2" / "gone").rmdir()
    (tmp_path / "d2" / "fresh" / "inner").mkdir(parents=True)
    (tmp_path / "d2" / "fresh" / "inner" / "y").write_bytes(b"y")
    dirty = {"d0", "d1", "d2"}
    incremental = scan(tmp_path, before.index, only=dirty)
    full = scan(tmp_path, before.index)
    assert observed(incremental) == observed(full)
    assert incremental.index.root.tree == full.index.root.tree
    assert incremental.stats.dirs_listed == len(dirty) + 2  # and the new fresh, fresh/inner
    assert full.stats.dirs_listed == 8
    assert incremental.stats.entries_carried == 2  # quiet and quiet/deep: never listed


def test_an_incremental_scan_escalates_a_dirty_dir_that_is_gone(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"f")
    before = scan(tmp_path)
    (tmp_path / "a" / "b" / "f").unlink()
    (tmp_path / "a" / "b").rmdir()
    (tmp_path / "a" / "b").symlink_to("/")  # a dirty set naming only the replaced directory
    incremental = scan(tmp_path, before.index, only={"a/b"})
    assert observed(incremental) == observed(scan(tmp_path))
    assert entry(incremental, "a/b").type == "symlink"


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


@needs_root
def test_a_chown_is_seen_by_the_stat_cache_and_changes_the_tree(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"same content")
    settle()
    first = scan(tmp_path)
    os.chown(tmp_path / "f", 65534, 65534)
    second = scan(tmp_path, first.index)
    assert (entry(second, "f").uid, entry(second, "f").gid) == (65534, 65534)
    assert entry(second, "f").digest == entry(first, "f").digest
    assert second.stats.entries_reused == 0 and second.stats.trees_built == 1
    assert entry(second, ".").tree != entry(first, ".").tree


def test_an_index_from_before_owners_were_recorded_is_refused(tmp_path: Path) -> None:
    from settled.canonical import canonical_bytes
    from settled.workspace.manifest import IndexMismatch

    index = scan(tmp_path).index
    old_row = [".", "dir", 0o755, 0, index.root.tree, 1, 2, 3, 4, index.root.node, 0]
    old = {"v": "settled.index/v2", "algorithm": index.algorithm, "scan_started_ns": 1,
           "root": old_row}  # fmt: skip
    with pytest.raises(IndexMismatch, match=r"settled\.index/v2"):
        Index.from_bytes(canonical_bytes(old), index.reader)


def test_the_index_round_trips_through_the_node_cache(tmp_path: Path) -> None:
    workspace, store = tmp_path / "ws", LocalObjectStore(tmp_path / "objects")
    cache = NodeCache(str(tmp_path / "index.db"))
    make_tree(workspace, files=4)
    (workspace / "link").symlink_to("d0")
    os.mkfifo(workspace / "fifo")
    index = scan(workspace, store=store, cache=cache).index
    again = Index.from_bytes(index.to_bytes(), NodeCache(str(tmp_path / "index.db")), index.ref)
    assert again.entries == index.entries and again.root == index.root
    assert again.count == len(index.entries) == 10


def test_a_failed_fsync_while_publishing_fails_the_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace, store = tmp_path / "ws", LocalObjectStore(tmp_path / "objects")
    make_tree(workspace, files=5)

    def failing_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(DurabilityError, match="Input/output error"):
        scan(workspace, store=store)
    monkeypatch.undo()
    assert not any(
        store.has(digest_bytes(DEFAULT_ALGORITHM, b"content %d\n" % i)) for i in range(5)
    )
    assert os.listdir(store.temp_dir) == []


class CountingReader:
    """A node cache that records which nodes a scan loaded."""

    def __init__(self, cache: NodeCache) -> None:
        self.cache, self.reads = cache, []  # type: ignore[var-annotated]

    def read(self, digest: str) -> bytes:
        self.reads.append(digest)
        return self.cache.read(digest)

    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        self.cache.put_many(items)


def test_an_incremental_scan_loads_and_builds_only_the_changed_path(tmp_path: Path) -> None:
    workspace, store = tmp_path / "ws", LocalObjectStore(tmp_path / "objects")
    for d in range(20):
        (workspace / f"d{d:02d}" / "deep").mkdir(parents=True)
        for f in range(5):
            (workspace / f"d{d:02d}" / f"f{f}").write_bytes(b"%d/%d" % (d, f))
    settle()
    cache = NodeCache(str(tmp_path / "index.db"))
    before = scan(workspace, store=store, cache=cache)
    (workspace / "d07" / "f3").write_bytes(b"changed")
    reader = CountingReader(cache)
    cold = Index.from_bytes(before.index.to_bytes(), reader)  # a new process: nothing loaded
    incremental = scan(workspace, cold, store, only={"d07"}, cache=cache)
    root_node, d07_node = before.index.node("."), before.index.node("d07")
    assert root_node is not None and d07_node is not None
    assert reader.reads == [root_node.ref, d07_node.ref]
    assert (incremental.stats.dirs_listed, incremental.stats.files_hashed) == (1, 1)
    assert (incremental.stats.trees_built, incremental.stats.nodes_built) == (2, 2)
    assert sorted(incremental.trees.values()) == [".", "d07"]
    assert incremental.stats.entries_carried == incremental.index.count - 1 - 1 - 6
    assert observed(incremental) == observed(scan(workspace))
    assert all(store.has(tree) for tree in incremental.trees)


def test_a_rescan_of_an_unchanged_tree_builds_no_node_and_no_tree(tmp_path: Path) -> None:
    workspace, store = tmp_path / "ws", LocalObjectStore(tmp_path / "objects")
    make_tree(workspace, files=12)
    settle()
    first = scan(workspace, store=store)
    again = scan(workspace, first.index, store)
    assert (again.stats.nodes_built, again.stats.trees_built, again.stats.files_hashed) == (0, 0, 0)
    assert again.index.root == first.index.root and again.trees == {}


def test_a_racy_entry_is_rehashed_once_then_trusted(tmp_path: Path) -> None:
    (tmp_path / "quiet").write_bytes(b"q")
    settle()
    (tmp_path / "fresh").write_bytes(b"written just before the scan")
    first = scan(tmp_path)  # "fresh" is racy: its mtime is not older than this scan's cutoff
    settle()
    second = scan(tmp_path, first.index)
    third = scan(tmp_path, second.index)
    assert (second.stats.files_hashed, second.stats.entries_reused) == (1, 1)
    assert second.stats.nodes_built == 1 and second.stats.trees_built == 0  # same content
    assert cutoff(second) > cutoff(first)
    assert (third.stats.files_hashed, third.stats.nodes_built) == (0, 0)


def test_identical_directories_share_one_tree(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name / "sub").mkdir(parents=True)
        (tmp_path / name / "sub" / "f").write_bytes(b"same")
    for path in ("a/sub/f", "b/sub/f", "a/sub", "b/sub"):  # trees record times: make them equal
        os.utime(tmp_path / path, ns=(10**18, 10**18))
    result = scan(tmp_path)
    assert entry(result, "a").tree == entry(result, "b").tree
    assert entry(result, "a/sub").tree == entry(result, "b/sub").tree
    assert sorted(result.trees.values()) == [".", "a", "a/sub"]  # one path named per tree


def test_an_unreadable_stat_cache_node_is_refused_not_trusted(tmp_path: Path) -> None:
    from settled.workspace.manifest import IndexMismatch

    workspace, store = tmp_path / "ws", LocalObjectStore(tmp_path / "objects")
    cache = NodeCache(str(tmp_path / "index.db"))
    make_tree(workspace, files=3)
    first = scan(workspace, store=store, cache=cache)
    node = first.index.node("d0")
    assert node is not None
    with sqlite3.connect(tmp_path / "index.db") as db:
        db.execute("UPDATE nodes SET data=CAST(replace(data, 'f0.txt', 'f9.txt') AS BLOB) "
                   "WHERE ref=?",
                   (node.ref,))  # fmt: skip
    cold = Index.from_bytes(first.index.to_bytes(), cache)
    with pytest.raises(IndexMismatch, match=f"{node.ref} of 'd0'"):
        scan(workspace, cold, store, cache=cache)


def every_kind(root: Path) -> None:
    """A tree with every entry kind the scanner records, ignored paths and a non-ASCII name."""
    (root / "d" / "deep" / "deeper").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "build").mkdir()
    (root / "build" / "out.o").write_bytes(b"ignored")
    (root / "x.log").write_bytes(b"ignored too")
    (root / "keep.log").write_bytes(b"kept by negation")
    for i in range(12):
        (root / "d" / f"f{i}").write_bytes(b"file %d\n" % i)
    (root / "d" / "deep" / "deeper" / "leaf").write_bytes(b"leaf")
    (root / "d" / "empty-file").write_bytes(b"")
    (root / "héllo wörld.txt").write_bytes(b"non-ascii name")
    os.link(root / "d" / "f0", root / "d" / "hard-link-to-f0")
    os.symlink("f1", root / "d" / "link-in")
    os.symlink("/etc/passwd", root / "link-out")
    os.symlink("missing", root / "dangling")
    os.symlink("d", root / "dir-link")
    os.mkfifo(root / "fifo")
    with contextlib.closing(socket.socket(socket.AF_UNIX)) as sock:
        sock.bind(str(root / "sock"))
    with contextlib.suppress(PermissionError):  # a device node needs CAP_MKNOD
        os.mknod(root / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    os.chmod(root / "d" / "f2", 0o751)
    with open(root / "sparse", "wb") as handle:  # a hole past MIN_HOLE, data at both ends
        handle.write(b"head")
        handle.seek(1 << 20)
        handle.write(b"tail")


def comparable(result: ScanResult) -> tuple[list[Entry], dict[str, str], dict[str, object]]:
    stats = {k: v for k, v in vars(result.stats).items() if k != "walker"}
    return observed(result), result.trees, stats


@pytest.mark.parametrize("walker", [walk.NATIVE], indirect=True)  # it runs both itself
def test_both_walkers_give_identical_results(tmp_path: Path, walker: str) -> None:
    """Every entry kind, racy files, ignored paths: the same index, trees and counters from the
    C walker and its Python twin, on a first scan, a rescan and a rescan after changes."""
    every_kind(tmp_path)
    rules = ignore.compile_rules(["build/", "*.log", "!keep.log"])

    def both(previous: Index | None) -> dict[str, ScanResult]:
        """Each walker from the same previous index: the stat cache's decisions (racy or not)
        depend on that index's cutoff only, never on when each scan ran."""
        out = {}
        for name in (walk.NATIVE, walk.PYTHON):
            os.environ["SETTLED_WALKER"] = name
            out[name] = scan(tmp_path, previous, ignore=rules)
            assert out[name].stats.walker == name
        return out

    first = both(None)
    settle()
    second = both(first[walk.NATIVE].index)  # everything racy in the first: re-read once
    third = both(second[walk.NATIVE].index)  # all vouched for
    (tmp_path / "d" / "f3").write_bytes(b"changed\n")
    (tmp_path / "d" / "f4").unlink()
    (tmp_path / "d" / "new").write_bytes(b"new")
    os.chmod(tmp_path / "d" / "f5", 0o600)
    fourth = both(third[walk.NATIVE].index)
    for step in (first, second, third, fourth):
        assert comparable(step[walk.NATIVE]) == comparable(step[walk.PYTHON])
    paths = set(fourth[walk.NATIVE].index.by_path)
    assert {"keep.log", "fifo", "sock", "dangling", "héllo wörld.txt", "d/new"} <= paths
    assert not {"build", "build/out.o", "x.log", "d/f4"} & paths
    assert second[walk.NATIVE].stats.files_hashed > 0  # what was racy when first seen
    assert third[walk.NATIVE].stats.files_hashed == 0
    assert third[walk.NATIVE].stats.entries_reused == 18 + 4  # the files and the symlinks
    assert fourth[walk.NATIVE].stats.files_hashed == 3  # f3, f5 (its mode), new


def test_a_walker_that_cannot_be_used_is_an_error_not_a_silent_fallback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SETTLED_WALKER", "fast")
    with pytest.raises(walk.WalkerUnavailable, match="SETTLED_WALKER='fast'"):
        walk.choose()
    monkeypatch.setattr(walk, "_native", lambda: None)  # as if the extension were not built
    monkeypatch.setenv("SETTLED_WALKER", walk.NATIVE)
    with pytest.raises(walk.WalkerUnavailable, match="pip install -e"):
        walk.choose()
    monkeypatch.delenv("SETTLED_WALKER")
    assert walk.choose().name == walk.PYTHON  # the fallback, named in every scan's stats


def test_the_c_walker_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """CI installs with `pip install -e .`, which must have compiled it."""
    monkeypatch.delenv("SETTLED_WALKER", raising=False)
    assert walk.choose().name == walk.NATIVE


def test_a_directory_listed_ahead_that_fails_is_named_when_reached(
    tmp_path: Path, walker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Siblings are listed together; one whose listing failed fails the scan with its own
    path, when the walk reaches it (a mode cannot make a directory unreadable to root)."""
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_bytes(name.encode())
    real = walk.choose(walker)

    def failing_b(jobs: list[walk.Job], workers: int) -> list[walk.Listed | OSError]:
        listed = real.scan_dirs(jobs, workers)
        for i, (fd, _, _) in enumerate(jobs):
            if os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path / "b"):
                listed[i] = PermissionError(13, "Permission denied")
        return listed

    monkeypatch.setattr(scan_module, "choose", lambda: real._replace(scan_dirs=failing_b))
    with pytest.raises(WorkspaceUnreadable, match="'b'"):
        scan(tmp_path)


def test_a_file_swapped_for_a_fifo_after_the_listing_is_never_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, walker: str
) -> None:
    """The walker reads small files after listing them: one replaced by a FIFO in between is
    recorded as the FIFO it now is (opening it for reading would block the scan forever)."""
    (tmp_path / "f").write_bytes(b"a file when listed")
    real = walk.choose(walker)

    def swap_after_listing(jobs: list[walk.Job], workers: int) -> list[walk.Listed | OSError]:
        listed = real.scan_dirs(jobs, workers)
        if (tmp_path / "f").is_file():
            (tmp_path / "f").unlink()
            os.mkfifo(tmp_path / "f")
        return listed

    monkeypatch.setattr(scan_module, "choose", lambda: real._replace(scan_dirs=swap_after_listing))
    result = scan(tmp_path, store=LocalObjectStore(tmp_path.parent / f"{tmp_path.name}-o"))
    assert entry(result, "f").type == "fifo" and result.stats.files_hashed == 0


def test_many_dirty_directories_are_listed_ahead_in_batches_and_match_a_full_scan(
    tmp_path: Path, walker: str
) -> None:
    count = scan_module.AHEAD_BATCH + 6
    for d in range(count):
        (tmp_path / f"d{d:03d}").mkdir()
        for f in range(3):
            (tmp_path / f"d{d:03d}" / f"f{f}").write_bytes(b"%d %d" % (d, f))
    settle()
    first = scan(tmp_path)
    settle()
    for d in range(count):
        (tmp_path / f"d{d:03d}" / "f1").write_bytes(b"changed %d" % d)
    dirty = [f"d{d:03d}" for d in range(count)]
    incremental = scan(tmp_path, first.index, only=dirty)
    full = scan(tmp_path, first.index)
    assert observed(incremental) == observed(full)
    assert (incremental.stats.dirs_listed, incremental.stats.files_hashed) == (count, count)


def test_a_dirty_directory_replaced_after_it_was_listed_ahead_is_recorded_as_it_is_now(
    tmp_path: Path, walker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_bytes(name.encode())
    settle()
    first = scan(tmp_path)
    (tmp_path / "a" / "f").write_bytes(b"a changed")
    (tmp_path / "b" / "f").write_bytes(b"b changed")
    real = walk.choose(walker)
    swapped = []

    def swap_b_after_listing(jobs: list[walk.Job], workers: int) -> list[walk.Listed | OSError]:
        listed = real.scan_dirs(jobs, workers)
        if len(jobs) > 1 and not swapped:  # the batch listed ahead: now b is another directory
            os.rename(tmp_path / "b", tmp_path / "old-b")
            (tmp_path / "b").mkdir()
            (tmp_path / "b" / "g").write_bytes(b"the new b")
            swapped.append(True)
        return listed

    monkeypatch.setattr(
        scan_module, "choose", lambda: real._replace(scan_dirs=swap_b_after_listing)
    )
    result = scan(tmp_path, first.index, only=["a", "b"])
    paths = set(result.index.by_path)
    assert swapped and {"b/g", "old-b/f"} <= paths and "b/f" not in paths
    assert entry(result, "old-b/f").digest == digest_bytes(DEFAULT_ALGORITHM, b"b changed")


def test_the_garbage_collector_is_paused_during_a_scan_and_restored_after(tmp_path: Path) -> None:
    import gc

    make_tree(tmp_path, files=3)
    seen: list[bool] = []
    real = walk.choose()

    def noting(jobs: list[walk.Job], workers: int) -> list[walk.Listed | OSError]:
        seen.append(gc.isenabled())
        return real.scan_dirs(jobs, workers)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scan_module, "choose", lambda: real._replace(scan_dirs=noting))
        assert gc.isenabled()
        scan(tmp_path)
        assert gc.isenabled() and seen and not any(seen)
        gc.disable()
        try:
            scan(tmp_path)
            assert not gc.isenabled()  # left as it was found
        finally:
            gc.enable()
        patch.setattr(scan_module, "choose", lambda: real._replace(scan_dirs=None))
        with pytest.raises(TypeError):
            scan(tmp_path)
        assert gc.isenabled()  # restored on the way out of a failed scan too


def test_an_entry_from_stat_is_the_entry_its_fields_make(tmp_path: Path) -> None:
    """``Entry.from_stat`` builds the tuple positionally: it must equal the keyword form."""
    (tmp_path / "f").write_bytes(b"x")
    (tmp_path / "d").mkdir()
    os.symlink("f", tmp_path / "l")
    os.mkfifo(tmp_path / "p")
    cases: list[tuple[str, dict[str, str]]] = [
        ("f", {"digest": "blake3:" + "0" * 64}), ("d", {}), ("l", {"target": "f"}), ("p", {}),
    ]  # fmt: skip
    for name, extra in cases:
        st = os.lstat(tmp_path / name)
        kind = TYPES[stat.S_IFMT(st.st_mode)]
        size = st.st_size if kind in ("file", "symlink") else 0
        expected = Entry(
            name, kind, stat.S_IMODE(st.st_mode), size, extra.get("digest"), extra.get("target"),
            None, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns,
            uid=st.st_uid, gid=st.st_gid, mtime=st.st_mtime_ns, xattrs=(),  # the scan adds any
        )  # fmt: skip
        made = Entry.from_stat(name, st, **extra)
        assert made == expected and type(made) is Entry and made._asdict() == expected._asdict()


# -- hard links: read once a scan ------------------------------------------------------------


def test_a_file_with_many_links_is_read_once_and_every_link_has_its_digest(
    tmp_path: Path,
) -> None:
    """65,000 links of a 1 GiB file cost ~1 s of `ln` and made a scan read 63 TiB: a link of a
    file this scan already read, unchanged and not racy, takes that read's digest."""
    data = os.urandom(2 * 1024 * 1024)
    (tmp_path / "big").write_bytes(data)
    for n in range(40):
        os.link(tmp_path / "big", tmp_path / f"link{n:02d}")
    (tmp_path / "other").write_bytes(data)  # the same bytes, another inode: read on its own
    settle()
    result = scan(tmp_path)
    assert result.stats.bytes_read == 2 * len(data)
    assert result.stats.links_reused == 40
    digest = digest_bytes(DEFAULT_ALGORITHM, data)
    assert {e.path: e.digest for e in result.index.entries if e.path != "."} == {
        "big": digest, "other": digest, **{f"link{n:02d}": digest for n in range(40)},
    }  # fmt: skip
    assert len({entry(result, f"link{n:02d}").ino for n in range(40)}) == 1


def test_a_link_changed_after_its_file_was_read_is_read_again(tmp_path: Path) -> None:
    """Only an unchanged file is vouched for: a link whose inode's ctime moved (any write, a
    new link) is read, and so is one whose file changed within the clock's slack of the read."""
    data = os.urandom(256 * 1024)
    (tmp_path / "a").write_bytes(data)
    os.link(tmp_path / "a", tmp_path / "b")
    os.link(tmp_path / "a", tmp_path / "c")
    result = scan(tmp_path)  # just written: racy, each link read
    assert result.stats.bytes_read == 3 * len(data) and result.stats.links_reused == 0
    settle()
    real_read_file = scan_module._Scanner.read_file
    changed: list[str] = []

    def read_then_change(self: Any, fd: int, name: str, *args: Any) -> Entry | None:
        got = real_read_file(self, fd, name, *args)
        if not changed:  # the first link read: write through it before the others are seen
            changed.append(name)
            settle()
            with open(tmp_path / name, "r+b") as f:
                f.write(b"X")
        return got

    scan_module._Scanner.read_file = read_then_change  # type: ignore[method-assign]
    try:
        again = scan(tmp_path)
    finally:
        scan_module._Scanner.read_file = real_read_file  # type: ignore[method-assign]
    now = digest_bytes(DEFAULT_ALGORITHM, b"X" + data[1:])
    others = {"a", "b", "c"} - set(changed)
    assert all(entry(again, path).digest == now for path in others)
    assert again.stats.links_reused == 0  # the change is within the slack of every later read


def test_an_mtime_set_in_the_future_does_not_make_every_link_read_again(tmp_path: Path) -> None:
    """A command may set any mtime (utimes), never the ctime: racy is decided by the ctime,
    or a future mtime would have every one of 65,000 links read."""
    data = os.urandom(256 * 1024)
    (tmp_path / "a").write_bytes(data)
    for n in range(10):
        os.link(tmp_path / "a", tmp_path / f"l{n}")
    future = time.time() + 10 * 365 * 86400
    os.utime(tmp_path / "a", (future, future))
    settle()
    result = scan(tmp_path)
    assert result.stats.bytes_read == len(data) and result.stats.links_reused == 10
