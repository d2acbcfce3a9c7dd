"""Which S3 client the object store uses: boto3 or obstore, measured on a real SeaweedFS.

For each client: the import time (``python -X importtime``, the cumulative time of the top-level
import, and the wall time of import plus making a client, in fresh interpreters: an owner
process may open the object store), small-object PUT (create-only) and GET latency (1 KiB
objects), and the throughput of a 256 MiB multipart upload in 8 MiB parts sent one after
another (as ``S3ObjectStore`` does), with ``S3ObjectStore`` itself (spool, hash, upload) as a
third row. Then what each one can do that the store requires: ``If-None-Match: *`` on a PUT and
on ``CompleteMultipartUpload``, and ``VersionId`` on a PUT and a GET. The two clients run
interleaved, block by block, on one server. Nothing is asserted; the table says what was seen.

    .venv/bin/python bench/run.py objects_s3 [--quick]
"""

from __future__ import annotations

import io
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from common import MIB, distribution, fmt, header, log, machine, md_table, scratch, source_revision

TESTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path.insert(0, TESTS_DIR)
SRC_DIR = os.path.join(os.path.dirname(TESTS_DIR), "src")
sys.path.append(SRC_DIR)  # last: a PYTHONPATH naming another checkout's src (an A/B) wins

import s3 as weed_server  # noqa: E402  (tests/s3.py: the SeaweedFS launcher)

PART = 8 * MIB
CLIENTS = ("boto3", "obstore")
SETUP = {
    "boto3": (
        "import boto3; boto3.session.Session().client('s3', endpoint_url='http://127.0.0.1:9', "
        "aws_access_key_id='k', aws_secret_access_key='s', region_name='us-east-1')"
    ),
    "obstore": (
        "from obstore.store import S3Store; S3Store('b', endpoint='http://127.0.0.1:9', "
        "access_key_id='k', secret_access_key='s', region='us-east-1', "
        "client_options={'allow_http': True})"
    ),
}


def _import_ms(module: str) -> float:
    """The cumulative import time of ``module`` in a fresh interpreter, from -X importtime."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for line in reversed(done.stderr.splitlines()):
        match = re.match(rf"import time:\s+\d+ \|\s+(\d+) \| {re.escape(module)}$", line)
        if match:
            return int(match[1]) / 1000
    raise RuntimeError(f"no import time line for {module}")


def _setup_ms(client: str) -> float:
    """Wall time of import plus one client, measured inside a fresh interpreter."""
    code = f"import time; t = time.perf_counter(); {SETUP[client]}; print(time.perf_counter() - t)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return float(done.stdout.strip()) * 1000


class Boto:
    name = "boto3"

    def __init__(self, weed: weed_server.Weed, bucket: str) -> None:
        self.client, self.bucket = weed.client(), bucket

    def put_create(self, key: str, data: bytes) -> dict[str, Any]:
        result: dict[str, Any] = self.client.put_object(
            Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*"
        )
        return result

    def get(self, key: str, version: str | None = None) -> bytes:
        extra = {"VersionId": version} if version else {}
        body: bytes = self.client.get_object(Bucket=self.bucket, Key=key, **extra)["Body"].read()
        return body

    def multipart_create(self, key: str, path: str) -> str:
        """Sequential 8 MiB parts, completed create-only; returns the ETag."""
        upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        parts = []
        try:
            with open(path, "rb") as handle:
                while data := handle.read(PART):
                    number = len(parts) + 1
                    part = self.client.upload_part(
                        Bucket=self.bucket, Key=key, UploadId=upload, PartNumber=number, Body=data
                    )
                    parts.append({"PartNumber": number, "ETag": part["ETag"]})
            done = self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload,
                MultipartUpload={"Parts": parts},
                IfNoneMatch="*",
            )
        except BaseException:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
            raise
        return str(done["ETag"])


class Obstore:
    name = "obstore"

    def __init__(self, weed: weed_server.Weed, bucket: str) -> None:
        import obstore
        from obstore.store import S3Store

        self.obstore = obstore
        self.store = S3Store(
            bucket,
            endpoint=weed.endpoint,
            access_key_id=weed.access_key,
            secret_access_key=weed.secret_key,
            region="us-east-1",
            client_options={"allow_http": True},
            virtual_hosted_style_request=False,
        )

    def put_create(self, key: str, data: bytes) -> dict[str, Any]:
        result = self.obstore.put(self.store, key, data, mode="create")
        return {"VersionId": result.get("version"), "ETag": result.get("e_tag")}

    def get(self, key: str, version: str | None = None) -> bytes:
        options: Any = {"version": version} if version else None
        return bytes(self.obstore.get(self.store, key, options=options).bytes())

    def multipart_create(self, key: str, path: str) -> str:
        """obstore's multipart put (one part in flight, like ours); it cannot be create-only."""
        with open(path, "rb") as handle:
            result = self.obstore.put(
                self.store, key, handle, use_multipart=True, chunk_size=PART, max_concurrency=1
            )
        return str(result.get("e_tag"))

    def multipart_with_create_mode(self, key: str, data: bytes) -> str:
        with io.BytesIO(data) as handle:
            result = self.obstore.put(
                self.store, key, handle, mode="create", use_multipart=True, chunk_size=PART
            )
        return str(result.get("e_tag"))


def _refused(call: Callable[[], object]) -> str:
    try:
        call()
    except Exception as error:
        text = str(error)
        status = getattr(error, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status == 412 or "412" in text or "PreconditionFailed" in text:
            return "yes (412)"
        return f"no ({type(error).__name__})"
    return "no (overwritten)"


def capabilities(weed: weed_server.Weed, client: Boto | Obstore, prefix: str) -> dict[str, str]:
    """What the store needs, tried on the versioned bucket."""
    key = f"{prefix}/{client.name}/cap"
    first = client.put_create(key, b"first")
    found = {"put If-None-Match:*": _refused(lambda: client.put_create(key, b"second"))}
    blob = os.urandom(PART + 1)
    if isinstance(client, Boto):
        with scratch("objects-s3-cap") as tmp:
            path = os.path.join(tmp, "blob")
            with open(path, "wb") as handle:
                handle.write(blob)
            etag = client.multipart_create(f"{key}-mp", path)
            refused = _refused(lambda: client.multipart_create(f"{key}-mp", path))
        found["multipart complete If-None-Match:*"] = (
            refused if etag.rstrip('"').endswith("-2") else f"no (ETag {etag})"
        )
    else:
        etag = client.multipart_with_create_mode(f"{key}-mp", blob)
        multipart = etag.rstrip('"').endswith("-2")
        found["multipart complete If-None-Match:*"] = (
            "yes"
            if multipart
            else "no: mode='create' sends one PUT of the whole blob, held in memory"
        )
    version = first.get("VersionId")
    found["VersionId on put"] = "yes" if version else "no"
    weed.client().put_object(Bucket=weed_server.VERSIONED_BUCKET, Key=key, Body=b"overwritten")
    got = client.get(key, version) if version else b""
    found["GET by VersionId"] = "yes" if got == b"first" else f"no ({got[:20]!r})"
    return found


def _time(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def small_ops(clients: list[Boto | Obstore], prefix: str, count: int) -> dict[str, Any]:
    """``count`` 1 KiB create-only PUTs and GETs per client, in interleaved blocks of 50."""
    results: dict[str, dict[str, list[float]]] = {c.name: {"put": [], "get": []} for c in clients}
    for block in range(0, count, 50):
        for client in clients:
            keys = [f"{prefix}/{client.name}/small/{block + n}" for n in range(min(50, count))]
            for key in keys:
                data = os.urandom(1024)
                results[client.name]["put"].append(
                    _time(lambda c=client, k=key, d=data: c.put_create(k, d))
                )
            for key in keys:
                results[client.name]["get"].append(_time(lambda c=client, k=key: c.get(k)))
    return results


def multipart(
    weed: weed_server.Weed, clients: list[Boto | Obstore], size: int, runs: int, tmp: str
) -> dict[str, list[float]]:
    """MB/s of one ``size`` upload from a file, per client and for S3ObjectStore, interleaved;
    each object is deleted after its run (the plain bucket: no versions kept)."""
    from settled.objects.s3 import S3ObjectStore

    path = os.path.join(tmp, "blob")
    with open(path, "wb") as handle:
        for _ in range(size // MIB):
            handle.write(os.urandom(MIB))
    ours = S3ObjectStore(
        weed_server.PLAIN_BUCKET,
        f"bench-{secrets.token_hex(3)}",
        endpoint=weed.endpoint,
        access_key=weed.access_key,
        secret_key=weed.secret_key,
    )
    raw = weed.client()
    speeds: dict[str, list[float]] = {c.name: [] for c in clients} | {"S3ObjectStore": []}
    for run in range(runs):
        for client in clients:
            key = f"bench-mp/{client.name}/{run}"
            ms = _time(lambda c=client, k=key: c.multipart_create(k, path))
            speeds[client.name].append(size / MIB / (ms / 1000))
            raw.delete_object(Bucket=weed_server.PLAIN_BUCKET, Key=key)
        with open(path, "rb") as handle:
            ms = _time(lambda h=handle: ours.put_stream(h))
        speeds["S3ObjectStore"].append(size / MIB / (ms / 1000))
        for digest in list(ours.list_digests()):
            raw.delete_object(Bucket=weed_server.PLAIN_BUCKET, Key=ours.key_of(digest))
        log(
            f"multipart run {run + 1}/{runs}: "
            + ", ".join(f"{k} {v[-1]:.0f} MB/s" for k, v in speeds.items())
        )
    return speeds


def run(quick: bool) -> tuple[dict[str, Any], str]:
    count, size, runs, imports = (100, 32 * MIB, 1, 3) if quick else (500, 256 * MIB, 3, 7)
    data: dict[str, Any] = {
        "machine": machine(),
        "source": source_revision(),
        "quick": quick,
        "params": {"small_count": count, "small_size": 1024, "multipart_size": size, "part": PART},
    }
    log("import times")
    data["import_ms"] = {client: [_import_ms(client) for _ in range(imports)] for client in CLIENTS}
    data["setup_ms"] = {client: [_setup_ms(client) for _ in range(imports)] for client in CLIENTS}
    with scratch("objects-s3") as tmp:
        weed = weed_server.start(os.path.join(tmp, "weed"))
        try:
            weed_server.make_buckets(weed)
            data["weed"] = subprocess.run(
                [weed_server.weed_binary() or "weed", "version"], capture_output=True, text=True
            ).stdout.split("\n")[0]
            prefix = f"bench-{secrets.token_hex(3)}"
            versioned = [
                Boto(weed, weed_server.VERSIONED_BUCKET),
                Obstore(weed, weed_server.VERSIONED_BUCKET),
            ]
            log("capabilities")
            data["capabilities"] = {c.name: capabilities(weed, c, prefix) for c in versioned}
            log(f"small objects: {count} x 1 KiB")
            data["small"] = small_ops(versioned, prefix, count)
            log(f"multipart: {size // MIB} MiB x {runs}")
            plain = [Boto(weed, weed_server.PLAIN_BUCKET), Obstore(weed, weed_server.PLAIN_BUCKET)]
            data["multipart_mb_s"] = multipart(weed, plain, size, runs, tmp)
        finally:
            weed.stop()
    return data, markdown(data)


def markdown(data: dict[str, Any]) -> str:
    median = lambda values: distribution(values)["p50"]  # noqa: E731
    small, speeds, caps = data["small"], data["multipart_mb_s"], data["capabilities"]
    size = data["params"]["multipart_size"] // MIB
    rows = []
    for client in CLIENTS:
        rows.append(
            [
                client,
                fmt(median(data["import_ms"][client]), 0),
                fmt(median(data["setup_ms"][client]), 0),
                fmt(median(small[client]["put"])),
                fmt(median(small[client]["get"])),
                fmt(median(speeds[client]), 0),
                *caps[client].values(),
            ]
        )
    rows.append(
        ["S3ObjectStore (boto3)", "", "", "", "", fmt(median(speeds["S3ObjectStore"]), 0)]
        + [""] * 4
    )
    headers = [
        "client",
        "import ms",
        "import+client ms",
        "PUT 1 KiB p50 ms",
        "GET 1 KiB p50 ms",
        f"{size} MiB multipart MB/s",
        *next(iter(caps.values())).keys(),
    ]
    count = data["params"]["small_count"]
    return "\n\n".join(
        [
            header("S3 client: boto3 vs obstore on SeaweedFS", data),
            f"{data.get('weed', 'weed')}, one `weed server` on loopback; {count} objects of 1 KiB "
            f"per client (PUT create-only, then GET), interleaved in blocks of 50; multipart "
            f"from a file in 8 MiB parts sent one at a time, median of the runs.",
            md_table(headers, rows),
        ]
    )


if __name__ == "__main__":
    from common import RESULTS_DIR, write_results

    quick = "--quick" in sys.argv
    result, text = run(quick)
    write_results(
        os.path.join(RESULTS_DIR, "quick") if quick else RESULTS_DIR,
        "objects_s3",
        result,
        text,
    )
    print(text)
