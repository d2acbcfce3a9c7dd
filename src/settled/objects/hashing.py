"""Content digests of the workspace layer: ``"<algo>:<hex>"`` strings, hashers and their parsing.

Owns the algorithm names, the digest string format, its validation (a digest is also a path in
the object store, so nothing but ``<known algo>:<64 lowercase hex>`` is ever accepted) and the
choice of ``DEFAULT_ALGORITHM``. Must never: mix algorithms inside one manifest, accept a digest
string it cannot parse, or do I/O.

Measured here once (Linux 6.18, 2 vCPU with SHA-NI and AVX-512, Python 3.11.7, blake3 1.0.11;
best of 5, input in memory, fed in 1 MiB updates; wall time per input):

    input     SHA-256 (hashlib, SHA-NI)   BLAKE3 (1 thread)       BLAKE3 (max_threads=AUTO)
    1 KiB       1.5 us  0.68 GB/s           2.1 us  0.48 GB/s       1.8 us  0.58 GB/s
    16 KiB     10.3 us  1.59 GB/s           4.0 us  4.13 GB/s       3.6 us  4.58 GB/s
    100 KiB    58.3 us  1.76 GB/s          18.1 us  5.67 GB/s      30.5 us  3.36 GB/s
    1 MiB       582 us  1.80 GB/s           163 us  6.42 GB/s        92 us 11.4 GB/s
    64 MiB     37.5 ms  1.79 GB/s          14.7 ms  4.56 GB/s       8.9 ms  7.52 GB/s

Choice: BLAKE3 for every manifest. SHA-256 wins only below ~4 KiB, and there by 0.6 us per
file, while opening, reading and hashing a cached 1 KiB file costs ~7 us with either algorithm
(6.7 us SHA-256, 7.4 us BLAKE3): per-file system calls dominate small files. A typical workspace
(sources plus build outputs, wheels, datasets, .git packs) spends its hashing time in the large
files, where BLAKE3 is 3.5-6x faster. So one algorithm per manifest, BLAKE3, and SHA-256 stays
available (a manifest records its algorithm; a store can hold both). Hashers for inputs known to
be at least 1 MiB use BLAKE3's multi-threaded mode (the second core); below that the thread
hand-off costs more than it saves (100 KiB: 30 us vs 18 us).
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Final, Protocol

import blake3

from settled import nothreads
from settled.errors import SettledError

BLAKE3: Final = "blake3"
SHA256: Final = "sha256"
ALGORITHMS: Final = (BLAKE3, SHA256)
DEFAULT_ALGORITHM: Final = BLAKE3
HEX_LENGTH: Final = 64  # both algorithms produce 32-byte digests
THREADED_FROM_BYTES: Final = 1 << 20

_DIGEST: Final = re.compile(r"(blake3|sha256):([0-9a-f]{64})")

Buffer = bytes | bytearray | memoryview


class UnknownAlgorithm(SettledError):
    def __init__(self, algo: str) -> None:
        super().__init__(
            f"unknown digest algorithm {algo!r}: expected one of {', '.join(ALGORITHMS)}"
        )
        self.algo = algo


class BadDigest(SettledError):
    def __init__(self, digest: object, reason: str) -> None:
        super().__init__(f"bad digest {digest!r}: {reason}; expected '<algo>:<64 lowercase hex>'")
        self.digest = digest


class Hasher(Protocol):
    """The part of hashlib's and blake3's hasher interface this layer uses."""

    def update(self, data: Buffer, /) -> object: ...

    def hexdigest(self) -> str: ...


def check_algorithm(algo: str) -> str:
    if algo not in ALGORITHMS:
        raise UnknownAlgorithm(algo)
    return algo


def new_hasher(algo: str = DEFAULT_ALGORITHM, *, size_hint: int | None = None) -> Hasher:
    """A fresh hasher for ``algo``; ``size_hint`` (bytes expected) may enable BLAKE3 threads."""
    check_algorithm(algo)
    if algo == SHA256:
        return hashlib.sha256()
    threaded = size_hint is not None and size_hint >= THREADED_FROM_BYTES and threads_can_start()
    return blake3.blake3(max_threads=blake3.blake3.AUTO if threaded else 1)


def threads_can_start() -> bool:
    """False in a process that made a PID namespace for its children (an owner, once its
    boundary exists): the kernel refuses CLONE_THREAD there (EINVAL), and BLAKE3's thread pool
    would panic instead of hashing; and in an owner whose command runs (settled.nothreads: it
    starts no thread after its command). Two readlinks, asked only for large inputs."""
    if nothreads.refused() is not None:
        return False
    try:
        return os.readlink("/proc/self/ns/pid") == os.readlink("/proc/self/ns/pid_for_children")
    except OSError:
        return True  # no /proc to ask: nothing here unshares without one


def format_digest(algo: str, hexdigest: str) -> str:
    return f"{check_algorithm(algo)}:{hexdigest}"


def digest_bytes(algo: str, data: Buffer) -> str:
    """``"<algo>:<hex>"`` of ``data``."""
    hasher = new_hasher(algo, size_hint=len(data))
    hasher.update(data)
    return format_digest(algo, hasher.hexdigest())


def parse_digest(digest: object) -> tuple[str, str]:
    """``"blake3:ab12..."`` -> ``("blake3", "ab12...")``, refusing anything else."""
    match = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if match is not None:
        return match[1], match[2]
    if not isinstance(digest, str):
        raise BadDigest(digest, "not a string")
    algo, sep, _ = digest.partition(":")
    if not sep:
        raise BadDigest(digest, "no ':' between algorithm and hex")
    if algo not in ALGORITHMS:
        raise BadDigest(digest, f"unknown algorithm {algo!r}")
    raise BadDigest(digest, f"hex part is not {HEX_LENGTH} lowercase hex characters")


def algorithm_of(digest: str) -> str:
    return parse_digest(digest)[0]
