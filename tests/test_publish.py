"""Publishing many objects: each fsynced while few, then staged into one pack, synced once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from settled.objects import DurabilityError
from settled.objects import packs as packs_module
from settled.objects.hashing import DEFAULT_ALGORITHM, digest_bytes
from settled.objects.local import LocalObjectStore
from settled.workspace.publish import GROUP_FROM, Publisher
from settled.workspace.scan import scan


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "objects")


def submit_all(publisher: Publisher, store: LocalObjectStore, payloads: list[bytes]) -> None:
    for data in payloads:
        writer = store.writer(size_hint=len(data))
        writer.write(data)
        publisher.submit(writer)


def payloads(count: int, size: int = 100) -> list[bytes]:
    return [(b"%06d" % i) * (size // 6) for i in range(count)]


def test_past_the_threshold_every_object_is_staged_then_synced_once(
    store: LocalObjectStore,
) -> None:
    data = [*payloads(40), os.urandom(3 * (1 << 20))]  # the last one spills to its temp file
    with Publisher(store, group_from=10) as publisher:
        submit_all(publisher, store, data)
        staged = [digest_bytes(DEFAULT_ALGORITHM, d) for d in data]
        assert not any(store.has(digest) for digest in staged)  # no name before the sync
        publisher.close()
    assert (publisher.submitted, publisher.grouped, publisher.created) == (41, 41, 41)
    assert all(store.verify(digest_bytes(DEFAULT_ALGORITHM, d)) for d in data)
    assert os.listdir(store.temp_dir) == []


def test_a_staged_object_already_present_is_not_written_again(store: LocalObjectStore) -> None:
    present = store.put_bytes(b"already here")
    before = os.stat(store.path_of(present))
    with Publisher(store, group_from=0) as publisher:
        submit_all(publisher, store, [b"already here", b"new"])
    assert (publisher.grouped, publisher.created) == (2, 1)
    assert os.stat(store.path_of(present)).st_ino == before.st_ino
    assert os.listdir(store.temp_dir) == []


def test_a_failed_group_sync_names_no_object_and_leaves_no_temp(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fsync = packs_module._fsync

    def failing_pack_fsync(fd: int, path: str) -> None:
        if path.endswith(".pack"):
            raise DurabilityError(path, OSError(5, "Input/output error"))
        real_fsync(fd, path)

    monkeypatch.setattr(packs_module, "_fsync", failing_pack_fsync)
    data = payloads(20)
    publisher = Publisher(store, group_from=5)
    with pytest.raises(DurabilityError, match="Input/output error"), publisher:
        submit_all(publisher, store, data)
    present = [store.has(digest_bytes(DEFAULT_ALGORITHM, d)) for d in data]
    assert present == [False] * 20  # the five held back were staged with the rest
    assert os.listdir(store.temp_dir) == []
    assert os.listdir(store.packs.dir) == []  # the pack that was never named is gone


def test_a_small_publish_is_committed_object_by_object_at_close(store: LocalObjectStore) -> None:
    data = payloads(GROUP_FROM)
    with Publisher(store) as publisher:
        submit_all(publisher, store, data)
        assert not any(store.has(digest_bytes(DEFAULT_ALGORITHM, d)) for d in data)
    assert (publisher.grouped, publisher.created) == (0, GROUP_FROM)
    assert all(os.path.isfile(store.path_of(digest_bytes(DEFAULT_ALGORITHM, d))) for d in data)
    assert not os.path.exists(store.packs.dir)


def test_a_group_of_small_objects_is_one_pack_named_after_its_sync(
    store: LocalObjectStore,
) -> None:
    data = payloads(50)
    with Publisher(store, group_from=0) as publisher:
        submit_all(publisher, store, data)
        assert os.listdir(store.packs.dir) == [next(iter(os.listdir(store.packs.dir)))]
        assert not any(store.has(digest_bytes(DEFAULT_ALGORITHM, d)) for d in data)
    assert (publisher.grouped, publisher.created) == (50, 50)
    names = sorted(os.listdir(store.packs.dir))
    assert [n.rsplit(".", 1)[1] for n in names] == ["idx", "pack"]
    assert all(os.stat(os.path.join(store.packs.dir, n)).st_mode & 0o777 == 0o400 for n in names)
    assert all(store.verify(digest_bytes(DEFAULT_ALGORITHM, d)) for d in data)
    assert not os.path.exists(store.path_of(digest_bytes(DEFAULT_ALGORITHM, data[0])))


def test_a_large_scan_stages_its_blobs_trees_and_their_list_into_one_pack(
    tmp_path: Path,
) -> None:
    workspace, store = tmp_path / "ws", LocalObjectStore(tmp_path / "objects")
    for d in range(100):
        (workspace / f"d{d:02d}").mkdir(parents=True)
        for f in range(2):
            (workspace / f"d{d:02d}" / f"f{f}").write_bytes(b"%d/%d" % (d, f))
    result = scan(workspace, store=store, list_published=True)
    assert result.stats.blobs_written == 200  # the blobs alone, though trees share the pack
    assert result.stats.objects_grouped == 200 + 101 + 1 > 2 * GROUP_FROM
    packs = [n for n in os.listdir(store.packs.dir) if n.endswith(".idx")]
    assert len(packs) == 1  # one pack made durable, then named: blobs and trees together
    assert all(store.verify(digest) for digest in result.blobs)
    assert all(store.has(tree) for tree in result.trees)
    assert result.published_ref is not None
    where = store.location_of(result.published_ref)
    assert where is not None and where[0] == store.packs.pack_path(packs[0][:-4])
    listed = json.loads(store.read(result.published_ref))
    assert listed == {"trees": result.trees, "blobs": sorted(result.blobs)}
    assert os.listdir(store.temp_dir) == []


def test_a_small_scan_commits_its_blobs_then_its_trees_and_their_list_as_files(
    tmp_path: Path,
) -> None:
    """Too few objects to group: each blob is committed (its own fsync) when the blobs'
    publisher closes, and only then are the trees and the list written."""
    workspace, store = tmp_path / "ws", LocalObjectStore(tmp_path / "objects")
    (workspace / "a").mkdir(parents=True)
    (workspace / "a" / "f").write_bytes(b"one")
    (workspace / "g").write_bytes(b"two")
    result = scan(workspace, store=store, list_published=True)
    assert result.stats.blobs_written == 2 and result.stats.objects_grouped == 0
    assert result.published_ref is not None
    for digest in [*result.blobs, *result.trees, result.published_ref]:
        assert os.path.isfile(store.path_of(digest))  # a file each, none packed
    assert json.loads(store.read(result.published_ref))["trees"] == result.trees
