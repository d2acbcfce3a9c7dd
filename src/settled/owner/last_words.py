"""An owner's last words: why it could not write its receipt, where recovery will look.

Owns the small file ``sessions/<s>/last_words``: created and fallocated before the command runs,
so that writing it later needs no new block of a filesystem that may be full by then (fsynced
once the command runs: the allocation is what matters, and it is the fallocate's); written at
most once, in place (pwrite at offset 0, then fsync), as one JSON object padded with NUL bytes.
Recovery and status read it for a session whose owner is gone without a receipt, and the
`unknown` state then carries that reason.

Must never: grow the file (a reason that does not fit is shortened), raise from `record` (an
owner that cannot say why it failed still exits), or be taken for a receipt (it proves nothing;
only the boundary's evidence ends an unknown session). Standard library only: the owner runs
under ``python -I -S``, and creates this on its launch path, so json loads only to speak.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

SIZE = 4096  # one block: fallocated at claim, so a full disk cannot refuse the last words
REASON_LIMIT = 3000  # characters of reason kept; the rest of the block is the JSON around it


class LastWords:
    """The owner's open, preallocated last-words file."""

    def __init__(self, path: str) -> None:
        """Create and preallocate the file; OSError (no space for even this) to the caller."""
        self.path = path
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        self._fd = os.open(path, flags, 0o600)
        try:
            os.posix_fallocate(self._fd, 0, SIZE)
        except BaseException:
            os.close(self._fd)
            try:  # noqa: SIM105 - contextlib stays off the owner's launch path
                os.unlink(path)
            except OSError:
                pass
            raise
        self.said: str | None = None

    def sync(self) -> None:
        """fsync the reserved block (after the command started: off the launch path). A
        failure is ignored: `record` fsyncs what it writes, and says whether it could."""
        if self._fd >= 0 and self.said is None:
            try:  # noqa: SIM105 - contextlib stays off the owner's launch path
                os.fsync(self._fd)
            except OSError:
                pass

    def record(self, reason: str, **facts: Any) -> bool:
        """Write `reason` (and small `facts`) into the preallocated block; whether it is on disk.
        Only the first call writes: the first failure is the one that explains the rest."""
        if self.said is not None or self._fd < 0:
            return False
        self.said = reason
        data = _encode(reason, facts)
        try:
            os.pwrite(self._fd, data.ljust(SIZE, b"\0"), 0)
            os.fsync(self._fd)
        except OSError:
            return False
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _encode(reason: str, facts: dict[str, Any]) -> bytes:
    """The JSON of the last words, the reason shortened until it fits the block."""
    import json
    import time

    keep = REASON_LIMIT
    while True:
        body = {"reason": reason[:keep], "at": round(time.time(), 6), **facts}
        data = json.dumps(body, sort_keys=True, default=str).encode()
        if len(data) < SIZE or keep == 0:
            return data[: SIZE - 1]
        keep //= 2


def read_last_words(path: str) -> dict[str, Any] | None:
    """The recorded last words, or None (no file, nothing said, or not readable as said)."""
    import json

    try:
        with open(path, "rb") as handle:
            data = handle.read(SIZE).split(b"\0", 1)[0]
    except OSError:
        return None
    if not data:
        return None
    try:
        words = json.loads(data)
    except ValueError:
        return {"reason": f"unreadable last words ({len(data)} bytes)"}
    return words if isinstance(words, dict) and isinstance(words.get("reason"), str) else None
