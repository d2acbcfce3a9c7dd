"""The PostgreSQL store's password: where it comes from, never the home.

Owns the rule that no credential is written into a home: a home's binding (`backends.json`)
records the store URL without its password, and each process finds the password when it
connects, from the first of:
1. the URL it was given (`--store` or `SETTLED_STORE`, which travel to its owners in their
   environment), when that URL is the bound one but for the password;
2. a file the operator names (`--password-file`, `SETTLED_STORE_PASSWORD_FILE`, or the path a
   home recorded when it was bound with one): a regular file holding the password on its first
   line, refused (one line) if a group or others may read or write it;
3. libpq's own: `PGPASSWORD`, `PGPASSFILE` or `~/.pgpass` (the URL is then used bare);
4. the password an older settled wrote into `backends.json`: still used, with one warning a
   process. It is scrubbed from the file (rewritten atomically) by the first process that
   connects with the password from any other source, so an old home keeps working until the
   operator gives the password another way, and holds no secret after.

Must never: write a password anywhere; print one (every message names the URL redacted or a
file's path); import a backend (the binding's reader, `backends.py`, is foundation).
"""

from __future__ import annotations

import json
import os
import stat
import sys

from settled.errors import BadInput

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final

PASSWORD_FILE_ENV: Final = "SETTLED_STORE_PASSWORD_FILE"
LIBPQ_SOURCES: Final = ("PGPASSWORD", "PGPASSFILE")  # besides ~/.pgpass
PASSWORD_FILE_MAX: Final = 4096

_warned: set[str] = set()  # homes whose stored password this process has warned about


class PasswordFileRefused(BadInput):
    """The named password file cannot be used: missing, not a regular file, empty, or
    readable or writable by a group or others. Names the path and why, never its content."""


def password_of(url: str) -> str | None:
    """The URL's password, unquoted; None if it has none."""
    from urllib.parse import unquote, urlsplit

    raw = urlsplit(url).password
    return None if raw is None else unquote(raw)


def without_password(url: str) -> str:
    """The URL with its password taken out (`user@host`, and any `password=` of its query, as
    libpq also reads one there), everything else as it was."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if parts.password is None and all(name != "password" for name, _ in pairs):
        return url  # as given: urlunsplit would respell `sqlite:///path` as `sqlite:/path`
    if any(name == "password" for name, _ in pairs):
        kept = [(name, value) for name, value in pairs if name != "password"]
        parts = parts._replace(query=urlencode(kept))
    if parts.password is not None:
        at = parts.netloc.rindex("@")
        user = parts.netloc[:at].partition(":")[0]
        parts = parts._replace(netloc=f"{user}@{parts.netloc[at + 1 :]}")
    return urlunsplit(parts)


def with_password(url: str, password: str) -> str:
    """The URL carrying ``password`` (for this process's connection only, never written)."""
    from urllib.parse import quote, urlsplit, urlunsplit

    parts = urlsplit(without_password(url))
    user, _, host = parts.netloc.rpartition("@")
    netloc = f"{user}:{quote(password, safe='')}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


def read_password_file(path: str) -> str:
    """The password on the file's first line; PasswordFileRefused if it cannot be trusted."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise PasswordFileRefused(f"password file {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PasswordFileRefused(f"password file {path} is not a regular file")
        if info.st_mode & 0o077:
            raise PasswordFileRefused(
                f"password file {path} is open to its group or others (mode "
                f"{stat.S_IMODE(info.st_mode):04o}): chmod 600 {path}"
            )
        data = os.read(fd, PASSWORD_FILE_MAX)
    finally:
        os.close(fd)
    password = data.decode("utf-8", "replace").partition("\n")[0].rstrip("\r")
    if not password:
        raise PasswordFileRefused(f"password file {path} holds no password on its first line")
    return password


def check_password_file(path: str) -> str:
    """The file's absolute path once it holds a usable password (what a binding records)."""
    if not os.path.isabs(path):
        path = os.path.abspath(path)
    read_password_file(path)
    return path


def stored_password(binding_file: str) -> str | None:
    """The password an older settled wrote into the binding's store URL, if any."""
    try:
        with open(binding_file, encoding="utf-8") as handle:
            store = json.load(handle).get("store")
    except (OSError, ValueError, AttributeError):
        return None
    return password_of(store) if isinstance(store, str) else None


def scrub(binding_file: str) -> None:
    """Rewrite the binding with the store URL's password taken out (atomically)."""
    from settled.atomic import write_atomic

    with open(binding_file, encoding="utf-8") as handle:
        data = json.load(handle)
    data["store"] = without_password(str(data["store"]))
    write_atomic(binding_file, json.dumps(data).encode())


def _libpq_has_one(environ: dict[str, str] | os._Environ[str]) -> bool:
    if any(environ.get(name) for name in LIBPQ_SOURCES):
        return True
    home = environ.get("HOME") or os.path.expanduser("~")
    return os.path.exists(os.path.join(home, ".pgpass"))


def connection_password(
    bound_store: str, given_store: str | None, recorded_file: str | None, binding_file: str
) -> tuple[str | None, str]:
    """(the password to connect with, or None to let libpq find it; where it came from:
    `url`, `file`, `libpq`, `home` or `none`), in the order of the module's list."""
    environ = os.environ
    if given_store and without_password(given_store) == without_password(bound_store):
        given = password_of(given_store)
        if given is not None:
            return given, "url"
    path = environ.get(PASSWORD_FILE_ENV) or recorded_file
    if path:
        return read_password_file(path), "file"
    if _libpq_has_one(environ):
        return None, "libpq"
    stored = stored_password(binding_file)
    if stored is not None:
        if binding_file not in _warned:
            _warned.add(binding_file)
            print(
                f"settled: warning: {binding_file} holds the database password; give it by "
                f"PGPASSWORD, ~/.pgpass or --password-file and settled removes it from there",
                file=sys.stderr,
            )
        return stored, "home"
    return None, "none"
