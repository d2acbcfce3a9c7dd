"""The object store: content-addressed, create-only, durable before it says so.

The contract tests take ``store``, one of ``IMPLEMENTATIONS`` typed as the ``ObjectStore``
protocol: a new backend is one more line there (the local directory, and the S3 store on a real
SeaweedFS server in a versioned bucket and in one without versioning, from ``tests/s3.py``).
Tests of the local directory layout (fan-out directories, modes, temp files, fsync ordering,
quarantine by rename) take ``local`` and run against ``LocalObjectStore`` only; the S3-only
tests are in ``test_objects_s3.py``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from settled.objects import (
    DigestMismatch,
    DurabilityError,
    ObjectMissing,
    ObjectStore,
    ObjectUnreadable,
    StagingUnavailable,
    VersionMissing,
)
from settled.objects.hashing import (
    DEFAULT_ALGORITHM,
    SHA256,
    BadDigest,
    digest_bytes,
    parse_digest,
)
from settled.objects.local import LocalObjectStore
from settled.objects.s3 import open_s3


def _local(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    return LocalObjectStore(tmp_path / "objects")


def _s3(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    return open_s3(request.getfixturevalue("s3_url"))


def _s3_unversioned(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    return open_s3(request.getfixturevalue("s3_url_unversioned"))


# Every implementation of the protocol; the contract tests below run against each of them.
IMPLEMENTATIONS = [
    pytest.param(_local, id="local"),
    pytest.param(_s3, id="s3"),
    pytest.param(_s3_unversioned, id="s3-etag"),
]


@pytest.fixture(params=IMPLEMENTATIONS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    make: Callable[[pytest.FixtureRequest, Path], ObjectStore] = request.param
    return make(request, tmp_path)


@pytest.fixture
def local(tmp_path: Path) -> LocalObjectStore:
    """For the tests of the local directory layout only (fan-out, modes, temps, fsyncs)."""
    return LocalObjectStore(tmp_path / "objects")


def temps(store: LocalObjectStore) -> list[str]:
    return os.listdir(store.temp_dir)


# -- the contract: every ObjectStore -------------------------------------------------------------


def test_a_put_object_exists_reads_back_and_verifies(store: ObjectStore) -> None:
    digest = store.put_bytes(b"hello")
    assert digest == digest_bytes(DEFAULT_ALGORITHM, b"hello")
    assert store.has(digest) and store.read(digest) == b"hello" and store.verify(digest)
    assert not store.has(digest_bytes(DEFAULT_ALGORITHM, b"other"))
    assert store.writer().size == 0


def test_a_store_holds_objects_of_either_algorithm(store: ObjectStore) -> None:
    digest = store.put_bytes(b"x", SHA256)
    assert digest.startswith("sha256:") and store.verify(digest)


def test_put_stream_reads_fds_and_files_in_chunks(store: ObjectStore, tmp_path: Path) -> None:
    data = os.urandom(3 * (1 << 20) + 17)
    source = tmp_path / "big"
    source.write_bytes(data)
    fd = os.open(source, os.O_RDONLY)
    try:
        from_fd = store.put_stream(fd)
    finally:
        os.close(fd)
    assert from_fd == digest_bytes(DEFAULT_ALGORITHM, data)
    assert store.put_stream(io.BytesIO(data), expected_digest=from_fd) == from_fd
    assert store.read(from_fd) == data


def test_put_stream_refuses_content_that_does_not_match_the_expected_digest(
    store: ObjectStore,
) -> None:
    expected = digest_bytes(DEFAULT_ALGORITHM, b"promised")
    with pytest.raises(DigestMismatch, match=expected):
        store.put_stream(io.BytesIO(b"delivered" * 200_000), expected_digest=expected)
    assert not store.has(expected)
    assert not store.has(digest_bytes(DEFAULT_ALGORITHM, b"delivered" * 200_000))


def test_a_put_is_create_only_the_existing_object_stands(store: ObjectStore) -> None:
    data = os.urandom(2 << 20)  # past one chunk: the second put stages a temp file too
    with store.writer() as writer:
        writer.write(data)
        first = writer.commit()
    with store.writer() as writer:
        writer.write(data)
        second = writer.commit()
    assert first.created and not second.created
    assert first.digest == second.digest == digest_bytes(DEFAULT_ALGORITHM, data)
    assert first.size == second.size == len(data)
    assert store.stamp(first.digest) == store.stamp(second.digest)
    assert store.read(first.digest) == data


def test_concurrent_puts_of_the_same_content_end_with_one_object(store: ObjectStore) -> None:
    data = os.urandom((1 << 20) + 1)
    barrier = threading.Barrier(8)
    results: list[tuple[str, bool]] = []

    def put() -> None:
        with store.writer() as writer:
            writer.write(data)
            barrier.wait()
            stored = writer.commit()
        results.append((stored.digest, stored.created))

    threads = [threading.Thread(target=put) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    digest = digest_bytes(DEFAULT_ALGORITHM, data)
    assert sorted(results) == [(digest, False)] * 7 + [(digest, True)]
    assert store.verify(digest) and list(store.list_digests()) == [digest]


def test_the_version_a_write_returned_reads_exactly_that_object(store: ObjectStore) -> None:
    with store.writer() as writer:
        writer.write(b"pinned")
        stored = writer.commit()
    assert store.read(stored.digest, version=stored.version) == b"pinned"
    with store.open(stored.digest, version=stored.version) as handle:
        assert handle.read() == b"pinned"
    with pytest.raises(VersionMissing, match="no version 'not-a-version'") as missing:
        store.read(stored.digest, version="not-a-version")
    assert isinstance(missing.value, ObjectMissing)


def test_list_digests_names_every_object_and_only_objects(store: ObjectStore) -> None:
    blake = {store.put_bytes(b"one"), store.put_bytes(b"two")}
    sha = {store.put_bytes(b"three", SHA256)}
    assert set(store.list_digests()) == blake | sha
    assert set(store.list_digests(DEFAULT_ALGORITHM)) == blake
    assert set(store.list_digests(SHA256)) == sha


def test_a_reread_hashes_every_byte_and_names_the_copy_it_read(store: ObjectStore) -> None:
    data = os.urandom((1 << 20) * 2 + 5)
    digest = store.put_bytes(data)
    kept = store.reread(digest, keep=True)
    assert (kept.actual, kept.size, kept.data) == (digest, len(data), data)
    assert kept.stamp is not None and kept.stamp == store.stamp(digest)
    assert kept.stamp.size == len(data)
    assert store.reread(digest).data is None


def test_rereads_answers_each_digest_in_order_like_reread(store: ObjectStore) -> None:
    present = [store.put_bytes(b"reread %d" % i) for i in range(3)]
    absent = digest_bytes(DEFAULT_ALGORITHM, b"never written")
    asked = [present[2], absent, present[0], "not-a-digest", present[1]]
    got = store.rereads(asked)
    assert [type(g).__name__ for g in got] == [
        "Reread", "ObjectMissing", "Reread", "BadDigest", "Reread"
    ]  # fmt: skip
    for digest, one in zip(asked, got, strict=True):
        if digest in present:
            assert not isinstance(one, Exception)
            assert (one.actual, one.data) == (digest, None)
            assert one.stamp == store.stamp(digest)
    assert store.rereads([]) == []


def test_an_absent_object_is_missing_to_every_reader(store: ObjectStore) -> None:
    absent = digest_bytes(DEFAULT_ALGORITHM, b"never written")
    assert not store.has(absent) and not store.verify(absent)
    for read in (store.read, store.open, store.stamp, store.reread):
        with pytest.raises(ObjectMissing, match=absent):
            read(absent)


def test_a_staged_object_is_stored_once_synced_and_published(store: ObjectStore) -> None:
    with contextlib.ExitStack() as group:
        try:
            sync = group.enter_context(store.staging())
        except StagingUnavailable:  # S3: each PUT is durable on its own, so it says so
            assert not hasattr(store, "path_of"), "the local store must group its fsyncs"
            with store.writer() as writer:
                writer.write(b"staged")
                stored = writer.commit()
            assert store.read(stored.digest) == b"staged"
            return
        with store.writer() as writer:
            writer.write(b"staged")
            staged = writer.stage()
        sync()
        assert staged.publish().created and store.read(staged.digest) == b"staged"


def test_a_digest_that_is_not_a_digest_is_refused_by_every_operation(store: ObjectStore) -> None:
    for bad in (
        "blake3:../../etc/passwd", "md5:" + "0" * 64, "blake3:" + "A" * 64, "nocolon",
        "blake3:" + "0" * 62 + " 0", "blake3:" + "é" * 64, "blake3:" + "0" * 63 + "g",
    ):  # fmt: skip
        for operation in (store.has, store.read, store.open, store.stamp, store.reread):
            with pytest.raises(BadDigest):
                operation(bad)


# -- the local directory store only: its layout, modes, temp files and fsyncs -------------------


def test_local_objects_are_read_only_files_under_their_fan_out_directory(
    local: LocalObjectStore,
) -> None:
    digest = local.put_bytes(b"hello")
    algo, hexdigest = parse_digest(digest)
    assert local.path_of(digest) == os.path.join(local.root, algo, hexdigest[:2], hexdigest[2:])
    assert os.stat(local.path_of(digest)).st_mode & 0o777 == 0o400
    assert local.location == local.root and temps(local) == []


def test_local_store_satisfies_the_protocol(local: LocalObjectStore) -> None:
    backend: ObjectStore = local
    assert backend.writer().size == 0


def test_local_refused_and_deduped_writes_leave_no_temp_file(local: LocalObjectStore) -> None:
    expected = digest_bytes(DEFAULT_ALGORITHM, b"promised")
    with pytest.raises(DigestMismatch):
        local.put_stream(io.BytesIO(b"delivered" * 200_000), expected_digest=expected)
    assert temps(local) == []


def test_local_dedupe_does_not_rewrite_an_existing_object(local: LocalObjectStore) -> None:
    data = os.urandom(2 << 20)  # past one chunk: the second put stages a temp file too
    digest = local.put_bytes(data)
    before = os.stat(local.path_of(digest))
    with local.writer() as writer:
        writer.write(data)
        stored = writer.commit()
    after = os.stat(local.path_of(digest))
    assert stored.digest == digest and not stored.created and stored.version == digest
    assert (after.st_ino, after.st_mtime_ns, after.st_ctime_ns) == (
        before.st_ino,
        before.st_mtime_ns,
        before.st_ctime_ns,
    )
    assert temps(local) == []


def test_local_concurrent_puts_leave_one_file_and_no_temp(local: LocalObjectStore) -> None:
    data = os.urandom((1 << 20) + 1)
    threads = [threading.Thread(target=local.put_bytes, args=(data,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    digest = digest_bytes(DEFAULT_ALGORITHM, data)
    fanout = os.path.dirname(local.path_of(digest))
    assert os.listdir(fanout) == [os.path.basename(local.path_of(digest))]
    assert temps(local) == []


def test_local_version_is_the_digest_itself(local: LocalObjectStore) -> None:
    digest = local.put_bytes(b"one version")
    assert local.read(digest, version=digest) == b"one version"
    with pytest.raises(VersionMissing):
        local.read(digest, version=digest_bytes(DEFAULT_ALGORITHM, b"another"))


def test_local_stamp_is_the_lstat_identity_and_follows_any_change(local: LocalObjectStore) -> None:
    digest = local.put_bytes(b"stamped")
    path = local.path_of(digest)
    st = os.lstat(path)
    stamp = local.stamp(digest)
    assert stamp == (st.st_ctime_ns, st.st_ino, st.st_mtime_ns, st.st_size, st.st_dev)
    os.chmod(path, 0o444)  # a chmod changes the ctime
    assert local.stamp(digest) != stamp


def test_local_a_name_that_holds_no_regular_file_is_unreadable(
    local: LocalObjectStore, tmp_path: Path
) -> None:
    linked = digest_bytes(DEFAULT_ALGORITHM, b"a symlink holds my name")
    local.put_bytes(b"warm")  # makes the algorithm's directory
    os.makedirs(os.path.dirname(local.path_of(linked)), exist_ok=True)
    (tmp_path / "elsewhere").write_bytes(b"a symlink holds my name")
    os.symlink(tmp_path / "elsewhere", local.path_of(linked))
    with pytest.raises(ObjectUnreadable, match="not a regular file"):
        local.stamp(linked)
    with pytest.raises(ObjectUnreadable, match="cannot open"):
        local.reread(linked)
    assert not local.has(linked) and linked not in set(local.list_digests())


def test_local_listing_skips_what_is_not_an_object(local: LocalObjectStore) -> None:
    digest = local.put_bytes(b"listed")
    fanout = os.path.dirname(local.path_of(digest))
    Path(fanout, "stray").write_bytes(b"")
    Path(local.root, DEFAULT_ALGORITHM, "zz").mkdir()
    assert list(local.list_digests()) == [digest]


def test_a_tampered_object_fails_verify(local: LocalObjectStore) -> None:
    digest = local.put_bytes(b"original bytes")
    path = local.path_of(digest)
    os.chmod(path, 0o644)
    Path(path).write_bytes(b"tampered bytes")
    assert local.has(digest) and not local.verify(digest)


def test_a_quarantined_object_is_kept_aside_and_its_bytes_can_be_written_again(
    local: LocalObjectStore,
) -> None:
    digest = local.put_bytes(b"original bytes")
    os.chmod(local.path_of(digest), 0o600)
    Path(local.path_of(digest)).write_bytes(b"tampered bytes")
    assert local.put_bytes(b"original bytes") == digest and not local.verify(digest)  # dedupe
    moved = local.quarantine(digest)
    assert moved is not None and Path(moved).read_bytes() == b"tampered bytes"
    assert os.path.dirname(moved) == os.path.join(local.root, "quarantine")
    assert not local.has(digest) and local.quarantine(digest) is None
    assert local.put_bytes(b"original bytes") == digest and local.verify(digest)


def test_directories_an_earlier_version_made_readable_to_others_are_made_private(
    tmp_path: Path,
) -> None:
    root = tmp_path / "objects"
    digest = LocalObjectStore(root).put_bytes(b"x")
    fanout = os.path.dirname(LocalObjectStore(root).path_of(digest))
    for path in (root, root / "tmp", Path(fanout).parent, Path(fanout)):
        os.chmod(path, 0o755)
    store = LocalObjectStore(root)
    store.put_bytes(b"x")
    for path in (root, root / "tmp", Path(fanout).parent, Path(fanout)):
        assert path.stat().st_mode & 0o777 == 0o700, path


def test_a_failed_fsync_raises_and_links_nothing(
    local: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(DurabilityError, match="Input/output error"):
        local.put_bytes(b"never durable")
    monkeypatch.undo()
    assert not local.has(digest_bytes(DEFAULT_ALGORITHM, b"never durable"))
    assert temps(local) == []


def test_a_batch_fsyncs_each_fanout_directory_once_at_its_end(
    local: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    local.put_bytes(b"warm the fan-out directory")
    synced: list[str] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    with local.batch():
        digests = [local.put_bytes(b"same fan-out %d" % i) for i in range(40)]
        inside = list(synced)
    fanouts = {os.path.dirname(local.path_of(d)) for d in digests}
    assert sum(path.startswith(local.temp_dir) for path in inside) == 40  # bytes before links
    assert not fanouts & set(inside)  # no fan-out directory synced per object...
    assert sorted(synced[len(inside) :]) == sorted(fanouts)  # ...but each once, at the end


def test_a_digest_that_is_not_a_digest_is_never_a_path(local: LocalObjectStore) -> None:
    for bad in (
        "blake3:../../etc/passwd", "md5:" + "0" * 64, "blake3:" + "A" * 64, "nocolon",
        "blake3:" + "0" * 62 + " 0", "blake3:" + "é" * 64, "blake3:" + "0" * 63 + "g",
    ):  # fmt: skip
        with pytest.raises(BadDigest):
            local.path_of(bad)
    with pytest.raises(ObjectMissing, match="blake3:" + "0" * 64):
        local.read("blake3:" + "0" * 64)
