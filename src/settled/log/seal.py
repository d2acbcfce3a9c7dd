"""Sealed logs: a settled stream's bytes published to the object store with its receipt.

A log in the home dies with the home. When a home's object store lives outside it (S3, or a
directory other homes share), the owner publishes each stream before it writes the receipt:
content-addressed chunks of at most `SEAL_CHUNK` bytes, then a small manifest naming them in
order with the stream's length and digest. The receipt names the manifest (`output.<stream>.
sealed`), and the receipt is in the authority store, so the chain receipt → manifest → chunks is
checked by hash at every step, and any host can serve `logs SESSION --from N` bit for bit after
the home is gone.

Reading a sealed stream (`fetch_sealed`) rebuilds the log file in the reader's home, each chunk
checked against its name and the whole against the stream digest the owner counted, and then
every ordinary reader (ranges, windows, follow) serves it as it serves a local log.

Must never: seal bytes past the final cursor (the receipt's cursor bounds the seal), or serve a
byte no check covered.
"""

from __future__ import annotations

import json
import os
from typing import Any, Final

from settled.atomic import replacing
from settled.canonical import canonical_bytes
from settled.errors import SettledError
from settled.objects import ObjectStore
from settled.objects.hashing import algorithm_of, digest_bytes, new_hasher

SEAL_CHUNK: Final = 4 << 20
MANIFEST_KIND: Final = "settled.log/1"


class SealBroken(SettledError):
    """A sealed stream did not check out: a chunk or the manifest is missing or damaged."""


def seal_stream(objects: ObjectStore, path: str, length: int, digest: str) -> dict[str, Any]:
    """Publish bytes [0, length) of the log at `path`; the fact the receipt names. The bytes
    are hashed again as they are read, so a log changed since the writer counted it is refused
    instead of sealed. An empty stream needs no object: its fact says so."""
    if length == 0:
        return {"manifest": None, "chunks": 0}
    hasher = new_hasher(algorithm_of(digest))
    chunks: list[list[Any]] = []
    with open(path, "rb") as source:
        offset = 0
        while offset < length:
            data = source.read(min(SEAL_CHUNK, length - offset))
            if not data:
                raise SealBroken(f"log {path} holds {offset} bytes, its receipt counts {length}")
            hasher.update(data)
            chunks.append([offset, len(data), _put(objects, data)])
            offset += len(data)
    read = f"{algorithm_of(digest)}:{hasher.hexdigest()}"
    if read != digest:
        raise SealBroken(f"log {path} hashes to {read} now, not the {digest} its writer counted")
    manifest = {"kind": MANIFEST_KIND, "length": length, "digest": digest, "chunks": chunks}
    return {"manifest": _put(objects, canonical_bytes(manifest)), "chunks": len(chunks)}


def _put(objects: ObjectStore, data: bytes) -> str:
    """One object, hashed on this thread: no size hint, so BLAKE3 starts no thread pool (an
    owner cannot always start one: a panic there would cost the receipt)."""
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
    hasher = new_hasher(algorithm_of(digest))
    with replacing(dest, 0o400) as out:
        for offset, size, name in manifest["chunks"]:
            data = objects.read(name)
            if digest_bytes(algorithm_of(name), data) != name or len(data) != size:
                raise SealBroken(f"chunk {name} at {offset} of a sealed log is damaged")
            hasher.update(data)
            out.write(data)
        whole = f"{algorithm_of(digest)}:{hasher.hexdigest()}"
        if whole != digest:
            raise SealBroken(f"sealed log {sealed['manifest']} rebuilds to {whole}, not {digest}")
    return dest


def _manifest(objects: ObjectStore, name: str, digest: str) -> dict[str, Any]:
    text = objects.read(name)
    if digest_bytes(algorithm_of(name), text) != name:
        raise SealBroken(f"the manifest {name} of a sealed log is damaged")
    manifest: dict[str, Any] = json.loads(text)
    if manifest.get("kind") != MANIFEST_KIND or manifest.get("digest") != digest:
        raise SealBroken(f"{name} is not the sealed log of a stream with digest {digest}")
    return manifest
