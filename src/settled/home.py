"""The settled home: where the embedded store, the logs and the objects live.

Owns the on-disk layout and the check that a home is usable before anything is recorded in it.
Resolution order: `--home`, then `SETTLED_HOME`, then `./.settled`. The home is private: the
directory and every directory in it 0700, every file 0600 or stricter, whatever the umask (a
command running as another uid reads nothing of it; one running as root never sees it, see
boundary/isolation.py). A home reached through a symlink is refused: a command that can
rewrite the link could point every later settled at a home it forged.

Space is budgeted here, not discovered (after PostgreSQL's and Kafka's disk guards): a home-wide
*reserve* of bytes must stay free on the home's filesystem. Below it admission refuses
(`check_reserve`, one statvfs) and owners stop storing output (`SpaceGuard`), so the reserve is
left for what must still be written: receipts, the store, recovery and the close's checkpoint.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager

from settled.errors import HomeUnusable, SettledError, SpaceExhausted, StorageFailed, StoreMissing
from settled.records import Frozen
from settled.where import ROOT_HOME as ROOT_HOME  # re-exported: where a home is
from settled.where import default_home as default_home
from settled.where import resolve_home as resolve_home
from settled.where import run_dir as run_dir

STORE_FILE = "settled.db"
HOME_ID_FILE = "home.id"  # written once; the store's meta table holds the same id


PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def _refuse_symlinks(home: str) -> None:
    path = "/"
    for part in home.strip("/").split("/"):
        path = os.path.join(path, part)
        if os.path.islink(path):
            raise HomeUnusable(
                f"settled home {home} is reached through the symlink {path} -> "
                f"{os.readlink(path)}; give the real path ({os.path.realpath(home)})"
            )


def prepare_home(home: str) -> str:
    """Create the home if missing (private); refuse one that exists but cannot be read and
    written, or that is reached through a symlink."""
    _refuse_symlinks(home)
    if os.path.exists(home) and not os.path.isdir(home):
        raise HomeUnusable(f"settled home {home} exists and is not a directory")
    try:
        for sub in ("", "sessions", "stdin", "run"):
            os.makedirs(os.path.join(home, sub), mode=PRIVATE_DIR, exist_ok=True)
        if os.stat(home).st_mode & 0o077 and os.stat(home).st_uid == os.geteuid():
            os.chmod(home, PRIVATE_DIR)  # a home made by an older settled, or by hand
    except OSError as exc:
        typed = storage_error(exc, os.path.dirname(home) or home, "creating the settled home")
        if typed is not None:  # a full or failing disk, not a home the user must fix
            raise typed from exc
        raise HomeUnusable(f"cannot create settled home {home}: {exc.strerror}") from exc
    if not os.access(home, os.R_OK | os.W_OK | os.X_OK):
        raise HomeUnusable(f"settled home {home} is not readable and writable by this user")
    check_store_present(home)
    return home


# -- the home's identity ---------------------------------------------------------------------
# A home is one store with its logs and objects. Its id lives twice: in home.id and in the
# store's meta table (store/sqlite.py writes both, the store first). A store that is missing
# while the rest remains, or a store whose id is another home's, is refused by name.


def store_path(home: str) -> str:
    return os.path.join(home, STORE_FILE)


def home_id_path(home: str) -> str:
    return os.path.join(home, HOME_ID_FILE)


def read_home_id(home: str) -> str | None:
    """The id in home.id, or None when there is none (a fresh home, or one an older settled
    made)."""
    try:
        with open(home_id_path(home), encoding="ascii") as handle:
            return handle.read().strip() or None
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise HomeUnusable(f"{home_id_path(home)} cannot be read: {exc}") from exc


def write_home_id_once(home: str, value: str) -> str:
    """Create home.id holding `value` unless it exists: a link never replaces a name, so two
    first openers agree on one id. Returns the id the file holds."""
    from settled.atomic import create_once

    create_once(home_id_path(home), value.encode("ascii") + b"\n", PRIVATE_FILE)
    return read_home_id(home) or value


def ensure_home_id(home: str) -> str:
    """The home's id, made now when its store does not make it (a store shared by many homes,
    where each home is a host)."""
    from settled.identity import new_id

    return read_home_id(home) or write_home_id_once(home, new_id("h"))


def _remains(home: str) -> dict[str, int]:
    """What a home holds besides its store: the identity file, session logs, objects."""
    sessions = os.path.join(home, "sessions")
    objects = os.path.join(home, "objects")
    return {
        "session log directories": len(os.listdir(sessions)) if os.path.isdir(sessions) else 0,
        "objects": sum(len(files) for _dir, _dirs, files in os.walk(objects)),
        HOME_ID_FILE: int(os.path.exists(home_id_path(home))),
    }


def check_store_present(home: str) -> None:
    """StoreMissing when the store file is gone but anything it accounted for remains; a home
    with nothing in it is simply new. The store file is made before home.id, so a first
    opener racing this check is told apart by looking at the store again."""
    from settled.backends import read_binding

    binding = read_binding(home)
    if binding is not None and binding.store_scheme != "sqlite":
        return  # the store lives elsewhere, and the binding names it
    store = binding.store.removeprefix("sqlite://") if binding else store_path(home)
    if os.path.exists(store):
        return
    remains = _remains(home)
    if any(remains.values()) and not os.path.exists(store):
        raise StoreMissing(home, store, remains)


def private_file(path: str) -> str:
    """Create `path` empty and 0600 if it does not exist, or take group and other bits off one
    an older settled made (SQLite gives its -wal and -shm files the mode of the database
    file), so no umask makes it readable by others."""
    # Never open an existing database file here: closing any descriptor of it drops every POSIX
    # lock this process holds on it, and another connection of this process may hold one.
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE))
    except FileExistsError:
        if os.stat(path).st_mode & 0o077:
            os.chmod(path, PRIVATE_FILE)
    return path


def make_session_dir(home: str, session: str) -> str:
    directory = session_dir(home, session)
    os.makedirs(directory, mode=PRIVATE_DIR, exist_ok=True)
    return directory


def session_dir(home: str, session: str) -> str:
    return os.path.join(home, "sessions", session)


def log_path(home: str, session: str, stream: str) -> str:
    if stream not in ("stdout", "stderr"):
        raise ValueError(f"stream {stream!r} is not stdout or stderr")
    return os.path.join(session_dir(home, session), f"{stream}.log")


def stdin_path(home: str, digest: str) -> str:
    return os.path.join(home, "stdin", digest.replace(":", "-"))


def journal_socket(home: str) -> str:
    """Where the home's mutation journal answers every task's barriers (one daemon watches
    every open task's workspace; each request names its task, see settled.workspace.journal)."""
    return os.path.join(run_dir(home), "journal.sock")


def last_words_path(home: str, session: str) -> str:
    """Where the session's owner leaves the reason it could not write its receipt (owner/)."""
    return os.path.join(session_dir(home, session), "last_words")


# -- the reserve ---------------------------------------------------------------------------

RESERVE_ENV = "SETTLED_RESERVE_BYTES"
RESERVE_FLOOR = 64 << 20  # the default is max(64 MiB, 2% of the filesystem) ...
RESERVE_FRACTION = 0.02
RESERVE_CEILING = 4  # ... but never more than a quarter of it, so a small home still works
RESERVE_MAX = 1 << 50  # the override's bound: 1 PiB
SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
STORAGE_ERRNOS = SPACE_ERRNOS | {errno.EIO, errno.EROFS}


class Space(Frozen):
    """One statvfs of the home's filesystem, with the reserve that applies to it."""

    __slots__ = ("free", "path", "reserve", "total")
    path: str
    free: int  # bytes available to this user (f_bavail)
    total: int
    reserve: int

    def __init__(self, path: str, free: int, total: int, reserve: int) -> None:
        self._fill(locals())

    @property
    def spare(self) -> int:
        """Bytes that may still be used before the reserve is reached (negative below it)."""
        return self.free - self.reserve


def reserve_bytes(total: int) -> int:
    """The reserve for a filesystem of `total` bytes: SETTLED_RESERVE_BYTES (ASCII digits, at
    most RESERVE_MAX) or max(64 MiB, 2% of it), capped at a quarter of it."""
    text = os.environ.get(RESERVE_ENV)
    if text is not None and text != "":
        if not (text.isascii() and text.isdigit()) or int(text) > RESERVE_MAX:
            raise HomeUnusable(
                f"{RESERVE_ENV}={text!r} is not a number of bytes from 0 to {RESERVE_MAX}"
            )
        return int(text)
    return min(max(RESERVE_FLOOR, int(total * RESERVE_FRACTION)), total // RESERVE_CEILING)


def space_of(path: str) -> Space:
    """The free space and reserve of the filesystem holding `path` (one statvfs)."""
    st = os.statvfs(path)
    total = st.f_blocks * st.f_frsize
    return Space(path, st.f_bavail * st.f_frsize, total, reserve_bytes(total))


def check_reserve(home: str, what: str) -> Space:
    """Refuse `what` (SpaceExhausted) when the home's filesystem is below its reserve."""
    space = space_of(home)
    if space.spare < 0:
        raise SpaceExhausted(
            f"{what} refused: the filesystem of {home} has {space.free} bytes free, below the "
            f"reserve of {space.reserve} bytes; free space there (or lower {RESERVE_ENV})",
            home,
            space.free,
            space.reserve,
        )
    return space


def storage_error(exc: OSError, home: str, what: str) -> StorageFailed | None:
    """The typed error for an OSError of the home's filesystem (no space, EIO, read-only), or
    None for any other OSError (which stays what it is)."""
    if exc.errno not in STORAGE_ERRNOS:
        return None
    where = f"{exc.filename} on the filesystem of {home}" if exc.filename else home
    if exc.errno in SPACE_ERRNOS:
        try:
            space: Space | None = space_of(home)
        except (OSError, HomeUnusable):
            space = None
        free = space.free if space else None
        reserve = space.reserve if space else None
        return SpaceExhausted(
            f"{what} failed: {exc.strerror or 'no space left'} on {where} ({free} bytes free, "
            f"reserve {reserve} bytes); free space there and retry",
            home,
            free,
            reserve,
        )
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return StorageFailed(f"{what} failed: {exc.strerror} ({name}) on {where}", home, name)


@contextmanager
def storage_errors(home: str, what: str) -> Iterator[None]:
    """Turn an OSError of the home's filesystem raised inside (or a settled error caused by
    one) into its typed error: one line naming the disk for every face, never a traceback."""
    try:
        yield
    except StorageFailed:
        raise
    except OSError as exc:
        typed = storage_error(exc, home, what)
        if typed is None:
            raise
        raise typed from exc
    except SettledError as exc:  # one that wraps the disk's refusal (a DurabilityError)
        cause = exc.__cause__
        typed = storage_error(cause, home, what) if isinstance(cause, OSError) else None
        if typed is None:
            raise
        raise typed from exc


class SpaceGuard:
    """How many of the next bytes of output an owner may store and leave the reserve free.

    Shared by a session's two stream writers. It looks (statvfs) when its allowance from the
    last look is used up and at least every `recheck_every` bytes, so other writers on the
    filesystem move it too, and a silent or slow stream costs nothing. Once it refused it
    refuses for good: a log is a prefix of the output, never a prefix with a hole in it."""

    def __init__(self, path: str, recheck_every: int = 1 << 20) -> None:
        self.path = path
        self.refused: str | None = None
        self._recheck_every = recheck_every
        self._allowance = 0
        self._since_look = 0
        self._why = ""

    def room(self, size: int) -> int:
        """How many of `size` bytes may be stored (all, some, or none)."""
        if self.refused is not None:
            return 0
        if size > self._allowance or self._since_look >= self._recheck_every:
            self._look()
        granted = max(0, min(size, self._allowance))
        if granted < size and self.refused is None:
            self.refused = self._why
        self._allowance -= granted
        self._since_look += granted
        return granted

    def _look(self) -> None:
        try:
            space = space_of(self.path)
        except (OSError, HomeUnusable) as exc:
            self._allowance, self._why = 0, f"the free space of {self.path} is unknown: {exc}"
            return
        self._allowance, self._since_look = space.spare, 0
        self._why = (
            f"reserve reached: {space.free} bytes free on the filesystem of {self.path}, "
            f"reserve {space.reserve} bytes"
        )
