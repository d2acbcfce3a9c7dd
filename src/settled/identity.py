"""Identity of a logical command (rule 1: identity outlives transport).

Owns the canonical form of a command and its digest, and the making of keys and ids.
A session's identity is (task, invocation_key); its digest covers everything that defines the run,
so a retry with the same key and digest is the same command and a different digest is a conflict.
Never touches processes or the store.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from settled.canonical import digest_of
from settled.errors import BadInput

SPEC_VERSION = "settled.command/v1"
BOUNDARY_POLICIES = ("auto", "cgroup2", "pidns", "subreaper", "pgroup")
DEFAULT_GRACE_S = 5.0
SHELL = "/bin/sh"


def new_key() -> str:
    return "k_" + os.urandom(8).hex()


def new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(8).hex()}"


@dataclass(frozen=True)
class CommandSpec:
    """Everything that defines a run; two specs with equal digests are the same command."""

    argv: tuple[str, ...] | None = None
    shell: str | None = None
    cwd: str = "."
    env: tuple[tuple[str, str], ...] = ()
    stdin_digest: str | None = None
    timeout: float | None = None
    grace: float = DEFAULT_GRACE_S
    boundary: str = "auto"
    service: bool = False

    def __post_init__(self) -> None:
        if (self.argv is None) == (self.shell is None):
            raise BadInput("a command needs exactly one of argv or shell")
        if self.argv is not None and (not self.argv or not self.argv[0]):
            raise BadInput(f"argv {list(self.argv)!r} is empty: nothing to run")
        for name in ("timeout", "grace"):
            value = getattr(self, name)
            if value is None and name == "timeout":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise BadInput(f"--{name} {value!r} must be a number of seconds")
            if not math.isfinite(value) or value < 0:
                raise BadInput(f"--{name} {value!r} must be a finite number of seconds >= 0")
            object.__setattr__(self, name, float(value))  # 5 and 5.0 are one command
        if self.boundary not in BOUNDARY_POLICIES:
            raise BadInput(
                f"--boundary {self.boundary!r} is not one of {', '.join(BOUNDARY_POLICIES)}"
            )
        for name, _ in self.env:
            if not name or "=" in name or "\0" in name:
                raise BadInput(f"--env name {name!r} is not a valid variable name")

    @property
    def exec_argv(self) -> list[str]:
        """What is executed: a single shell string runs through /bin/sh -c."""
        if self.shell is not None:
            return [SHELL, "-c", self.shell]
        assert self.argv is not None
        return list(self.argv)

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
        )

    @property
    def digest(self) -> str:
        return digest_of(self.to_json())


def normalize_env(pairs: list[str] | dict[str, str]) -> tuple[tuple[str, str], ...]:
    """`K=V` strings or a mapping, sorted by name so order never changes the digest."""
    items: dict[str, str] = {}
    if isinstance(pairs, dict):
        items = dict(pairs)
    else:
        for pair in pairs:
            name, sep, value = pair.partition("=")
            if not sep:
                raise BadInput(f"--env {pair!r} is not of the form NAME=VALUE")
            items[name] = value
    return tuple(sorted(items.items()))


def resolve_cwd(workspace: str, cwd: str) -> str:
    """The cwd relative to the workspace, refusing any path (or symlink) that leaves it."""
    root = os.path.realpath(workspace)
    target = os.path.realpath(os.path.join(root, cwd))
    if os.path.commonpath([root, target]) != root:
        raise BadInput(f"--cwd {cwd!r} leaves the workspace {root} (resolves to {target})")
    if not os.path.isdir(target):
        raise BadInput(f"--cwd {cwd!r} is not a directory inside the workspace {root}")
    rel = os.path.relpath(target, root)
    return "." if rel == "." else rel
