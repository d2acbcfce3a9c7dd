"""A remote owner is cheap (issue 39, item 5): the home's zygote imports a remote home's
backends once (psycopg and its store, boto3 and a ready S3 client) and an embedded home's
nothing more; owners forked after it seal their logs with them; a seal streams, one chunk in
memory whatever the log's size; and `upload_file` stores a stream whose digest is known, past
the multipart threshold too, never bytes that do not hash to it.

Real processes and servers: the CLI as a user runs it, the home's zygote, PostgreSQL and
SeaweedFS from the shared fixtures (nothing here stops or stalls them).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_cli import CLI

from settled.objects.hashing import new_hasher

pytestmark = pytest.mark.timeout(300)

REMOTE_MODULES = ("boto3", "botocore", "psycopg", "settled.store.postgres", "settled.objects.s3")
LINES = 120_000  # `seq 1 120000`: 763,893 bytes, one sealed chunk


def _digest_of_file(path: Path) -> str:
    hasher = new_hasher("blake3")
    with open(path, "rb") as handle:
        while data := handle.read(1 << 20):
            hasher.update(data)
    return f"blake3:{hasher.hexdigest()}"


def _seq(lines: int) -> bytes:
    return "".join(f"{n}\n" for n in range(1, lines + 1)).encode()


def _calls_after_refills(cli: CLI, task: str, argv: list[str], count: int) -> list[dict[str, Any]]:
    """`count` sessions of `argv`, each after the zygote's refill (and so its preparation of
    the home's backends) was due: what a user's calls a moment apart get."""
    receipts = []
    for _ in range(count):
        receipts.append(cli.json("run", "--task", task, "--", *argv))
        time.sleep(0.3)  # past REFILL_AFTER_S: the zygote prepares, then forks its spare
    return receipts


def _zygote_modules(dump: Path) -> set[str]:
    return set(dump.read_text().split())


def _zygote_pid(cli: CLI) -> int:
    return int((cli.home / "run" / "launcher.lock").read_text())


def _tcp_sockets_of(pid: int) -> list[str]:
    """The zygote's sockets that are TCP (a connection, which a fork would share)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    tcp = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as handle:
            for line in handle.readlines()[1:]:
                if line.split()[9] in inodes:
                    tcp.append(line.strip())
    return tcp


@pytest.fixture
def remote_cli(
    tmp_path: Path, marker: str, pg_cluster: Any, s3_url: str, s3_env: dict[str, str]
) -> Any:
    import pg

    env = {
        "TEST_SESSION_MARKER": marker,
        "SETTLED_STORE": pg.url_for_directory(str(tmp_path)),
        "SETTLED_OBJECTS": s3_url,
        "SETTLED_DEBUG_ZYGOTE_MODULES": str(tmp_path / "zygote.modules"),
        **s3_env,
    }
    return CLI(tmp_path / "home", env)


def test_a_remote_homes_zygote_imports_its_backends_once_and_its_owners_seal_with_them(
    remote_cli: CLI, tmp_path: Path
) -> None:
    (tmp_path / "ws").mkdir()
    task = remote_cli.json("task", "new", "--workspace", str(tmp_path / "ws"))["task"]
    receipts = _calls_after_refills(remote_cli, task, ["seq", "1", str(LINES)], 3)
    modules = _zygote_modules(tmp_path / "zygote.modules")
    assert set(REMOTE_MODULES) <= modules  # imported once, in the zygote, before its forks
    zygote = _zygote_pid(remote_cli)
    assert os.listdir(f"/proc/{zygote}/task") == [str(zygote)]  # it forks: never a thread
    assert _tcp_sockets_of(zygote) == []  # nor a connection a fork would share
    for receipt in receipts:
        assert receipt["exit"]["code"] == 0
        status = _sealed_status(remote_cli, receipt["session"])  # the seal follows the receipt
        sealed = status["sealed"]["stdout"]
        assert sealed["chunks"] == 1 and sealed["manifest"].startswith("blake3:"), sealed
        assert status["state"] == "settled" and status["receipt"] == receipt  # it stands
    # The last owner was forked after the zygote prepared: its sealed copy reads back on
    # another host (which reads it from the bucket), bit for bit.
    other = CLI(
        tmp_path / "other", {k: v for k, v in remote_cli.env.items() if k != "SETTLED_HOME"}
    )
    read = other.run("logs", receipts[-1]["session"], "--stream", "stdout")
    assert read.returncode == 0, read.stderr
    assert read.stdout == _seq(LINES)


def _sealed_status(cli: CLI, session: str) -> dict[str, Any]:
    """The session's status once its stdout's seal is recorded (bounded: 60 s)."""
    give_up = time.monotonic() + 60
    while True:
        status: dict[str, Any] = cli.json("status", session)
        if (status.get("sealed") or {}).get("stdout") is not None or time.monotonic() > give_up:
            return status
        time.sleep(0.1)


def test_an_embedded_homes_zygote_imports_no_remote_backend(tmp_path: Path, marker: str) -> None:
    dump = tmp_path / "zygote.modules"
    cli = CLI(tmp_path / "home", {"TEST_SESSION_MARKER": marker,
                                  "SETTLED_DEBUG_ZYGOTE_MODULES": str(dump)})  # fmt: skip
    (tmp_path / "ws").mkdir()
    task = cli.json("task", "new", "--workspace", str(tmp_path / "ws"))["task"]
    for receipt in _calls_after_refills(cli, task, ["seq", "1", "1000"], 2):
        assert receipt["exit"]["code"] == 0 and "sealed" not in receipt["output"]["stdout"]
    modules = _zygote_modules(dump)
    assert "settled.owner.session" in modules  # the dump is the zygote's own
    assert not {"boto3", "botocore", "psycopg", "settled.objects.s3"} & modules


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
