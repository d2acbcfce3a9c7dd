"""Canonical JSON bytes and their digests: the one encoding every digest in settled is taken over.

Sorted keys, no insignificant whitespace, UTF-8, no NaN. Never used for logs (logs are bytes).
"""

from __future__ import annotations

import hashlib
import json
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
    return "sha256:" + hashlib.sha256(data).hexdigest()
