"""Manifests name a tree exactly; restore rebuilds it exactly, or leaves nothing behind."""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from settled.canonical import canonical_bytes
from settled.workspace.hashing import DEFAULT_ALGORITHM, digest_bytes
from settled.workspace.manifest import (
    Manifest,
    ManifestCorrupt,
    ManifestInvalid,
    MissingObject,
    read_manifest,
    write_manifest,
)
from settled.workspace.objects import LocalObjectStore
from settled.workspace.readback import CLOSURE, SINCE_PARENT, read_back
from settled.workspace.restore import BlobCorrupt, DestinationNotEmpty, restore
from settled.workspace.scan import scan
from settled.workspace.verified import VerifiedRecord
from settled.workspace.verify import verify_manifest


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "objects")


def make_workspace(root: Path) -> Path:
    """Every restorable kind of entry, with modes that matter."""
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "mod.py").write_bytes(b"print('hi')\n")
    (root / "bin").mkdir()
    (root / "bin" / "run").write_bytes(b"#!/bin/sh\necho run\n")
    os.chmod(root / "bin" / "run", 0o755)
    (root / "private").write_bytes(b"\x00binary\xff" * 1000)
    os.chmod(root / "private", 0o600)
    (root / "setuid").write_bytes(b"s")
    os.chmod(root / "setuid", 0o4755)
    (root / "empty").mkdir()
    (root / "shared").mkdir(mode=0o700)
    os.chmod(root / "shared", 0o1777)
    (root / "readonly").mkdir()
    (root / "readonly" / "f").write_bytes(b"r")
    os.chmod(root / "readonly", 0o555)
    (root / "big").write_bytes(os.urandom(3 * (1 << 20) + 5))
    (root / "rel-link").symlink_to("src/pkg/mod.py")
    (root / "abs-link").symlink_to("/etc/passwd")
    (root / "dangling").symlink_to("does/not/exist")
    os.mkfifo(root / "pipe", 0o620)
    return root


def checkpoint(
    store: LocalObjectStore, workspace: Path, *, watermark: int | None = None, generation: int = 0
) -> str:
    index = scan(workspace, store=store).index
    return write_manifest(
        store, index.algorithm, index.root, watermark=watermark, generation=generation
    )


def tree_of(root: Path) -> Manifest:
    index = scan(root).index
    return Manifest(index.algorithm, tuple(e.without_stat() for e in index.entries))


def test_the_manifest_id_is_the_hash_of_its_canonical_bytes_and_deterministic(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    first, second = tmp_path / "one", tmp_path / "two"
    for root in (first, second):
        (root / "d").mkdir(parents=True)
        (root / "d" / "f").write_bytes(b"same")
    manifest_id = checkpoint(store, first, watermark=7, generation=2)
    assert checkpoint(store, second, watermark=7, generation=2) == manifest_id  # other inodes
    manifest = read_manifest(store, manifest_id)
    assert manifest_id == digest_bytes(DEFAULT_ALGORITHM, canonical_bytes(manifest.to_dict()))
    assert store.read(manifest_id) == manifest.to_bytes()
    assert checkpoint(store, first, watermark=8, generation=2) != manifest_id


def test_neither_manifest_nor_tree_has_stat_cache(store: LocalObjectStore, tmp_path: Path) -> None:
    (tmp_path / "ws" / "d").mkdir(parents=True)
    (tmp_path / "ws" / "d" / "f").write_bytes(b"x")
    manifest_id = checkpoint(store, tmp_path / "ws")
    manifest = read_manifest(store, manifest_id)
    trees = {e.tree for e in manifest.entries if e.tree is not None}
    assert len(trees) == 2
    for raw in [store.read(manifest_id), *(store.read(tree) for tree in trees)]:
        assert b"ino" not in raw and b"mtime" not in raw and b"ctime" not in raw
        assert b"node" not in raw and b"trusted" not in raw
    assert set(manifest.to_dict()) == {
        "v", "algorithm", "root", "parent", "watermark", "generation",
    }  # fmt: skip


def test_reading_back_refuses_a_corrupted_manifest_or_tree(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    manifest_id = checkpoint(store, make_workspace(tmp_path / "ws"))
    tree = {e.path: e.tree for e in read_manifest(store, manifest_id).entries}["src/pkg"]
    assert tree is not None
    for object_id, old, new in [(tree, b'"mode":420', b'"mode":511'), (manifest_id, b"{", b" {")]:
        path = store.path_of(object_id)
        original = Path(path).read_bytes()
        os.chmod(path, 0o644)
        Path(path).write_bytes(original.replace(old, new, 1))
        with pytest.raises(ManifestCorrupt, match=object_id):
            read_manifest(store, manifest_id)
        assert not verify_manifest(store, manifest_id).ok
        Path(path).write_bytes(original)
    assert verify_manifest(store, manifest_id).ok


def test_a_manifest_whose_trees_are_not_published_is_never_written(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "unpublished").write_bytes(b"only on disk")
    index = scan(tmp_path / "ws").index  # scanned without a store
    assert index.root.tree is not None
    with pytest.raises(MissingObject, match=f"root tree {index.root.tree}"):
        write_manifest(store, index.algorithm, index.root)
    assert os.listdir(store.root) == ["tmp"]  # nothing was written


def test_verify_names_a_tampered_blob_and_its_paths(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    manifest_id = checkpoint(store, make_workspace(tmp_path / "ws"))
    assert verify_manifest(store, manifest_id).ok
    digest = digest_bytes(DEFAULT_ALGORITHM, b"r")
    os.chmod(store.path_of(digest), 0o644)
    Path(store.path_of(digest)).write_bytes(b"R")
    assert verify_manifest(store, manifest_id).ok  # same size: only --read-data can tell
    result = verify_manifest(store, manifest_id, read_data=True)
    assert [(p.object, p.problem, p.paths) for p in result.problems] == [
        (digest, "damaged", ("readonly/f",))
    ]
    Path(store.path_of(digest)).write_bytes(b"RR")
    shorter = verify_manifest(store, manifest_id)
    assert [(p.object, p.problem, p.detail) for p in shorter.problems] == [
        (digest, "damaged", "is 2 bytes; its entries say 1")
    ]


def test_restore_reproduces_the_tree_bit_for_bit(store: LocalObjectStore, tmp_path: Path) -> None:
    workspace = make_workspace(tmp_path / "ws")
    manifest_id = checkpoint(store, workspace, watermark=3, generation=1)
    result = restore(store, manifest_id, tmp_path / "restored")
    restored = tmp_path / "restored"
    assert tree_of(restored) == tree_of(workspace)
    assert (restored / "big").read_bytes() == (workspace / "big").read_bytes()
    assert stat.S_IMODE(os.stat(restored / "setuid").st_mode) == 0o4755
    assert stat.S_IMODE(os.stat(restored / "shared").st_mode) == 0o1777
    assert os.access(restored / "bin" / "run", os.X_OK)
    assert os.readlink(restored / "abs-link") == "/etc/passwd"
    assert stat.S_ISFIFO(os.lstat(restored / "pipe").st_mode)
    assert (result.files, result.dirs, result.symlinks, result.fifos) == (6, 6, 3, 1)
    assert result.complete and result.not_restorable == ()


def test_restore_into_an_existing_empty_directory_is_allowed(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    workspace = make_workspace(tmp_path / "ws")
    (tmp_path / "dest").mkdir()
    restore(store, checkpoint(store, workspace), tmp_path / "dest")
    assert tree_of(tmp_path / "dest") == tree_of(workspace)


def test_restore_refuses_a_destination_that_is_not_empty(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    manifest_id = checkpoint(store, make_workspace(tmp_path / "ws"))
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep").write_bytes(b"mine")
    with pytest.raises(DestinationNotEmpty, match=str(dest)):
        restore(store, manifest_id, dest)
    assert os.listdir(dest) == ["keep"] and (dest / "keep").read_bytes() == b"mine"


def test_restore_refuses_a_tampered_blob_and_leaves_nothing(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    manifest_id = checkpoint(store, make_workspace(tmp_path / "ws"))
    digest = digest_bytes(DEFAULT_ALGORITHM, b"print('hi')\n")
    os.chmod(store.path_of(digest), 0o644)
    Path(store.path_of(digest)).write_bytes(b"print('pwned')\n")
    (tmp_path / "out").mkdir()
    with pytest.raises(BlobCorrupt, match=f"{digest} for 'src/pkg/mod.py'"):
        restore(store, manifest_id, tmp_path / "out" / "dest")
    assert os.listdir(tmp_path / "out") == []  # no dest, no temp directory


def _put_manifest(store: LocalObjectStore, entries: list[dict[str, object]]) -> str:
    raw = {"v": "settled.manifest/v1", "algorithm": DEFAULT_ALGORITHM, "entries": entries,
           "parent": None, "watermark": None, "generation": 0}  # fmt: skip
    return store.put_bytes(canonical_bytes(raw))


def test_restore_refuses_paths_that_escape_or_cross_a_symlink(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    blob = store.put_bytes(b"evil")
    root = {"path": ".", "type": "dir", "mode": 0o755, "size": 0}
    file = {"type": "file", "mode": 0o644, "size": 4, "digest": blob}
    link = {"path": "link", "type": "symlink", "mode": 0o777, "size": len(str(outside)),
            "target": str(outside)}  # fmt: skip
    escapes = [
        [{**file, "path": "../evil"}, root],
        [{**file, "path": "/tmp/evil"}, root],
        [root, link, {**file, "path": "link/evil"}],
    ]
    for number, entries in enumerate(escapes):
        with pytest.raises(ManifestInvalid):
            restore(store, _put_manifest(store, entries), tmp_path / f"dest{number}")
        assert not (tmp_path / f"dest{number}").exists()
    assert os.listdir(outside) == []


def test_sockets_are_reported_as_not_restorable(
    store: LocalObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    monkeypatch.chdir(workspace)  # a short relative path: AF_UNIX paths are limited to 108 bytes
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind("sock")
        result = restore(store, checkpoint(store, workspace), tmp_path / "dest")
    assert result.not_restorable == (("sock", "socket"),) and not result.complete
    assert os.listdir(tmp_path / "dest") == []


def test_restore_itself_never_traverses_a_symlink_it_created(
    store: LocalObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from settled.workspace import restore as restore_module
    from settled.workspace.manifest import Entry, UnsafePath

    outside = tmp_path / "outside"
    outside.mkdir()
    blob = store.put_bytes(b"evil")
    unchecked = Manifest(DEFAULT_ALGORITHM, (
        Entry(".", "dir", 0o755, 0),
        Entry("link", "symlink", 0o777, len(str(outside)), target=str(outside)),
        Entry("link/evil", "file", 0o644, 4, digest=blob),
    ))  # fmt: skip
    monkeypatch.setattr(restore_module, "read_manifest", lambda store, manifest_id: unchecked)
    with pytest.raises(UnsafePath, match="'link/evil'"):
        restore(store, blob, tmp_path / "dest")
    assert os.listdir(outside) == [] and not (tmp_path / "dest").exists()


def _put_tree(store: LocalObjectStore, entries: list[dict[str, object]]) -> str:
    raw = {"v": "settled.tree/v1", "algorithm": DEFAULT_ALGORITHM, "entries": entries}
    return store.put_bytes(canonical_bytes(raw))


def _put_head(store: LocalObjectStore, root_tree: str) -> str:
    raw = {"v": "settled.manifest/v2", "algorithm": DEFAULT_ALGORITHM,
           "root": {"mode": 0o755, "tree": root_tree}, "parent": None, "watermark": None,
           "generation": 0}  # fmt: skip
    return store.put_bytes(canonical_bytes(raw))


def test_restore_refuses_tree_names_that_could_climb_out(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    blob = store.put_bytes(b"evil")
    file = {"type": "file", "mode": 0o644, "size": 4, "digest": blob}
    empty = _put_tree(store, [])
    bad_trees = [
        [{**file, "name": ".."}],
        [{**file, "name": "a/b"}],
        [{**file, "name": ""}],
        [{**file, "name": "."}],
        [{**file, "name": "x\0y"}],
        [{"name": "d", "type": "dir", "mode": 0o755, "size": 0}],  # a directory without a tree
        [{"name": "d", "type": "dir", "mode": 0o755, "size": 0, "tree": empty, "digest": blob}],
        [{**file, "name": "b"}, {**file, "name": "a"}],  # not sorted
        [{**file, "name": "a"}, {**file, "name": "a"}],  # not unique
    ]
    for number, entries in enumerate(bad_trees):
        manifest_id = _put_head(store, _put_tree(store, entries))
        with pytest.raises(ManifestInvalid):
            restore(store, manifest_id, tmp_path / f"dest{number}")
        assert not (tmp_path / f"dest{number}").exists()
    assert sorted(os.listdir(tmp_path)) == ["objects"]


def test_identical_directories_restore_from_one_shared_tree(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    workspace = tmp_path / "ws"
    for name in ("a", "b"):
        (workspace / name / "sub").mkdir(parents=True)
        (workspace / name / "sub" / "f").write_bytes(b"same")
    manifest_id = checkpoint(store, workspace)
    restore(store, manifest_id, tmp_path / "dest")
    assert tree_of(tmp_path / "dest") == tree_of(workspace)
    assert (tmp_path / "dest" / "b" / "sub" / "f").read_bytes() == b"same"


def test_the_read_back_checks_what_the_checkpoint_published_and_what_it_reuses(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    workspace = tmp_path / "ws"
    for d in range(5):
        (workspace / f"d{d}").mkdir(parents=True)
        (workspace / f"d{d}" / "f").write_bytes(b"%d" % d)
        (workspace / f"d{d}" / "same").write_bytes(b"same")
    time.sleep(0.05)
    first = scan(workspace, store=store)
    (workspace / "d3" / "f").write_bytes(b"changed")
    second = scan(workspace, first.index, store, only={"d3"})
    index = second.index
    manifest_id = write_manifest(store, index.algorithm, index.root)

    def check(scope: str) -> Any:
        return read_back(
            store, manifest_id, record=None, index=index, root_tree=index.root.tree,
            fresh=set(second.trees) | second.blobs,
            open_trees=set(second.trees) if scope == SINCE_PARENT else None,
        )  # fmt: skip

    closure = check(CLOSURE)
    assert closure.ok, closure.problems
    unindexed = read_back(store, manifest_id, record=None)  # every tree read and parsed
    assert unindexed.ok and unindexed.objects_reached == closure.objects_reached
    # the manifest, 6 trees and 6 blobs: five "f" and the "same" that every directory shares
    assert (closure.objects_reached, closure.rehashed, closure.trusted) == (13, 13, 0)
    since = check(SINCE_PARENT)
    assert since.ok
    # the manifest, the new root and d3 trees, d3's two blobs and the four reused subtrees
    assert (since.objects_reached, since.trusted_subtrees) == (9, 4)

    reused = first.index.by_path["d1"].tree
    assert reused is not None
    os.rename(store.path_of(reused), store.path_of(reused) + ".away")
    missing = check(SINCE_PARENT)
    assert [(p.object, p.problem, p.paths) for p in missing.problems] == [
        (reused, "missing", ("d1",))
    ]
    os.rename(store.path_of(reused) + ".away", store.path_of(reused))

    new_tree = next(tree for tree, path in second.trees.items() if path == "d3")
    original = Path(store.path_of(new_tree)).read_bytes()
    os.chmod(store.path_of(new_tree), 0o644)
    Path(store.path_of(new_tree)).write_bytes(original.replace(b'"f"', b'"g"'))
    torn = check(SINCE_PARENT)
    assert [(p.object, p.problem) for p in torn.problems] == [(new_tree, "damaged")]
    assert "reads back as" in torn.problems[0].detail
    Path(store.path_of(new_tree)).write_bytes(original)

    reused_blob = digest_bytes(DEFAULT_ALGORITHM, b"same")  # in d3, not re-read by the scan
    os.chmod(store.path_of(reused_blob), 0o644)
    Path(store.path_of(reused_blob)).write_bytes(b"SAME")
    tampered = check(SINCE_PARENT)
    assert [(p.object, p.problem, p.paths) for p in tampered.problems] == [
        (reused_blob, "damaged", ("d3/same",))
    ]
    everywhere = check(CLOSURE)
    assert [p.paths for p in everywhere.problems] == [tuple(f"d{d}/same" for d in range(5))]


def test_the_read_back_trusts_only_objects_unchanged_since_they_hashed_right(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    workspace = tmp_path / "ws"
    (workspace / "d").mkdir(parents=True)
    (workspace / "d" / "f").write_bytes(b"content")
    index = scan(workspace, store=store).index
    manifest_id = write_manifest(store, index.algorithm, index.root)
    record = VerifiedRecord(str(tmp_path / "index.db"))
    time.sleep(0.05)  # older than the racy slack: what is re-hashed now can be trusted later

    def check() -> Any:
        return read_back(store, manifest_id, record=record, index=index)

    first = check()
    assert first.ok and (first.rehashed, first.trusted) == (first.objects_reached, 0) == (4, 0)
    again = check()
    assert again.ok and (again.rehashed, again.trusted) == (1, 3)  # only the manifest re-read
    blob = digest_bytes(DEFAULT_ALGORITHM, b"content")
    os.chmod(store.path_of(blob), 0o444)  # a chmod changes the ctime: no longer vouched for
    os.chmod(store.path_of(blob), 0o400)
    touched = check()
    assert touched.ok and (touched.rehashed, touched.trusted, touched.blobs_rehashed) == (2, 2, 1)
    record.close()
    fresh = VerifiedRecord(str(tmp_path / "other.db"))  # the record lost: re-hashing, not trust
    lost = read_back(store, manifest_id, record=fresh, index=index)
    assert lost.ok and (lost.rehashed, lost.trusted) == (4, 0)
    fresh.close()


def test_tree_objects_are_canonical_json_of_every_entry_type(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    manifest = read_manifest(store, checkpoint(store, make_workspace(tmp_path / "ws")))
    trees = {e.tree for e in manifest.entries if e.tree is not None}
    assert len(trees) == 6  # 7 directories; "empty" and "shared" share the empty tree
    kinds = set()
    for tree in trees:
        data = store.read(tree)
        assert canonical_bytes(json.loads(data)) == data
        kinds |= {form["type"] for form in json.loads(data)["entries"]}
    assert kinds == {"file", "dir", "symlink", "fifo"}
