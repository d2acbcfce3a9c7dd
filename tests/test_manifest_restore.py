"""Manifests name a tree exactly; restore rebuilds it exactly, or leaves nothing behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import pytest
from conftest import tamper_object

from settled.canonical import canonical_bytes
from settled.objects.hashing import DEFAULT_ALGORITHM, digest_bytes
from settled.objects.local import LocalObjectStore
from settled.workspace.manifest import (
    Manifest,
    ManifestCorrupt,
    ManifestInvalid,
    MissingObject,
    read_manifest,
    write_manifest,
)
from settled.workspace.readback import CLOSURE, SINCE_PARENT, read_back
from settled.workspace.restore import (
    BlobCorrupt,
    DestinationIsSymlink,
    DestinationNotEmpty,
    Restorer,
    SameOwnerNeedsRoot,
    earned_setid,
    restore,
)
from settled.workspace.scan import scan
from settled.workspace.verified import VerifiedRecord
from settled.workspace.verify import verify_manifest

NOBODY: Final = 65534  # uid of nobody and gid of nogroup here
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the attack needs root: chown to another user, restore as root"
)


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


def same_times(root: Path, ns: int = 1_600_000_000_123_456_789) -> None:
    """Give everything under ``root`` one mtime (children first), so trees compare by content."""
    for path in [*sorted(root.rglob("*"), key=lambda p: -len(p.parts)), root]:
        os.utime(path, ns=(ns, ns), follow_symlinks=False)


def test_the_manifest_id_is_the_hash_of_its_canonical_bytes_and_deterministic(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    first, second = tmp_path / "one", tmp_path / "two"
    for root in (first, second):
        (root / "d").mkdir(parents=True)
        (root / "d" / "f").write_bytes(b"same")
        same_times(root)
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
        assert b"ino" not in raw and b"mtime_ns" not in raw and b"ctime" not in raw
        assert b"node" not in raw and b"trusted" not in raw
        assert b'"mtime"' in raw  # a recorded fact of the tree (v3) and of the root (v4)
    assert set(manifest.to_dict()) == {
        "v", "algorithm", "root", "parent", "watermark", "generation",
    }  # fmt: skip
    assert set(manifest.to_dict()["root"]) == {"mode", "tree", "uid", "gid", "mtime"}  # v4


def test_every_tree_entry_and_the_manifest_root_record_the_owner_lstat_saw(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    workspace = make_workspace(tmp_path / "ws")
    manifest_id = checkpoint(store, workspace)
    assert json.loads(store.read(manifest_id))["v"] == "settled.manifest/v4"
    manifest = read_manifest(store, manifest_id)
    for entry in manifest.entries:
        st = os.lstat(workspace / entry.path)
        assert (entry.uid, entry.gid) == (st.st_uid, st.st_gid), entry.path
    for tree in {e.tree for e in manifest.entries if e.tree is not None}:
        raw = json.loads(store.read(tree))
        assert raw["v"] == "settled.tree/v4"
        assert all({"uid", "gid", "mtime"} <= set(form) for form in raw["entries"])


def test_a_manifest_whose_root_records_no_owner_is_never_written(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    (tmp_path / "ws").mkdir()
    index = scan(tmp_path / "ws", store=store).index
    ownerless = index.root._replace(uid=None, gid=None)
    with pytest.raises(ManifestInvalid, match="records no owner"):
        write_manifest(store, index.algorithm, ownerless)


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
    assert result.setid_dropped == ()  # the restorer owns "setuid" as it did in the workspace


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


def _put_tree(
    store: LocalObjectStore, entries: list[dict[str, object]], version: str = "settled.tree/v2"
) -> str:
    raw = {"v": version, "algorithm": DEFAULT_ALGORITHM, "entries": entries}
    return store.put_bytes(canonical_bytes(raw))


def _put_head(
    store: LocalObjectStore, root_tree: str, owner: tuple[int, int] | None = (0, 0)
) -> str:
    """A manifest object: v3 (the root's owner recorded), or the v2 form when ``owner`` is
    None."""
    root: dict[str, object] = {"mode": 0o755, "tree": root_tree}
    if owner is not None:
        root.update(uid=owner[0], gid=owner[1])
    raw = {"v": "settled.manifest/v3" if owner else "settled.manifest/v2",
           "algorithm": DEFAULT_ALGORITHM, "root": root, "parent": None, "watermark": None,
           "generation": 0}  # fmt: skip
    return store.put_bytes(canonical_bytes(raw))


def test_restore_refuses_tree_names_that_could_climb_out(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    blob = store.put_bytes(b"evil")
    file = {"type": "file", "mode": 0o644, "size": 4, "digest": blob, "uid": 0, "gid": 0}
    empty = _put_tree(store, [])
    directory = {"name": "d", "type": "dir", "mode": 0o755, "size": 0, "uid": 0, "gid": 0}
    bad_trees = [
        [{**file, "name": ".."}],
        [{**file, "name": "a/b"}],
        [{**file, "name": ""}],
        [{**file, "name": "."}],
        [{**file, "name": "x\0y"}],
        [directory],  # a directory without a tree
        [{**directory, "tree": empty, "digest": blob}],
        [{**file, "name": "b"}, {**file, "name": "a"}],  # not sorted
        [{**file, "name": "a"}, {**file, "name": "a"}],  # not unique
    ]
    for number, entries in enumerate(bad_trees):
        manifest_id = _put_head(store, _put_tree(store, entries))
        with pytest.raises(ManifestInvalid):
            restore(store, manifest_id, tmp_path / f"dest{number}")
        assert not (tmp_path / f"dest{number}").exists()
    assert sorted(os.listdir(tmp_path)) == ["objects"]


def test_a_tree_entry_with_a_missing_or_impossible_owner_is_refused(
    store: LocalObjectStore,
) -> None:
    blob = store.put_bytes(b"x")
    file = {"name": "f", "type": "file", "mode": 0o644, "size": 1, "digest": blob}
    bad_owners = [
        {},  # a v2 tree records every owner
        {"uid": 0},
        {"uid": -1, "gid": 0},
        {"uid": 2**32 - 1, "gid": 0},  # (uid_t)-1: "leave unchanged" to chown
        {"uid": 0, "gid": "0"},
        {"uid": True, "gid": 0},
    ]
    for owner in bad_owners:
        manifest_id = _put_head(store, _put_tree(store, [{**file, **owner}]))
        with pytest.raises(ManifestInvalid, match="'f'"):
            read_manifest(store, manifest_id)
    legacy = _put_head(store, _put_tree(store, [{**file, "uid": 0, "gid": 0}], "settled.tree/v1"))
    with pytest.raises(ManifestInvalid, match="has fields"):  # a v1 tree records no owner
        read_manifest(store, legacy)


def test_trees_and_manifests_written_before_owners_are_still_read_without_owner(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    blob = store.put_bytes(b"old")
    file = {"name": "f", "type": "file", "mode": 0o644, "size": 3, "digest": blob}
    manifest_id = _put_head(store, _put_tree(store, [file], "settled.tree/v1"), owner=None)
    manifest = read_manifest(store, manifest_id)
    assert [(e.path, e.uid, e.gid) for e in manifest.entries] == [
        (".", None, None),
        ("f", None, None),
    ]
    assert manifest.id == manifest_id  # read back, it gives back its v2 bytes
    restore(store, manifest_id, tmp_path / "dest")
    assert (tmp_path / "dest" / "f").read_bytes() == b"old"


def test_a_flat_v1_manifest_is_still_read_without_owner(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    blob = store.put_bytes(b"flat")
    manifest_id = _put_manifest(store, [
        {"path": ".", "type": "dir", "mode": 0o755, "size": 0},
        {"path": "f", "type": "file", "mode": 0o644, "size": 4, "digest": blob},
    ])  # fmt: skip
    manifest = read_manifest(store, manifest_id)
    assert [(e.path, e.uid, e.gid) for e in manifest.entries] == [
        (".", None, None),
        ("f", None, None),
    ]
    assert manifest.id == manifest_id
    restore(store, manifest_id, tmp_path / "dest")
    assert (tmp_path / "dest" / "f").read_bytes() == b"flat"


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
    away = store.quarantine(reused)  # in the first scan's pack, with its blobs
    assert away is not None
    missing = check(SINCE_PARENT)
    assert [(p.object, p.problem, p.paths) for p in missing.problems] == [
        (reused, "missing", ("d1",))
    ]
    assert store.put_bytes(Path(away).read_bytes()) == reused  # back, as a file of its own

    new_tree = next(tree for tree, path in second.trees.items() if path == "d3")
    original = Path(store.path_of(new_tree)).read_bytes()
    os.chmod(store.path_of(new_tree), 0o644)
    Path(store.path_of(new_tree)).write_bytes(original.replace(b'"f"', b'"g"'))
    torn = check(SINCE_PARENT)
    assert [(p.object, p.problem) for p in torn.problems] == [(new_tree, "damaged")]
    assert "reads back as" in torn.problems[0].detail
    Path(store.path_of(new_tree)).write_bytes(original)

    reused_blob = digest_bytes(DEFAULT_ALGORITHM, b"same")  # in d3, not re-read by the scan
    tamper_object(store, reused_blob, lambda _: b"SAME")  # in the first scan's pack
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
        assert json.loads(data)["v"] == "settled.tree/v4"
        kinds |= {form["type"] for form in json.loads(data)["entries"]}
    assert kinds == {"file", "dir", "symlink", "fifo"}


# -- restore grants nothing (issue 10) ----------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _owner(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_uid, st.st_gid


def test_the_setid_rule_keeps_only_bits_the_restorer_could_set_itself() -> None:
    from settled.workspace.manifest import Entry

    root, user = Restorer(0, frozenset({0})), Restorer(1000, frozenset({1000, 50}))
    same = Restorer(0, frozenset({0}), same_owner=True)

    def kept(uid: int | None, gid: int | None, who: Restorer, now: tuple[int, int]) -> int:
        return earned_setid(Entry("f", "file", 0o6755, 0, uid=uid, gid=gid), *now, who)

    assert kept(NOBODY, NOBODY, root, (0, 0)) == 0  # root restoring nobody's: neither bit
    assert kept(0, 0, root, (0, 0)) == 0o6000  # root restoring root's own
    assert kept(NOBODY, NOBODY, same, (NOBODY, NOBODY)) == 0o6000  # chowned back: both
    assert kept(NOBODY, NOBODY, same, (0, 0)) == 0  # the chown did not happen: neither
    assert kept(1000, 50, user, (1000, 50)) == 0o6000  # its uid, one of its groups
    assert kept(1000, 60, user, (1000, 1000)) == 0o4000  # not one of its groups
    assert kept(0, 1000, user, (1000, 1000)) == 0o2000  # root's file: no set-uid
    assert kept(None, None, same, (0, 0)) == 0  # no owner recorded: nothing to earn


@needs_root
def test_restoring_as_root_a_setuid_file_of_nobody_makes_no_setuid_root_file(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "prog").write_bytes(b"#!/bin/sh\nid\n")
    os.chown(workspace / "prog", NOBODY, NOBODY)
    os.chmod(workspace / "prog", 0o4755)
    result = restore(store, checkpoint(store, workspace), tmp_path / "dest")
    restored = tmp_path / "dest" / "prog"
    assert _owner(restored) == (0, 0) and _mode(restored) == 0o755
    assert result.setid_dropped == ("prog",) and not result.owners_restored


@needs_root
def test_restoring_as_root_a_setgid_file_of_another_group_drops_the_bit(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "prog").write_bytes(b"#!/bin/sh\nid\n")
    os.chown(workspace / "prog", 0, NOBODY)
    os.chmod(workspace / "prog", 0o2755)
    result = restore(store, checkpoint(store, workspace), tmp_path / "dest")
    restored = tmp_path / "dest" / "prog"
    assert _owner(restored) == (0, 0) and _mode(restored) == 0o755
    assert result.setid_dropped == ("prog",)


@needs_root
def test_a_setgid_directory_of_another_group_loses_the_bit_and_keeps_the_sticky_bit(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    workspace = tmp_path / "ws"
    (workspace / "shared").mkdir(parents=True)
    os.chown(workspace / "shared", 0, NOBODY)
    os.chmod(workspace / "shared", 0o3775)
    (workspace / "own").mkdir()
    os.chmod(workspace / "own", 0o2755)  # set-gid, of root's own group: earned
    result = restore(store, checkpoint(store, workspace), tmp_path / "dest")
    assert _owner(tmp_path / "dest" / "shared") == (0, 0)
    assert _mode(tmp_path / "dest" / "shared") == 0o1775
    assert _mode(tmp_path / "dest" / "own") == 0o2755
    assert result.setid_dropped == ("shared",)


@needs_root
def test_same_owner_restores_every_owner_and_the_setid_bits_that_go_with_them(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    workspace = tmp_path / "ws"
    (workspace / "shared").mkdir(parents=True)
    (workspace / "prog").write_bytes(b"#!/bin/sh\nid\n")
    os.mkfifo(workspace / "pipe", 0o640)
    (workspace / "link").symlink_to("/etc/passwd")
    for name in ("prog", "pipe", "shared", "."):
        os.chown(workspace / name, NOBODY, NOBODY)
    os.chown(workspace / "link", NOBODY, 0, follow_symlinks=False)
    os.chmod(workspace / "prog", 0o6755)
    os.chmod(workspace / "shared", 0o3775)
    result = restore(store, checkpoint(store, workspace), tmp_path / "dest", same_owner=True)
    assert tree_of(tmp_path / "dest") == tree_of(workspace)  # owners and modes, bit for bit
    assert _owner(tmp_path / "dest" / "prog") == (NOBODY, NOBODY)
    assert _mode(tmp_path / "dest" / "prog") == 0o6755
    assert _owner(tmp_path / "dest" / "link") == (NOBODY, 0)
    assert result.owners_restored and result.setid_dropped == ()
    assert result.owners_unrecorded == 0


def test_same_owner_is_refused_when_not_root_and_nothing_is_written(
    store: LocalObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest_id = checkpoint(store, make_workspace(tmp_path / "ws"))
    (tmp_path / "out").mkdir()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SameOwnerNeedsRoot, match="needs root; this process runs as euid 1000"):
        restore(store, manifest_id, tmp_path / "out" / "dest", same_owner=True)
    assert os.listdir(tmp_path / "out") == []


def _put_ownerless_setid(store: LocalObjectStore) -> str:
    """A v1 tree (no owner recorded) holding a set-uid file and a set-gid directory."""
    blob = store.put_bytes(b"old")
    empty = _put_tree(store, [], "settled.tree/v1")
    return _put_head(store, _put_tree(store, [
        {"name": "d", "type": "dir", "mode": 0o2775, "size": 0, "tree": empty},
        {"name": "prog", "type": "file", "mode": 0o4755, "size": 3, "digest": blob},
    ], "settled.tree/v1"), owner=None)  # fmt: skip


def test_an_entry_that_records_no_owner_never_keeps_a_setid_bit(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    result = restore(store, _put_ownerless_setid(store), tmp_path / "dest")
    assert _mode(tmp_path / "dest" / "prog") == 0o755
    assert _mode(tmp_path / "dest" / "d") == 0o775
    assert result.setid_dropped == ("d", "prog") and result.owners_unrecorded == 3


@needs_root
def test_same_owner_without_a_recorded_owner_drops_setid_bits_and_says_so(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    result = restore(store, _put_ownerless_setid(store), tmp_path / "dest", same_owner=True)
    assert _mode(tmp_path / "dest" / "prog") == 0o755
    assert _owner(tmp_path / "dest" / "prog") == (0, 0)
    assert result.setid_dropped == ("d", "prog")
    assert not result.owners_restored and result.owners_unrecorded == 3


@contextlib.contextmanager
def _world_readable_dir() -> Iterator[Path]:
    """A directory another user can reach (pytest's tmp_path is under a 0700 directory)."""
    top = Path(tempfile.mkdtemp(prefix="settled-restore-", dir="/tmp"))
    try:
        os.chmod(top, 0o755)
        yield top
    finally:
        shutil.rmtree(top)


def _as_user(uid: int, gid: int, work: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """Run ``work`` in a forked child that is ``uid``:``gid`` (no other groups); return what it
    returned (JSON), or raise what it raised, as text."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root for good, do the work, report, exit
        code = 0
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            try:
                reply = {"ok": work()}
            except Exception as error:
                reply = {"error": f"{type(error).__name__}: {error}"}
            os.write(write_end, json.dumps(reply).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    deadline = time.monotonic() + timeout_s
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise TimeoutError(f"the child restoring as {uid} ran over {timeout_s} s")
            time.sleep(0.01)
        data = os.read(read_end, 1 << 20)
    finally:
        os.close(read_end)
    reply = json.loads(data)
    if "error" in reply:
        raise AssertionError(reply["error"])
    return reply["ok"]


@needs_root
def test_an_ordinary_user_keeps_the_setuid_bit_of_its_own_files_only() -> None:
    with _world_readable_dir() as top:
        workspace, out = top / "ws", top / "out"
        workspace.mkdir()
        out.mkdir()
        os.chown(out, NOBODY, NOBODY)
        for name, owner in (("mine", NOBODY), ("roots", 0)):
            (workspace / name).write_bytes(b"#!/bin/sh\nid\n")
            os.chown(workspace / name, owner, owner)
            os.chmod(workspace / name, 0o4755)
        store = LocalObjectStore(top / "objects")
        manifest_id = checkpoint(store, workspace)
        for below, dirs, files in os.walk(top / "objects"):  # the user's own (private) store
            for name in [*dirs, *files]:
                os.chown(os.path.join(below, name), NOBODY, NOBODY)
        os.chown(top / "objects", NOBODY, NOBODY)

        def work() -> list[str]:
            return list(restore(store, manifest_id, out / "dest").setid_dropped)

        assert _as_user(NOBODY, NOBODY, work) == ["roots"]
        assert _owner(out / "dest" / "mine") == (NOBODY, NOBODY)
        assert _mode(out / "dest" / "mine") == 0o4755
        assert _owner(out / "dest" / "roots") == (NOBODY, NOBODY)
        assert _mode(out / "dest" / "roots") == 0o755


@needs_root
def test_a_device_node_is_recorded_by_the_scan_and_never_created_by_restore(
    store: LocalObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    os.mknod(workspace / "mem", 0o600 | stat.S_IFCHR, os.makedev(1, 1))  # /dev/mem
    os.mknod(workspace / "disk", 0o600 | stat.S_IFBLK, os.makedev(7, 0))  # /dev/loop0
    manifest_id = checkpoint(store, workspace)
    kinds = {e.path: (e.type, e.rdev) for e in read_manifest(store, manifest_id).entries}
    assert kinds["mem"] == ("chardev", os.makedev(1, 1))
    assert kinds["disk"] == ("blockdev", os.makedev(7, 0))

    def no_mknod(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"restore called mknod{args}")

    monkeypatch.setattr(os, "mknod", no_mknod)
    result = restore(store, manifest_id, tmp_path / "dest", same_owner=True)
    assert result.not_restorable == (("disk", "blockdev"), ("mem", "chardev"))
    assert not result.complete and os.listdir(tmp_path / "dest") == []


@needs_root
def test_a_hand_made_chardev_entry_is_reported_not_restorable_never_created(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    manifest_id = _put_manifest(store, [
        {"path": ".", "type": "dir", "mode": 0o755, "size": 0},
        {"path": "null", "type": "chardev", "mode": 0o666, "size": 0,
         "rdev": os.makedev(1, 3)},
    ])  # fmt: skip
    result = restore(store, manifest_id, tmp_path / "dest", same_owner=True)
    assert result.not_restorable == (("null", "chardev"),)
    assert os.listdir(tmp_path / "dest") == []


# -- a symlink in the destination is never followed ---------------------------------------------


def test_a_destination_that_is_a_symlink_is_refused_and_nothing_is_written(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    manifest_id = checkpoint(store, make_workspace(tmp_path / "ws"))
    target, dest = tmp_path / "target", tmp_path / "dest"
    target.mkdir()
    dest.symlink_to(target)
    with pytest.raises(DestinationIsSymlink, match=f"{dest}' is a symlink to '{target}'"):
        restore(store, manifest_id, dest)
    assert os.listdir(target) == [] and os.readlink(dest) == str(target)
    assert sorted(os.listdir(tmp_path)) == ["dest", "objects", "target", "ws"]


def test_a_dangling_symlink_at_the_destination_is_refused_and_its_target_never_made(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    manifest_id = checkpoint(store, make_workspace(tmp_path / "ws"))
    dest = tmp_path / "dest"
    dest.symlink_to(tmp_path / "made-by-restore")
    with pytest.raises(DestinationIsSymlink, match="made-by-restore"):
        restore(store, manifest_id, dest)
    assert not (tmp_path / "made-by-restore").exists()


def test_a_destination_under_a_symlinked_parent_is_refused_naming_the_link(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    manifest_id = checkpoint(store, make_workspace(tmp_path / "ws"))
    real, link = tmp_path / "real", tmp_path / "link"
    (real / "deeper").mkdir(parents=True)
    link.symlink_to(real)
    with pytest.raises(DestinationIsSymlink, match=f"goes through '{link}', which is a symlink"):
        restore(store, manifest_id, link / "deeper" / "dest")
    assert os.listdir(real / "deeper") == []


def _swap_for_symlink(directory: Path, moved: Path, elsewhere: Path) -> None:
    """Move ``directory`` away to ``moved`` and put a symlink to ``elsewhere`` in its place."""
    os.rename(directory, moved)
    directory.symlink_to(elsewhere)


@pytest.fixture
def swap_dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """``parent`` (where the restore goes), ``moved`` (where it is moved to mid-restore) and
    ``elsewhere`` (where the symlink planted in its place points)."""
    (tmp_path / "parent").mkdir()
    (tmp_path / "elsewhere").mkdir()
    return tmp_path / "parent", tmp_path / "moved", tmp_path / "elsewhere"


def test_a_parent_swapped_for_a_symlink_during_the_build_is_refused_before_the_rename(
    store: LocalObjectStore,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    swap_dirs: tuple[Path, Path, Path],
) -> None:
    from settled.workspace import restore as restore_module

    parent, moved, elsewhere = swap_dirs
    manifest_id = checkpoint(store, make_workspace(tmp_path / "ws"))
    build = restore_module._Builder.build

    def build_then_swap(builder: Any) -> None:
        build(builder)
        _swap_for_symlink(parent, moved, elsewhere)

    monkeypatch.setattr(restore_module._Builder, "build", build_then_swap)
    with pytest.raises(DestinationIsSymlink, match=f"goes through '{parent}'"):
        restore(store, manifest_id, parent / "dest")
    assert os.listdir(elsewhere) == [] and os.listdir(moved) == []  # temp directory removed


def test_a_parent_swapped_for_a_symlink_at_the_rename_never_redirects_the_tree(
    store: LocalObjectStore,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    swap_dirs: tuple[Path, Path, Path],
) -> None:
    parent, moved, elsewhere = swap_dirs
    manifest_id = checkpoint(store, make_workspace(tmp_path / "ws"))
    real_rename = os.rename
    landed: list[str] = []

    def swap_then_rename(src: Any, dst: Any, **kwargs: Any) -> None:
        if not landed and dst == "dest":  # the rename into place, after every check
            _swap_for_symlink(parent, moved, elsewhere)
            real_rename(src, dst, **kwargs)
            landed.extend(sorted(os.listdir(moved / "dest")))
            return
        real_rename(src, dst, **kwargs)

    monkeypatch.setattr(os, "rename", swap_then_rename)
    with pytest.raises(DestinationIsSymlink, match=f"goes through '{parent}'"):
        restore(store, manifest_id, parent / "dest")
    assert "src" in landed  # the rename went into the directory that was checked...
    assert os.listdir(elsewhere) == []  # ...never through the symlink
    assert os.listdir(moved) == []  # and, the path having moved, it was undone


def test_a_symlink_planted_at_the_destination_at_the_rename_is_never_followed(
    store: LocalObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest_id = checkpoint(store, make_workspace(tmp_path / "ws"))
    (tmp_path / "parent").mkdir()
    (tmp_path / "elsewhere").mkdir()
    dest = tmp_path / "parent" / "dest"
    real_rename = os.rename

    def plant_then_rename(src: Any, dst: Any, **kwargs: Any) -> None:
        if dst == "dest" and not dest.is_symlink():
            dest.symlink_to(tmp_path / "elsewhere")
        real_rename(src, dst, **kwargs)

    monkeypatch.setattr(os, "rename", plant_then_rename)
    with pytest.raises(DestinationIsSymlink, match="is a symlink to"):
        restore(store, manifest_id, dest)
    assert os.listdir(tmp_path / "elsewhere") == []
    assert os.listdir(tmp_path / "parent") == ["dest"] and dest.is_symlink()


def test_planted_symlinks_out_of_a_workspace_are_restored_as_links_never_written_through(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    workspace = tmp_path / "ws"
    (workspace / "d").mkdir(parents=True)
    (workspace / "etc").symlink_to("/etc")
    (workspace / "up").symlink_to("..")
    (workspace / "d" / "upup").symlink_to("../../..")
    (workspace / "d" / "f").write_bytes(b"in d")
    etc_before = sorted(os.listdir("/etc"))
    manifest_id = checkpoint(store, workspace)
    links = {e.path: (e.type, e.target) for e in read_manifest(store, manifest_id).entries}
    assert links["etc"] == ("symlink", "/etc") and links["up"] == ("symlink", "..")
    assert links["d/upup"] == ("symlink", "../../..")
    out = tmp_path / "out"
    out.mkdir()
    restore(store, manifest_id, out / "dest")
    for path, target in (("etc", "/etc"), ("up", ".."), ("d/upup", "../../..")):
        assert os.readlink(out / "dest" / path) == target
    assert os.listdir(out) == ["dest"] and sorted(os.listdir("/etc")) == etc_before
    assert tree_of(out / "dest") == tree_of(workspace)


def test_a_file_under_a_restored_symlink_is_refused_at_any_depth(
    store: LocalObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from settled.workspace import restore as restore_module
    from settled.workspace.manifest import Entry, UnsafePath

    with _world_readable_dir() as outside:  # a real directory under /tmp, outside dest
        blob = store.put_bytes(b"evil")
        target = str(outside)
        unchecked = Manifest(DEFAULT_ALGORITHM, (
            Entry(".", "dir", 0o755, 0),
            Entry("d", "dir", 0o755, 0),
            Entry("d/a", "symlink", 0o777, len(target), target=target),
            Entry("d/a/x", "file", 0o644, 4, digest=blob),
        ))  # fmt: skip
        monkeypatch.setattr(restore_module, "read_manifest", lambda store, manifest_id: unchecked)
        with pytest.raises(UnsafePath, match="'d/a/x'"):
            restore(store, blob, tmp_path / "dest")
        assert os.listdir(outside) == [] and not (tmp_path / "dest").exists()
