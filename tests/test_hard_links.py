"""Hard links are recorded as link groups and restored as links (issue 36).

Why: the scanner reads a file once per inode, so 65,000 links of a 1 GiB file checkpoint
cheaply; restored as copies they were 63 TiB. A file with other links records its group's key
(a hash of its device and inode) in its tree entry, and restore links the members it has to the
first one it wrote. Real files, a real object store, real links; no mocks.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Final

import pytest

from settled.canonical import canonical_bytes
from settled.objects.hashing import DEFAULT_ALGORITHM
from settled.objects.local import LocalObjectStore
from settled.workspace.index import Index
from settled.workspace.manifest import Entry, read_manifest, write_manifest
from settled.workspace.readback import read_back
from settled.workspace.restore import restore
from settled.workspace.scan import scan
from settled.workspace.verify import LINK_GROUP, verify_manifest

MIB: Final = 1 << 20


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "objects")


def checkpoint(store: LocalObjectStore, workspace: Path, previous: Index | None = None) -> Index:
    index = scan(workspace, previous, store=store).index
    manifest_id = write_manifest(store, index.algorithm, index.root)
    assert read_back(store, manifest_id, record=None, index=index).ok
    return index


def manifest_id_of(store: LocalObjectStore, index: Index) -> str:
    return write_manifest(store, index.algorithm, index.root)


def groups(index: Index) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for entry in index.entries:
        if entry.link is not None:
            found.setdefault(entry.link, set()).add(entry.path)
    return found


def test_a_thousand_links_of_one_8_mib_file_restore_as_one_inode(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    workspace, dest = tmp_path / "ws", tmp_path / "restored"
    original = workspace / "big.bin"
    for sub in ("a", "b", "c/d"):
        (workspace / sub).mkdir(parents=True)
    original.write_bytes(os.urandom(8 * MIB))
    links = [original] + [
        workspace / ("a", "b", "c/d")[number % 3] / f"link{number:04d}" for number in range(999)
    ]
    for link in links[1:]:
        os.link(original, link)
    index = checkpoint(store, workspace)
    assert list(groups(index).values()) == [{str(p.relative_to(workspace)) for p in links}]
    result = restore(store, manifest_id_of(store, index), dest)
    assert (result.files, result.hard_links, result.bytes_written) == (1000, 999, 8 * MIB)
    inodes = {os.stat(dest / p.relative_to(workspace)).st_ino for p in links}
    assert len(inodes) == 1
    assert os.stat(dest / "big.bin").st_nlink == 1000
    assert (dest / "c/d/link0002").read_bytes() == original.read_bytes()
    used_kib = int(subprocess.run(["du", "-sk", str(dest)], capture_output=True,
                                  text=True, check=True).stdout.split()[0])  # fmt: skip
    assert 8 * 1024 <= used_kib < 9 * 1024  # ~8 MiB: one file's blocks, not 1000 copies


def test_a_group_spans_directories_and_members_outside_the_workspace_are_absent(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    workspace, outside, dest = tmp_path / "ws", tmp_path / "outside", tmp_path / "restored"
    (workspace / "x").mkdir(parents=True)
    (workspace / "y" / "z").mkdir(parents=True)
    outside.mkdir()
    (workspace / "x" / "one").write_bytes(b"shared bytes\n")
    os.link(workspace / "x" / "one", workspace / "y" / "z" / "two")
    os.link(workspace / "x" / "one", outside / "three")  # a member the checkpoint cannot hold
    (workspace / "alone").write_bytes(b"shared bytes\n")  # same bytes, another inode
    index = checkpoint(store, workspace)
    assert list(groups(index).values()) == [{"x/one", "y/z/two"}]
    assert index.by_path["alone"].link is None
    result = restore(store, manifest_id_of(store, index), dest)
    assert result.hard_links == 1
    one, two = os.stat(dest / "x" / "one"), os.stat(dest / "y" / "z" / "two")
    assert one.st_ino == two.st_ino and one.st_nlink == 2
    assert os.stat(dest / "alone").st_ino != one.st_ino
    assert one.st_mtime_ns == os.stat(workspace / "x" / "one").st_mtime_ns


def test_the_stat_cache_keeps_the_group_and_a_new_link_joins_it(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    workspace = tmp_path / "ws"
    (workspace / "d").mkdir(parents=True)
    (workspace / "f").write_bytes(b"linked\n")
    os.link(workspace / "f", workspace / "d" / "g")
    time.sleep(0.1)  # ctimes older than the scan by more than the clock slack: not racy
    first = checkpoint(store, workspace)
    again = scan(workspace, first, store=store)
    assert again.stats.files_hashed == 0 and again.stats.entries_reused == 2
    assert again.index.root.tree == first.root.tree  # an unchanged inode keeps its key
    assert groups(again.index) == groups(first)
    os.link(workspace / "f", workspace / "h")  # the inode's ctime moves: every link re-read
    third = checkpoint(store, workspace, again.index)
    (key,) = groups(first)
    assert groups(third) == {key: {"f", "d/g", "h"}}
    assert third.root.tree != first.root.tree
    os.unlink(workspace / "d" / "g")
    os.unlink(workspace / "h")  # one link left: no group any more
    fourth = checkpoint(store, workspace, third)
    assert groups(fourth) == {}


def _v4_tree(store: LocalObjectStore, entries: list[dict[str, object]]) -> str:
    raw = {"v": "settled.tree/v4", "algorithm": DEFAULT_ALGORITHM, "entries": entries}
    return store.put_bytes(canonical_bytes(raw))


def _head(store: LocalObjectStore, tree: str) -> str:
    raw = {"v": "settled.manifest/v4", "algorithm": DEFAULT_ALGORITHM,
           "root": {"mode": 0o755, "tree": tree, "uid": 0, "gid": 0, "mtime": 0},
           "parent": None, "watermark": None, "generation": 0}  # fmt: skip
    return store.put_bytes(canonical_bytes(raw))


def test_a_group_whose_members_disagree_is_named_by_verify_and_restored_as_separate_files(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    key = "0123456789abcdef" * 2
    first, second = store.put_bytes(b"one\n"), store.put_bytes(b"two\n")
    base = {"type": "file", "mode": 0o644, "size": 4, "uid": 0, "gid": 0, "mtime": 0, "link": key}
    manifest_id = _head(store, _v4_tree(store, [
        {**base, "name": "a", "digest": first}, {**base, "name": "b", "digest": second},
    ]))  # fmt: skip
    report = verify_manifest(store, manifest_id)
    assert [(p.object, p.paths) for p in report.problems] == [(f"{LINK_GROUP}:{key}", ("a", "b"))]
    result = restore(store, manifest_id, tmp_path / "dest")
    assert result.hard_links == 0
    assert (tmp_path / "dest" / "b").read_bytes() == b"two\n"
    assert os.stat(tmp_path / "dest" / "a").st_ino != os.stat(tmp_path / "dest" / "b").st_ino


def test_a_link_group_is_a_file_field_of_a_v4_tree_only(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    from settled.workspace.manifest import ManifestInvalid

    blob = store.put_bytes(b"x")
    file = {"name": "f", "type": "file", "mode": 0o644, "size": 1, "uid": 0, "gid": 0,
            "mtime": 0, "digest": blob}  # fmt: skip
    for bad in ("not-a-key", 7, "A" * 32):
        with pytest.raises(ManifestInvalid, match="link group"):
            read_manifest(store, _head(store, _v4_tree(store, [{**file, "link": bad}])))
    v3 = {"v": "settled.tree/v3", "algorithm": DEFAULT_ALGORITHM,
          "entries": [{**file, "link": "0" * 32}]}  # fmt: skip
    with pytest.raises(ManifestInvalid, match="has fields"):
        read_manifest(store, _head(store, store.put_bytes(canonical_bytes(v3))))
    entry = Entry("f", "file", 0o644, 1, digest=blob, uid=0, gid=0, mtime=0)
    assert "link" not in entry.tree_form()
