"""Canonical JSON bytes and their digests: the one encoding every digest in settled is taken over.

Sorted keys, no insignificant whitespace, UTF-8, no NaN. Never used for logs (logs are bytes).

Names that are not UTF-8. A path is kept as the ``str`` ``os.fsdecode`` makes of its bytes: each
byte that is not part of valid UTF-8 becomes a lone surrogate U+DC80..U+DCFF (``os.fsencode``
gives the byte back). UTF-8 cannot encode a surrogate, so ``utf8_json`` writes each one as its
JSON escape ``\\udcXX`` (ASCII), which ``json.loads`` reads back as the same surrogate; every other
character is written as before, so bytes without a surrogate are unchanged (and so every id
taken over them). One value, one encoding: a high surrogate (U+D800..U+DBFF) is refused, since
no name decodes to one and, escaped before a low one, it would read back as another character.
"""

from __future__ import annotations

import json
import re

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def canonical_bytes(value: Any) -> bytes:
    text = json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )
    return utf8_json(text)


def utf8_json(text: str) -> bytes:
    """JSON text (``ensure_ascii=False``) as bytes: UTF-8, each lone surrogate escaped
    (``\\udcXX``); ``ValueError`` for a high surrogate. Text without a surrogate costs one
    strict encode, as before."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        found = _HIGH_SURROGATE.search(text)
        if found is not None:
            raise ValueError(
                f"a string holds the high surrogate {found.group()!r} (U+D800..U+DBFF), "
                "which no name decodes to and JSON cannot write alone"
            ) from None
        return text.encode("utf-8", "backslashreplace")


_HIGH_SURROGATE = re.compile("[\ud800-\udbff]")


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
