"""The local object store: content-addressed, create-only, durable before it says so."""

from __future__ import annotations

import errno
import io
import os
import threading
from pathlib import Path

import pytest

from settled.workspace.hashing import (
    DEFAULT_ALGORITHM,
    SHA256,
    BadDigest,
    digest_bytes,
    parse_digest,
)
from settled.workspace.objects import (
    DigestMismatch,
    DurabilityError,
    LocalObjectStore,
    ObjectMissing,
    ObjectStore,
)


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "objects")


def temps(store: LocalObjectStore) -> list[str]:
    return os.listdir(store.temp_dir)


def test_put_bytes_is_readable_verifiable_and_read_only(store: LocalObjectStore) -> None:
    digest = store.put_bytes(b"hello")
    assert digest == digest_bytes(DEFAULT_ALGORITHM, b"hello")
    assert store.has(digest) and store.read(digest) == b"hello" and store.verify(digest)
    algo, hexdigest = parse_digest(digest)
    assert store.path_of(digest) == os.path.join(store.root, algo, hexdigest[:2], hexdigest[2:])
    assert os.stat(store.path_of(digest)).st_mode & 0o777 == 0o400
    assert not store.has(digest_bytes(DEFAULT_ALGORITHM, b"other"))
    assert temps(store) == []


def test_local_store_satisfies_the_protocol(store: LocalObjectStore) -> None:
    backend: ObjectStore = store
    assert backend.writer().size == 0


def test_a_store_holds_objects_of_either_algorithm(store: LocalObjectStore) -> None:
    digest = store.put_bytes(b"x", SHA256)
    assert digest.startswith("sha256:") and store.verify(digest)


def test_put_stream_reads_fds_and_files_in_chunks(store: LocalObjectStore, tmp_path: Path) -> None:
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
    store: LocalObjectStore,
) -> None:
    expected = digest_bytes(DEFAULT_ALGORITHM, b"promised")
    with pytest.raises(DigestMismatch, match=expected):
        store.put_stream(io.BytesIO(b"delivered" * 200_000), expected_digest=expected)
    assert not store.has(expected)
    assert not store.has(digest_bytes(DEFAULT_ALGORITHM, b"delivered" * 200_000))
    assert temps(store) == []


def test_dedupe_does_not_rewrite_an_existing_object(store: LocalObjectStore) -> None:
    data = os.urandom(2 << 20)  # past one chunk: the second put stages a temp file too
    digest = store.put_bytes(data)
    before = os.stat(store.path_of(digest))
    with store.writer() as writer:
        writer.write(data)
        stored = writer.commit()
    after = os.stat(store.path_of(digest))
    assert stored.digest == digest and not stored.created and stored.version == digest
    assert (after.st_ino, after.st_mtime_ns, after.st_ctime_ns) == (
        before.st_ino,
        before.st_mtime_ns,
        before.st_ctime_ns,
    )
    assert temps(store) == []


def test_concurrent_puts_of_the_same_content_end_with_one_object(store: LocalObjectStore) -> None:
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
    fanout = os.path.dirname(store.path_of(digest))
    assert os.listdir(fanout) == [os.path.basename(store.path_of(digest))]
    assert store.verify(digest) and temps(store) == []


def test_a_tampered_object_fails_verify(store: LocalObjectStore) -> None:
    digest = store.put_bytes(b"original bytes")
    path = store.path_of(digest)
    os.chmod(path, 0o644)
    Path(path).write_bytes(b"tampered bytes")
    assert store.has(digest) and not store.verify(digest)


def test_a_quarantined_object_is_kept_aside_and_its_bytes_can_be_written_again(
    store: LocalObjectStore,
) -> None:
    digest = store.put_bytes(b"original bytes")
    os.chmod(store.path_of(digest), 0o600)
    Path(store.path_of(digest)).write_bytes(b"tampered bytes")
    assert store.put_bytes(b"original bytes") == digest and not store.verify(digest)  # dedupe
    moved = store.quarantine(digest)
    assert moved is not None and Path(moved).read_bytes() == b"tampered bytes"
    assert os.path.dirname(moved) == os.path.join(store.root, "quarantine")
    assert not store.has(digest) and store.quarantine(digest) is None
    assert store.put_bytes(b"original bytes") == digest and store.verify(digest)


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
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(DurabilityError, match="Input/output error"):
        store.put_bytes(b"never durable")
    monkeypatch.undo()
    assert not store.has(digest_bytes(DEFAULT_ALGORITHM, b"never durable"))
    assert temps(store) == []


def test_a_batch_fsyncs_each_fanout_directory_once_at_its_end(
    store: LocalObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.put_bytes(b"warm the fan-out directory")
    synced: list[str] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    with store.batch():
        digests = [store.put_bytes(b"same fan-out %d" % i) for i in range(40)]
        inside = list(synced)
    fanouts = {os.path.dirname(store.path_of(d)) for d in digests}
    assert sum(path.startswith(store.temp_dir) for path in inside) == 40  # bytes before links
    assert not fanouts & set(inside)  # no fan-out directory synced per object...
    assert sorted(synced[len(inside) :]) == sorted(fanouts)  # ...but each once, at the end


def test_a_digest_that_is_not_a_digest_is_never_a_path(store: LocalObjectStore) -> None:
    for bad in ("blake3:../../etc/passwd", "md5:" + "0" * 64, "blake3:" + "A" * 64, "nocolon"):
        with pytest.raises(BadDigest):
            store.path_of(bad)
    with pytest.raises(ObjectMissing, match="blake3:" + "0" * 64):
        store.read("blake3:" + "0" * 64)
