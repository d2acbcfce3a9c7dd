"""The S3 object store on a real SeaweedFS server (``tests/s3.py``): what only S3 has.

Create-only writes against a key something else wrote (the right bytes: dedupe; wrong ones:
detected, quarantined, never reported stored), a multipart upload and its abort, versions that
are read exactly and go missing, the one-line errors of a missing bucket, a wrong secret and a
dead endpoint (retried within the bound), and a checkpoint of a task's workspace into a bucket
read back, verified and restored. The protocol contract is in ``test_objects.py``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
from s3 import VERSIONED_BUCKET, Weed

from settled.objects import (
    ObjectMissing,
    ObjectStoreUnreachable,
    VersionMissing,
)
from settled.objects.hashing import DEFAULT_ALGORITHM, digest_bytes
from settled.objects.s3 import (
    ATTEMPTS,
    PART_SIZE,
    BadObjectsUrl,
    S3ObjectStore,
    _Spool,
    open_s3,
    parse_s3_url,
)
from settled.runtime import Runtime
from settled.workspace.service import WorkspaceService


def raw_put(weed: Weed, store: S3ObjectStore, digest: str, data: bytes) -> dict[str, Any]:
    """Write ``data`` under ``digest``'s key behind the store's back (unconditionally)."""
    response: dict[str, Any] = weed.client().put_object(
        Bucket=store.bucket, Key=store.key_of(digest), Body=data
    )
    return response


def uploads(weed: Weed, store: S3ObjectStore) -> list[Any]:
    listed = weed.client().list_multipart_uploads(Bucket=store.bucket, Prefix=store.prefix)
    return list(listed.get("Uploads", []))


def test_an_existing_key_with_the_right_bytes_is_dedupe(weed: Weed, s3_url: str) -> None:
    store = open_s3(s3_url)
    data = b"written by someone else first"
    digest = digest_bytes(DEFAULT_ALGORITHM, data)
    put = raw_put(weed, store, digest, data)
    with store.writer() as writer:
        writer.write(data)
        stored = writer.commit()
    assert (stored.digest, stored.created) == (digest, False)
    assert stored.version == f"v:{put['VersionId']}"
    versions = weed.client().list_object_versions(Bucket=store.bucket, Prefix=store.key_of(digest))
    assert len(versions["Versions"]) == 1  # the refused PUT made no version


@pytest.mark.parametrize("size", [100, PART_SIZE + 1], ids=["put", "multipart"])
def test_an_existing_key_with_wrong_bytes_is_detected_and_never_reported_stored(
    weed: Weed, s3_url: str, size: int
) -> None:
    store = open_s3(s3_url)
    data = os.urandom(size)
    digest = digest_bytes(DEFAULT_ALGORITHM, data)
    raw_put(weed, store, digest, b"planted bytes of another content")
    assert not store.verify(digest)
    with store.writer() as writer:
        writer.write(data)
        stored = writer.commit()
    assert stored.created and store.read(digest) == data and store.verify(digest)
    assert store.read(digest, version=stored.version) == data
    client = weed.client()
    quarantined = client.list_objects_v2(Bucket=store.bucket, Prefix=f"{store.prefix}/quarantine/")
    [evidence] = quarantined["Contents"]
    body = client.get_object(Bucket=store.bucket, Key=evidence["Key"])["Body"].read()
    assert body == b"planted bytes of another content"
    assert uploads(weed, store) == []


def test_a_multipart_blob_reads_back_by_its_version(weed: Weed, s3_url: str) -> None:
    store = open_s3(s3_url)
    data = os.urandom(40 << 20)
    with store.writer() as writer:
        for start in range(0, len(data), 1 << 20):
            writer.write(data[start : start + (1 << 20)])
        stored = writer.commit()
    assert stored.created and stored.size == len(data) and stored.version.startswith("v:")
    head = weed.client().head_object(Bucket=store.bucket, Key=store.key_of(stored.digest))
    assert head["ETag"].endswith('-5"')  # five 8 MiB parts: it was a multipart upload
    assert store.read(stored.digest, version=stored.version) == data
    again = store.reread(stored.digest)
    assert again.actual == stored.digest and again.stamp == store.stamp(stored.digest)
    assert uploads(weed, store) == []


def test_a_multipart_upload_refused_at_completion_is_aborted_and_deduped(
    weed: Weed, s3_url: str, tmp_path: Path
) -> None:
    """The create-only condition is on CompleteMultipartUpload: an object that appeared while
    the parts were sent wins, the upload is aborted, and the existing copy is re-hashed."""
    store = open_s3(s3_url)
    data = os.urandom(PART_SIZE + 5)
    digest = digest_bytes(DEFAULT_ALGORITHM, data)
    raw_put(weed, store, digest, data)
    with open(tmp_path / "spool", "w+b") as spooled:
        spooled.write(data)
        spooled.flush()
        stored = store._multipart(store.client(), digest, _Spool(b"", spooled))
    assert stored is not None and not stored.created and stored.digest == digest
    assert uploads(weed, store) == []


def test_a_version_that_was_deleted_is_missing(weed: Weed, s3_url: str) -> None:
    store = open_s3(s3_url)
    with store.writer() as writer:
        writer.write(b"soon gone")
        stored = writer.commit()
    weed.client().delete_object(
        Bucket=store.bucket,
        Key=store.key_of(stored.digest),
        VersionId=stored.version.removeprefix("v:"),
    )
    with pytest.raises(VersionMissing, match=stored.version):
        store.read(stored.digest, version=stored.version)
    with pytest.raises(ObjectMissing):
        store.read(stored.digest)


def test_without_versioning_the_version_is_the_etag_and_a_rewrite_loses_it(
    weed: Weed, s3_url_unversioned: str
) -> None:
    store = open_s3(s3_url_unversioned)
    with store.writer() as writer:
        writer.write(b"first copy")
        stored = writer.commit()
    assert stored.version.startswith("etag:")
    stamp = store.stamp(stored.digest)
    assert store.read(stored.digest, version=stored.version) == b"first copy"
    raw_put(weed, store, stored.digest, b"overwritten behind its back")
    assert store.stamp(stored.digest) != stamp
    with pytest.raises(VersionMissing):
        store.read(stored.digest, version=stored.version)
    assert not store.verify(stored.digest)


def test_a_rewrite_behind_its_back_changes_the_stamp(weed: Weed, s3_url: str) -> None:
    store = open_s3(s3_url)
    digest = store.put_bytes(b"stamped")
    stamp = store.stamp(digest)
    raw_put(weed, store, digest, b"stamped")  # the same bytes, a new version
    assert store.stamp(digest) != stamp and store.verify(digest)


def test_a_quarantined_object_is_kept_and_its_name_can_be_written_again(
    weed: Weed, s3_url: str
) -> None:
    store = open_s3(s3_url)
    digest = store.put_bytes(b"original bytes")
    raw_put(weed, store, digest, b"tampered bytes")
    moved = store.quarantine(digest)
    assert moved is not None and moved.startswith(f"s3://{VERSIONED_BUCKET}/{store.prefix}/")
    key = moved.removeprefix(f"s3://{store.bucket}/")
    evidence = weed.client().get_object(Bucket=store.bucket, Key=key)["Body"].read()
    assert evidence == b"tampered bytes"
    assert not store.has(digest) and store.quarantine(digest) is None
    assert digest not in set(store.list_digests())
    with store.writer() as writer:
        writer.write(b"original bytes")
        assert writer.commit().created
    assert store.verify(digest)


def test_a_listing_skips_keys_that_are_not_digests(weed: Weed, s3_url: str) -> None:
    store = open_s3(s3_url)
    digest = store.put_bytes(b"listed")
    client = weed.client()
    client.put_object(
        Bucket=store.bucket, Key=f"{store.prefix}/{DEFAULT_ALGORITHM}/stray", Body=b""
    )
    assert list(store.list_digests()) == [digest]


def test_a_listing_follows_every_page(weed: Weed, s3_url: str) -> None:
    store = open_s3(s3_url)
    digests = {store.put_bytes(b"object %d" % n) for n in range(1005)}  # past one 1000-key page
    assert set(store.list_digests()) == digests


def _one_line(error: ObjectStoreUnreachable, *needles: str) -> str:
    message = str(error)
    assert "\n" not in message and "Traceback" not in message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def test_a_missing_bucket_is_one_line_naming_it(s3_env: dict[str, str]) -> None:
    store = open_s3("s3://no-such-bucket-here/p")
    with pytest.raises(ObjectStoreUnreachable) as caught:
        store.put_bytes(b"x")
    _one_line(caught.value, "no-such-bucket-here", s3_env["AWS_ENDPOINT_URL"], "NoSuchBucket")


@pytest.mark.parametrize("wrong", ["AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"])
def test_wrong_credentials_are_one_line_without_the_secret_and_not_retried(
    s3_url: str, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, wrong: str
) -> None:
    bad = "WRONG" + s3_env[wrong][5:]
    monkeypatch.setenv(wrong, bad)
    store = open_s3(s3_url)
    for operation in (store.has, store.read, store.stamp):
        with pytest.raises(ObjectStoreUnreachable) as caught:
            operation(digest_bytes(DEFAULT_ALGORITHM, b"x"))
        reason = (
            "SignatureDoesNotMatch" if wrong == "AWS_SECRET_ACCESS_KEY" else "InvalidAccessKeyId"
        )
        message = _one_line(caught.value, VERSIONED_BUCKET, reason)
        assert s3_env["AWS_SECRET_ACCESS_KEY"] not in message and bad not in message
        assert "attempts" not in message  # a 4xx is never retried


@pytest.mark.timeout(40)
def test_a_dead_endpoint_is_retried_within_the_bound_then_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as probe:  # a port nothing listens on: connection refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-never-shown")
    store = open_s3("s3://bucket/prefix")
    with pytest.raises(ObjectStoreUnreachable) as caught:
        store.has(digest_bytes(DEFAULT_ALGORITHM, b"x"))
    message = _one_line(caught.value, f"127.0.0.1:{port}", "s3://bucket/prefix")
    assert f"after {ATTEMPTS} attempts" in message and "secret-never-shown" not in message


def test_a_url_that_is_not_a_bucket_and_prefix_is_refused() -> None:
    assert parse_s3_url("s3://bucket/a/b/") == ("bucket", "a/b")
    assert parse_s3_url("s3://bucket") == ("bucket", "")
    for bad in ("file:///x", "s3://", "s3://bad_bucket!/x", "s3://b/a/../c", "s3://b/a//c"):
        with pytest.raises(BadObjectsUrl):
            parse_s3_url(bad)


def test_a_checkpoint_into_a_bucket_reads_back_verifies_restores_and_heals(
    weed: Weed, s3_url: str, tmp_path: Path
) -> None:
    """The workspace service over the S3 store: checkpoint (scan, publish, manifest, read-back),
    verify every byte, restore bit for bit; then a blob damaged behind its back is found by the
    next checkpoint's read-back, quarantined, and published again from the workspace."""
    store = open_s3(s3_url)
    with Runtime(str(tmp_path / "home")) as rt:
        rt.workspace.close()
        rt.workspace = WorkspaceService(rt.home, rt.store, objects=store)
        workspace = tmp_path / "workspace"
        (workspace / "sub").mkdir(parents=True)
        (workspace / "small.txt").write_bytes(b"hello from a bucket\n")
        big = os.urandom(PART_SIZE + 12345)
        (workspace / "sub" / "big.bin").write_bytes(big)
        task = rt.new_task(str(workspace))
        try:
            receipt = rt.checkpoint(task.task, incremental=False)
            manifest = receipt["manifest"]
            assert store.has(manifest) and receipt["read_back"]
            assert rt.verify(task.task, read_data=True)["verified"]
            rt.restore(task.task, str(tmp_path / "restored"))
            assert (tmp_path / "restored" / "sub" / "big.bin").read_bytes() == big
            assert (tmp_path / "restored" / "small.txt").read_bytes() == b"hello from a bucket\n"

            blob = digest_bytes(DEFAULT_ALGORITHM, b"hello from a bucket\n")
            raw_put(weed, store, blob, b"damaged")
            again = rt.checkpoint(task.task, incremental=False)
            healed = again["read_back"]["healed"]
            assert [q["object"] for q in healed["quarantined"]] == [blob]
            assert store.verify(blob) and rt.verify(task.task, read_data=True)["verified"]
        finally:
            rt.close_task(task.task)


def test_a_checkpoint_names_the_manifest_version_its_read_back_re_hashed(
    weed: Weed, s3_url: str, tmp_path: Path
) -> None:
    """The receipt records the manifest's VersionId; the read-back reads exactly that upload,
    so a version that is not the one written is missing to it, whatever the key holds."""
    from settled.objects.hashing import algorithm_of
    from settled.workspace.readback import read_back

    store = open_s3(s3_url)
    with Runtime(str(tmp_path / "home")) as rt:
        rt.workspace.close()
        rt.workspace = WorkspaceService(rt.home, rt.store, objects=store)
        workspace = tmp_path / "workspace"
        workspace.mkdir()
        (workspace / "a.txt").write_bytes(b"versioned\n")
        task = rt.new_task(str(workspace))
        receipt = rt.checkpoint(task.task, incremental=False)
    manifest, version = receipt["manifest"], receipt["manifest_version"]
    assert version.startswith("v:")
    data = store.read(manifest, version=version)
    assert digest_bytes(algorithm_of(manifest), data) == manifest
    assert read_back(store, manifest, record=None, manifest_version=version).ok
    elsewhere = read_back(store, manifest, record=None, manifest_version="v:not-that-upload")
    assert [p.object for p in elsewhere.problems] == [manifest]
    assert elsewhere.problems[0].problem == "missing"
