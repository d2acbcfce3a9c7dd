"""Identity of a logical command (rule 1: identity outlives transport).

Owns the canonical form of a command and its digest, and the making of keys and ids.
A session's identity is (task, invocation_key); its digest covers everything that defines the run,
so a retry with the same key and digest is the same command and a different digest is a conflict.
Never touches processes or the store.
"""

from __future__ import annotations

import os

from settled import grammar, netpolicy
from settled.canonical import digest_of
from settled.errors import BadInput
from settled.records import Frozen

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

SPEC_VERSION = "settled.command/v1"
BOUNDARY_POLICIES = ("auto", "cgroup2+pidns", "cgroup2", "pidns", "subreaper", "pgroup")
ISOLATION_POLICIES = ("auto", "strict", "none")
# A command's network: "proxy" (the Runtime's default), its task's own network namespace whose
# one way out is settled's proxy, which records every connection (netproxy/); "none", that
# namespace's loopback alone; "host", the host's (a grant its receipt names). A spec recorded
# without the field ran on the host's, as every command did before pods had a network.
NETWORK_POLICIES = ("proxy", "none", "host")
MAX_ID = (1 << 32) - 2  # uid_t/gid_t, (uid_t)-1 excluded
DEFAULT_GRACE_S = 5.0
SHELL = "/bin/sh"


def new_key() -> str:
    return "k_" + os.urandom(8).hex()


def new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(8).hex()}"


class CommandSpec(Frozen):
    """Everything that defines a run; two specs with equal digests are the same command.
    Built by keyword; every field is checked against its grammar (``settled.grammar``) here,
    whoever builds the spec, and normalized so that one command has one digest."""

    __slots__ = (
        "allow_hosts",
        "argv",
        "boundary",
        "cpus",
        "cwd",
        "env",
        "env_removed",
        "grace",
        "inherited",
        "isolation",
        "memory",
        "network",
        "pids",
        "readable",
        "service",
        "shell",
        "stdin_digest",
        "timeout",
        "user",
        "writable",
    )
    argv: tuple[str, ...] | None
    shell: str | None
    cwd: str
    env: tuple[tuple[str, str], ...]
    stdin_digest: str | None
    timeout: float | None
    grace: float
    boundary: str
    service: bool
    isolation: str
    user: tuple[int, int] | None  # (uid, gid) the command runs as; None: the owner's
    writable: tuple[str, ...]  # host paths granted writable beside the workspace and /tmp
    readable: tuple[str, ...]  # host paths granted read-only in the command's view
    memory: int | None  # bytes; None: the host's default (boundary/limits.py)
    network: str  # one of NETWORK_POLICIES
    allow_hosts: tuple[str, ...]  # netpolicy patterns: where the proxy lets it go; () all public
    pids: int | None  # processes and threads at once; None: the host's default
    cpus: float | None  # CPUs' worth of time; None: the host's default
    inherited: tuple[str, ...]  # names in env whose values came from the caller's environ
    env_removed: tuple[str, ...]  # the caller's names withheld from --inherit-env

    def __init__(
        self,
        *,
        argv: tuple[str, ...] | None = None,
        shell: str | None = None,
        cwd: str = ".",
        env: tuple[tuple[str, str], ...] = (),
        stdin_digest: str | None = None,
        timeout: float | None = None,
        grace: float = DEFAULT_GRACE_S,
        boundary: str = "auto",
        service: bool = False,
        isolation: str = "auto",
        user: tuple[int, int] | None = None,
        writable: tuple[str, ...] = (),
        readable: tuple[str, ...] = (),
        memory: int | None = None,
        pids: int | None = None,
        cpus: float | None = None,
        network: str = "host",
        allow_hosts: tuple[str, ...] = (),
        inherited: tuple[str, ...] = (),
        env_removed: tuple[str, ...] = (),
    ) -> None:
        if (argv is None) == (shell is None):
            raise BadInput("a command needs exactly one of argv or shell")
        if argv is not None:
            argv = grammar.check_argv("argv", argv)
        if shell is not None:
            grammar.check_text("shell", shell, grammar.MAX_ARG_BYTES)
        grammar.check_text("cwd", cwd, grammar.MAX_PATH_BYTES)
        env = grammar.check_env("env", env)
        grammar.check_command_size("command", _exec_argv(argv, shell), env)
        if timeout is not None:  # 5 and 5.0 are one command
            timeout = grammar.check_seconds("timeout", timeout, grammar.MAX_TIMEOUT_S)
        grace = grammar.check_seconds("grace", grace, grammar.MAX_GRACE_S)
        grammar.check_choice("boundary", boundary, BOUNDARY_POLICIES)
        grammar.check_choice("isolation", isolation, ISOLATION_POLICIES)
        grammar.check_choice("network", network, NETWORK_POLICIES)
        allow_hosts = netpolicy.check_allowed("allow_hosts", allow_hosts, network)
        grammar.check_bool("service", service)
        if user is not None:
            user = check_user(user)
        writable = tuple(sorted(set(grammar.check_paths("writable", writable))))
        readable = tuple(sorted(set(grammar.check_paths("readable", readable))))
        if memory is not None:
            memory = grammar.check_memory("memory", memory)
        if pids is not None:
            pids = grammar.check_pids("pids", pids)
        if cpus is not None:  # 2 and 2.0 are one command
            cpus = grammar.check_cpus("cpus", cpus)
        inherited, env_removed = _names("inherited", inherited), _names("env_removed", env_removed)
        if stray := set(inherited) - {name for name, _ in env}:
            raise BadInput(f"inherited names {sorted(stray)} are not in the command's env")
        self._fill(locals())

    @property
    def exec_argv(self) -> list[str]:
        """What is executed: a single shell string runs through /bin/sh -c."""
        return _exec_argv(self.argv, self.shell)

    def to_json(self) -> dict[str, Any]:
        return {
            "v": SPEC_VERSION,
            "argv": list(self.argv) if self.argv is not None else None,
            "shell": self.shell,
            "cwd": self.cwd,
            "env": [[k, v] for k, v in self.env],
            "stdin": self.stdin_digest,
            "timeout": self.timeout,
            "grace": self.grace,
            "boundary": self.boundary,
            "service": self.service,
            # Only when not the default, so every digest made before these existed still holds.
            **({"isolation": self.isolation} if self.isolation != "auto" else {}),
            **({"user": list(self.user)} if self.user is not None else {}),
            **({"writable": list(self.writable)} if self.writable else {}),
            **({"readable": list(self.readable)} if self.readable else {}),
            **({"memory": self.memory} if self.memory is not None else {}),
            **({"pids": self.pids} if self.pids is not None else {}),
            **({"cpus": self.cpus} if self.cpus is not None else {}),
            **({"network": self.network} if self.network != "host" else {}),
            **({"allow_hosts": list(self.allow_hosts)} if self.allow_hosts else {}),
            **({"inherited": list(self.inherited)} if self.inherited else {}),
            **({"env_removed": list(self.env_removed)} if self.env_removed else {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CommandSpec:
        if data.get("v") != SPEC_VERSION:
            raise BadInput(f"command spec version {data.get('v')!r} is not {SPEC_VERSION}")
        argv = data.get("argv")
        return cls(
            argv=tuple(argv) if argv is not None else None,
            shell=data.get("shell"),
            cwd=data.get("cwd", "."),
            env=tuple((str(k), str(v)) for k, v in data.get("env", [])),
            stdin_digest=data.get("stdin"),
            timeout=data.get("timeout"),
            grace=float(data.get("grace", DEFAULT_GRACE_S)),
            boundary=data.get("boundary", "auto"),
            service=bool(data.get("service", False)),
            isolation=data.get("isolation", "auto"),
            user=check_user(data["user"]) if data.get("user") is not None else None,
            writable=tuple(data.get("writable", ())),
            readable=tuple(data.get("readable", ())),
            memory=data.get("memory"),
            pids=data.get("pids"),
            cpus=data.get("cpus"),
            network=data.get("network", "host"),
            allow_hosts=tuple(data.get("allow_hosts", ())),
            inherited=tuple(data.get("inherited", ())),
            env_removed=tuple(data.get("env_removed", ())),
        )

    @property
    def digest(self) -> str:
        return digest_of(self.to_json())


def _exec_argv(argv: tuple[str, ...] | None, shell: str | None) -> list[str]:
    if shell is not None:
        return [SHELL, "-c", shell]
    assert argv is not None
    return list(argv)


def _names(label: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """A list of environment names, each inside the grammar, sorted and without repeats."""
    listed = tuple(sorted(set(names)))
    grammar.check_env(label, ((name, "") for name in listed))
    return listed


def check_user(user: object) -> tuple[int, int]:
    if (
        not isinstance(user, tuple | list)
        or len(user) != 2
        or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_ID for i in user
        )
    ):
        raise BadInput(f"--user {user!r} must be a uid and gid, each 0..{MAX_ID}")
    return (int(user[0]), int(user[1]))


def parse_user(text: str) -> tuple[int, int]:
    """`UID[:GID]` or `NAME[:GROUP]` (a name is looked up here, once, never in the owner); a
    missing GID is the user's primary group, or the uid itself when no such user exists."""
    import grp
    import pwd

    grammar.check_user_text("user", text)
    name, _, group = text.partition(":")
    try:
        if name.isascii() and name.isdigit():
            uid = int(name)
            try:
                default_gid = pwd.getpwuid(uid).pw_gid
            except KeyError:
                default_gid = uid
        else:
            entry = pwd.getpwnam(name)
            uid, default_gid = entry.pw_uid, entry.pw_gid
        if not group:
            gid = default_gid
        elif group.isascii() and group.isdigit():
            gid = int(group)
        else:
            gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise BadInput(f"--user {text!r}: no such user or group on this host") from None
    return check_user((uid, gid))


def normalize_env(pairs: list[str] | dict[str, str]) -> tuple[tuple[str, str], ...]:
    """`K=V` strings or a mapping, sorted by name so order never changes the digest."""
    items: dict[str, str] = {}
    if isinstance(pairs, dict):
        for name, value in pairs.items():  # text here; a name's form is the spec's to check
            grammar.utf8_size("env name", name)
            grammar.utf8_size(f"env {name}", value)
        items = dict(pairs)
    else:
        if not isinstance(pairs, list | tuple):
            raise BadInput(f"env {pairs!r} must be a list of NAME=VALUE or a mapping")
        for pair in pairs:
            grammar.check_text("env", pair, grammar.MAX_ARG_BYTES)
            name, sep, value = pair.partition("=")
            if not sep:
                raise BadInput(f"--env {pair!r} is not of the form NAME=VALUE")
            items[name] = value
    return tuple(sorted(items.items()))


def resolve_cwd(workspace: str, cwd: str) -> str:
    """The cwd relative to the workspace, refusing any path (or symlink) that leaves it."""
    grammar.check_path("workspace", workspace)
    grammar.check_text("cwd", cwd, grammar.MAX_PATH_BYTES)  # "": the workspace itself
    root = os.path.realpath(workspace)
    target = os.path.realpath(os.path.join(root, cwd))
    if os.path.commonpath([root, target]) != root:
        raise BadInput(f"--cwd {cwd!r} leaves the workspace {root} (resolves to {target})")
    if not os.path.isdir(target):
        raise BadInput(f"--cwd {cwd!r} is not a directory inside the workspace {root}")
    rel = os.path.relpath(target, root)
    return "." if rel == "." else rel
