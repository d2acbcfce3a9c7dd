"""A harness's file reads and writes as commands inside a task's boundary, and their answers.

Owns: what the adapters that read and write files for a harness (the Inspect sandbox, `settled
serve --swerex`) run to do it: a read is `head -c` of the path, a write is `cat` of stdin into
it (its parents made), an upload of a directory is `tar -x` of stdin into it; each a command of
the task, so it reaches exactly what the task's commands reach, and a path means what it means
to them (a symlink a command left is followed inside its view, never on the host). The
scripts' own answers (a path absent, a directory, not a directory) are a marker line on stderr
with exit 0, never text of the file; `raise_for` turns an answer or a refusal into Python's own
error (FileNotFoundError, IsADirectoryError, NotADirectoryError, FileExistsError,
PermissionError, TimeoutError, else OSError), and `answer` refuses too a read whose bytes the
home did not store whole. `zip_as_tar` turns a zipped directory (SWE-ReX's upload) into the tar
the unpack script reads, in memory.

Must never: open, resolve or stat a path of the request on the host; take a marker from a
stream the file's bytes are on; read more of a file than its limit and one byte; let an
archive member name a place outside its target.
"""

from __future__ import annotations

import errno
import io
import os
import posixpath
import tarfile
import zipfile
from dataclasses import dataclass
from typing import Any

from settled.integrations._steps import StepResult

# The scripts' PATH is fixed in them (in their digests), whatever the caller's environment.
_SAY = 'echo "settled-file: %s" >&2; exit 0'
ABSENT, DIRECTORY, NOT_DIRECTORY = (
    f"settled-file: {word}\n".encode() for word in ("absent", "directory", "not a directory")
)
READ_SCRIPT = (
    f'PATH=/usr/bin:/bin; if [ ! -e "$1" ]; then {_SAY % "absent"}; '
    f'elif [ -d "$1" ]; then {_SAY % "directory"}; fi; exec head -c "$2" -- "$1"'
)
WRITE_SCRIPT = (
    f'PATH=/usr/bin:/bin; if [ -d "$1" ]; then {_SAY % "directory"}; fi; '
    'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
)
UNPACK_SCRIPT = (
    f'PATH=/usr/bin:/bin; if [ -e "$1" ] && [ ! -d "$1" ]; then {_SAY % "not a directory"}; '
    'fi; mkdir -p -- "$1" && exec tar -x -f - -C "$1" --no-same-owner'
)


@dataclass(frozen=True)
class FileOp:
    """One file operation as a command: its argv and the bytes it reads on stdin."""

    argv: list[str]
    stdin: bytes | None = None


def read_op(path: str, limit: int) -> FileOp:
    """Read `path`: its bytes on stdout, at most `limit` and one more (so the caller can tell
    a file over its limit from one at it, without reading the rest)."""
    named = "./-" if path == "-" else path  # head reads its stdin for `-`, even after --
    return FileOp(["/bin/sh", "-c", READ_SCRIPT, "sh", named, str(limit + 1)])


def write_op(path: str, data: bytes) -> FileOp:
    """Write `data` to `path`, its parent directories made."""
    return FileOp(["/bin/sh", "-c", WRITE_SCRIPT, "sh", path], data)


def unpack_op(directory: str, tar: bytes) -> FileOp:
    """Unpack the tar `tar` into `directory` (made with its parents), owned by the command."""
    return FileOp(["/bin/sh", "-c", UNPACK_SCRIPT, "sh", directory], tar)


def raise_for(code: int | None, stderr: bytes, timed_out: bool, path: str) -> None:
    """The script's answer or refusal as Python's own error; nothing when it did its work."""
    if timed_out:
        raise TimeoutError(f"{path}: the file operation did not end within its timeout")
    if code == 0:
        for marker, number in ((ABSENT, errno.ENOENT), (DIRECTORY, errno.EISDIR)):
            if stderr == marker:
                raise _error(number, path)
        if stderr == NOT_DIRECTORY:
            raise _error(errno.ENOTDIR, path)
        return
    reason = stderr.decode("utf-8", errors="replace").strip() or f"exit {code}"
    if "ermission denied" in reason or "ead-only file system" in reason:
        raise PermissionError(errno.EACCES, reason, path)
    if "o such file or directory" in reason or "irectory nonexistent" in reason:  # sh's words
        raise FileNotFoundError(errno.ENOENT, reason, path)
    if "ot a directory" in reason:  # a parent of the path is a file
        raise NotADirectoryError(errno.ENOTDIR, reason, path)
    if "ile exists" in reason:  # mkdir of a parent that is a file, as Path.mkdir says it
        raise FileExistsError(errno.EEXIST, reason, path)
    raise OSError(f"{path}: {reason}")


def answer(result: StepResult, path: str) -> bytes:
    """What the operation's command printed (a read's bytes), once its answer is no error and
    its output was stored whole (a home's log cap never passes for the file's end)."""
    raise_for(result.code, result.stderr, result.timed_out, path)
    lost = _lost(result.receipt, "stdout")
    if lost:
        raise OSError(f"{path}: {lost} bytes of the file were not stored (the home's log cap)")
    return result.stdout


def _lost(receipt: dict[str, Any], stream: str) -> int:
    fact = (receipt.get("output") or {}).get(stream) or {}
    return int(fact.get("not_stored") or 0) + int(fact.get("dropped") or 0)


def _error(number: int, path: str) -> OSError:
    """OSError(number, ...) is the subclass of that errno (FileNotFoundError for ENOENT)."""
    return OSError(number, os.strerror(number), path)


class ArchiveRefused(ValueError):
    """A zipped directory that is not unpacked: a member outside its target, or too large."""


def zip_as_tar(data: bytes, target: str, limit: int) -> bytes:
    """The zip's directories and files as a tar (what `unpack_op` reads), each member's unix
    mode kept (else 0644; a link stored in the zip becomes a file holding its target, as
    zipfile's extractall makes it). Refused: a member whose name leaves the target (absolute,
    or `..` after normalizing), or more than `limit` bytes in all once unzipped."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as archive, tarfile.open(fileobj=out, mode="w") as tar:
        members = archive.infolist()
        total = sum(member.file_size for member in members)
        if total > limit:
            raise ArchiveRefused(
                f"the zip unpacks to {total} bytes, over the limit of {limit} bytes"
            )
        for member in members:
            name = _inside(member.filename, target)
            if name is None:
                continue
            entry = tarfile.TarInfo(name)
            default = 0o755 if member.is_dir() else 0o644
            entry.mode = (member.external_attr >> 16) & 0o777 or default
            if member.is_dir():
                entry.type = tarfile.DIRTYPE
                tar.addfile(entry)
                continue
            content = archive.read(member)  # its CRC checked; never more than it declared
            entry.size = len(content)
            tar.addfile(entry, io.BytesIO(content))
    return out.getvalue()


def _inside(name: str, target: str) -> str | None:
    """The member's name below the target, None for the target itself; refused if outside."""
    normal = posixpath.normpath(name)  # a backslash is a character of a name here, as in zipfile
    if normal.startswith("/") or normal == ".." or normal.startswith("../"):
        raise ArchiveRefused(f"zip member {name!r} escapes {target}")
    return None if normal == "." else normal
