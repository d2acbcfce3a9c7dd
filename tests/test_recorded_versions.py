"""What a checkpoint recorded is read back from the upload that holds it (issue 39, item 9).

In a versioned bucket (real SeaweedFS, ``tests/s3.py``) a key overwritten or deleted behind
settled's back after its checkpoint keeps its intact old upload: ``verify --read-data`` and
``restore`` read it. In a bucket without versioning nothing older is kept, so the same
tampering is named (damaged, missing) and the restore refuses, as before.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from s3 import Weed

from settled.objects.hashing import DEFAULT_ALGORITHM, digest_bytes
from settled.objects.s3 import PART_SIZE, S3ObjectStore, open_s3
from settled.runtime import Runtime
from settled.workspace.restore import RestoreError
from settled.workspace.service import WorkspaceService

SMALL = b"the small file's bytes\n"
GONE = b"a file whose key is deleted later\n"


def _checkpointed(store: S3ObjectStore, tmp_path: Path) -> tuple[Runtime, str, bytes]:
    rt = Runtime(str(tmp_path / "home"))
    rt.workspace.close()
    rt.workspace = WorkspaceService(rt.home, rt.store, objects=store)
    workspace = tmp_path / "workspace"
    (workspace / "sub").mkdir(parents=True)
    (workspace / "small.txt").write_bytes(SMALL)
    (workspace / "gone.txt").write_bytes(GONE)
    big = os.urandom(PART_SIZE + 4321)  # a multipart upload, and a spool past one chunk
    (workspace / "sub" / "big.bin").write_bytes(big)
    task = rt.new_task(str(workspace))
    rt.checkpoint(task.task, incremental=False)
    return rt, task.task, big


def _tamper(weed: Weed, store: S3ObjectStore, big: bytes) -> None:
    """Overwrite two keys and delete one (a delete marker where versions are kept)."""
    client = weed.client()
    for data in (SMALL, big):
        key = store.key_of(digest_bytes(DEFAULT_ALGORITHM, data))
        client.put_object(Bucket=store.bucket, Key=key, Body=b"overwritten behind its back")
    gone = store.key_of(digest_bytes(DEFAULT_ALGORITHM, GONE))
    client.delete_object(Bucket=store.bucket, Key=gone)


def test_a_versioned_bucket_serves_the_recorded_upload_after_overwrite_and_delete(
    weed: Weed, s3_url: str, tmp_path: Path
) -> None:
    store = open_s3(s3_url)
    rt, task, big = _checkpointed(store, tmp_path)
    try:
        _tamper(weed, store, big)
        assert not store.verify(digest_bytes(DEFAULT_ALGORITHM, SMALL))  # the newest is wrong
        checked: dict[str, Any] = rt.verify(task, read_data=True)
        assert checked["verified"], checked
        rt.restore(task, str(tmp_path / "restored"))
        assert (tmp_path / "restored" / "small.txt").read_bytes() == SMALL
        assert (tmp_path / "restored" / "gone.txt").read_bytes() == GONE
        assert (tmp_path / "restored" / "sub" / "big.bin").read_bytes() == big
    finally:
        rt.close()


def test_without_versioning_the_same_tampering_is_named_and_the_restore_refused(
    weed: Weed, s3_url_unversioned: str, tmp_path: Path
) -> None:
    store = open_s3(s3_url_unversioned)
    rt, task, big = _checkpointed(store, tmp_path)
    try:
        _tamper(weed, store, big)
        checked: dict[str, Any] = rt.verify(task, read_data=True)
        assert not checked["verified"]
        words = str(checked)
        assert digest_bytes(DEFAULT_ALGORITHM, GONE) in words and "missing" in words
        assert digest_bytes(DEFAULT_ALGORITHM, SMALL) in words
        with pytest.raises(RestoreError):
            rt.restore(task, str(tmp_path / "restored"))
        assert not (tmp_path / "restored").exists()
    finally:
        rt.close()
