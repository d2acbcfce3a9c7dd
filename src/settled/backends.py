"""Which store and object store a home uses: chosen once, recorded in the home, never guessed.

A home is bound to one authority store (`sqlite:///path`, the embedded default, or
`postgresql://...`) and one object store (`file:///path`, the local default, or
`s3://bucket/prefix`). The first Runtime that opens a home records the binding in
`<home>/backends.json` (private, written once); every later opener, and every owner the home
launches, reads it from there, so an owner can never write its receipt to another store than the
one its Runtime admitted the session in. Asking for a different backend than the one recorded is
refused by name (`BackendMismatch`): silently switching would hide every task of the first one.

The URLs come from `--store` / `--objects`, else `SETTLED_STORE` / `SETTLED_OBJECTS`, else the
defaults. No credential is ever recorded: the binding holds the store URL without its password
(and the path of a password file the operator named); `store_connection` puts the password back
in memory from where `storepass.py` finds it (the URL given, the file, libpq's PGPASSWORD /
PGPASSFILE / ~/.pgpass, or a binding an older settled wrote, scrubbed once another source
works); S3 keys stay in `AWS_*`. `credential_names` lists what a command must never inherit
when a home uses a remote backend, since a command holding them could write the evidence
itself. Imports no backend: `store.open_store` and `objects.open_object_store` do, by scheme.
Over 400 lines: the binding, its URLs' checks (a `search_path` schema read as PostgreSQL reads
it) and its credential rules are one contract; the schema parser could move out on its own.
"""

from __future__ import annotations

import contextlib
import json
import os

from settled.atomic import create_once
from settled.errors import BadInput, HomeUnusable
from settled.records import Frozen
from settled.storepass import (
    PASSWORD_FILE_ENV,
    check_password_file,
    connection_password,
    scrub,
    stored_password,
    with_password,
    without_password,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Final
    from urllib.parse import SplitResult

BINDING_FILE: Final = "backends.json"
STORE_ENV: Final = "SETTLED_STORE"
OBJECTS_ENV: Final = "SETTLED_OBJECTS"
STORE_SCHEMES: Final = ("sqlite", "postgresql", "postgres")
OBJECT_SCHEMES: Final = ("file", "s3")
S3_CREDENTIALS: Final = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
)
POSTGRES_CREDENTIALS: Final = ("PGPASSWORD", "PGPASSFILE", "PGSERVICEFILE", "PGSSLKEY",
                                STORE_ENV, PASSWORD_FILE_ENV)  # fmt: skip


class BadBackend(BadInput):
    """A store or objects URL that settled cannot use: names the URL (without its password)."""


class BackendMismatch(BadInput):
    """The home is bound to other backends than the ones asked for."""


class Backends(Frozen):
    __slots__ = ("objects", "password_file", "store")
    store: str  # sqlite:///abs/path | postgresql://... (never with a password: storepass.py)
    objects: str  # file:///abs/path | s3://bucket/prefix
    password_file: str | None  # the file the operator named for the store's password (a path)

    def __init__(self, store: str, objects: str, password_file: str | None = None) -> None:
        self._fill(locals())

    @property
    def store_scheme(self) -> str:
        return scheme(self.store)

    @property
    def objects_scheme(self) -> str:
        return scheme(self.objects)

    @property
    def remote(self) -> bool:
        """Whether any evidence lives outside the home (and so outlives it)."""
        return self.store_scheme != "sqlite" or self.objects_scheme != "file"

    def to_json(self) -> dict[str, str]:
        """For receipts and `settled --version`: never a password."""
        return {"store": redacted(self.store), "objects": redacted(self.objects)}


def scheme(url: str) -> str:
    """The scheme, as `urlsplit` reads it (lowercase; none unless a letter leads letters, digits,
    `+`, `-` or `.` before the first colon), without importing urllib.parse: every verb reads
    its home's binding, and urllib.parse (with ipaddress) costs as much as the rest of `status`."""
    name, colon, _ = url.partition(":")
    leads = name[:1].isascii() and name[:1].isalpha()
    if colon and leads and all(c.isascii() and (c.isalnum() or c in "+-.") for c in name):
        return name.lower()
    return ""


def _split(url: str) -> SplitResult:
    from urllib.parse import urlsplit  # only where a URL is checked or redacted

    return urlsplit(url)


def _unsplit(parts: SplitResult) -> str:
    from urllib.parse import urlunsplit

    return urlunsplit(parts)


def redacted(url: str) -> str:
    """The URL with any password replaced by `***`."""
    parts = _split(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return _unsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


# The package each remote backend needs, by the top-level module a missing one names.
EXTRA_OF_MODULE: Final = {"psycopg": "postgres", "psycopg_pool": "postgres", "boto3": "s3",
                          "botocore": "s3"}  # fmt: skip


@contextlib.contextmanager
def extra_needed(url: str) -> Iterator[None]:
    """A remote backend whose package is not installed is one line naming what to install
    (BadBackend, exit 2), never an internal error: `settled[postgres]`, `settled[s3]`."""
    try:
        yield
    except ModuleNotFoundError as exc:
        module = (exc.name or "").partition(".")[0]
        if module not in EXTRA_OF_MODULE:
            raise
        extra = EXTRA_OF_MODULE[module]
        raise BadBackend(
            f"{redacted(url)} needs the {extra} extra ({module} is not installed): "
            f"pip install 'settled[{extra}]'"
        ) from exc


def _require_packages(backends: Backends) -> None:
    """BadBackend naming the extra to install for each remote backend whose package this
    Python cannot import (found without importing it: boto3 costs ~0.2 s)."""
    from importlib.util import find_spec

    for url, module in ((backends.store, "psycopg"), (backends.objects, "boto3")):
        if scheme(url) in ("postgresql", "s3") and find_spec(module) is None:
            with extra_needed(url):
                raise ModuleNotFoundError(f"No module named {module!r}", name=module)


def default_backends(home: str) -> Backends:
    return Backends(
        store=f"sqlite://{os.path.join(home, 'settled.db')}",
        objects=f"file://{os.path.join(home, 'objects')}",
    )


def binding_path(home: str) -> str:
    return os.path.join(home, BINDING_FILE)


def check_store_url(url: str) -> str:
    """The store URL normalised (`postgres://` spelled `postgresql://`), or BadBackend."""
    parts = _split(url)
    if parts.scheme not in STORE_SCHEMES:
        raise BadBackend(
            f"store URL {redacted(url)!r}: the scheme must be one of sqlite:///PATH or "
            "postgresql://USER@HOST:PORT/DB"
        )
    if parts.scheme == "sqlite":
        if parts.netloc or not os.path.isabs(parts.path):
            raise BadBackend(f"store URL {url!r}: spell an SQLite store sqlite:///ABSOLUTE/PATH")
        return f"sqlite://{os.path.normpath(parts.path)}"
    if not parts.path.strip("/"):
        raise BadBackend(f"store URL {redacted(url)!r} names no database (…/DBNAME)")
    from urllib.parse import parse_qs

    for options in parse_qs(parts.query, keep_blank_values=True).get("options", []):
        search_path_schema(options)  # a malformed one is refused before the home is bound
    return _unsplit(parts._replace(scheme="postgresql"))


SCHEMA_NAME_MAX: Final = 63  # bytes: PostgreSQL's NAMEDATALEN - 1; it cuts a longer name


def search_path_schema(options: str) -> str | None:
    """The schema a PostgreSQL store lives in: the first entry of `-c search_path=...` in the
    libpq `options`, read as PostgreSQL reads it, so the schema settled creates is the one the
    server's search_path then names: an unquoted name is folded to lower case (`MySchema` is
    `myschema`), a double-quoted one is taken verbatim (`"MySchema"`, `""` for a quote).
    None without a search_path; BadBackend, one line, for an entry that names no schema."""
    value = _search_path_value(options.split())
    if value is None:
        return None
    name, rest = _first_entry(value.strip())
    if rest.strip() and not rest.strip().startswith(","):
        raise _bad_schema(value, "text after the quoted name; separate entries with commas")
    if name == "$user":
        raise _bad_schema(value, "$user is not a schema settled can create; name the schema")
    if len(name.encode()) > SCHEMA_NAME_MAX:
        raise _bad_schema(value, f"longer than {SCHEMA_NAME_MAX} bytes (PostgreSQL would cut it)")
    if not name.isprintable():
        raise _bad_schema(value, "a control character")
    return name


def _search_path_value(tokens: list[str]) -> str | None:
    for i, token in enumerate(tokens):
        for prefix in ("-csearch_path=", "--search_path="):
            if token.startswith(prefix):
                return token[len(prefix) :]
        if token == "-c" and i + 1 < len(tokens) and tokens[i + 1].startswith("search_path="):
            return tokens[i + 1][len("search_path=") :]
    return None


def _first_entry(value: str) -> tuple[str, str]:
    """(the first entry's schema name, what follows it), unquoted names folded as PostgreSQL
    folds them (ASCII letters only, as it does in UTF-8)."""
    if not value.startswith('"'):
        name = value.split(",")[0].strip()
        if not name or '"' in name or any(c.isspace() for c in name):
            raise _bad_schema(value, "no schema name" if not name else "a quote or a space")
        return name.translate(_ASCII_LOWER), value[len(value.split(",")[0]) :]
    parts: list[str] = []
    at = 1
    while True:
        end = value.find('"', at)
        if end < 0:
            raise _bad_schema(value, "an unterminated double quote")
        parts.append(value[at:end])
        if value[end + 1 : end + 2] != '"':
            break
        parts.append('"')
        at = end + 2
    name = "".join(parts)
    if not name:
        raise _bad_schema(value, "an empty quoted name")
    return name, value[end + 1 :]


_ASCII_LOWER: Final = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _bad_schema(value: str, why: str) -> BadBackend:
    return BadBackend(
        f"store URL: search_path {value!r} names no schema settled can use: {why} "
        "(options=-csearch_path%3DNAME; quote it, %22Name%22, to keep upper case)"
    )


def check_objects_url(url: str) -> str:
    parts = _split(url)
    if parts.scheme not in OBJECT_SCHEMES:
        raise BadBackend(
            f"objects URL {url!r}: the scheme must be one of file:///PATH or s3://BUCKET/PREFIX"
        )
    if parts.scheme == "file":
        if parts.netloc or not os.path.isabs(parts.path):
            raise BadBackend(f"objects URL {url!r}: spell a directory file:///ABSOLUTE/PATH")
        return f"file://{os.path.normpath(parts.path)}"
    if not parts.netloc:
        raise BadBackend(f"objects URL {url!r} names no bucket (s3://BUCKET/PREFIX)")
    return url.rstrip("/")


def read_binding(home: str) -> Backends | None:
    """The recorded binding, its store URL without a password even where an older settled
    wrote one (`storepass.py` finds that one when it is still needed)."""
    try:
        with open(binding_path(home), encoding="utf-8") as handle:
            data = json.load(handle)
        password_file = data.get("password_file")
        return Backends(
            store=without_password(str(data["store"])),
            objects=str(data["objects"]),
            password_file=str(password_file) if password_file else None,
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HomeUnusable(
            f"{binding_path(home)} (which store and object store this home uses) cannot be "
            f"read: {exc}; restore it, or use another --home"
        ) from exc


def bound_backends(home: str) -> Backends:
    """What the home is bound to; a home never bound uses (and will record) the defaults."""
    return read_binding(home) or default_backends(home)


def bind(home: str, store: str | None = None, objects: str | None = None) -> Backends:
    """The home's backends: the recorded binding, checked against what was asked (argument,
    else environment), or, on a home's first open, what was asked recorded as its binding."""
    store = store or os.environ.get(STORE_ENV) or None
    objects = objects or os.environ.get(OBJECTS_ENV) or None
    default = default_backends(home)
    asked = Backends(
        store=without_password(check_store_url(store)) if store else default.store,
        objects=check_objects_url(objects) if objects else default.objects,
        password_file=_password_file_asked(store),
    )
    bound = read_binding(home)
    if bound is None:
        # A home an older settled made holds its SQLite store already: that is its binding.
        first = default if os.path.exists(os.path.join(home, "settled.db")) else asked
        _require_packages(first)  # never a home bound to a backend it cannot open
        bound = _record_once(home, first)
    _refuse_mismatch(home, bound, store, objects)
    return bound


def _password_file_asked(store: str | None) -> str | None:
    """The password file named (`--password-file`, `SETTLED_STORE_PASSWORD_FILE`) for a
    PostgreSQL store, checked (PasswordFileRefused, nothing recorded) and made absolute."""
    named = os.environ.get(PASSWORD_FILE_ENV) or None
    if named is None or not store or scheme(store) not in ("postgresql", "postgres"):
        return None
    return check_password_file(named)


def _refuse_mismatch(home: str, bound: Backends, store: str | None, objects: str | None) -> None:
    for what, asked, have, check in (
        ("store", store, bound.store, _store_without_password),
        ("objects", objects, bound.objects, check_objects_url),
    ):
        if asked is not None and check(asked) != have:
            raise BackendMismatch(
                f"home {home} is bound to {what} {redacted(have)}, not {redacted(asked)} "
                f"(recorded in {binding_path(home)}); use another --home for another {what}"
            )


def _store_without_password(url: str) -> str:
    return without_password(check_store_url(url))


def _record_once(home: str, backends: Backends) -> Backends:
    """Write the binding unless one exists (a link never replaces a name): two first openers
    agree on one binding, and the loser's request is checked against it. Never a password:
    the store URL without it, and the path of the file that holds it if one was named."""
    fields = {"store": without_password(backends.store), "objects": backends.objects}
    if backends.password_file:
        fields["password_file"] = backends.password_file
    data = json.dumps(fields).encode()
    create_once(binding_path(home), data)
    return read_binding(home) or backends


def seals_logs(home: str) -> bool:
    """Whether settled streams are published to the home's object store: only when it lives
    outside the home, since a copy inside the home dies with the log it copies."""
    backends = bound_backends(home)
    if backends.objects_scheme != "file":
        return True
    root = os.path.realpath(backends.objects.removeprefix("file://"))
    real_home = os.path.realpath(home)
    return os.path.commonpath([root, real_home]) != real_home


def store_connection(home: str) -> tuple[str, str]:
    """(the URL this process connects to the home's store with, the password's source as
    `storepass.connection_password` names it). The password lives in memory only."""
    bound = bound_backends(home)
    if bound.store_scheme != "postgresql":
        return bound.store, "none"
    given = os.environ.get(STORE_ENV) or None
    if given is not None:
        try:
            given = check_store_url(given)
        except BadBackend:
            given = None
    password, source = connection_password(
        bound.store, given, bound.password_file, binding_path(home)
    )
    return (bound.store if password is None else with_password(bound.store, password)), source


def connected(home: str, source: str) -> None:
    """The store was reached with the password from ``source``: a password an older settled
    left in the binding is scrubbed once another source has proven itself."""
    if source in ("url", "file", "libpq") and stored_password(binding_path(home)) is not None:
        with contextlib.suppress(OSError, ValueError, KeyError):
            scrub(binding_path(home))


def credential_names(backends: Backends, environ: dict[str, str]) -> list[str]:
    """Inherited variables a command must not see: the remote backends' credentials, settled's
    own store variables, and any whose value holds the store URL (with or without a
    password inside it)."""
    names: list[str] = []
    if backends.objects_scheme == "s3":
        names += [n for n in S3_CREDENTIALS if n in environ]
    if backends.store_scheme == "postgresql":
        names += [n for n in environ if n in POSTGRES_CREDENTIALS or n == "DATABASE_URL"]
        bare = without_password(backends.store)
        names += [n for n, v in environ.items() if bare in _passwords_out(v)]
    return sorted(set(names))


def _passwords_out(value: str) -> str:
    """``value`` with the password of any URL in it taken out (`://user:secret@` -> `://user@`)."""
    import re

    return re.sub(r"(://[^/:@\s]*):[^@\s]*@", r"\1@", value)


def credential_files(backends: Backends, environ: dict[str, str]) -> list[str]:
    """Files holding the store's password that exist here: the one the operator named, libpq's
    PGPASSFILE and ~/.pgpass. Every command's view covers them (a file under a system root
    the view shows, such as /etc, is readable by a command of the same uid, and a command
    holding the password could write the evidence itself)."""
    if backends.store_scheme != "postgresql":
        return []
    named = [backends.password_file, environ.get("PGPASSFILE")]
    home = environ.get("HOME")
    if home:
        named.append(os.path.join(home, ".pgpass"))
    return sorted({os.path.realpath(p) for p in named if p and os.path.exists(p)})
