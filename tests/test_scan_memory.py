"""A scan of millions of entries holds a few directories, not all of them (issue 36, item 7).

Past ``KEEP_ENTRIES`` a full scan keeps no more nodes (its index reads them back from the stat
cache by ref), an index keeps at most ``LOADED_ENTRIES`` of the nodes it loads, node bytes go
to the cache in batches, trees wait for their blobs in a spool that spills to an unlinked file,
and a publisher counts a pack's members instead of holding one object each. Each bound is made
tiny here, and every answer must be the one the unbounded scan gives. The memory itself is a
figure in bench/ (``proof_cost``: the whole ``settled close`` of 1,000,000 empty files).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import tamper_object

from settled.objects.local import LocalObjectStore
from settled.workspace import index as index_module
from settled.workspace import scan as scan_module
from settled.workspace.index import Index
from settled.workspace.manifest import write_manifest
from settled.workspace.nodecache import NodeCache
from settled.workspace.publish import Publisher
from settled.workspace.readback import read_back
from settled.workspace.scan import scan

DIRS, FILES = 12, 15


def _tree(root: Path) -> None:
    for d in range(DIRS):
        for f in range(FILES):
            path = root / f"d{d:02d}" / f"sub{d % 3}" / f"f{f:02d}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"same" if f == 0 else f"{d}/{f}".encode())
    time.sleep(0.05)  # older than a scan's racy cutoff: a rescan may reuse every row


def _bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan_module, "KEEP_ENTRIES", 20)
    monkeypatch.setattr(scan_module, "NODES_FLUSH_BYTES", 512)
    monkeypatch.setattr(scan_module, "TREES_IN_MEMORY", 256)
    monkeypatch.setattr(index_module, "LOADED_ENTRIES", 20)


def _recorded(index: Index) -> dict[str, dict[str, object]]:
    """What the trees say of every entry (a node's ref differs: it holds its scan's cutoff)."""
    return {path: entry.tree_form() for path, entry in index.by_path.items() if path != "."}


def test_a_bounded_scan_gives_every_answer_the_unbounded_one_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = tmp_path / "ws"
    _tree(ws)
    free = scan(
        ws,
        None,
        LocalObjectStore(tmp_path / "free"),
        cache=NodeCache(str(tmp_path / "f.db")),
        list_published=True,
    )
    _bounded(monkeypatch)
    store = LocalObjectStore(tmp_path / "objects")
    bounded = scan(ws, None, store, cache=NodeCache(str(tmp_path / "b.db")), list_published=True)
    assert bounded.index.root.tree == free.index.root.tree
    assert bounded.index.count == free.index.count == 1 + DIRS * 2 + DIRS * FILES
    kept = bounded.index.loaded()
    assert sum(len(node.entries) for node in kept.values()) <= 20 + FILES + DIRS  # and the root's
    assert _recorded(bounded.index) == _recorded(free.index)  # every node read back by ref
    assert bounded.stats.trees_built == free.stats.trees_built
    assert bounded.stats.objects_grouped == free.stats.objects_grouped
    manifest = write_manifest(store, bounded.index.algorithm, bounded.index.root)
    checked = read_back(store, manifest, record=None, index=bounded.index)
    entries = free.index.by_path.values()
    trees = {e.tree for e in entries if e.tree is not None}
    blobs = {e.digest for e in entries if e.type == "file"}
    assert checked.ok and checked.objects_reached == 1 + len(trees) + len(blobs)
    rescan = scan(ws, bounded.index, store, cache=NodeCache(str(tmp_path / "b.db")))
    assert rescan.index.root.tree == free.index.root.tree
    assert rescan.stats.files_hashed == 0  # the stat cache, read back by ref, still vouches


def test_a_problem_in_a_bounded_index_is_named_with_every_path_that_uses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read-back keeps no listing it took from the index; to name a damaged object's
    paths it reads those nodes again."""
    ws = tmp_path / "ws"
    _tree(ws)
    _bounded(monkeypatch)
    store = LocalObjectStore(tmp_path / "objects")
    result = scan(ws, None, store, cache=NodeCache(str(tmp_path / "c.db")))
    manifest = write_manifest(store, result.index.algorithm, result.index.root)
    same = result.index.by_path["d00/sub0/f00"].digest
    assert same is not None
    tamper_object(store, same, lambda _: b"SAME")
    checked = read_back(store, manifest, record=None, index=result.index)
    [problem] = checked.problems
    assert problem.object == same and problem.problem == "damaged"
    assert problem.paths == tuple(sorted(f"d{d:02d}/sub{d % 3}/f00" for d in range(DIRS)))


def test_a_publisher_counts_a_packs_members_instead_of_holding_them(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    with store.batch(), Publisher(store, group_from=0) as publisher:
        digests = [publisher.submit_bytes(f"object {n}".encode(), "blake3") for n in range(50)]
        publisher.submit_bytes(b"object 0", "blake3")  # present already: counted, not created
        assert publisher.grouping and publisher._staged == []
        publisher.close()
    assert (publisher.grouped, publisher.created) == (51, 50)
    assert all(store.read(digest) == f"object {n}".encode() for n, digest in enumerate(digests))
    assert os.listdir(tmp_path / "objects" / "tmp") == []  # no staged file left behind
