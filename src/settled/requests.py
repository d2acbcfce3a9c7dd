"""What a caller asks of a verb, written once: `ExecRequest` (exec) and `TaskRequest` (task new).

Owns, for each option of those verbs, one row of its request's table (`Option`): its name (the
Runtime's keyword and the HTTP body's key, the same word), its default, the grammar a value
from the wire must pass (`settled.grammar`, `netpolicy`), and whether it travels over the wire
at all (`stdin` and the caller's own environment never do: a remote caller resolves them
where they are). Every face builds one: the CLI from its flags, the HTTP service from a body
(`from_json`, which refuses an unknown field by name), the MCP tools from their arguments, the
Python client for the body it sends (`to_json`); the Runtime takes one (`Runtime.admit`,
`Runtime.create_task`). A new exec option is one row and one annotation here, the Runtime's
use of it, and its flag in `cli/parser.py`.

Must never: judge what a value means (a path's owner, a task's defaults, what this host can
enforce: the Runtime does, after this), coerce a type (``"5"`` is not a number of seconds),
or guess a missing invocation key on the wire (a retry after a lost response must send the key
of its first attempt). Foundation layer: slotted `records.Frozen` classes and no `typing` at
import, since the client and every exec load it.
"""

from __future__ import annotations

from settled import grammar, netpolicy
from settled.errors import BadInput
from settled.records import Frozen

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any, Self

    Check = Callable[[str, Any], Any]


class Option(Frozen):
    """One option of a verb: `check` is the grammar a value from the wire passes (applied to
    a value that is not null; null is the default); `wire` False for what never travels."""

    __slots__ = ("check", "default", "name", "wire")
    name: str
    default: Any
    check: Check | None
    wire: bool

    def __init__(self, name: str, default: Any, check: Check | None, wire: bool = True) -> None:
        self._fill(locals())


def refuse_unknown(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
    """BadInput naming every field of `body` that the endpoint does not take: a typo such as
    ``"timout"`` must not silently run a command without its timeout."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadInput(
            f"unknown field(s) {grammar.shown(', '.join(map(repr, unknown)))}; "
            f"this endpoint takes {', '.join(sorted(allowed))}"
        )


class Request(Frozen):
    """A verb's options as one value: made from keywords (the Runtime's and the faces'), from a
    JSON body (`from_json`), and sent as one (`to_json`)."""

    __slots__ = ()
    OPTIONS: tuple[Option, ...] = ()

    def __init__(self, **given: Any) -> None:
        names = {option.name for option in self.OPTIONS}
        for name in given:
            if name not in names:  # what Python says of a keyword no signature has
                raise TypeError(f"{type(self).__name__}() got an unexpected keyword {name!r}")
        self._fill({o.name: given.get(o.name, o.default) for o in self.OPTIONS})

    @classmethod
    def fields(cls) -> frozenset[str]:
        """The JSON body's fields: every option that travels."""
        return frozenset(option.name for option in cls.OPTIONS if option.wire)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Self:
        """The request a JSON body asks for, each value through its grammar; an unknown field
        is refused by name, and so is one that never travels (`stdin`)."""
        refuse_unknown(body, cls.fields())
        cls._check_whole(body)
        values = {}
        for option in cls.OPTIONS:
            value = body.get(option.name) if option.wire else None
            if value is not None and option.check is not None:
                values[option.name] = option.check(option.name, value)
        return cls(**values)

    @classmethod
    def _check_whole(cls, body: Mapping[str, Any]) -> None:
        """What a body must say as a whole, before its fields are checked one by one."""

    def to_json(self) -> dict[str, Any]:
        """The body that asks for this request, in the table's order, so every retry sends
        the same bytes: each option that travels, unless null or its default (which the
        server reads the same from its absence)."""
        body: dict[str, Any] = {}
        for option in self.OPTIONS:
            value = _plain(getattr(self, option.name))
            if option.wire and value is not None and value != _plain(option.default):
                body[option.name] = value
        return body

    def keywords(self) -> dict[str, Any]:
        """The options as keyword arguments."""
        return {option.name: getattr(self, option.name) for option in self.OPTIONS}


def _plain(value: Any) -> Any:
    """A value as JSON carries it: a sequence as a list, a mapping as an object."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


# -- the grammar of each field on the wire ----------------------------------------------------


def _argv(name: str, value: Any) -> list[str]:
    return list(grammar.check_argv(name, value))


def _shell(name: str, value: Any) -> str | None:
    return grammar.optional_text(name, value, grammar.MAX_ARG_BYTES)


def _timeout(name: str, value: Any) -> float | None:
    return grammar.optional_seconds(name, value, grammar.MAX_TIMEOUT_S)


def _grace(name: str, value: Any) -> float | None:
    return grammar.optional_seconds(name, value, grammar.MAX_GRACE_S)


def _cwd(name: str, value: Any) -> str:
    return grammar.optional_text(name, value, grammar.MAX_PATH_BYTES) or "."


def _env(name: str, value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise grammar.BadText(name, value, "must be an object of NAME: VALUE strings")
    return dict(grammar.check_env(name, value.items()))


def _inherited(name: str, value: Any) -> list[str]:
    """Names of `env` the caller took from its own environment: recorded, never resolved by
    a server (it hands a command none of its own variables)."""
    if not isinstance(value, list):
        raise grammar.BadText(name, value, "must be a list of variable names")
    return [variable for variable, _ in grammar.check_env(name, ((n, "") for n in value))]


def _boundary(name: str, value: Any) -> str:
    from settled.identity import BOUNDARY_POLICIES

    return grammar.check_choice(name, value, BOUNDARY_POLICIES)


def _isolation(name: str, value: Any) -> str:
    from settled.identity import ISOLATION_POLICIES

    return grammar.check_choice(name, value, ISOLATION_POLICIES)


def _network(name: str, value: Any) -> str:
    from settled.identity import NETWORK_POLICIES

    return grammar.check_choice(name, value, NETWORK_POLICIES)


def _paths(name: str, value: Any) -> list[str]:
    return list(grammar.check_paths(name, value))


def _allow_hosts(name: str, value: Any) -> list[str]:
    return list(netpolicy.check_patterns(name, value))


MAX_IGNORE_PATTERNS = 1024


def _ignore(name: str, value: Any) -> list[str]:
    """Extra gitignore patterns (strings, at most MAX_IGNORE_PATTERNS); compiled at task new."""
    if not isinstance(value, list) or len(value) > MAX_IGNORE_PATTERNS:
        raise BadInput(f"{name} must be a list of at most {MAX_IGNORE_PATTERNS} patterns")
    return [grammar.check_text(name, pattern, 4096, 1) for pattern in value]


# The walls of a command: its grants and limits, its network and where that may go. An exec's
# own, or (in a task's request) the defaults of every command of the task.
WALLS = (
    Option("writable", (), _paths),
    Option("readable", (), _paths),
    Option("memory", None, grammar.check_memory),
    Option("pids", None, grammar.check_pids),
    Option("cpus", None, grammar.check_cpus),
    Option("network", None, _network),
    Option("allow_hosts", None, _allow_hosts),
)


class ExecRequest(Request):
    """`exec`: a command (exactly one of `argv` and `shell`) and how it runs. Runtime.admit's
    docstring says what each option means."""

    OPTIONS = (
        Option("key", None, grammar.check_key),
        Option("argv", None, _argv),
        Option("shell", None, _shell),
        Option("timeout", None, _timeout),
        Option("grace", None, _grace),
        Option("cwd", ".", _cwd),
        Option("env", None, _env),
        Option("inherited", (), _inherited),
        Option("service", False, grammar.check_bool),
        Option("boundary", "auto", _boundary),
        Option("isolation", "auto", _isolation),
        Option("user", None, grammar.check_user_text),
        *WALLS,
        Option("stdin", None, None, wire=False),  # bytes: a remote caller sends none
        Option("inherit", (), None, wire=False),  # names of this process's variables
        Option("inherit_env", False, None, wire=False),  # all of this process's variables
    )
    __slots__ = tuple(option.name for option in OPTIONS)
    key: str | None
    argv: list[str] | tuple[str, ...] | None
    shell: str | None
    timeout: float | None
    grace: float | None
    cwd: str
    env: dict[str, str] | list[str] | None
    inherited: list[str] | tuple[str, ...]
    service: bool
    boundary: str
    isolation: str
    user: str | tuple[int, int] | list[int] | None
    writable: list[str] | tuple[str, ...]
    readable: list[str] | tuple[str, ...]
    memory: int | None
    pids: int | None
    cpus: float | None
    network: str | None
    allow_hosts: list[str] | tuple[str, ...] | None
    stdin: bytes | None
    inherit: list[str] | tuple[str, ...]
    inherit_env: bool

    @classmethod
    def _check_whole(cls, body: Mapping[str, Any]) -> None:
        if body.get("key") is None:
            raise BadInput(
                "`key` is required over HTTP: choose it before the first attempt and send the "
                "same key on every retry, so a retry after a lost response returns the same "
                "session"
            )
        grammar.check_key("key", body["key"])
        if (body.get("shell") is None) == (body.get("argv") is None):
            raise BadInput("give exactly one of `shell` (a string) or `argv` (a list of strings)")


class TaskRequest(Request):
    """`task new`: the workspace (None: one settled makes), the key, and the defaults of every
    command of the task. Runtime.create_task's docstring says what each option means."""

    OPTIONS = (
        Option("workspace", None, grammar.check_path),
        Option("key", None, grammar.optional_key),
        Option("user", None, grammar.check_user_text),
        Option("shared_workspace", False, grammar.check_bool),
        Option("ignore", (), _ignore),
        *WALLS,
    )
    __slots__ = tuple(option.name for option in OPTIONS)
    workspace: str | None
    key: str | None
    user: str | tuple[int, int] | None
    shared_workspace: bool
    ignore: list[str] | tuple[str, ...]
    writable: list[str] | tuple[str, ...]
    readable: list[str] | tuple[str, ...]
    memory: int | None
    pids: int | None
    cpus: float | None
    network: str | None
    allow_hosts: list[str] | tuple[str, ...] | None
