"""The settled home: where the embedded store, the logs and the objects live.

Owns the on-disk layout and the check that a home is usable before anything is recorded in it.
Resolution order: `--home`, then `SETTLED_HOME`, then `./.settled`. The home is private: the
directory and every directory in it 0700, every file 0600 or stricter, whatever the umask (a
command running as another uid reads nothing of it; one running as root never sees it, see
boundary/isolation.py). A home reached through a symlink is refused: a command that can
rewrite the link could point every later settled at a home it forged.
"""

from __future__ import annotations

import os

from settled.errors import HomeUnusable

DEFAULT_HOME = ".settled"


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
    return home


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
