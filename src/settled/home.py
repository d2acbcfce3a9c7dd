"""The settled home: where the embedded store, the logs and the objects live.

Owns the on-disk layout and the check that a home is usable before anything is recorded in it.
Resolution order: `--home`, then `SETTLED_HOME`, then `./.settled`. The home is private: the
directory and every directory in it 0700, every file 0600 or stricter, whatever the umask (a
command running as another uid reads nothing of it; one running as root never sees it, see
boundary/isolation.py). A home reached through a symlink is refused: a command that can
rewrite the link could point every later settled at a home it forged.
"""

from __future__ import annotations

import contextlib
import os
import secrets

from settled.errors import HomeUnusable, StoreMissing

DEFAULT_HOME = ".settled"
STORE_FILE = "settled.db"
HOME_ID_FILE = "home.id"  # written once; the store's meta table holds the same id


PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def resolve_home(explicit: str | None = None) -> str:
    return os.path.abspath(explicit or os.environ.get("SETTLED_HOME") or DEFAULT_HOME)


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
    path = home_id_path(home)
    temp = f"{path}.{secrets.token_hex(6)}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE)
    try:
        os.write(fd, value.encode("ascii") + b"\n")
        os.fsync(fd)
        os.close(fd)
        with contextlib.suppress(FileExistsError):
            os.link(temp, path)
    finally:
        os.unlink(temp)
    return read_home_id(home) or value


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
    store = store_path(home)
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


def run_dir(home: str) -> str:
    """The home's run directory: its one journal daemon's socket, lock, log and task states."""
    return os.path.join(home, "run")


def journal_socket(home: str) -> str:
    """Where the home's mutation journal answers every task's barriers (one daemon watches
    every open task's workspace; each request names its task, see settled.workspace.journal)."""
    return os.path.join(run_dir(home), "journal.sock")
