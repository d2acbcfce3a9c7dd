"""Ignore rules in gitignore syntax, bound once at task creation.

A workspace as developers keep it has build output, caches and virtualenvs nobody wants in a
checkpoint. The rules come from ``.settledignore`` in the workspace root plus patterns given at
task creation, and are read ONCE, then (the patterns, in order, and their digest) recorded: a
command that edits ``.settledignore`` mid-task cannot widen what the proof leaves out, because
the scans use the recorded rules, never the file as it is now. ``.settledignore`` itself is
never ignored, so its content at each checkpoint is covered like any other file.

Ignored paths are not in a checkpoint; restore leaves them as they are (it neither restores nor
removes what the checkpoint does not cover), which the manifest states by carrying the patterns.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pathspec import GitIgnoreSpec

from settled.errors import BadInput

IGNORE_FILE = ".settledignore"
MAX_IGNORE_BYTES = 1 << 20  # a rules file larger than this is refused, not read without bound


@dataclass(frozen=True)
class IgnoreRules:
    """Compiled patterns; ``patterns`` is what is recorded, ``digest`` names them."""

    patterns: tuple[str, ...] = ()
    spec: GitIgnoreSpec = field(default_factory=lambda: GitIgnoreSpec.from_lines([]), repr=False)

    @property
    def digest(self) -> str:
        """What a receipt or manifest quotes to name these patterns (``ignore_digest``)."""
        return ignore_digest(self.patterns)

    def record(self) -> dict[str, Any]:
        """The fact a task record / manifest carries: the patterns and their digest."""
        return {"patterns": list(self.patterns), "digest": self.digest}

    def ignores(self, rel: str, is_dir: bool) -> bool:
        """Whether the workspace-relative path ``rel`` is left out (``.settledignore`` never)."""
        if not self.patterns or rel == IGNORE_FILE:
            return False
        return bool(self.spec.match_file(rel + "/" if is_dir else rel))


NO_RULES = IgnoreRules()


def ignore_digest(patterns: Iterable[str]) -> str:
    """sha256 of the compact JSON list of patterns, in order (order matters: later ones win)."""
    data = json.dumps(list(patterns), separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(data.encode("utf-8")).hexdigest()


def compile_rules(patterns: Iterable[str]) -> IgnoreRules:
    """Compile ``patterns`` (blanks and ``#`` comments dropped); a bad one is refused by name."""
    kept: list[str] = []
    for raw in patterns:
        if not isinstance(raw, str):
            raise BadInput(f"ignore pattern {raw!r} is not a string")
        line = raw.rstrip("\r\n")
        if "\n" in line or "\x00" in line:
            raise BadInput(f"ignore pattern {raw!r} holds a newline or NUL")
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            raise BadInput(f"ignore pattern {raw!r} is not valid UTF-8") from None
        if not line.strip() or line.startswith("#"):
            continue
        try:
            GitIgnoreSpec.from_lines([line])
        except ValueError as error:
            raise BadInput(
                f"ignore pattern {line!r} is not valid gitignore syntax: {error}"
            ) from None
        kept.append(line)
    return IgnoreRules(tuple(kept), GitIgnoreSpec.from_lines(kept))


def read_ignore_file(root: str | os.PathLike[str]) -> list[str]:
    """The lines of ``root/.settledignore`` (none if absent); a symlink or non-file is refused."""
    path = os.path.join(os.fspath(root), IGNORE_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return []
    except OSError as error:
        raise BadInput(f"{IGNORE_FILE} cannot be read: {error.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise BadInput(f"{IGNORE_FILE} is not a regular file")
        data = handle.read(MAX_IGNORE_BYTES + 1)
    if len(data) > MAX_IGNORE_BYTES:
        raise BadInput(f"{IGNORE_FILE} is larger than {MAX_IGNORE_BYTES} bytes")
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise BadInput(f"{IGNORE_FILE} is not UTF-8") from None


def bind(root: str | os.PathLike[str], extra: Iterable[str] = ()) -> IgnoreRules:
    """The rules for a new task: the file's patterns first, then ``extra`` (later ones win)."""
    return compile_rules([*read_ignore_file(root), *extra])


def from_record(fact: object) -> IgnoreRules:
    """Rebuild the rules from a recorded fact (``record()``'s shape); absent means none."""
    if fact is None:
        return NO_RULES
    if not isinstance(fact, dict) or not isinstance(fact.get("patterns"), list):
        raise BadInput(f"recorded ignore rules {fact!r} are malformed")
    rules = compile_rules(fact["patterns"])
    if fact.get("digest") not in (None, rules.digest):
        raise BadInput("recorded ignore rules do not match their digest")
    return rules
