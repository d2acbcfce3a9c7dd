"""The one way settled replaces a file: a reader sees the old bytes or all of the new, never half.

Temporary file in the same directory (a rename never crosses filesystems), write, fsync, fchmod,
rename over the name, fsync of the directory (so the new name survives a power cut as well as a
crash). The content-addressed object store does not use this: its puts are create-only links
that never replace a name, which is a different promise.

Standard library only: the journal daemon and the owner import it on their start-up paths.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import BinaryIO


def fsync_dir(path: str) -> None:
    """Make the directory's entries (a rename, a new name) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_once(path: str, data: bytes, mode: int = 0o600) -> bool:
    """Create `path` holding `data` unless the name exists: written and fsynced under a
    temporary name, then linked, and a link never replaces a name, so two first writers agree
    on one content. Returns whether this call created it."""
    temp = f"{path}.{os.urandom(6).hex()}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        try:
            os.link(temp, path)
        except FileExistsError:
            return False
    finally:
        os.unlink(temp)
    fsync_dir(os.path.dirname(path) or ".")
    return True


@contextlib.contextmanager
def replacing(path: str, mode: int = 0o600) -> Iterator[BinaryIO]:
    """Yield a handle whose bytes replace `path` when the block ends without an exception;
    on an exception the temporary file is removed and `path` is untouched."""
    directory = os.path.dirname(path) or "."
    temp = os.path.join(directory, f".{os.path.basename(path)}.{os.urandom(6).hex()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    fsync_dir(directory)


def write_atomic(path: str, data: bytes, mode: int = 0o600) -> None:
    with replacing(path, mode) as handle:
        handle.write(data)
