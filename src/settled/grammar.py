"""The grammar of every number and string settled accepts, and its bounds (issue 12, item 4).

Owns: the one table of bounds below, the parsers that turn a face's text (a CLI argument, a
query parameter, a header) into a number, and the checks that every value, however it arrived
(a JSON body, an MCP tool call, a library call), is inside its field's grammar. The CLI, the
HTTP service, the MCP tools and the Runtime all call these functions, so one value is refused
the same way, naming the same field, wherever it comes from.

Why a grammar at all: Python's own parsers are generous (``int("٣")`` is 3, ``float("1e300")``
is a grace of 10**292 years, ``"²".isdigit()`` is true and ``int("²")`` raises), and a string
that cannot be encoded (a lone surrogate from JSON ``"\\ud800"``, a NUL) breaks the store, the
digest or ``execve`` long after admission, as a 500 or a traceback. Here a value is accepted
only if it is one settled can record, hash and run.

Numbers are ASCII digits (``[0-9]+``, seconds also ``[0-9]+(.[0-9]+)?``: no sign, exponent,
``inf`` or ``nan``), finite, and inside their field's bounds:

=================  =========================  =============================================
field              bounds                     why
=================  =========================  =============================================
timeout            0 <= t <= 604800 (7 days)  a command's deadline; 0 is none (timeout(1))
grace              0 <= g <= 3600 (1 hour)    TERM to KILL; a close waits it out
deadline (close)   0 <= d <= 86400 (1 day)    how long a close lets sessions run
wait (CLI, lib)    0 <= w <= 604800 (7 days)  ``wait --timeout``, ``logs --follow --timeout``
wait (HTTP query)  0 <= w <= 3600 (1 hour)    a long poll holds a connection
cursor             0 <= c <= 2**63 - 1        a byte offset (``from``, ``Last-Event-ID``)
max (HTTP query)   1 <= m <= 2**63 - 1        bytes of one read
budget / view      0 <= b <= 1048576 (1 MiB)  bytes of a model view, read twice over
port               0 <= p <= 65535            0 picks a free one
uid, gid           0 <= i <= 2**32 - 2        (uid_t)-1 means "unchanged" to the kernel
memory             4 MiB <= m <= 2**50 bytes  a session's memory limit (a command needs a
                                              few MiB to start; 2**50 is a petabyte)
pids               1 <= n <= 4194304          a session's process and thread limit (the
                                              kernel's largest pid_max)
cpus               0.01 <= c <= 1024          CPUs' worth of time a period (cfs quota)
=================  =========================  =============================================

A memory size as text is ``[0-9]+`` bytes, or with one binary suffix ``K``, ``M``, ``G`` or
``T`` (any case, an optional ``iB`` or ``B`` after it): ``512M`` is 536870912 bytes. In JSON it
is an integer count of bytes.

Strings are text settled can store and run: encodable as strict UTF-8 (a lone surrogate is
not; so are the non-UTF-8 bytes of a CLI argument, which Python hands over as surrogates:
settled records commands as UTF-8 text, so such bytes are refused, and a command that needs
them writes them itself, e.g. ``printf '\\377'``) and without NUL (``execve`` and every path
end at NUL). Lengths are UTF-8 bytes:

=================  ==================  ==================================================
field              at most             why
=================  ==================  ==================================================
argv item, shell   131071 bytes        MAX_ARG_STRLEN (32 pages) less its NUL
env NAME=VALUE     131071 bytes        the same limit; NAME is 1..1024 bytes, no ``=``
argv + env         1048576 bytes       half of ARG_MAX (2 MiB): the rest is inherited
argv items         65536               each costs a pointer too
env entries        4096
path (cwd, ...)    4095 bytes          PATH_MAX less its NUL
writable paths     64                  and as many readable paths
key                1..256 bytes        no control characters: keys are printed
user               1..256 bytes        ``UID[:GID]`` or names
id (task, session) 1..128 ASCII        ``[A-Za-z0-9_-]``: what ``new_id`` makes
final              1048576 bytes       the model's final answer
reason             4096 bytes
=================  ==================  ==================================================

A value over a length (or count) bound is ``TooLarge`` (HTTP 413; an id is not content, so
an overlong one is ``BadText``); any other refusal is a ``BadNumber`` or ``BadText`` (HTTP
400); all are ``BadInput`` (exit 2).

Must never: import anything of settled but ``errors`` (every layer imports this), coerce (a
JSON ``"5"`` is not a number, ``true`` is not 1, ``5.0`` is not an integer), or accept what a
later layer would have to refuse.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Iterable

from settled.errors import BadInput

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

# -- the bounds -----------------------------------------------------------------------------

DAY_S: Final = 86400.0
MAX_TIMEOUT_S: Final = 7 * DAY_S
MAX_GRACE_S: Final = 3600.0
MAX_DEADLINE_S: Final = DAY_S
MAX_WAIT_S: Final = 7 * DAY_S
MAX_HTTP_WAIT_S: Final = 3600.0
MAX_CURSOR: Final = (1 << 63) - 1
MAX_BUDGET: Final = 1 << 20
MAX_PORT: Final = 65535
MAX_ID_NUMBER: Final = (1 << 32) - 2
MIN_MEMORY: Final = 4 << 20
MAX_MEMORY: Final = 1 << 50
MAX_PIDS: Final = 4194304
MIN_CPUS: Final = 0.01
MAX_CPUS: Final = 1024.0

MAX_ARG_BYTES: Final = 131071
MAX_ENV_NAME_BYTES: Final = 1024
MAX_COMMAND_BYTES: Final = 1 << 20
MAX_ARGV_ITEMS: Final = 65536
MAX_ENV_ITEMS: Final = 4096
MAX_PATH_BYTES: Final = 4095
MAX_WRITABLE: Final = 64
MAX_KEY_BYTES: Final = 256
MAX_USER_BYTES: Final = 256
MAX_ID_CHARS: Final = 128
MAX_FINAL_BYTES: Final = 1 << 20
MAX_REASON_BYTES: Final = 4096
POINTER_BYTES: Final = 8  # each argv and env entry also costs its pointer in ARG_MAX

INTEGER: Final = re.compile(r"[0-9]+")
DECIMAL: Final = re.compile(r"[0-9]+(\.[0-9]+)?")
ID: Final = re.compile(r"[A-Za-z0-9_-]+")
SIZE: Final = re.compile(r"([0-9]+)(?:([KMGT])(?:I?B)?|B)?", re.IGNORECASE)
SIZE_SHIFT: Final = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}
MAX_DIGITS: Final = 40  # past this no bound above is reachable; int() is never asked
MAX_NUMBER_CHARS: Final = 64
SHOWN_CHARS: Final = 80


# -- the errors -----------------------------------------------------------------------------


def shown(value: object) -> str:
    """The value as an error names it: its repr (every surrogate and NUL escaped, so the
    message is itself valid text), truncated with its length said."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    size = f"{len(value)} chars" if isinstance(value, str) else f"{len(text)} chars of repr"
    return f"{text[:SHOWN_CHARS]}... ({size})"


class BadValue(BadInput):
    """A value outside its field's grammar: names the field and the value (truncated)."""

    def __init__(self, field: str, value: object, rule: str) -> None:
        super().__init__(f"{field} {shown(value)} {rule}")
        self.field, self.value = field, value

    def to_json(self) -> dict[str, object]:
        return {**super().to_json(), "field": self.field}


class BadNumber(BadValue):
    """Not a number of this field's grammar (not ASCII digits, not finite, out of bounds)."""


class BadText(BadValue):
    """A string settled cannot store or run (NUL, not UTF-8) or of the wrong form."""


class TooLarge(BadValue):
    """Over a length or count bound (HTTP 413): the value is refused, not cut."""


# -- numbers from text ------------------------------------------------------------------------


def _digits(field: str, text: str, pattern: re.Pattern[str], what: str) -> str:
    if not isinstance(text, str) or len(text) > MAX_NUMBER_CHARS:
        raise BadNumber(field, text, f"must be {what} of at most {MAX_NUMBER_CHARS} characters")
    if pattern.fullmatch(text) is None:
        raise BadNumber(field, text, f"must be {what} (ASCII digits only)")
    if len(text.lstrip("0").partition(".")[0]) > MAX_DIGITS:
        raise BadNumber(field, text, "is out of range")
    return text


def parse_int(field: str, text: str, lo: int, hi: int) -> int:
    """``[0-9]+`` within ``[lo, hi]``: what a cursor, a size or a port is as text."""
    value = int(_digits(field, text, INTEGER, "an integer"))
    if not lo <= value <= hi:
        raise BadNumber(field, text, f"must be between {lo} and {hi}")
    return value


def parse_seconds(field: str, text: str, hi: float, lo: float = 0.0) -> float:
    """``[0-9]+(.[0-9]+)?`` seconds within ``[lo, hi]``: no sign, exponent, inf or nan."""
    value = float(_digits(field, text, DECIMAL, "a number of seconds like 5 or 0.5"))
    if not lo <= value <= hi:
        raise BadNumber(field, text, f"must be between {lo:g} and {hi:g} seconds")
    return value


def parse_memory(field: str, text: str) -> int:
    """A memory size: ``[0-9]+`` bytes or with a binary suffix (``512M``, ``2GiB``), within
    ``[MIN_MEMORY, MAX_MEMORY]``."""
    if not isinstance(text, str) or len(text) > MAX_NUMBER_CHARS or not text.isascii():
        raise BadNumber(field, text, "must be a size like 512M, 2G or 1073741824 (bytes)")
    match = SIZE.fullmatch(text)
    if match is None or len(match.group(1).lstrip("0")) > MAX_DIGITS:
        raise BadNumber(field, text, "must be a size like 512M, 2G or 1073741824 (bytes)")
    value = int(match.group(1)) << SIZE_SHIFT[(match.group(2) or "").upper()]
    return check_memory(field, value, shown_as=text)


def parse_cpus(field: str, text: str) -> float:
    """CPUs as ``[0-9]+(.[0-9]+)?`` within ``[MIN_CPUS, MAX_CPUS]``."""
    value = float(_digits(field, text, DECIMAL, "a number of CPUs like 2 or 0.5"))
    return check_cpus(field, value)


# -- numbers however they arrived ---------------------------------------------------------------


def check_int(field: str, value: object, lo: int, hi: int) -> int:
    """An int (never a bool or a float, however integral) within ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadNumber(field, value, "must be an integer")
    if not lo <= value <= hi:
        raise BadNumber(field, value, f"must be between {lo} and {hi}")
    return value


def check_seconds(field: str, value: object, hi: float, lo: float = 0.0) -> float:
    """A finite int or float (never a bool) within ``[lo, hi]``, as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadNumber(field, value, "must be a number of seconds")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadNumber(field, value, f"must be a finite number of seconds, {lo:g}..{hi:g}")
    if not lo <= value <= hi:
        raise BadNumber(field, value, f"must be between {lo:g} and {hi:g} seconds")
    return float(value)


def optional_seconds(field: str, value: object, hi: float) -> float | None:
    return None if value is None else check_seconds(field, value, hi)


def check_memory(field: str, value: object, shown_as: object = None) -> int:
    """A memory limit in bytes (an int, never a bool or float), 4 MiB .. 2**50."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadNumber(field, value, "must be an integer number of bytes")
    if not MIN_MEMORY <= value <= MAX_MEMORY:
        raise BadNumber(
            field,
            value if shown_as is None else shown_as,
            f"must be between {MIN_MEMORY} (4M) and {MAX_MEMORY} bytes",
        )
    return value


def check_pids(field: str, value: object) -> int:
    return check_int(field, value, 1, MAX_PIDS)


def check_cpus(field: str, value: object) -> float:
    """A finite number of CPUs (int or float, never a bool), 0.01 .. 1024."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadNumber(field, value, "must be a number of CPUs")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadNumber(field, value, f"must be a finite number of CPUs, {MIN_CPUS}..{MAX_CPUS:g}")
    if not MIN_CPUS <= value <= MAX_CPUS:
        raise BadNumber(field, value, f"must be between {MIN_CPUS} and {MAX_CPUS:g} CPUs")
    return float(value)


def check_cursor(field: str, value: object) -> int:
    return check_int(field, value, 0, MAX_CURSOR)


# -- strings ----------------------------------------------------------------------------------


def utf8_size(field: str, value: object) -> int:
    """The UTF-8 size of a string settled can store and run; BadText for anything else."""
    if not isinstance(value, str):
        raise BadText(field, value, "must be a string")
    if "\0" in value:
        raise BadText(field, value, "contains a NUL byte, which no argument or path can hold")
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise BadText(
            field,
            value,
            f"is not valid UTF-8 text (character {exc.start} is {value[exc.start]!r}: a lone "
            "surrogate, or a byte of a non-UTF-8 argument); settled records commands as UTF-8",
        ) from None


def check_text(field: str, value: object, max_bytes: int, min_bytes: int = 0) -> str:
    """A string of ``min_bytes..max_bytes`` UTF-8 bytes, without NUL."""
    size = utf8_size(field, value)
    assert isinstance(value, str)
    if size > max_bytes:
        raise TooLarge(field, value, f"is {size} bytes; at most {max_bytes} are accepted")
    if size < min_bytes:
        raise BadText(field, value, f"must be at least {min_bytes} byte(s)")
    return value


def optional_text(field: str, value: object, max_bytes: int) -> str | None:
    return None if value is None else check_text(field, value, max_bytes)


def check_path(field: str, value: object) -> str:
    """A path: non-empty text of at most PATH_MAX - 1 bytes."""
    return check_text(field, value, MAX_PATH_BYTES, 1)


def check_key(field: str, value: object) -> str:
    """An invocation or task key: 1..256 bytes with no control character (keys are shown)."""
    key = check_text(field, value, MAX_KEY_BYTES, 1)
    for char in key:
        if unicodedata.category(char) == "Cc":
            raise BadText(field, key, f"contains the control character {char!r}")
    return key


def optional_key(field: str, value: object) -> str | None:
    return None if value is None else check_key(field, value)


def check_id(field: str, value: object) -> str:
    """A task or session id: ``[A-Za-z0-9_-]{1,128}``. Anything else names no record."""
    if not isinstance(value, str):
        raise BadText(field, value, "must be an id string")
    if len(value) > MAX_ID_CHARS:
        raise BadText(field, value, f"is {len(value)} characters; ids are at most {MAX_ID_CHARS}")
    if ID.fullmatch(value) is None:
        raise BadText(field, value, "is not an id (ASCII letters, digits, '_' and '-')")
    return value


def check_user_text(field: str, value: object) -> str:
    return check_text(field, value, MAX_USER_BYTES, 1)


def check_argv(field: str, argv: object) -> tuple[str, ...]:
    """A non-empty list of argument strings whose first is non-empty."""
    if not isinstance(argv, list | tuple):
        raise BadText(field, argv, "must be a list of strings")
    if len(argv) > MAX_ARGV_ITEMS:
        raise TooLarge(field, f"<{len(argv)} items>", f"has over {MAX_ARGV_ITEMS} items")
    items = tuple(check_text(f"{field}[{i}]", a, MAX_ARG_BYTES) for i, a in enumerate(argv))
    if not items or not items[0]:
        raise BadText(field, list(items), "is empty: nothing to run")
    return items


def check_env(field: str, env: Iterable[tuple[object, object]]) -> tuple[tuple[str, str], ...]:
    """``(NAME, VALUE)`` pairs: NAME 1..1024 bytes without ``=``, ``NAME=VALUE`` within
    MAX_ARG_STRLEN."""
    pairs = list(env)
    if len(pairs) > MAX_ENV_ITEMS:
        raise TooLarge(field, f"<{len(pairs)} entries>", f"has over {MAX_ENV_ITEMS} entries")
    checked = []
    for name, value in pairs:
        name_size = utf8_size(f"{field} name", name)
        assert isinstance(name, str)
        if not name or "=" in name:
            raise BadText(f"{field} name", name, "is not a variable name (non-empty, no '=')")
        if name_size > MAX_ENV_NAME_BYTES:
            raise TooLarge(f"{field} name", name, f"is over {MAX_ENV_NAME_BYTES} bytes")
        check_text(f"{field} {name}", value, MAX_ARG_BYTES - name_size - 1)
        assert isinstance(value, str)
        checked.append((name, value))
    return tuple(checked)


def check_command_size(field: str, argv: Iterable[str], env: Iterable[tuple[str, str]]) -> None:
    """argv and env together within half of ARG_MAX, each entry costing its NUL and pointer."""
    total = sum(len(a.encode()) + 1 + POINTER_BYTES for a in argv)
    total += sum(len(k.encode()) + len(v.encode()) + 2 + POINTER_BYTES for k, v in env)
    if total > MAX_COMMAND_BYTES:
        raise TooLarge(
            field, f"<{total} bytes>", f"argv and env are over {MAX_COMMAND_BYTES} bytes"
        )


def check_paths(field: str, paths: object) -> tuple[str, ...]:
    """A list of at most 64 absolute paths."""
    if not isinstance(paths, list | tuple):
        raise BadText(field, paths, "must be a list of absolute paths")
    if len(paths) > MAX_WRITABLE:
        raise TooLarge(field, f"<{len(paths)} paths>", f"has over {MAX_WRITABLE} paths")
    checked = tuple(check_path(field, p) for p in paths)
    for path in checked:
        if not path.startswith("/"):
            raise BadText(field, path, "must be an absolute path")
    return checked


def check_choice(field: str, value: object, choices: Iterable[str]) -> str:
    options = tuple(choices)
    if not isinstance(value, str) or value not in options:
        raise BadText(field, value, f"is not one of {', '.join(options)}")
    return value


def check_bool(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise BadValue(field, value, "must be true or false")
    return value


def reject_constant(name: str) -> Any:
    """``json.loads(parse_constant=...)``: NaN and Infinity are not JSON numbers."""
    raise BadNumber("body", name, "is not a JSON number (NaN and Infinity are not accepted)")
