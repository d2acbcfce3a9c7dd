"""The settled home: where the embedded store, the logs and the objects live.

Owns the on-disk layout and the check that a home is usable before anything is recorded in it.
Resolution order: `--home`, then `SETTLED_HOME`, then `./.settled`.
"""

from __future__ import annotations

import os

from settled.errors import HomeUnusable

DEFAULT_HOME = ".settled"


def resolve_home(explicit: str | None = None) -> str:
    return os.path.abspath(explicit or os.environ.get("SETTLED_HOME") or DEFAULT_HOME)


def prepare_home(home: str) -> str:
    """Create the home if missing; refuse one that exists but cannot be read and written."""
    if os.path.exists(home) and not os.path.isdir(home):
        raise HomeUnusable(f"settled home {home} exists and is not a directory")
    try:
        os.makedirs(os.path.join(home, "sessions"), exist_ok=True)
        os.makedirs(os.path.join(home, "stdin"), exist_ok=True)
    except OSError as exc:
        raise HomeUnusable(f"cannot create settled home {home}: {exc.strerror}") from exc
    if not os.access(home, os.R_OK | os.W_OK | os.X_OK):
        raise HomeUnusable(f"settled home {home} is not readable and writable by this user")
    return home


def session_dir(home: str, session: str) -> str:
    return os.path.join(home, "sessions", session)


def log_path(home: str, session: str, stream: str) -> str:
    if stream not in ("stdout", "stderr"):
        raise ValueError(f"stream {stream!r} is not stdout or stderr")
    return os.path.join(session_dir(home, session), f"{stream}.log")


def stdin_path(home: str, digest: str) -> str:
    return os.path.join(home, "stdin", digest.replace(":", "-"))


def journal_socket(home: str, task: str) -> str:
    """Where the task's mutation journal answers barriers (see settled.workspace.journal)."""
    return os.path.join(home, "run", task, "journal.sock")
