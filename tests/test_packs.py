"""Packs: the local store's small objects in one file, named only once their bytes are durable."""

from __future__ import annotations

import itertools
import os
import random
from pathlib import Path

import pytest

from settled.objects import DurabilityError, ObjectMissing
from settled.objects import packs as packs_module
from settled.objects.hashing import DEFAULT_ALGORITHM, SHA256, digest_bytes
from settled.objects.local import LocalObjectStore
from settled.objects.packs import PackWriter, key_of
from settled.workspace.publish import Publisher


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "objects")


def packed(
    store: LocalObjectStore, payloads: list[bytes], algo: str = DEFAULT_ALGORITHM
) -> list[str]:
    """Publish ``payloads`` as one group (one pack); their digests."""
    with Publisher(store, group_from=0) as publisher:
        for data in payloads:
            writer = store.writer(algo, size_hint=len(data))
            writer.write(data)
            publisher.submit(writer)
    return [digest_bytes(algo, data) for data in payloads]


def payloads(count: int, tag: bytes = b"") -> list[bytes]:
    return [b"object %d %s\n" % (i, tag) * (1 + i % 7) for i in range(count)]


def pack_file(store: LocalObjectStore, suffix: str) -> Path:
    (name,) = [n for n in os.listdir(store.packs.dir) if n.endswith(suffix)]
    return Path(store.packs.dir) / name


def rewrite_at(path: Path, offset: int, data: bytes) -> None:
    path.chmod(0o600)
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)
    path.chmod(0o400)


def test_packed_objects_read_back_like_files(store: LocalObjectStore) -> None:
    data = payloads(20)
    digests = packed(store, data)
    assert not any(os.path.exists(store.path_of(d)) for d in digests)  # no file each
    for digest, content in zip(digests, data, strict=True):
        assert store.has(digest) and store.verify(digest)
        assert store.read(digest) == content
        with store.open(digest, version=digest) as handle:
            assert handle.read() == content
        again = store.reread(digest, keep=True)
        assert (again.actual, again.size, again.data) == (digest, len(content), content)
        assert again.stamp == store.stamp(digest) and again.stamp.size == len(content)
    assert set(store.list_digests()) == set(digests)
    assert store.stamps([*digests[:2], digest_bytes(DEFAULT_ALGORITHM, b"absent")])[
        2
    ].__class__ is (ObjectMissing)


def test_both_algorithms_share_a_pack_and_a_stored_file_is_listed_once(
    store: LocalObjectStore,
) -> None:
    both = packed(store, [b"same bytes"], SHA256) + packed(store, [b"same bytes"])
    assert both[0] != both[1] and all(store.verify(d) for d in both)
    loose = store.put_bytes(b"loose and packed")
    packed(store, [b"loose and packed", b"another"])
    assert sorted(store.list_digests()).count(loose) == 1
    assert set(store.list_digests(SHA256)) == {both[0]}


def test_a_group_that_ends_without_its_sync_names_nothing_and_leaves_no_pack(
    store: LocalObjectStore,
) -> None:
    data = payloads(10)
    with pytest.raises(RuntimeError, match="crash"), Publisher(store, group_from=0) as publisher:
        for content in data:
            writer = store.writer()
            writer.write(content)
            publisher.submit(writer)
        raise RuntimeError("crash before close")
    assert not any(store.has(digest_bytes(DEFAULT_ALGORITHM, d)) for d in data)
    assert os.listdir(store.packs.dir) == [] and os.listdir(store.temp_dir) == []


def test_a_pack_without_its_index_names_nothing(store: LocalObjectStore, tmp_path: Path) -> None:
    """A crash between the pack's bytes and its index: the pack is there, nothing is named."""
    store._ensure_dir(store.packs.dir)
    writer = PackWriter(store.packs.dir, store.temp_dir)
    digest = digest_bytes(DEFAULT_ALGORITHM, b"orphan")
    assert writer.add(key_of(digest), b"orphan")
    writer._flush()  # the bytes are in the pack file; finish() never ran
    fresh = LocalObjectStore(tmp_path / "objects")
    assert not fresh.has(digest) and list(fresh.list_digests()) == []
    with pytest.raises(ObjectMissing):
        fresh.reread(digest)
    writer.discard()


def test_the_pack_is_durable_before_its_index_names_it(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_fsync, real_link, real_fsync_dir = packs_module._fsync, os.link, packs_module.fsync_dir

    def fsync(fd: int, path: str) -> None:
        if not os.path.isdir(path):  # a directory's fsync is recorded by fsync_dir
            events.append("fsync " + path.rsplit(".", 1)[1])
        real_fsync(fd, path)

    def link(source: str, target: str) -> None:
        events.append("link " + target.rsplit(".", 1)[1])
        real_link(source, target)

    def fsync_dir(path: str) -> None:
        events.append("fsync " + os.path.basename(path))
        real_fsync_dir(path)

    monkeypatch.setattr(packs_module, "_fsync", fsync)
    monkeypatch.setattr(packs_module.os, "link", link)
    monkeypatch.setattr(packs_module, "fsync_dir", fsync_dir)
    packed(store, payloads(5))
    assert events == ["fsync pack", "fsync idx", "link idx", "fsync packs"]


@pytest.mark.parametrize("hint", ["libc", "none", "refused"])
def test_a_large_pack_starts_its_writeback_early_and_is_still_fsynced_before_named(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch, hint: str
) -> None:
    """Each full buffer written out is handed to the kernel's writeback at once (a hint; with
    no sync_file_range, or refused, there is none); the pack's fsync still comes before its index
    names anything, and every object reads back."""
    events: list[tuple[str, int, int]] = []
    real_hint, real_fsync = packs_module._writeback(), packs_module._fsync

    def writeback(fd: int, offset: int, length: int) -> None:
        events.append(("writeback", offset, length))
        if hint == "refused":
            raise OSError(22, "refused")
        assert real_hint is not None
        real_hint(fd, offset, length)

    def fsync(fd: int, path: str) -> None:
        if not os.path.isdir(path):
            events.append(("fsync " + path.rsplit(".", 1)[1], 0, os.fstat(fd).st_size))
        real_fsync(fd, path)

    monkeypatch.setattr(packs_module, "_writeback", lambda: None if hint == "none" else writeback)
    monkeypatch.setattr(packs_module, "_fsync", fsync)
    big = [os.urandom(600_000) + b"%d" % i for i in range(7)]  # ~4 MiB: three full buffers
    digests = packed(store, big)
    pack_size = sum(len(data) for data in big)
    hints = [(offset, length) for event, offset, length in events if event == "writeback"]
    if hint == "none":
        assert hints == []
    else:
        assert len(hints) == 3 and hints[0][0] == 0
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(hints))
        assert hints[-1][0] + hints[-1][1] < pack_size  # the rest: the fsync's alone
    fsyncs = [event for event in events if event[0] != "writeback"]
    assert fsyncs[0] == ("fsync pack", 0, pack_size) and fsyncs[1][0] == "fsync idx"
    assert [store.read(digest) for digest in digests] == big


def test_another_store_finds_a_pack_written_after_it_listed(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    other = LocalObjectStore(tmp_path / "objects")
    first = packed(store, [b"first"])
    assert other.has(first[0])  # lists the packs
    second = packed(store, [b"second", b"third"])
    assert other.has(second[1]) and other.read(second[0]) == b"second"


def test_a_damaged_packed_object_is_found_quarantined_and_written_again(
    store: LocalObjectStore,
) -> None:
    data = payloads(12)
    digests = packed(store, data)
    target, victim = digests[5], data[5]
    offset = sum(len(d) for d in data[:5])  # objects lie back to back, in staging order
    before = store.stamp(target)
    rewrite_at(pack_file(store, ".pack"), offset, b"X")
    assert store.reread(target).actual != target and not store.verify(target)
    assert store.stamp(target) != before  # the pack changed: nothing vouches for it now
    moved = store.quarantine(target)
    assert moved is not None and Path(moved).read_bytes() == b"X" + victim[1:]  # the evidence
    assert not store.has(target)
    with pytest.raises(ObjectMissing):
        store.reread(target)
    assert all(store.verify(d) for d in digests if d != target)  # the rest of the pack stays
    assert store.quarantine(target) is None  # nothing holds the name any more
    assert packed(store, [victim]) == [target] and store.verify(target)


def test_quarantines_by_two_stores_in_one_pack_do_not_undo_each_other(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    digests = packed(store, payloads(8))
    other = LocalObjectStore(tmp_path / "objects")
    assert other.has(digests[0])  # it holds the first index now
    store.quarantine(digests[1])
    other.quarantine(digests[2])
    for reader in (store, other, LocalObjectStore(tmp_path / "objects")):
        assert [reader.has(d) for d in digests[:4]] == [True, False, False, True]


def test_a_stamp_changes_with_the_index_as_with_the_pack(store: LocalObjectStore) -> None:
    digests = packed(store, payloads(6))
    before = store.stamp(digests[0])
    assert store.stamp(digests[0]) == before
    store.quarantine(digests[3])  # the index is replaced by one without it
    assert store.stamp(digests[0]) != before
    again = store.stamp(digests[0])
    pack_file(store, ".pack").chmod(0o400)  # a chmod changes the pack's ctime
    assert store.stamp(digests[0]) != again


def test_an_index_that_does_not_hash_to_its_trailer_names_nothing(
    store: LocalObjectStore, tmp_path: Path
) -> None:
    digests = packed(store, payloads(4))
    index = pack_file(store, ".idx")
    rewrite_at(index, 30, b"\xff")
    fresh = LocalObjectStore(tmp_path / "objects")
    assert not any(fresh.has(d) for d in digests)
    assert "does not hash to its trailer" in next(iter(fresh.packs.unusable.values()))


def test_an_index_finds_every_object_and_nothing_else() -> None:
    rng = random.Random(7)
    for count in (1, 2, 300, 5000):
        records = {rng.randbytes(32) + b"\x01": (i * 10, 10) for i in range(count)}
        data = packs_module.index_bytes(records, count * 10)
        index = packs_module.parse_index("p", data, (0, 0, 0, 0, 0))
        assert index.count == count and 8 <= index.bits <= 16
        assert all(index.find(key) == at for key, at in records.items())
        assert not any(index.find(rng.randbytes(32) + b"\x01") for _ in range(200))
        assert not any(index.find(key[:32] + b"\x02") for key in list(records)[:50])


def test_rereads_read_a_pack_once_and_stamp_nothing_if_it_changed_meanwhile(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = payloads(30)
    digests = packed(store, data)
    loose = store.put_bytes(b"a file of its own")
    opened: list[str] = []
    real_open = os.open

    def counting_open(path: str, flags: int, *args: int, **kwargs: int) -> int:
        opened.append(os.path.basename(str(path)))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(packs_module.os, "open", counting_open)
    got = store.rereads([*digests, loose])
    assert [g.actual for g in got if not isinstance(g, Exception)] == [*digests, loose]
    assert all(
        not isinstance(g, Exception) and g.stamp == store.stamp(d)
        for g, d in zip(got, [*digests, loose], strict=True)
    )
    assert len([name for name in opened if name.endswith(".pack")]) == 1
    monkeypatch.undo()
    real_pread = os.pread
    pack = pack_file(store, ".pack")

    def read_then_touch(fd: int, size: int, offset: int) -> bytes:
        got = real_pread(fd, size, offset)
        pack.chmod(0o400)  # the pack changes (its ctime) while the batch reads it
        return got

    monkeypatch.setattr(os, "pread", read_then_touch)
    changed = store.rereads(digests[:3])
    assert all(
        not isinstance(g, Exception) and g.actual == d and g.stamp is None
        for g, d in zip(changed, digests, strict=False)
    )


def test_rereads_name_a_damaged_and_a_dropped_packed_object(store: LocalObjectStore) -> None:
    data = payloads(6)
    digests = packed(store, data)
    rewrite_at(pack_file(store, ".pack"), 0, b"Z")  # the first object's first byte
    store.quarantine(digests[1])  # its bytes are fine, but its name is taken away
    got = store.rereads(digests)
    assert not isinstance(got[0], Exception) and got[0].actual != digests[0]
    assert isinstance(got[1], ObjectMissing)
    assert all(
        not isinstance(g, Exception) and g.actual == d
        for g, d in zip(got[2:], digests[2:], strict=True)
    )


def test_lookups_find_objects_in_many_small_packs_and_a_large_one(
    store: LocalObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(packs_module, "DICT_KEYS", 40)  # the large pack fills it, then searched
    other = LocalObjectStore(tmp_path / "objects")  # a second writer, knowing of no pack yet
    large = packed(store, payloads(10, b"large"))
    smalls = [packed(store, payloads(3, b"small %d" % i)) for i in range(20)]
    twice = packed(other, payloads(3, b"small 7"))  # not deduped: a second copy of pack 7's
    for reader in (store, LocalObjectStore(tmp_path / "objects")):
        assert all(reader.has(d) for d in large + [d for s in smalls for d in s])
    assert store.quarantine(twice[0]) is not None  # dropped from the pack found first...
    assert store.has(twice[0]) and store.verify(twice[0])  # ...the other copy still names it
    assert store.quarantine(twice[0]) is not None and not store.has(twice[0])
    assert store.packs.where(key_of(digest_bytes(DEFAULT_ALGORITHM, b"absent"))) is None


def test_location_of_names_the_file_and_the_bytes_a_read_finds(store: LocalObjectStore) -> None:
    data = payloads(4)
    digests = packed(store, data)
    loose = store.put_bytes(b"loose")
    where, offset, size = store.location_of(digests[2]) or ("", -1, -1)
    with open(where, "rb") as handle:
        handle.seek(offset)
        assert handle.read(size) == data[2] and where.endswith(".pack")
    assert store.location_of(loose) == (store.path_of(loose), 0, 5)
    assert store.location_of(digest_bytes(DEFAULT_ALGORITHM, b"absent")) is None


@pytest.mark.parametrize("action", ["enospc", "eio"])
def test_a_failing_write_into_a_pack_fails_the_publish_and_names_nothing(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    from settled import faults

    monkeypatch.setattr(faults, "_ARMED_POINT", "checkpoint.blob_write")
    monkeypatch.setattr(faults, "_ARMED_ACTION", action)
    data = payloads(20)
    with pytest.raises(DurabilityError, match=r"injected at fault point checkpoint\.blob_write"):
        packed(store, data)
    monkeypatch.undo()
    assert not any(store.has(digest_bytes(DEFAULT_ALGORITHM, d)) for d in data)
    assert os.listdir(store.packs.dir) == [] and os.listdir(store.temp_dir) == []


def test_a_reread_of_most_of_a_pack_rehashes_all_of_it_and_says_it_was_whole(
    store: LocalObjectStore,
) -> None:
    """Asked for at least half of a pack's members, the read-back re-hashes the rest with them
    (between the same two fstats): ``whole`` only if every member it names hashed right."""
    digests = packed(store, payloads(10))
    every = store.rereads(digests)
    assert all(not isinstance(g, Exception) and g.whole for g in every)
    most = store.rereads(digests[:5])
    assert [g.actual for g in most if not isinstance(g, Exception)] == digests[:5]
    assert all(not isinstance(g, Exception) and g.whole for g in most)
    few = store.rereads(digests[:4])  # fewer than half: only those, the pack not vouched for
    assert all(
        not isinstance(g, Exception) and g.actual == d and not g.whole
        for g, d in zip(few, digests, strict=False)
    )
    assert not any(
        not isinstance(g, Exception) and g.whole for g in store.rereads([digests[0], digests[0]])
    )
    location = store.location_of(digests[9])
    assert location is not None
    rewrite_at(pack_file(store, ".pack"), location[1], b"Z")  # a member not asked for
    damaged = store.rereads(digests[:5])
    assert [g.actual for g in damaged if not isinstance(g, Exception)] == digests[:5]
    assert not any(not isinstance(g, Exception) and g.whole for g in damaged)


def test_an_index_is_written_byte_for_byte_as_packs_on_disk_expect() -> None:
    """The index format is on disk in every home: 3,000 records from a fixed seed must give the
    very bytes the first writer of this format gave (their BLAKE3 below), whatever way
    ``index_bytes`` builds them, and read back to the same locations."""
    rng = random.Random(20261206)
    records = {
        rng.randbytes(32) + bytes([1 + i % 2]): (rng.randrange(2**40), rng.randrange(2**20))
        for i in range(3000)
    }
    data = packs_module.index_bytes(records, 2**42)
    expected = "c3a21ad0b721d9c090d2121f243fbd680e9bc3ea81a32b00acfcd01f9daf7fcf"
    assert digest_bytes(DEFAULT_ALGORITHM, data) == f"{DEFAULT_ALGORITHM}:{expected}"
    index = packs_module.parse_index("p", data, (0, 0, 0, 0, 0))
    assert all(index.find(key) == location for key, location in records.items())
