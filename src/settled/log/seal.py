"""Sealed logs: a settled stream's bytes published to the object store with its receipt.

A log in the home dies with the home. When a home's object store lives outside it (S3, or a
directory other homes share), the owner publishes each stream: content-addressed chunks of at
most `SEAL_CHUNK` bytes, then a small manifest naming them in order with the stream's length
and digest. The receipt names the manifest (`output.<stream>.sealed`), and the receipt is in the
authority store, so the chain receipt → manifest → chunks is checked by hash at every step, and
any host can serve `logs SESSION --from N` bit for bit after the home is gone.

The seal streams: one pass over the log, a chunk in memory at a time whatever the log's size,
each chunk hashed once for its name while the whole is hashed for the stream's digest (a log
changed since its writer counted it is refused, never sealed); into S3 each chunk is one PUT
straight from memory (objects/s3.py `upload_file`: no temp-file spool, no listing first), so a
small log costs one PUT and its manifest another.

Reading a sealed stream (`fetch_sealed`) rebuilds the log file in the reader's home, each chunk
streamed and checked against its name and the whole against the stream digest the owner
counted before the file appears, and then every ordinary reader (ranges, windows, follow)
serves it as it serves a local log.

Must never: seal bytes past the final cursor (the receipt's cursor bounds the seal), hold more
than a chunk of a log in memory, start a thread, or serve a byte no check covered.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any, BinaryIO, Final, Protocol, runtime_checkable

from settled.atomic import replacing
from settled.canonical import canonical_bytes
from settled.errors import SettledError
from settled.objects import CHUNK, ObjectStore, StoredObject
from settled.objects.hashing import (
    DEFAULT_ALGORITHM,
    Hasher,
    algorithm_of,
    digest_bytes,
    format_digest,
    new_hasher,
)

SEAL_CHUNK: Final = 4 << 20
MANIFEST_KIND: Final = "settled.log/1"


class SealBroken(SettledError):
    """A sealed stream did not check out: a chunk or the manifest is missing or damaged."""


@runtime_checkable
class FileUploader(Protocol):
    """An object store that stores a stream under a digest known ahead (objects/s3.py)."""

    def upload_file(self, source: BinaryIO, length: int, digest: str) -> StoredObject: ...


def seal_stream(objects: ObjectStore, path: str, length: int, digest: str) -> dict[str, Any]:
    """Publish bytes [0, length) of the log at `path`; the fact the receipt names. The bytes
    are hashed again as they are read, so a log changed since the writer counted it is refused
    instead of sealed. An empty stream needs no object: its fact says so."""
    if length == 0:
        return {"manifest": None, "chunks": 0}
    whole = new_hasher(algorithm_of(digest))  # no size hint: BLAKE3 starts no thread pool
    chunks: list[list[Any]] = []
    with open(path, "rb") as source:
        offset = 0
        while offset < length:
            data = _read(source, min(SEAL_CHUNK, length - offset))
            if not data:
                raise SealBroken(f"log {path} holds {offset} bytes, its receipt counts {length}")
            whole.update(data)
            chunks.append([offset, len(data), _store(objects, data)])
            offset += len(data)
    read = f"{algorithm_of(digest)}:{whole.hexdigest()}"
    if read != digest:
        raise SealBroken(f"log {path} hashes to {read} now, not the {digest} its writer counted")
    manifest = {"kind": MANIFEST_KIND, "length": length, "digest": digest, "chunks": chunks}
    return {"manifest": _store(objects, canonical_bytes(manifest)), "chunks": len(chunks)}


def _read(source: BinaryIO, size: int) -> bytes:
    """Up to `size` bytes (fewer only at the file's end)."""
    data = source.read(size)
    while data and len(data) < size and (more := source.read(size - len(data))):
        data += more
    return data


def _store(objects: ObjectStore, data: bytes) -> str:
    """One object, named by its digest, hashed on this thread (no size hint, so BLAKE3 starts
    no thread pool: an owner cannot always start one, and a panic there would cost the
    receipt). A store that uploads under a digest known ahead (S3) sends it as one PUT
    straight from memory; any other goes through its writer."""
    hasher = new_hasher(DEFAULT_ALGORITHM)
    hasher.update(data)
    name = format_digest(DEFAULT_ALGORITHM, hasher.hexdigest())
    if isinstance(objects, FileUploader):
        objects.upload_file(io.BytesIO(data), len(data), name)
        return name
    with objects.writer() as writer:
        writer.write(data)
        return writer.commit().digest


def fetch_sealed(objects: ObjectStore, sealed: dict[str, Any], digest: str, dest: str) -> str:
    """Rebuild the sealed stream at `dest` (once; a later call finds it) and return `dest`."""
    if os.path.exists(dest):
        return dest
    os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
    if sealed.get("manifest") is None and sealed.get("chunks") == 0:
        with replacing(dest, 0o400):
            pass  # an empty stream, sealed as empty
        return dest
    manifest = _manifest(objects, str(sealed["manifest"]), digest)
    whole = new_hasher(algorithm_of(digest))
    with replacing(dest, 0o400) as out:  # `dest` appears only once every check passed
        for offset, size, name in manifest["chunks"]:
            _copy_chunk(objects, name, offset, size, whole, out)
        rebuilt = f"{algorithm_of(digest)}:{whole.hexdigest()}"
        if rebuilt != digest:
            raise SealBroken(f"sealed log {sealed['manifest']} rebuilds to {rebuilt}, not {digest}")
    return dest


def _copy_chunk(
    objects: ObjectStore, name: str, offset: int, size: int, whole: Hasher, out: BinaryIO
) -> None:
    """Stream one chunk into `out`, CHUNK bytes at a time, checked against its name and size."""
    chunk = new_hasher(algorithm_of(name))
    got = 0
    with objects.open(name) as source:
        while data := source.read(CHUNK):
            chunk.update(data)
            whole.update(data)
            out.write(data)
            got += len(data)
    if f"{algorithm_of(name)}:{chunk.hexdigest()}" != name or got != size:
        raise SealBroken(f"chunk {name} at {offset} of a sealed log is damaged")


def _manifest(objects: ObjectStore, name: str, digest: str) -> dict[str, Any]:
    text = objects.read(name)
    if digest_bytes(algorithm_of(name), text) != name:
        raise SealBroken(f"the manifest {name} of a sealed log is damaged")
    manifest: dict[str, Any] = json.loads(text)
    if manifest.get("kind") != MANIFEST_KIND or manifest.get("digest") != digest:
        raise SealBroken(f"{name} is not the sealed log of a stream with digest {digest}")
    return manifest
