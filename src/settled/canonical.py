"""Canonical JSON bytes and their digests: the one encoding every digest in settled is taken over.

Sorted keys, no insignificant whitespace, UTF-8, no NaN. Never used for logs (logs are bytes).
"""

from __future__ import annotations

import json

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def canonical_bytes(value: Any) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def digest_of(value: Any) -> str:
    """SHA-256 of the canonical bytes: small inputs, where SHA-NI beats BLAKE3 (FACTS.md)."""
    return digest_of_canonical(canonical_bytes(value))


def digest_of_canonical(data: bytes) -> str:
    """The same digest, of bytes already canonical (a stored fact, checked without re-encoding)."""
    hexdigest: str = _sha256(data).hexdigest()
    return "sha256:" + hexdigest


def _load_sha256() -> Callable[[bytes], Any]:
    """CPython's own SHA-256 (`_sha256` in 3.11, `_sha2` from 3.12), else hashlib's. Every
    `settled status` checks its receipts' digests, and `import hashlib` loads OpenSSL: 2 ms,
    a fifth of the interpreter's whole start. Receipts are a few KiB, where the built-in's
    ~11 us more per digest is nothing; bulk data (stdin, objects) uses hashlib or BLAKE3."""
    for name in ("_sha256", "_sha2"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        constructor: Callable[[bytes], Any] = module.sha256
        return constructor
    import hashlib

    return hashlib.sha256


_sha256 = _load_sha256()
