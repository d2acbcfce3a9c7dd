"""The key of `settled serve --swerex`: the one given, or one made now, written 0600, said where.

Owns: choosing the service's X-API-Key, so that it never runs without one. In order:
`--api-key-file FILE` when FILE exists (its content, stripped; an empty file is refused), else
`SETTLED_SWEREX_API_KEY` (removed from this process's environment either way, so no command
inherits it). With neither, a key is made: 32 random bytes from the kernel, as 64 hex digits,
written to a new file of mode 0600, and its path (never the key) is printed, as Jupyter prints
where its token is. The file is `--api-key-file FILE` when that names a file that does not exist
yet (kept when the service ends: the next start with the same option reads the same key), else
`<home>/run/swerex-<pid>.key` (in the home's run directory, 0700 and hidden from every
isolated command; removed when the service ends, as the key dies with it).

Must never: take a key from argv (other processes read it in /proc), print a key, replace an
existing file, leave a key file half-written or readable by another uid, or serve with an
empty key.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from settled.errors import BadInput

KEY_ENV = "SETTLED_SWEREX_API_KEY"
KEY_BYTES = 32


def choose_key(
    run: str, key_file: str | None, environ: MutableMapping[str, str]
) -> tuple[str, str | None, bool]:
    """(key, the file made for it or None, whether that file is the service's to remove)."""
    from_env = (environ.pop(KEY_ENV, None) or "").strip()
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as handle:
                key = handle.read().strip()
        except FileNotFoundError:
            return _made(key_file), key_file, False
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise BadInput(f"--api-key-file {key_file!r}: {why}") from exc
        if not key:
            raise BadInput(
                f"--api-key-file {key_file!r} is empty: put a key in it, or name a file that "
                "does not exist yet and the service makes one there"
            )
        return key, None, False
    if from_env:
        return from_env, None, False
    os.makedirs(run, mode=0o700, exist_ok=True)
    path = os.path.join(run, f"swerex-{os.getpid()}.key")
    return _made(path), path, True


def where_said(key_file: str | None, made: str | None) -> str:
    """Where the key is, as the service says it at start: a path or a variable, never the key."""
    if made is not None:
        return (f"no key was given: made one in {made} (mode 0600); send its content as "
                "X-API-Key (SWE-ReX's auth_token)")  # fmt: skip
    if key_file is not None:
        return f"key: the content of {key_file}, sent as X-API-Key (SWE-ReX's auth_token)"
    return f"key: from {KEY_ENV}, removed from this process's environment before serving"


def _made(path: str) -> str:
    """A new key, written to `path` (which must not exist) whole or not at all: under a
    temporary name, fsynced, mode set to 0600 whatever the umask, then linked (a link never
    replaces a name)."""
    key = os.urandom(KEY_BYTES).hex()
    directory = os.path.dirname(os.path.abspath(path))
    temp = os.path.join(directory, f".{os.path.basename(path)}.{os.urandom(6).hex()}.tmp")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, f"{key}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, path)
        finally:
            os.unlink(temp)
    except FileExistsError as exc:
        raise BadInput(f"--api-key-file {path!r} appeared while its key was made: not "
                       "replaced") from exc  # fmt: skip
    except OSError as exc:
        raise BadInput(f"cannot write a new key to {path!r}: {exc.strerror}") from exc
    return key
