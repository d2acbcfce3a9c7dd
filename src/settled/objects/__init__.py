"""The object store's contract: what every backend of content-addressed objects guarantees.

Owns the ``ObjectStore`` protocol and the vocabulary its callers (scan, publish, manifest,
restore, readback, verify, checkpoint) use: ``ObjectWriter`` and ``StagedObject`` (an object
being written), ``StoredObject`` (what a write left), ``Stamp`` and ``Reread`` (what identifies
a stored copy, and what re-reading it found), and the errors a backend raises; and
``open_object_store``, the one place that chooses a home's backend from its binding
(``settled.backends``). A backend is a module of its own behind this seam, imported by
``open_object_store`` alone: ``local.LocalObjectStore`` (a directory, with its ``packs``) and
``s3.S3ObjectStore`` (an S3-compatible bucket). Everything else takes the protocol. The package
(with ``hashing``, the digest vocabulary) is a layer of its own (tests/test_layers.py,
"objects"), below the workspace service, so that an owner sealing its logs and recovery reach
the object store without the checkpoint code.

The cut follows restic's backend (Save, Load, Stat, List, Remove over named blobs) with two
differences that content addressing allows. There is no Remove: an object, once visible, is
never replaced or deleted, and the only way its name is taken away is ``quarantine``, for an
object just found not to hash to its name (moved aside and kept as evidence, so the right bytes
can be written again). And Save is create-only: writing an object that is already present is a
success that changes nothing (dedupe), as an S3 ``PutObject`` with ``If-None-Match: *`` is
(``412 Precondition Failed`` is that success, not an error).

    restic / S3                       here
    Save / PutObject If-None-Match:*  writer().commit(), put_bytes, put_stream
    Load / GetObject [versionId]      open(digest, version=), read(digest, version=)
    Stat / HeadObject                 has(digest) (exists), stamp(digest) (which copy, its size)
    List / ListObjectsV2              list_digests(algo)
    Remove / DeleteObject             none; quarantine(digest) for a damaged object only

Versions. An object's id is its digest, and its bytes can never change under that id, so the
digest already pins the content; a version names one stored upload of it. S3 keeps versions (the
``x-amz-version-id`` of the PUT that created the object), and pinning it lets an audit name the
exact upload. The local store keeps exactly one copy per digest, written once and never
replaced, so its only version is the digest itself: ``StoredObject.version`` is the digest, and
``open``/``read`` with ``version=`` equal to the digest read the object, any other version is
``VersionMissing``. A caller asks for "exactly this version" by passing the ``version`` a
write returned; ``version=None`` means "the object, whichever upload holds it", which is what
every reader here wants, since the bytes are checked against the digest anyway.

Must never: know a path, a bucket or a key layout (those are a backend's; the chooser reads only
the binding's scheme); import a backend but inside ``open_object_store``; know about manifests,
scans, or the settled store and database.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import BinaryIO, Final, NamedTuple, Protocol

from settled.errors import SettledError, SpaceExhausted
from settled.objects.hashing import DEFAULT_ALGORITHM, Buffer

CHUNK: Final = 1 << 20  # the most of one object's bytes a stream holds in memory at once


class ObjectMissing(SettledError):
    def __init__(self, digest: str) -> None:
        super().__init__(f"object {digest} is not in the object store")
        self.digest = digest


class VersionMissing(ObjectMissing):
    """The store holds no such version of the object (the local store's only one is its digest)."""

    def __init__(self, digest: str, version: str) -> None:
        SettledError.__init__(
            self,
            f"object {digest} has no version {version!r} in the object store; "
            "read it without a version, or with the version its write returned",
        )
        self.digest, self.version = digest, version


class ObjectUnreadable(SettledError):
    """Something holds the object's name that is not a readable object (for the local store:
    not a regular file, a symlink, or a file that cannot be opened or read)."""

    def __init__(self, digest: str, detail: str) -> None:
        super().__init__(f"object {digest} cannot be read back: {detail}")
        self.digest, self.detail = digest, detail


class DigestMismatch(SettledError):
    """Streamed bytes did not hash to the digest the caller announced; nothing was stored."""

    def __init__(self, expected: str, actual: str) -> None:
        super().__init__(f"content hashes to {actual}, not the expected {expected}; not stored")
        self.expected, self.actual = expected, actual


class DurabilityError(SettledError):
    """An fsync (or the write before it) failed: the object is not known to be durable."""

    def __init__(self, path: str, error: OSError) -> None:
        super().__init__(f"could not make {path} durable: {error}; nothing is claimed stored")
        self.path = path


class StagingUnavailable(SettledError):
    """The store cannot make a group of writes durable at once; commit them one by one."""


class ObjectStoreUnreachable(SettledError):
    """The object store cannot be used at all: its endpoint does not answer, its bucket does not
    exist, or it refuses the credentials. Names where and the server's reason, never a secret."""

    def __init__(self, location: str, reason: str) -> None:
        reason = " ".join(reason.split())  # one line, whatever the server sent
        super().__init__(f"the object store {location} cannot be used: {reason}")
        self.location, self.reason = location, reason


class ObjectStoreRefused(ObjectStoreUnreachable):
    """The object store refuses the credentials (or their rights): no retry will change that."""


class ObjectStoreFull(SpaceExhausted):
    """The object store refused a write for space: out of space, over a quota, or an object
    larger than it takes. A full store like a full home (exit 3, HTTP 507): blocked until space
    is made; named by the store's location and the server's reason, in one line."""

    def __init__(self, location: str, reason: str) -> None:
        reason = " ".join(reason.split())
        super().__init__(f"the object store {location} is full: {reason}", location, None, None)
        self.location, self.reason = location, reason


@dataclass(frozen=True)
class StoredObject:
    """What a committed write left in the store."""

    digest: str
    size: int
    created: bool  # False: the object was already present (dedupe), nothing was written
    version: str  # the backend's version id of the object; the local store uses the digest


class Stamp(NamedTuple):
    """What identifies one stored copy of an object, read without reading its bytes.

    Two equal stamps mean the very same copy, changed since in no way the backend records; the
    verified-object record trusts an object whose stamp is the one it had when it last hashed
    right (``verified``). Fields in the order that fails fastest when compared. Local: from an
    ``lstat`` of the object file, ``changed_ns`` its ctime (which user space cannot set),
    ``copy`` its inode, ``modified_ns`` its mtime, ``volume`` its device.
    """

    changed_ns: int
    copy: int
    modified_ns: int
    size: int
    volume: int


class Reread(NamedTuple):
    """One stored object read again in full: what its bytes hash to (in the algorithm of the
    digest asked for), how many there were, the bytes if asked to keep them, and the copy's
    stamp, or None if the copy changed while it was being read. (A NamedTuple: a read-back
    makes one per object, and a frozen dataclass cost ~1.5 us more to build.)"""

    actual: str
    size: int
    data: bytes | None
    stamp: Stamp | None
    started_ns: int  # the wall clock (time.time_ns) just before the read began
    # The copy is held in a container of many objects (the local store's pack) and every object
    # it names was read and hashed right between the same two looks at it: its stamp, but for
    # the size, then vouches for all of them (``verified``'s per-pack rows).
    whole: bool = False


class StagedObject(Protocol):
    """An object whose bytes were handed to the store without waiting for the disk.

    ``publish()`` makes it visible under its digest and may be called only after the ``sync``
    of the ``staging()`` group it was staged in returned; ``discard()`` drops it instead.
    """

    @property
    def digest(self) -> str: ...

    @property
    def visible_at_sync(self) -> bool:
        """Whether the group's sync alone makes it visible: its ``publish()`` then only reports
        it (and may be called at once) and its ``discard()`` does nothing, so a publisher can
        count it instead of holding it (a pack's member: a million of them held cost ~250 MB)."""
        ...

    def publish(self) -> StoredObject: ...

    def discard(self) -> None: ...


class ObjectWriter(Protocol):
    """One object being written: bytes in, then ``commit()``, ``stage()`` or ``abort()``.

    ``write`` hashes and stages the bytes; ``digest()`` ends the input and names the object;
    ``commit()`` makes it durable and visible (or finds it already there); ``stage()`` writes it
    without waiting for the disk (see ``StagedObject``); ``abort()`` discards what was staged.
    Leaving the context without ``commit()`` or ``stage()`` aborts.
    """

    @property
    def size(self) -> int: ...

    def write(self, data: Buffer) -> None: ...

    def digest(self) -> str: ...

    def commit(self) -> StoredObject: ...

    def stage(self) -> StagedObject: ...

    def abort(self) -> None: ...

    def __enter__(self) -> ObjectWriter: ...

    def __exit__(self, *exc: object) -> None: ...


class ObjectStore(Protocol):
    """A create-only, content-addressed blob store.

    Guarantees every backend gives: an object, once visible, is never replaced and its bytes hash
    to its name; a write returns only after the object is durable; writing an object that is
    already present is a success that changes nothing. Every ``digest`` argument is parsed
    (``hashing.BadDigest`` if it is not one) before anything is looked up.

    Mapping to an S3-compatible backend: the key is ``<prefix>/<algo>/<hex>``; ``put_*`` and
    ``ObjectWriter.commit()`` are one ``PUT`` with ``If-None-Match: *`` (a create-only write);
    ``412 Precondition Failed`` means the object exists, which is dedupe, not an error. Because
    the key is the digest, a writer whose digest is not known in advance spools to a local temp
    file (bounded memory) and PUTs at ``commit()``; ``put_stream`` with ``expected_digest`` can
    stream the PUT directly and still verifies the bytes (with the checksum header). The
    response's ``x-amz-version-id`` is the ``version`` of ``StoredObject``; the backend records it
    beside the digest (a manifest names objects by digest only, since content addressing makes
    the version redundant for integrity; the version pins the exact upload for audits). ``has``
    and ``stamp`` are ``HEAD``, ``open``/``read`` are ``GET`` (with ``versionId`` if a version
    is asked for), ``reread`` and ``verify`` are ``GET`` + re-hash, ``list_digests`` is
    ``ListObjectsV2`` under ``<prefix>/<algo>/``; ``batch`` may be a no-op. A PUT is durable
    when it returns, so ``stage()`` is the PUT, ``staging()`` yields a ``sync`` that does
    nothing, and ``publish()`` returns what the PUT stored.
    """

    @property
    def location(self) -> str:
        """Where the objects are, for messages: a directory, a bucket URL."""
        ...

    # -- writing (Save) --------------------------------------------------------------------

    def writer(
        self, algo: str = DEFAULT_ALGORITHM, *, size_hint: int | None = None
    ) -> ObjectWriter:
        """A writer for one object; ``size_hint`` (bytes expected) only tunes the hasher."""
        ...

    def put_bytes(self, data: Buffer, algo: str = DEFAULT_ALGORITHM) -> str:
        """Store ``data``, create-only; returns its digest (its id), whether it was written now
        or was already present. ``writer().commit()`` says which, and the version."""
        ...

    def put_stream(
        self,
        source: BinaryIO | int,
        expected_digest: str | None = None,
        algo: str = DEFAULT_ALGORITHM,
    ) -> str:
        """Store everything ``source`` yields, ``CHUNK`` bytes at a time; returns the digest.
        ``DigestMismatch`` (nothing stored) if the bytes do not hash to ``expected_digest``."""
        ...

    def batch(self) -> AbstractContextManager[None]:
        """Writers made in this thread inside the batch may defer what makes their names
        durable to the batch's end (once for all of them). Commit them before it ends."""
        ...

    def staging(self) -> AbstractContextManager[Callable[[], None]]:
        """A group of staged writes: yields ``sync``, which returns once every object staged (by
        any writer) since the group began is durable, and raises ``DurabilityError`` if any may
        not be. ``StagingUnavailable`` if the backend cannot group writes."""
        ...

    def stage_bytes(self, data: Buffer, algo: str = DEFAULT_ALGORITHM) -> StagedObject:
        """``writer(algo)``, ``write(data)`` and ``stage()`` in one call, for a small object
        held in memory: what a scan publishes for each small file and tree, so a backend may
        do it without a writer (the local store hashes it and appends it to the group's pack).
        Inside ``staging()`` it is visible once ``publish()`` follows the group's ``sync``."""
        ...

    def quarantine(self, digest: str) -> str | None:
        """Take the name away from what holds ``digest``, keeping those bytes aside as evidence
        (never deleted), so that the next write of the right bytes can create the object again.
        Returns where the evidence went, or None if nothing held the name. Only for an object
        the caller has just found not to hash to its name (or not to be an object at all)."""
        ...

    # -- reading (Load, Stat, List) --------------------------------------------------------

    def has(self, digest: str) -> bool:
        """The object exists (a name that holds something that is not an object: False)."""
        ...

    def open(self, digest: str, version: str | None = None) -> BinaryIO:
        """The object's bytes as a stream; ``version``: exactly that version (see the module's
        docstring). ``ObjectMissing`` (``VersionMissing``) if the store does not hold it."""
        ...

    def read(self, digest: str, version: str | None = None) -> bytes:
        """All of the object's bytes (``open``, read to the end); for small objects."""
        ...

    def stamp(self, digest: str) -> Stamp:
        """What identifies the stored copy now, without reading it. ``ObjectMissing`` if
        nothing holds the name, ``ObjectUnreadable`` if what holds it is not an object."""
        ...

    def stamps(self, digests: Sequence[str]) -> list[Stamp | Exception]:
        """``stamp`` of each digest, in order: a Stamp, or the error its ``stamp`` raised. A
        remote backend asks for them concurrently (one round trip each, many in flight); the
        closure of a read-back is one call."""
        ...

    def reread(self, digest: str, *, keep: bool = False) -> Reread:
        """Read every byte of the stored copy again and hash it; ``keep`` returns the bytes.
        ``ObjectMissing`` if nothing holds the name, ``ObjectUnreadable`` if it cannot be read
        (never following a link, never opening anything but an object)."""
        ...

    def rereads(self, digests: Sequence[str]) -> list[Reread | Exception]:
        """``reread`` (without keeping the bytes) of each digest, in order: a Reread, or the
        error its ``reread`` raised. One call for a read-back's objects: a local store reads
        each pack's objects between one pair of fstats of it, a remote one overlaps its GETs."""
        ...

    def verify(self, digest: str) -> bool:
        """Re-hash the stored bytes; False if they do not match ``digest`` or it is missing."""
        ...

    def recorded(self) -> ObjectStore:
        """This store as a reader of what a checkpoint recorded (verify, restore): where the
        backend keeps older uploads of a name (a versioned bucket), a read of an object whose
        newest upload was deleted or overwritten is served by the newest one that hashes to
        its digest. A store that keeps one copy per digest returns itself."""
        ...

    def list_digests(self, algo: str | None = None) -> Iterator[str]:
        """Every object's digest (of ``algo`` only, if given), in no promised order; an object
        written while the listing runs may or may not be in it."""
        ...


def open_object_store(home: str) -> ObjectStore:
    """The object store the home is bound to (by default the directory ``<home>/objects``)."""
    from settled.backends import bound_backends

    url = bound_backends(home).objects
    if url.startswith("s3://"):
        from settled.objects.s3 import open_s3  # boto3 loads at its first request

        return open_s3(url)
    from settled.objects.local import LocalObjectStore  # behind the seam

    return LocalObjectStore(url.removeprefix("file://"))


def prepare_object_store(home: str, env: dict[str, str]) -> bool:
    """In a process that forks owners, before it forks them: import what the home's object
    store will need in each of them and make it ready without a request (an S3 store: boto3 and
    a client, objects/s3.py `warm_client`); a local store needs nothing. True when it did
    anything. `env`: the environment the owners will run with (the endpoint, the credentials)."""
    from settled.backends import bound_backends

    url = bound_backends(home).objects
    if not url.startswith("s3://"):
        return False
    from settled.objects.s3 import warm_client  # behind the seam, as in open_object_store

    warm_client(url, env)
    return True
