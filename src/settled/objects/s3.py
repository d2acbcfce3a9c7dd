"""The S3 object store: the ``ObjectStore`` protocol (``settled.objects``), S3-compatible.

Owns ``S3ObjectStore`` and ``open_s3(url)``. Layout under ``s3://<bucket>/<prefix>``: an object
is the key ``<prefix>/<algo>/<hex>``; a quarantined one is copied to
``<prefix>/quarantine/<algo>-<hex>.<time_ns>.<random>`` (kept as evidence) before its key is
deleted. Endpoint and credentials come from the standard ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and ``AWS_REGION`` (default ``us-east-1``).

Writes are create-only: one ``PutObject`` with ``If-None-Match: *``, or for an object larger
than one part (8 MiB) a multipart upload whose ``CompleteMultipartUpload`` carries the same
condition, aborted on any failure so no parts are left behind. A writer spools to an unlinked
temp file past one chunk (its digest, the key, is known only at the end), so memory holds at
most one part. ``412`` (or a ``409`` conditional conflict) means the key exists: its bytes are
then read back and re-hashed, never assumed; if they match, the write is dedupe
(``created=False``); if not, the copy is quarantined and the right bytes written again, and if
that fails too the write raises ``ObjectUnreadable``: damaged bytes are never reported stored.

Versions: ``StoredObject.version`` is ``v:<VersionId>`` in a versioned bucket, else
``etag:<ETag>``; ``open``/``read`` with ``version=`` read exactly that (``GetObject``
``VersionId``, or ``If-Match`` the ETag), ``VersionMissing`` when it is gone or was never there.
``recorded()`` is a reader of what a checkpoint recorded (verify, restore): a read with no
version whose newest upload is a delete marker or other bytes is served by the newest older
upload of the key that hashes to the digest (``ListObjectVersions``, at most ``MAX_UPLOADS``);
``open`` then spools while hashing. A ``Stamp`` comes from a ``HEAD`` (or the ``GET`` a re-read
made): ``changed_ns`` and ``modified_ns`` the Last-Modified (whole seconds, so the
verified-object record adds its coarse clock slack), ``copy`` a 63-bit hash of the version id
(or ETag), ``volume`` one of the ETag, ``size`` the length. Every PUT is durable when it
returns, so there is no batch durability: ``staging()`` raises ``StagingUnavailable`` and the
publisher commits on its threads.

Retries: connection errors, 5xx and throttling only (never another 4xx), at most 5 attempts
with exponential backoff and full jitter, none started past 10 s. ``classify`` reads an error
answer: no room (507, ``InsufficientStorage``, ``QuotaExceeded``, ``EntityTooLarge``, ...) is
``ObjectStoreFull`` at once (a ``SpaceExhausted``: exit 3, HTTP 507), never retried; refused
credentials are ``ObjectStoreRefused``; a missing bucket or an endpoint that does not answer is
``ObjectStoreUnreachable``. Each is one line naming the bucket, the endpoint and the server's
reason (its error code), never the secret.
The client is boto3 (chosen by ``bench/objects_s3.py``: the only one measured that does a
create-only multipart upload); it is imported and built at the first request, not at open.

About 900 lines, over the usual 400: the writer, the readers (with the recorded-upload search)
and the quarantine share one client, its retries and one mapping of its answers, which must not
drift apart.

Must never: replace an object; report as stored bytes that were not re-hashed after a 412;
leave a multipart upload unaborted; retry a 4xx; put a secret in a message; hold more than one
part of a blob in memory; know about manifests, scans or the settled store and database.
"""

from __future__ import annotations

import calendar
import contextlib
import copy
import functools
import hashlib
import io
import itertools
import os
import random
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import IO, TYPE_CHECKING, Any, BinaryIO, Final, NoReturn, TypeVar, cast

from settled.errors import BadInput, SettledError
from settled.objects import (
    CHUNK,
    DigestMismatch,
    ObjectMissing,
    ObjectStoreFull,
    ObjectStoreRefused,
    ObjectStoreUnreachable,
    ObjectUnreadable,
    ObjectWriter,
    Reread,
    StagedObject,
    StagingUnavailable,
    Stamp,
    StoredObject,
    VersionMissing,
)
from settled.objects.hashing import (
    ALGORITHMS,
    DEFAULT_ALGORITHM,
    Buffer,
    check_algorithm,
    format_digest,
    new_hasher,
    parse_digest,
    threads_can_start,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

PART_SIZE: Final = 8 << 20  # a multipart upload's part, and the most of a blob held in memory
MAX_PARTS: Final = 10_000  # S3's limit; a blob past 80 GB gets larger parts
ATTEMPTS: Final = 5
RETRY_BUDGET_S: Final = 10.0
MAX_UPLOADS: Final = 100  # older uploads of one key a recorded() reader looks through
STAMP_CONCURRENCY: Final = 16  # HEADs in flight for a read-back's closure
BACKOFF_BASE_S: Final = 0.1
BACKOFF_CAP_S: Final = 2.0
QUARANTINE: Final = "quarantine"
DEFAULT_REGION: Final = "us-east-1"
VERSION_ID: Final = "v:"
ETAG: Final = "etag:"
_THROTTLED: Final = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError"}
)
# Answers that mean "no room": out of space (507, MinIO's XMinioStorageFull), a quota
# (QuotaExceeded, often a 403), an object larger than the store takes (EntityTooLarge, a 400).
_FULL: Final = frozenset({
    "InsufficientStorage", "QuotaExceeded", "EntityTooLarge", "StorageFull", "XMinioStorageFull",
    "XMinioAdminBucketQuotaExceeded", "NoSpaceLeft", "ServiceQuotaExceeded",
})  # fmt: skip
_FULL_WORDS: Final = ("no space left", "insufficient storage", "quota exceeded", "storage full",
                      "disk full", "exceeds the quota")  # fmt: skip
_REFUSED: Final = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
    "InvalidToken", "TokenRefreshRequired", "AuthorizationHeaderMalformed", "AccountProblem",
})  # fmt: skip
FULL, REFUSED, TRANSIENT, OTHER = "full", "refused", "transient", "other"
_EXISTS: Final = (412, 409)  # precondition failed; a conditional write in conflict with another
_T = TypeVar("_T")


class BadObjectsUrl(BadInput):
    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"bad object store URL {url!r}: {reason}; expected s3://bucket/prefix")
        self.url = url


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")`` (the prefix may be empty)."""
    scheme, sep, rest = url.partition("://")
    if scheme != "s3" or not sep:
        raise BadObjectsUrl(url, "not an s3:// URL")
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not bucket or not all(c.isalnum() or c in "-." for c in bucket) or len(bucket) > 63:
        raise BadObjectsUrl(url, f"{bucket!r} is not a bucket name")
    if "//" in prefix or any(part in (".", "..") for part in prefix.split("/")) or "\\" in prefix:
        raise BadObjectsUrl(url, f"the prefix {prefix!r} has an empty, '.' or '..' part")
    return bucket, prefix


def open_s3(url: str, env: Mapping[str, str] | None = None) -> S3ObjectStore:
    """The store at ``s3://bucket/prefix``, reached as the standard ``AWS_*`` variables say."""
    env = os.environ if env is None else env
    bucket, prefix = parse_s3_url(url)
    return S3ObjectStore(
        bucket,
        prefix,
        endpoint=env.get("AWS_ENDPOINT_URL") or None,
        region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or DEFAULT_REGION,
        access_key=env.get("AWS_ACCESS_KEY_ID") or None,
        secret_key=env.get("AWS_SECRET_ACCESS_KEY") or None,
    )


def _h63(text: str) -> int:
    """A stable 63-bit integer of ``text`` (a stamp field is an SQLite INTEGER)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest()) >> 1


def _ns(when: datetime) -> int:
    return calendar.timegm(when.utctimetuple()) * 1_000_000_000 + when.microsecond * 1000


def _code(error: Exception) -> tuple[int, str, str]:
    """(HTTP status, S3 error code, message) of a botocore ClientError."""
    response: Any = getattr(error, "response", {}) or {}
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    body = response.get("Error", {})
    return status, str(body.get("Code") or status), str(body.get("Message") or "")


def classify(status: int, code: str, message: str) -> str:
    """What an S3 error answer means, as a table: ``FULL`` (no room: never retried, a full
    store), ``REFUSED`` (the credentials or their rights), ``TRANSIENT`` (5xx, throttling:
    retried) or ``OTHER`` (any other 4xx: the caller's to map). Room first: a quota is often
    a 403 and a full disk a 5xx."""
    words = message.lower()
    if status == 507 or code in _FULL or any(w in words for w in _FULL_WORDS):
        return FULL
    if status >= 500 or status == 429 or code in _THROTTLED:
        return TRANSIENT
    if status in (401, 403) or code in _REFUSED:
        return REFUSED
    return OTHER


def _version_of(response: Mapping[str, Any]) -> str:
    version = response.get("VersionId")
    if version and version != "null":
        return VERSION_ID + str(version)
    return ETAG + str(response.get("ETag") or "").strip('"')


def _stamp_of(response: Mapping[str, Any], size: int) -> Stamp:
    etag = str(response.get("ETag") or "")
    version = str(response.get("VersionId") or "") or etag
    modified = _ns(response["LastModified"])
    return Stamp(modified, _h63(version), modified, size, _h63(etag))


@dataclass(frozen=True)
class _Found:
    """An upload re-read: what it hashed to, its version, and its bytes spooled if asked."""

    reread: Reread
    version: str
    spool: IO[bytes] | None


@dataclass(frozen=True)
class _Spool:
    """A writer's bytes once its input ended: in memory (one chunk at most) or a temp file."""

    memory: bytes
    file: IO[bytes] | None

    def read(self, size: int) -> bytes:
        return self.memory if self.file is None else self.file.read(size)

    def rewind(self) -> None:
        if self.file is not None:
            self.file.seek(0)


class S3ObjectStore:
    """``ObjectStore`` on ``s3://<bucket>/<prefix>``; safe to share between threads."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str = DEFAULT_REGION,
        access_key: str | None = None,
        secret_key: str | None = None,
    ) -> None:
        self.bucket, self.prefix, self.endpoint, self.region = bucket, prefix, endpoint, region
        self._base = f"{prefix}/" if prefix else ""
        self._access_key, self._secret_key = access_key, secret_key
        self._client: S3Client | None = None
        self._ready = False
        self._lock = threading.Lock()
        self._uploads = False  # a reader of recorded content: older uploads serve too

    def recorded(self) -> S3ObjectStore:
        """This store as a reader of what a checkpoint recorded: a read (with no version) whose
        newest upload is gone (a delete marker) or holds other bytes is served by the newest
        older upload of the key that hashes to the digest (a versioned bucket keeps them)."""
        view = copy.copy(self)
        view._uploads = True
        return view

    def __repr__(self) -> str:
        return f"S3ObjectStore({self.location!r})"

    @property
    def location(self) -> str:
        where = f" at {self.endpoint}" if self.endpoint else ""
        return f"s3://{self.bucket}/{self.prefix}{where}"

    def key_of(self, digest: str) -> str:
        algo, hexdigest = parse_digest(digest)
        return f"{self._base}{algo}/{hexdigest}"

    # -- the client, its errors and retries ------------------------------------------------

    def client(self) -> S3Client:
        """The boto3 client, made at the first request (boto3 costs ~0.4 s to import and set
        up), after one ``ListObjectsV2`` that names what is wrong if the bucket is unusable."""
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            client = self._client
        if not self._ready:
            from botocore.exceptions import ClientError

            try:
                self._call(
                    lambda: client.list_objects_v2(Bucket=self.bucket, Prefix=self._base, MaxKeys=1)
                )
            except ClientError as error:
                self._unreachable(error)
            self._ready = True
        return client

    def _make_client(self) -> S3Client:
        warm = _WARM.get(self._client_key())
        if warm is not None:  # built before this process was forked (warm_client)
            return warm
        from settled.backends import extra_needed

        with extra_needed(self.location):
            import boto3
            from botocore.config import Config

        config = Config(
            region_name=self.region,
            retries={"max_attempts": 1, "mode": "standard"},  # ours: bounded, 5xx only
            connect_timeout=3,
            read_timeout=30,
            max_pool_connections=16,
            s3={"addressing_style": "path"} if self.endpoint else {},
        )
        session = boto3.session.Session(
            aws_access_key_id=self._access_key,
            aws_secret_access_key=self._secret_key,
            region_name=self.region,
        )
        return session.client("s3", endpoint_url=self.endpoint, config=config)

    def _client_key(self) -> tuple[str | None, ...]:
        """What a client is made of: a warm client serves only a store that would make the same."""
        return (self.endpoint, self.region, self._access_key, self._secret_key)

    def _call(self, call: Callable[[], _T]) -> _T:
        """``call()``, retried on connection errors, 5xx and throttling, with backoff and full
        jitter: at most ``ATTEMPTS``, none started past ``RETRY_BUDGET_S``. A 4xx is raised as
        the ClientError for the caller to map; the last transient failure is unreachable."""
        from botocore.exceptions import BotoCoreError, ClientError

        deadline = time.monotonic() + RETRY_BUDGET_S
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return call()
            except ClientError as error:
                kind = classify(*_code(error))
                if kind == FULL:
                    self._unreachable(error)  # no retry makes room
                if kind != TRANSIENT:
                    raise
                failure: Exception = error
            except BotoCoreError as error:
                if not _transient(error):
                    self._unreachable(error)
                failure = error
            delay = random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt))
            if attempt == ATTEMPTS or time.monotonic() + delay > deadline:
                break
            time.sleep(delay)
        self._unreachable(failure, tries=attempt)

    def _unreachable(self, error: Exception, *, tries: int = 1) -> NoReturn:
        from botocore.exceptions import ClientError

        kind = OTHER
        if isinstance(error, ClientError):
            status, code, message = _code(error)
            reason = f"{code} (HTTP {status}){': ' + message if message else ''}"
            kind = classify(status, code, message)
        else:
            cause = getattr(error, "kwargs", {}).get("error")
            reason = f"{error}{f' ({cause})' if cause else ''}"
        after = f" after {tries} attempts" if tries > 1 else ""
        if kind == FULL:
            raise ObjectStoreFull(self.location, reason) from None
        if kind == REFUSED:
            raise ObjectStoreRefused(self.location, reason + after) from None
        raise ObjectStoreUnreachable(self.location, reason + after) from None

    def _raise(self, error: Exception, digest: str, version: str | None = None) -> NoReturn:
        """Map a 4xx of one object's request: missing, no such version, or unusable."""
        status, code, _ = _code(error)
        if version is not None and (status in (404, 412) or code == "InvalidArgument"):
            raise VersionMissing(digest, version) from None
        if status == 404 and code != "NoSuchBucket":
            raise ObjectMissing(digest) from None
        self._unreachable(error)

    # -- writing -------------------------------------------------------------------------------

    def writer(
        self, algo: str = DEFAULT_ALGORITHM, *, size_hint: int | None = None
    ) -> ObjectWriter:
        return _S3Writer(self, check_algorithm(algo), size_hint)

    def put_bytes(self, data: Buffer, algo: str = DEFAULT_ALGORITHM) -> str:
        with self.writer(algo, size_hint=len(data)) as writer:
            writer.write(data)
            return writer.commit().digest

    def put_stream(
        self,
        source: BinaryIO | int,
        expected_digest: str | None = None,
        algo: str = DEFAULT_ALGORITHM,
    ) -> str:
        """Spool everything ``source`` yields (a chunk at a time), refuse a wrong digest before
        anything is sent, then PUT create-only."""
        if expected_digest is not None:
            algo = parse_digest(expected_digest)[0]
        with self.writer(algo) as writer:
            while data := _read_chunk(source):
                writer.write(data)
            actual = writer.digest()
            if expected_digest is not None and actual != expected_digest:
                raise DigestMismatch(expected_digest, actual)
            return writer.commit().digest

    def batch(self) -> contextlib.AbstractContextManager[None]:
        """Nothing to defer: every PUT is durable when it returns."""
        return contextlib.nullcontext()

    def staging(self) -> contextlib.AbstractContextManager[Callable[[], None]]:
        raise StagingUnavailable(
            f"{self.location}: every PUT is durable on its own; objects are committed one by one"
        )

    def stage_bytes(self, data: Buffer, algo: str = DEFAULT_ALGORITHM) -> StagedObject:
        """The PUT itself, as ``writer().stage()`` is (durable when it returns)."""
        with self.writer(algo, size_hint=len(data)) as writer:
            writer.write(data)
            return writer.stage()

    def store_spooled(self, digest: str, size: int, spool: _Spool) -> StoredObject:
        """Create ``digest`` from the spool, create-only; an existing copy is re-hashed, and
        quarantined and written again (once) if it does not hash to its name. A blob larger
        than a part is looked for first, so a dedupe costs a GET, not an upload."""
        client = self.client()
        for attempt in (1, 2):
            spool.rewind()
            try:
                if size <= PART_SIZE:
                    stored = self._put_once(client, digest, size, spool.read(size))
                else:
                    try:
                        stored = self._existing(digest, size)
                    except ObjectMissing:
                        stored = self._multipart(client, digest, spool)
            except ObjectMissing:
                continue  # a 409 conflict that left no object: write again
            if stored is not None:
                return stored
            if attempt == 1:
                self.quarantine(digest)
        raise ObjectUnreadable(digest, "the stored copy does not hash to its name, even rewritten")

    def _put_once(
        self, client: S3Client, digest: str, size: int, data: bytes
    ) -> StoredObject | None:
        from botocore.exceptions import ClientError

        key = self.key_of(digest)
        try:
            put = self._call(
                lambda: client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
            )
        except ClientError as error:
            if _code(error)[0] not in _EXISTS:
                self._raise(error, digest)
            return self._existing(digest, size)
        return StoredObject(digest, size, created=True, version=_version_of(put))

    def _multipart(self, client: S3Client, digest: str, spool: _Spool) -> StoredObject | None:
        """Parts of ``PART_SIZE`` (larger past 10,000 parts) read one at a time; complete
        create-only; abort on any failure, a 412 included."""
        size = spool.file.seek(0, os.SEEK_END) if spool.file is not None else len(spool.memory)
        spool.rewind()
        part_size = max(PART_SIZE, -(-size // MAX_PARTS))
        return self._upload_parts(client, digest, size, lambda: spool.read(part_size))

    def _upload_parts(
        self,
        client: S3Client,
        digest: str,
        size: int,
        next_part: Callable[[], bytes],
        before_completing: Callable[[], None] = lambda: None,
    ) -> StoredObject | None:
        """One multipart upload of the parts ``next_part`` gives (b"" after the last),
        completed create-only once ``before_completing`` returned (it raises to refuse);
        aborted on any failure, a 412 included. None: an object of that name existed and did
        not hash to it (as ``_existing``)."""
        from botocore.exceptions import ClientError

        key, bucket = self.key_of(digest), self.bucket
        upload = self._call(lambda: client.create_multipart_upload(Bucket=bucket, Key=key))
        upload_id = upload["UploadId"]
        try:
            parts: list[dict[str, Any]] = []
            while data := next_part():
                number = len(parts) + 1
                part = self._call(
                    functools.partial(
                        client.upload_part, Bucket=bucket, Key=key, UploadId=upload_id,
                        PartNumber=number, Body=data,
                    )
                )  # fmt: skip
                parts.append({"PartNumber": number, "ETag": part["ETag"]})
            before_completing()
            done = self._call(
                lambda: client.complete_multipart_upload(
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": cast(Any, parts)},
                    IfNoneMatch="*",
                )
            )
        except ClientError as error:
            self._abort(client, key, upload_id)
            if _code(error)[0] not in _EXISTS:
                self._raise(error, digest)
            return self._existing(digest, size)
        except BaseException:
            self._abort(client, key, upload_id)
            raise
        return StoredObject(digest, size, created=True, version=_version_of(done))

    def _abort(self, client: S3Client, key: str, upload_id: str) -> None:
        with contextlib.suppress(Exception):
            self._call(
                lambda: client.abort_multipart_upload(
                    Bucket=self.bucket, Key=key, UploadId=upload_id
                )
            )

    def _existing(self, digest: str, size: int) -> StoredObject | None:
        """The copy that holds ``digest``, re-read and re-hashed: dedupe if it is right (its
        version the one that was hashed), None if it is damaged; ``ObjectMissing`` if none."""
        try:
            again, version = self._reread(digest, keep=False)
        except ObjectUnreadable:
            return None
        if again.actual != digest or again.size != size or again.stamp is None:
            return None
        return StoredObject(digest, size, created=False, version=version)

    def quarantine(self, digest: str) -> str | None:
        """Copy what holds ``digest`` (exactly the version a HEAD found) to
        ``<prefix>/quarantine/``, then delete the key so the right bytes can be written again.
        Returns the evidence's URL, or None if nothing held the name."""
        from botocore.exceptions import ClientError

        client, key = self.client(), self.key_of(digest)
        algo, hexdigest = parse_digest(digest)
        target = (
            f"{self._base}{QUARANTINE}/{algo}-{hexdigest}.{time.time_ns()}.{secrets.token_hex(4)}"
        )
        try:
            head = self._call(lambda: client.head_object(Bucket=self.bucket, Key=key))
            source: dict[str, str] = {"Bucket": self.bucket, "Key": key}
            if head.get("VersionId") and head.get("VersionId") != "null":
                source["VersionId"] = head["VersionId"]
            self._call(
                lambda: client.copy_object(
                    Bucket=self.bucket, Key=target, CopySource=cast(Any, source)
                )
            )
            self._call(lambda: client.delete_object(Bucket=self.bucket, Key=key))
        except ClientError as error:
            if _code(error)[0] == 404 and _code(error)[1] != "NoSuchBucket":
                return None
            self._raise(error, digest)
        return f"s3://{self.bucket}/{target}"

    # -- reading -------------------------------------------------------------------------------

    def has(self, digest: str) -> bool:
        try:
            self.stamp(digest)
        except ObjectMissing:
            return False
        return True

    def _get(self, digest: str, version: str | None = None) -> dict[str, Any]:
        from botocore.exceptions import ClientError

        key = self.key_of(digest)
        extra: dict[str, str] = {}
        if version is not None:
            if version.startswith(VERSION_ID) and len(version) > len(VERSION_ID):
                extra["VersionId"] = version[len(VERSION_ID) :]
            elif version.startswith(ETAG) and len(version) > len(ETAG):
                extra["IfMatch"] = f'"{version[len(ETAG) :]}"'
            else:
                raise VersionMissing(digest, version)
        client = self.client()
        try:
            got = self._call(
                lambda: client.get_object(Bucket=self.bucket, Key=key, **cast(Any, extra))
            )
        except ClientError as error:
            self._raise(error, digest, version)
        return cast(dict[str, Any], got)

    def open(self, digest: str, version: str | None = None) -> BinaryIO:
        """A stream of the object's bytes (``version``: exactly that one, see the module). A
        ``recorded()`` reader spools and hashes first, so it can fall back to an older upload."""
        if version is None and self._uploads:
            return self._open_right(digest)
        got = self._get(digest, version)
        return cast(BinaryIO, io.BufferedReader(_Body(got["Body"], digest), CHUNK))

    def read(self, digest: str, version: str | None = None) -> bytes:
        with self.open(digest, version) as handle:
            return handle.read()

    def stamp(self, digest: str) -> Stamp:
        """From a ``HEAD``: the Last-Modified, the version id and ETag, the size. A
        ``recorded()`` reader whose key is deleted stamps the newest upload left."""
        try:
            return self._stamp(digest, None)
        except ObjectMissing:
            if not self._uploads:
                raise
            for version in self._uploads_of(digest):
                with contextlib.suppress(VersionMissing):
                    return self._stamp(digest, version)
            raise

    def _stamp(self, digest: str, version: str | None) -> Stamp:
        from botocore.exceptions import ClientError

        key = self.key_of(digest)
        client = self.client()
        extra = {} if version is None else {"VersionId": version[len(VERSION_ID) :]}
        try:
            head = self._call(
                lambda: client.head_object(Bucket=self.bucket, Key=key, **cast(Any, extra))
            )
        except ClientError as error:
            self._raise(error, digest, version)
        return _stamp_of(cast(Mapping[str, Any], head), int(head["ContentLength"]))

    def _uploads_of(self, digest: str) -> list[str]:
        """The versions (``v:<VersionId>``) of the object's key, newest first, delete markers
        left out: none in a bucket without versioning. At most ``MAX_UPLOADS``."""
        from botocore.exceptions import ClientError

        client, key = self.client(), self.key_of(digest)
        found: list[tuple[datetime, str]] = []
        marker: dict[str, str] = {}
        while len(found) < MAX_UPLOADS:
            try:
                page = self._call(
                    functools.partial(
                        client.list_object_versions,
                        Bucket=self.bucket,
                        Prefix=key,
                        **cast(Any, marker),
                    )
                )
            except ClientError:
                break  # a server that lists no versions has no older upload to offer
            for entry in page.get("Versions", []):
                version = str(entry.get("VersionId") or "")
                if entry.get("Key") == key and version not in ("", "null"):
                    found.append((entry["LastModified"], VERSION_ID + version))
            key_marker, version_marker = page.get("NextKeyMarker"), page.get("NextVersionIdMarker")
            if not page.get("IsTruncated") or not key_marker:
                break
            marker = {"KeyMarker": key_marker, "VersionIdMarker": str(version_marker or "")}
        found.sort(key=lambda item: item[0], reverse=True)
        return [version for _, version in found[:MAX_UPLOADS]]

    def _open_right(self, digest: str) -> BinaryIO:
        """The bytes of the newest upload that hashes to ``digest``, spooled (memory up to one
        chunk, then an unlinked temp file) while hashed; the newest upload's if none does."""
        found = self._first_right(digest, spool=True)
        assert found.spool is not None
        found.spool.seek(0)
        return cast(BinaryIO, found.spool)

    def stamps(self, digests: Sequence[str]) -> list[Stamp | Exception]:
        """HEADs, ``STAMP_CONCURRENCY`` in flight (a boto3 client is thread-safe); one after
        another where this process cannot start threads (an owner inside its PID namespace)."""
        self.client()  # made once, before the threads share it

        def one(digest: str) -> Stamp | Exception:
            try:
                return self.stamp(digest)
            except (OSError, SettledError) as error:
                return error

        if len(digests) < 2 * STAMP_CONCURRENCY or not threads_can_start():
            return [one(d) for d in digests]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(STAMP_CONCURRENCY, thread_name_prefix="s3-stamp") as pool:
            return list(pool.map(one, digests))

    def rereads(self, digests: Sequence[str]) -> list[Reread | Exception]:
        """``reread`` of each, ``STAMP_CONCURRENCY`` GETs in flight (as ``stamps``); what
        ``reread`` says of an object is its result, any other error is raised."""

        def one(digest: str) -> Reread | Exception:
            try:
                return self.reread(digest)
            except SettledError as error:
                return error

        if len(digests) < 2 * STAMP_CONCURRENCY or not threads_can_start():
            return [one(d) for d in digests]
        self.client()  # made once, before the threads share it
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(STAMP_CONCURRENCY, thread_name_prefix="s3-reread") as pool:
            return list(pool.map(one, digests))

    def reread(self, digest: str, *, keep: bool = False) -> Reread:
        """One ``GET`` (one version, served whole), hashed a chunk at a time; its stamp is the
        response's, so it names exactly the copy that was hashed."""
        return self._reread(digest, keep)[0]

    def _reread(self, digest: str, keep: bool) -> tuple[Reread, str]:
        """The re-read, and the version of the copy it hashed (for a ``recorded()`` reader,
        the newest upload that hashes to the digest, if any does)."""
        if not self._uploads:
            return self._reread_version(digest, None, keep)
        found = self._first_right(digest, keep=keep)
        return found.reread, found.version

    def _first_right(self, digest: str, *, keep: bool = False, spool: bool = False) -> _Found:
        """The newest upload of the key (then the older ones, newest first) re-hashed until one
        hashes to ``digest``; the newest upload's result if none does, ``ObjectMissing`` if
        there is none."""
        first: _Found | None = None
        tried: str | None = None
        for version in itertools.chain((None,), self._later(lambda: self._uploads_of(digest))):
            if version is not None and version == tried:
                continue
            sink = tempfile.SpooledTemporaryFile(CHUNK) if spool else None  # noqa: SIM115
            try:
                reread, tried = self._reread_version(digest, version, keep, sink)
            except ObjectMissing:
                if sink is not None:
                    sink.close()
                continue
            found = _Found(reread, tried, sink)
            if reread.actual == digest:
                if first is not None and first.spool is not None:
                    first.spool.close()
                return found
            if first is None:
                first = found
            elif sink is not None:
                sink.close()
        if first is None:
            raise ObjectMissing(digest)
        return first

    @staticmethod
    def _later(make: Callable[[], list[str]]) -> Iterator[str]:
        """``make()``'s items, listed only once the first is wanted (the listing costs a call
        that an intact newest upload never needs)."""
        yield from make()

    def _reread_version(
        self, digest: str, version: str | None, keep: bool, sink: IO[bytes] | None = None
    ) -> tuple[Reread, str]:
        """One GET of ``version`` (None: the newest), hashed a chunk at a time; each chunk
        kept (``keep``) and written to ``sink``."""
        algo = parse_digest(digest)[0]
        started = time.time_ns()
        got = self._get(digest, version)
        expected = int(got["ContentLength"])
        hasher = new_hasher(algo, size_hint=expected)
        chunks: list[bytes] = []
        size = 0
        with io.BufferedReader(_Body(got["Body"], digest), CHUNK) as body:
            while chunk := body.read(CHUNK):
                hasher.update(chunk)
                size += len(chunk)
                if keep:
                    chunks.append(chunk)
                if sink is not None:
                    sink.write(chunk)
        stamp = _stamp_of(got, size) if size == expected else None
        data = b"".join(chunks) if keep else None
        actual = format_digest(algo, hasher.hexdigest())
        return Reread(actual, size, data, stamp, started), _version_of(got)

    def verify(self, digest: str) -> bool:
        try:
            return self.reread(digest).actual == digest
        except (ObjectMissing, ObjectUnreadable):
            return False

    def list_digests(self, algo: str | None = None) -> Iterator[str]:
        """``ListObjectsV2`` pages under ``<prefix>/<algo>/``; a key that is not a digest's
        (a stray) is not an object and is skipped."""
        client = self.client()
        for name in ALGORITHMS if algo is None else (check_algorithm(algo),):
            top = f"{self._base}{name}/"
            token: str | None = None
            while True:
                extra = {} if token is None else {"ContinuationToken": token}
                page = self._call(
                    functools.partial(
                        client.list_objects_v2, Bucket=self.bucket, Prefix=top, **cast(Any, extra)
                    )
                )
                for entry in page.get("Contents", []):
                    digest = f"{name}:{entry.get('Key', '')[len(top) :]}"
                    try:
                        parse_digest(digest)
                    except SettledError:
                        continue  # not a digest: not an object
                    yield digest
                token = page.get("NextContinuationToken")
                if not page.get("IsTruncated") or not token:
                    break

    # -- uploading a file whose digest is known (a sealed log) ----------------------------------

    def upload_file(self, source: BinaryIO, length: int, digest: str) -> StoredObject:
        """Store the first ``length`` bytes of ``source`` (a file, or any seekable stream, at
        its start) as the object ``digest``, which the caller counted as the bytes were written
        (a settled stream's), create-only, holding at most one part in memory: one PUT up to
        ``PART_SIZE``, else a multipart upload read a part at a time. The bytes are hashed as
        they are read; bytes that do not hash to ``digest`` are never stored
        (``DigestMismatch``: the PUT is not sent, the multipart upload is aborted before its
        completion). An existing copy is dedupe only once re-hashed, and a damaged one is
        quarantined and written again once, as ``store_spooled`` does. No ``ListObjectsV2``
        first (``client()``'s): a missing bucket or refused credentials fail the PUT itself,
        named as ``ObjectStoreUnreachable`` all the same."""
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            client = self._client
        for attempt in (1, 2):
            source.seek(0)
            try:
                if length <= PART_SIZE:
                    data = _hashed_read(source, length, digest)
                    stored = self._put_once(client, digest, length, data)
                else:
                    try:
                        stored = self._existing(digest, length)
                    except ObjectMissing:
                        stored = self._multipart_file(client, source, length, digest)
            except ObjectMissing:
                continue  # a 409 conflict that left no object: write again
            if stored is not None:
                return stored
            if attempt == 1:
                self.quarantine(digest)
        raise ObjectUnreadable(digest, "the stored copy does not hash to its name, even rewritten")

    def _multipart_file(
        self, client: S3Client, source: BinaryIO, length: int, digest: str
    ) -> StoredObject | None:
        """The multipart upload of ``upload_file``: parts read and hashed one at a time, the
        whole checked against ``digest`` before the create-only completion; aborted on any
        failure (a wrong digest, a 412 included)."""
        part_size = max(PART_SIZE, -(-length // MAX_PARTS))
        hasher = _Counted(digest)

        def next_part() -> bytes:
            if hasher.size >= length:
                return b""
            return hasher.read(source, min(part_size, length - hasher.size))

        return self._upload_parts(client, digest, length, next_part, lambda: hasher.check(length))


class _Counted:
    """The hash of bytes read from a file for an object whose digest the caller announced."""

    def __init__(self, digest: str) -> None:
        self.digest, self.algo = digest, parse_digest(digest)[0]
        self.hasher = new_hasher(self.algo)  # no size hint: BLAKE3 starts no thread pool
        self.size = 0

    def read(self, source: BinaryIO, size: int) -> bytes:
        """Exactly ``size`` bytes (fewer only at the file's end), hashed."""
        data = source.read(size)
        while data and len(data) < size and (more := source.read(size - len(data))):
            data += more
        self.hasher.update(data)
        self.size += len(data)
        if not data:
            self.check(self.size + size)  # the file ends early: that is another content
        return data

    def check(self, length: int) -> None:
        actual = format_digest(self.algo, self.hasher.hexdigest())
        if self.size != length or actual != self.digest:
            raise DigestMismatch(self.digest, f"{actual} ({self.size} of {length} bytes read)")


def _hashed_read(source: BinaryIO, length: int, digest: str) -> bytes:
    """Bytes [0, length) of ``source``, refused (``DigestMismatch``) unless they hash to
    ``digest``."""
    counted = _Counted(digest)
    data = counted.read(source, length) if length else b""
    counted.check(length)
    return data


def _transient(error: Exception) -> bool:
    """A connection that failed, was closed or timed out: worth another attempt."""
    from botocore.exceptions import ConnectionError, HTTPClientError

    return isinstance(error, ConnectionError | HTTPClientError)


def _read_chunk(source: BinaryIO | int) -> bytes:
    if isinstance(source, int):
        return os.read(source, CHUNK)
    return source.read(CHUNK)


class _Body(io.RawIOBase):
    """A GET's streaming body as a raw stream; a failed read is ``ObjectUnreadable``."""

    def __init__(self, body: Any, digest: str) -> None:
        self._body, self._digest = body, digest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        try:
            data = self._body.read(len(buffer))
        except Exception as error:
            raise ObjectUnreadable(self._digest, f"the GET broke off: {error}") from None
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._body.close()
        super().close()


class _S3Writer:
    """Hash and spool bytes (memory up to one chunk, then an unlinked temp file); PUT at
    ``commit()``, when the digest, the key, is known."""

    def __init__(self, store: S3ObjectStore, algo: str, size_hint: int | None) -> None:
        self._store, self._algo = store, algo
        self._hasher = new_hasher(algo, size_hint=size_hint)
        self._pending = bytearray()
        self._file: IO[bytes] | None = None
        self._size = 0
        self._digest: str | None = None
        self._done = False

    @property
    def size(self) -> int:
        return self._size

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._done:
            self.abort()

    def write(self, data: Buffer) -> None:
        if self._digest is not None or self._done:
            raise ValueError("write after digest(), commit() or abort()")
        self._hasher.update(data)
        self._size += len(data)
        if self._file is None and len(self._pending) + len(data) <= CHUNK:
            self._pending += data
            return
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="settled-s3-")  # noqa: SIM115 (closed in abort)
            self._file.write(self._pending)
            self._pending = bytearray()
        self._file.write(data)

    def digest(self) -> str:
        if self._digest is None:
            self._digest = format_digest(self._algo, self._hasher.hexdigest())
        return self._digest

    def commit(self) -> StoredObject:
        if self._done:
            raise ValueError("commit() or stage() after commit(), stage() or abort()")
        digest = self.digest()
        try:
            if self._file is not None:
                self._file.flush()
            spool = _Spool(bytes(self._pending), self._file)
            return self._store.store_spooled(digest, self._size, spool)
        finally:
            self.abort()

    def stage(self) -> StagedObject:
        """The PUT itself (it is durable when it returns): ``publish()`` returns what it stored."""
        return _S3Staged(self.commit())

    def abort(self) -> None:
        self._done = True
        self._pending = bytearray()
        if self._file is not None:
            self._file.close()
            self._file = None


class _S3Staged:
    visible_at_sync = True  # stored when staged: publish() only reports it

    def __init__(self, stored: StoredObject) -> None:
        self._stored = stored

    @property
    def digest(self) -> str:
        return self._stored.digest

    def publish(self) -> StoredObject:
        return self._stored

    def discard(self) -> None:
        """Nothing to undo: the object is stored, and content addressing makes that harmless."""


# -- a client made before a fork -------------------------------------------------------------

_WARM: dict[tuple[str | None, ...], S3Client] = {}  # clients made by warm_client, by what made them


def warm_client(url: str, env: Mapping[str, str]) -> bool:
    """In a process that forks owners (a zygote), before it forks them: import boto3 and make
    the client of the store at ``url`` as ``env`` reaches it, endpoint resolved, without a
    request: no connection and no thread exist yet, so a forked owner shares those pages
    copy-on-write and opens connections of its own. Only with the credentials in ``env``:
    without them boto3 would look for them (an instance's metadata service is a request), so
    only the imports are made. True when a client was made."""
    store = open_s3(url, env)
    from settled.backends import extra_needed

    with extra_needed(store.location):
        import boto3  # noqa: F401
        import botocore.config  # noqa: F401
    if store._access_key is None or store._secret_key is None:
        return False
    if store._client_key() not in _WARM:
        client = store._make_client()
        _rehearse(client, store.bucket, store.key_of(REHEARSAL_DIGEST))
        _WARM[store._client_key()] = client
    return True


REHEARSAL_DIGEST: Final = "blake3:" + "0" * 64


def _rehearse(client: S3Client, bucket: str, key: str) -> None:
    """One create-only PutObject through the client's whole path (parameters, endpoint rules,
    signature, checksum), answered before it is sent: a 'before-send' handler returns a canned
    response, so no connection is made; what the client builds lazily at its first request is
    then built once, here, not in every owner."""
    from botocore.awsrequest import AWSResponse, HTTPHeaders

    def answer(request: Any, **_: Any) -> AWSResponse:
        return AWSResponse(request.url, 200, HTTPHeaders(), _NoBody())

    events = client.meta.events
    events.register_first("before-send.s3", cast(Any, answer), unique_id="settled-rehearsal")
    try:
        client.put_object(Bucket=bucket, Key=key, Body=b"", IfNoneMatch="*")
    finally:
        events.unregister("before-send.s3", unique_id="settled-rehearsal")
        with contextlib.suppress(AttributeError):  # were one opened all the same: let it go
            cast(Any, client)._endpoint.http_session.close()


class _NoBody:
    """The raw body of the rehearsal's canned response: empty."""

    def stream(self, *_: Any, **__: Any) -> Iterator[bytes]:
        yield b""

    def read(self, *_: Any, **__: Any) -> bytes:
        return b""
