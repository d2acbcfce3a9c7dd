"""A remote owner is cheap (issue 39, item 5): a seal streams, one chunk in memory whatever the
log's size; and `upload_file` stores a stream whose digest is known, past the multipart
threshold too, never bytes that do not hash to it.

Real processes and servers: the CLI as a user runs it, the home's zygote, PostgreSQL and
SeaweedFS from the shared fixtures (nothing here stops or stalls them).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from settled.objects.hashing import new_hasher

pytestmark = pytest.mark.timeout(300)


def _digest_of_file(path: Path) -> str:
    hasher = new_hasher("blake3")
    with open(path, "rb") as handle:
        while data := handle.read(1 << 20):
            hasher.update(data)
    return f"blake3:{hasher.hexdigest()}"


SEAL_AND_MEASURE = """
import json, os, sys
from settled.log.seal import fetch_sealed, seal_stream
from settled.objects.s3 import open_s3
path, length, digest, url, dest = sys.argv[1:]
objects = open_s3(url)
fact = seal_stream(objects, path, int(length), digest)
sealed_kib = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
fetch_sealed(objects, fact, digest, dest)
print(json.dumps({"fact": fact, "sealed_hwm_kib": sealed_kib,
                  "hwm_kib": int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])}))
"""


def test_a_200_mib_log_is_sealed_and_read_back_in_bounded_memory(
    tmp_path: Path, s3_url: str, s3_env: dict[str, str]
) -> None:
    size = 200 << 20
    log = tmp_path / "stdout.log"
    with open(log, "wb") as handle:  # sparse: 1 MiB of random bytes every 8 MiB, holes between
        for offset in range(0, size, 8 << 20):
            handle.seek(offset)
            handle.write(os.urandom(1 << 20))
        handle.truncate(size)
    digest = _digest_of_file(log)
    dest = tmp_path / "rebuilt" / "stdout"
    done = subprocess.run(
        [sys.executable, "-c", SEAL_AND_MEASURE, str(log), str(size), digest, s3_url, str(dest)],
        env={**os.environ, **s3_env},
        capture_output=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr.decode()
    result = json.loads(done.stdout)
    assert result["fact"]["chunks"] == 50  # 200 MiB in 4 MiB chunks, holes' chunks deduped
    assert result["sealed_hwm_kib"] < 160 * 1024  # far below the log's 200 MiB
    assert result["hwm_kib"] < 160 * 1024  # the read-back streams too
    assert dest.stat().st_size == size and _digest_of_file(dest) == digest


def test_upload_file_past_the_multipart_threshold_stores_exactly_the_announced_bytes(
    tmp_path: Path, s3_url: str, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from settled.objects import DigestMismatch
    from settled.objects.s3 import PART_SIZE, open_s3

    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    objects = open_s3(s3_url)
    data = os.urandom(PART_SIZE * 2 + 12345)  # three parts
    path = tmp_path / "big"
    path.write_bytes(data + b"past the length: never sent")
    digest = _digest_of_file_prefix(path, len(data))
    with open(path, "rb") as source:
        stored = objects.upload_file(source, len(data), digest)
    assert stored.created and stored.size == len(data)
    assert objects.read(digest) == data
    with open(path, "rb") as source:  # again: dedupe, re-hashed, nothing written
        assert not objects.upload_file(source, len(data), digest).created
    wrong = "blake3:" + "1" * 64
    with open(path, "rb") as source, pytest.raises(DigestMismatch):
        objects.upload_file(source, len(data), wrong)
    with pytest.raises(DigestMismatch):
        objects.upload_file(io.BytesIO(b"small"), 5, wrong)
    assert not objects.has(wrong)  # neither the multipart upload nor the PUT stored it


def _digest_of_file_prefix(path: Path, length: int) -> str:
    hasher = new_hasher("blake3")
    hasher.update(path.read_bytes()[:length])
    return f"blake3:{hasher.hexdigest()}"
