"""The store's admission and workspace rules as pure decisions: facts in, a verdict out.

Written once and called by every store implementation inside the transaction that records
the outcome (so the facts cannot change under the verdict), and by the Runtime's pre-check
before it pays for anything (`key_verdict`: is this key a retry?). The same facts give the
same verdict whichever database they came from; `tests/test_store_decisions.py` hands them in.

    key_verdict(existing, digest)       -> REUSE | NEW | KeyConflict
        a key names one command: the same digest again is a retry, another digest is refused
    admission_verdict(task facts)       -> ADMIT | AdmissionSealed | TaskFrozen | AdmissionFrozen
        only an open task, not frozen, with no session of unknown fate, admits a new command
    overlapping(workspace, candidates)  -> the tasks whose workspace overlaps this one
    creation_verdict(overlaps, shared)  -> CREATE | WorkspaceOverlap

A refusal is returned as the error to raise, never raised by the decision: a table test reads
it as a value, and a caller raises it with `enforce`.
Never touches a database, a process or the workspace.
"""

from __future__ import annotations

from settled.errors import (
    AdmissionFrozen,
    AdmissionSealed,
    KeyConflict,
    SettledError,
    TaskFrozen,
    WorkspaceOverlap,
)
from settled.records import SessionRecord
from settled.states import TASK_OPEN

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any, Final

    # A task that may share the workspace: (task, workspace path, its recorded identity).
    Candidate = tuple[str, str, dict[str, Any] | None]
    Refusal = AdmissionSealed | TaskFrozen | AdmissionFrozen

REUSE: Final = "reuse"  # the key was admitted with this digest: answer with its session
NEW: Final = "new"  # the key names no session yet: admit one
ADMIT: Final = "admit"
CREATE: Final = "create"


def key_verdict(existing: SessionRecord | None, key: str, digest: str) -> str | KeyConflict:
    """Is this key a retry? `existing` is the session the task already admitted under `key`
    (None: none). The same digest is a retry (REUSE); another digest is a KeyConflict naming
    both digests and the session that holds the key."""
    if existing is None:
        return NEW
    if existing.digest != digest:
        return KeyConflict(existing.task, key, existing.digest, digest, existing.session)
    return REUSE


def admission_verdict(
    task: str, state: str, frozen: str | None, unknown_session: str | None
) -> str | Refusal:
    """May the task admit a new command? Only while open (AdmissionSealed otherwise), not
    frozen by a vanished host (TaskFrozen), and with no session whose fate is unknown
    (AdmissionFrozen: a command that may still run could conflict with the new one). Asked
    after `key_verdict`: a retry is answered even by a sealed or frozen task."""
    if state != TASK_OPEN:
        return AdmissionSealed(task, state)
    if frozen is not None:
        return TaskFrozen(task, frozen)
    if unknown_session is not None:
        return AdmissionFrozen(task, unknown_session)
    return ADMIT


def overlap(a: str, b: str) -> bool:
    """Two resolved directories are the same, or one holds the other."""
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def workspaces_overlap(
    path: str, identity: dict[str, Any] | None, other_path: str, other: dict[str, Any] | None
) -> bool:
    """Two workspaces overlap by path (`overlap`), or, when both have identities recorded
    (rootid.read), by identity: the same directory, or either's root among the directories
    that hold the other (a bind mount, a symlinked path or a second mount of one filesystem
    shows the same device and inode under another path)."""
    if overlap(path, other_path):
        return True
    if identity is None or other is None:
        return False  # a task made before identities: by path, as it was
    root, other_root = _root(identity), _root(other)
    return root == other_root or root in _held_by(other) or other_root in _held_by(identity)


def _root(identity: dict[str, Any]) -> tuple[int, int]:
    return int(identity["dev"]), int(identity["ino"])


def _held_by(identity: dict[str, Any]) -> set[tuple[int, int]]:
    return {(int(dev), int(ino)) for dev, ino in identity.get("ancestors", ())}


def overlapping(
    workspace: str, identity: dict[str, Any] | None, candidates: Iterable[Candidate]
) -> list[tuple[str, str]]:
    """(task, path) of each candidate whose workspace overlaps this one, in the given order.
    The candidates are the tasks not yet complete on the same host (the store selects them)."""
    return [
        (task, path)
        for task, path, other in candidates
        if workspaces_overlap(workspace, identity, path, other)
    ]


def creation_verdict(
    workspace: str, overlaps: list[tuple[str, str]], shared_workspace: bool
) -> str | WorkspaceOverlap:
    """A task may be made in a workspace no unfinished task of its host has (CREATE), or in
    one that overlaps theirs when it asked to share (CREATE: each then names the other);
    otherwise WorkspaceOverlap naming them."""
    if overlaps and not shared_workspace:
        return WorkspaceOverlap(workspace, overlaps)
    return CREATE


def enforce(verdict: str | SettledError) -> str:
    """The verdict, once it is not a refusal; a refusal is raised."""
    if isinstance(verdict, SettledError):
        raise verdict
    return verdict
