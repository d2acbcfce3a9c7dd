"""The command's environment: explicit, recorded, and inside the command digest.

Nothing reaches a command by accident. Its environment is a small base (a standard PATH, HOME
of the user it runs as, LANG) overlaid by the caller's `PATH` (the one policy every face that
has a caller's environment applies, `caller_policy`: `python3` is the one the caller would run;
`--clean-env` keeps the base's; `path_in_view` leaves out what the task itself could have
written) and by what the caller asked for: `--env K=V`, an
`--env-file`, `--inherit NAME` (one variable of the caller's) or `--inherit-env` (all of the
caller's but settled's own and the credentials of the home's remote backends). The result is
the spec's `env`, so the digest covers every byte the command sees, and the names taken from
the caller are recorded beside it (`inherited`) with any left out (`env_removed`).

Resolution happens where the caller's environment is: in the CLI or the embedded Runtime's
process, or in the Python client before the request; a server never hands a command its own.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
from collections.abc import Iterable, Mapping, Sequence

from settled.errors import BadInput
from settled.records import Frozen

STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SETTLED_PREFIX = "SETTLED_"  # the home, the store, tokens, fault points: settled's own
STANDING_INHERIT_ENV = "SETTLED_INHERIT"


class CallerEnv(Frozen):
    """What a caller passes: the variables, which of them came from its environment, and
    which of its variables were withheld (by name only; their values never travel)."""

    __slots__ = ("env", "inherited", "removed")
    env: dict[str, str]
    inherited: tuple[str, ...]
    removed: tuple[str, ...]

    def __init__(
        self,
        env: dict[str, str] | None = None,
        inherited: tuple[str, ...] = (),
        removed: tuple[str, ...] = (),
    ) -> None:
        env = {} if env is None else env
        self._fill(locals())


def base_environment(uid: int | None = None) -> dict[str, str]:
    """The variables every command gets unless the caller overrides them: enough for a
    shell and common tools to run, nothing that identifies the caller's session."""
    home = "/"  # a uid without a passwd entry: its HOME is the root, said by the value
    with contextlib.suppress(KeyError):
        home = pwd.getpwuid(os.getuid() if uid is None else uid).pw_dir or "/"
    return {"PATH": STANDARD_PATH, "HOME": home, "LANG": "C.UTF-8"}


def parse_env_file(path: str) -> dict[str, str]:
    """`NAME=VALUE` lines (blank lines and `#` comments skipped, an optional `export `
    prefix, one pair of matching quotes around the value stripped); any other line is
    refused naming the file and line, so a typo never drops a variable silently."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError as exc:
        raise BadInput(f"--env-file {path!r} cannot be read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise BadInput(f"--env-file {path!r} is not UTF-8 text: {exc.reason}") from exc
    found: dict[str, str] = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.removeprefix("export ").partition("=")
        name = name.strip()
        if not sep or not name or not _is_name(name):
            raise BadInput(
                f"--env-file {path}:{number}: {raw!r} is not NAME=VALUE "
                "(NAME of letters, digits and _, not starting with a digit)"
            )
        found[name] = _unquote(value)
    return found


def _is_name(name: str) -> bool:
    return name.replace("_", "a").isalnum() and name.isascii() and not name[0].isdigit()


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def from_caller(
    names: Iterable[str],
    whole: bool,
    environ: Mapping[str, str],
    withheld: Iterable[str] = (),
) -> CallerEnv:
    """The caller's variables to pass: each of `names` (refused if unset, naming it), or with
    `whole` all of them but settled's own, `withheld` (credentials) and any secret by its
    name or value (`is_secret`: a model's API key in an agent's environment is not the
    command's); a name asked for explicitly is passed, since the caller chose it."""
    asked = list(dict.fromkeys(names))
    missing = [name for name in asked if name not in environ]
    if missing:
        raise BadInput(f"--inherit {', '.join(missing)}: not set in the caller's environment")
    chosen = {name: environ[name] for name in asked}
    removed: list[str] = []
    if whole:
        deny = set(withheld)
        for name, value in environ.items():
            if name in chosen:
                continue
            if name.startswith(SETTLED_PREFIX) or name in deny or is_secret(name, value):
                removed.append(name)
            else:
                chosen[name] = value
    return CallerEnv(chosen, tuple(sorted(chosen)), tuple(sorted(removed)))


# A word of a variable's name (between underscores) that says its value is a secret:
# OPENAI_API_KEY, GITHUB_TOKEN, AWS_SECRET_ACCESS_KEY, PGPASSWORD, ANTHROPIC_AUTH_TOKEN, DB_PASS,
# GITHUB_PAT, SENTRY_DSN, CLIENT_SECRETS; and a name that ends in KEY (OPENAI_KEY, AZURE_KEY).
_SECRET_WORDS = re.compile(
    r"(?:^|_)(?:API_?KEYS?|ACCESS_?KEYS?|PRIVATE_?KEYS?|SECRETS?|TOKENS?|PASSWORDS?|PASSWD"
    r"|PGPASSWORD|PASS|PAT|CREDENTIALS?|AUTH|DSN|COOKIES?|SESSION_?ID)(?:_|$)|(?:^|_)KEYS?$",
    re.IGNORECASE,
)
# A URL that carries a password in its user part: DATABASE_URL, PIP_INDEX_URL, REDIS_URL...
_CREDENTIAL_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:[^/\s@]+@")


def is_secret_name(name: str) -> bool:
    """Whether `name` says its value is a secret; `--inherit-env` withholds such a variable
    (named in `env_removed`) unless it is asked for by name."""
    return _SECRET_WORDS.search(name) is not None


def is_secret(name: str, value: str) -> bool:
    """A secret by its name, or a value holding a URL with a password. A deny-list: a secret
    named otherwise still passes with the whole environment (docs/TRUST.md says so); what a
    command must not see, pass by name instead (`--inherit NAME`, `--env`)."""
    return is_secret_name(name) or _CREDENTIAL_URL.search(value) is not None


DEFAULT_INHERITED = ("PATH",)  # what a command takes from its caller unless told --clean-env


def caller_policy(
    names: Sequence[str], whole: bool, clean: bool, environ: Mapping[str, str]
) -> list[str]:
    """The caller's variables a command gets by name: those asked for, and by default the
    caller's PATH (when it has one), so a command runs the tools its caller would; `clean`
    keeps the base's fixed PATH. `clean` with `whole` contradict each other and are refused."""
    if clean and whole:
        raise BadInput("--clean-env and --inherit-env contradict each other: choose one")
    asked = list(dict.fromkeys(names))
    if clean or whole:
        return asked
    return asked + [n for n in DEFAULT_INHERITED if n in environ and n not in asked]


def standing_inherit(environ: Mapping[str, str]) -> list[str]:
    """The names the caller always passes (SETTLED_INHERIT, comma or space separated), as if
    each were given with `--inherit`: a shell profile's choice, recorded like any other."""
    text = environ.get(STANDING_INHERIT_ENV, "")
    return [name for name in text.replace(",", " ").split() if name]


def compose(
    base: Mapping[str, str], caller: CallerEnv, explicit: Mapping[str, str]
) -> dict[str, str]:
    """base < inherited < explicit: an `--env` always wins over what the caller's shell has."""
    return {**base, **caller.env, **explicit}


# The directories a command's view makes its task's own (poddirs: bound at these paths and at
# its $HOME), which any earlier command of the task could have filled.
POD_PATHS = ("/tmp", "/var/tmp", "/dev/shm")


def path_in_view(search_path: str, home: str | None, shown: Iterable[str] = ()) -> str:
    """A caller's PATH as a command in a view of its own may search it: less empty and relative
    entries (the command's cwd) and those in a directory the view makes its task's own (its
    $HOME, /tmp, /var/tmp, /dev/shm), where an earlier command of the task, which is hostile,
    could plant the `pytest` or `git` a later one runs, unless the view shows a host directory
    there (`shown`: the workspace and the grants, bound over the task's own). The caller's
    ~/.local/bin is not the command's: in the view that path is the task's own home."""
    own = tuple(p for p in (*POD_PATHS, home) if p and p.startswith("/") and p != "/")
    granted = tuple(shown)
    kept = []
    for entry in search_path.split(":"):
        path = os.path.normpath(entry) if entry.startswith("/") else ""
        if path and (not within(path, own) or within(path, granted)):
            kept.append(entry)
    return ":".join(kept)


def path_of(env: Mapping[str, str], clean: bool, environ: Mapping[str, str]) -> str:
    """The PATH a command will search: an explicit one, else the caller's (unless `clean`),
    else the standard one."""
    if "PATH" in env:
        return env["PATH"]
    return STANDARD_PATH if clean else environ.get("PATH", STANDARD_PATH)


def unseen_on_path(word: str, search_path: str, roots: Iterable[str]) -> str | None:
    """One line for a person when `word` (a command's first word) is found on `search_path`
    where the command's view (it sees only `roots`) does not show it, or not what it links
    to: what it would have run, what it will run instead, and what to grant, so `python3`
    leading to the system's instead of the caller's virtualenv is said before it runs, not
    found out from a wrong result."""
    if not word or "/" in word:
        return None
    seen = tuple(root.rstrip("/") or "/" for root in roots)
    entries = [entry for entry in search_path.split(":") if entry.startswith("/")]
    found = [os.path.join(entry, word) for entry in entries]
    found = [path for path in found if os.path.isfile(path) and os.access(path, os.X_OK)]
    if not found or _usable(found[0], seen):
        return None
    instead = next((path for path in found if _usable(path, seen)), None)
    runs = f"it runs {instead}" if instead else "it will not find it"
    needed = (_prefix(os.path.dirname(p)) for p in (found[0], os.path.realpath(found[0])))
    grants = " ".join(f"--readable {d}" for d in dict.fromkeys(needed) if not within(d, seen))
    where = f"{word} is {found[0]} on the PATH, outside the command's view"
    return f"{where}: {runs}; to run it, grant {grants}" if grants else f"{where}: {runs}"


def _usable(path: str, roots: tuple[str, ...]) -> bool:
    """Whether the view shows `path` and what it links to."""
    return within(os.path.dirname(path), roots) and within(os.path.realpath(path), roots)


def _prefix(directory: str) -> str:
    """What to grant for a tool in `directory`: its prefix when that is a `bin` (an
    interpreter or a toolchain needs its `lib` and `share` beside it)."""
    return os.path.dirname(directory) if os.path.basename(directory) == "bin" else directory


def within(path: str, roots: tuple[str, ...]) -> bool:
    """Whether `path` is one of `roots` or lies below one (by name: no link is followed)."""
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)
