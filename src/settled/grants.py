"""Grants: which host directories a command may be given beside its workspace, decided once.

A session's view is an allow-list (boundary/isolation.py): the distribution's system roots
read-only, the workspace, the task's own /tmp and HOME, and nothing else of the host but what
the caller grants with `--writable DIR` (read-write) or `--readable DIR` (read-only), per exec
or as a task's default. A grant is the one way a caller opens the wall, so each is checked
before anything is recorded: it must be an absolute path to a directory that exists (resolved,
so the grant and the digest name the directory a bind mount would reach, never a link a
command could re-point), and it must not be or overlap anything settled holds evidence in: `/`
(the whole host: ask for `--isolation none` instead, which the receipt states), the settled
home (its store, logs, objects, pods and sockets), another task's workspace, or a store or
object directory of the home's backends. Each refusal is one `BadGrant` naming the grant and
what it would have opened.

Owns only that decision (pure, but for resolving each path). Must never: grant what it cannot
name, or accept a path it did not resolve.
"""

from __future__ import annotations

import os

from settled import grammar
from settled.errors import BadInput

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

GRANT_KINDS = ("writable", "readable")


class BadGrant(BadInput):
    """A `--writable` or `--readable` path the command may not be given: names it and why."""


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _overlap(a: str, b: str) -> bool:
    return _within(a, b) or _within(b, a)


def resolve(kind: str, paths: Iterable[str]) -> tuple[str, ...]:
    """Each path of a `--writable`/`--readable` list checked against the grammar, resolved
    and refused unless it is an existing directory; sorted, without repeats."""
    grammar.check_choice("grant", kind, GRANT_KINDS)
    resolved: set[str] = set()
    for path in grammar.check_paths(kind, list(paths)):
        real = os.path.realpath(path)
        if not os.path.isdir(real):
            why = "does not exist" if not os.path.lexists(path) else "is not a directory"
            raise BadGrant(f"--{kind} {path!r} {why} on this host")
        if real == "/":
            raise BadGrant(
                f"--{kind} {path!r} is the whole host: grant the directories the command "
                "needs, or run it with --isolation none (its receipt then says the host was "
                "open to it)"
            )
        resolved.add(real)
    return tuple(sorted(resolved))


def refuse_held(
    kind: str,
    granted: Iterable[str],
    *,
    home: str,
    workspace: str,
    workspaces: Iterable[str],
    evidence_dirs: Iterable[str] = (),
    other_homes: Iterable[str] = (),
) -> None:
    """BadGrant for the first grant that is, holds or lies inside the settled home, another
    task's workspace (any of `workspaces` other than this task's `workspace`) or one of
    `evidence_dirs` (the directories of the home's store and object store), or another home
    that shares its store (`other_homes`). The task's own
    workspace, a directory inside it or one holding it, may be granted."""
    paths = tuple(granted)
    if not paths:
        return
    home = os.path.realpath(home)
    others = {os.path.realpath(w) for w in workspaces} - {os.path.realpath(workspace)}
    held = [(home, "the settled home (its store, logs, objects and sockets)")]
    held += [(os.path.realpath(d), "a store or object directory of this home")
             for d in evidence_dirs]  # fmt: skip
    held += [(os.path.realpath(h), "another settled home sharing this home's store")
             for h in other_homes]  # fmt: skip
    for path in paths:
        for root, what in held:
            if _overlap(path, root):
                raise BadGrant(f"--{kind} {path!r} would open {root}, {what}")
        for other in sorted(others):
            if _overlap(path, other):
                raise BadGrant(f"--{kind} {path!r} would open {other}, another task's workspace")


def evidence_dirs(store_url: str, objects_url: str) -> list[str]:
    """The directories of a home's backends that hold evidence on this host: a SQLite store's
    directory and a local object store's. Remote backends hold none here."""
    found = []
    for url, scheme in ((store_url, "sqlite:"), (objects_url, "file:")):
        if url.startswith(scheme):
            path = url[len(scheme) :].lstrip("/")
            path = "/" + path
            found.append(os.path.dirname(path) if scheme == "sqlite:" else path)
    return found
