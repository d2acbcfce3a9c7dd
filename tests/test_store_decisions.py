"""The store's admission and overlap rules (`store/admission.py`), handed facts, no database.

Every store implementation and the Runtime's pre-check call these; the contract tests in
`tests/test_store.py` show each backend applying them inside its transaction."""

from __future__ import annotations

from typing import Any

import pytest

from settled.errors import (
    AdmissionFrozen,
    AdmissionSealed,
    KeyConflict,
    TaskFrozen,
    WorkspaceOverlap,
)
from settled.records import SessionRecord
from settled.states import SETTLED, UNKNOWN
from settled.store.admission import (
    ADMIT,
    CREATE,
    NEW,
    REUSE,
    admission_verdict,
    creation_verdict,
    enforce,
    key_verdict,
    overlap,
    overlapping,
    workspaces_overlap,
)


def _session(digest: str, state: str = SETTLED) -> SessionRecord:
    return SessionRecord(
        "s1", "t1", "k", digest, {}, state, 1, None, None, None, None, None, 0, 0, None,
        0.0, None, None, None,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("existing", "digest", "verdict"),
    [
        (None, "d1", NEW),  # the key names nothing yet
        (_session("d1"), "d1", REUSE),  # the same command again: a retry
        (_session("d1", UNKNOWN), "d1", REUSE),  # whatever became of it
        (_session("d1"), "d2", KeyConflict),  # another command under the key
    ],
)
def test_the_key_verdict_is_a_retry_a_new_command_or_a_conflict(
    existing: SessionRecord | None, digest: str, verdict: Any
) -> None:
    got = key_verdict(existing, "k", digest)
    if verdict is KeyConflict:
        assert isinstance(got, KeyConflict)
        assert (got.task, got.key, got.session) == ("t1", "k", "s1")
        assert (got.existing_digest, got.requested_digest) == ("d1", "d2")
    else:
        assert got == verdict


@pytest.mark.parametrize(
    ("state", "frozen", "unknown", "verdict"),
    [
        ("open", None, None, ADMIT),
        ("sealed", None, None, AdmissionSealed),
        ("closing", None, None, AdmissionSealed),
        ("complete", None, None, AdmissionSealed),
        ("open", "host gone", None, TaskFrozen),
        ("open", None, "s9", AdmissionFrozen),
        ("sealed", "host gone", "s9", AdmissionSealed),  # sealed first
        ("open", "host gone", "s9", TaskFrozen),  # then frozen, then an unknown session
    ],
)
def test_admission_admits_only_an_open_unfrozen_task_without_an_unknown_session(
    state: str, frozen: str | None, unknown: str | None, verdict: Any
) -> None:
    got = admission_verdict("t1", state, frozen, unknown)
    if isinstance(verdict, str):
        assert got == verdict
    else:
        assert type(got) is verdict
        assert "t1" in str(got)


def test_enforce_raises_a_refusal_and_passes_a_verdict() -> None:
    assert enforce(ADMIT) == ADMIT
    with pytest.raises(AdmissionFrozen, match="s9"):
        enforce(admission_verdict("t1", "open", None, "s9"))


ROOT = {"dev": 1, "ino": 10, "ancestors": [[1, 2]]}
BIND = {"dev": 1, "ino": 10, "ancestors": [[1, 5]]}  # the same directory by another path
INNER = {"dev": 1, "ino": 11, "ancestors": [[1, 10], [1, 2]]}  # a directory inside ROOT
APART = {"dev": 1, "ino": 12, "ancestors": [[1, 2]]}


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("/w", "/w", True),
        ("/w", "/w/sub", True),
        ("/w/sub", "/w", True),
        ("/w", "/w2", False),  # a prefix of the name is not a parent
        ("/", "/anything", True),
        ("/w/", "/w/x", True),
    ],
)
def test_two_paths_overlap_when_the_same_or_one_holds_the_other(
    a: str, b: str, expected: bool
) -> None:
    assert overlap(a, b) is expected


@pytest.mark.parametrize(
    ("path", "identity", "other_path", "other", "expected"),
    [
        ("/a", ROOT, "/b", BIND, True),  # one directory, two paths
        ("/a", ROOT, "/b", INNER, True),  # the other lies inside this one
        ("/b", INNER, "/a", ROOT, True),  # this one lies inside the other
        ("/a", ROOT, "/b", APART, False),  # siblings
        ("/a", None, "/b", BIND, False),  # an older task without identity: by path alone
        ("/a", ROOT, "/a/x", None, True),  # by path, whatever the identities
    ],
)
def test_two_workspaces_overlap_by_path_or_by_recorded_identity(
    path: str, identity: Any, other_path: str, other: Any, expected: bool
) -> None:
    assert workspaces_overlap(path, identity, other_path, other) is expected


def test_overlapping_names_each_overlapping_task_in_the_order_given() -> None:
    candidates = [
        ("t1", "/b", BIND),
        ("t2", "/elsewhere", APART),
        ("t3", "/a/inner", None),
        ("t4", "/c", INNER),
    ]
    assert overlapping("/a", ROOT, candidates) == [("t1", "/b"), ("t3", "/a/inner"), ("t4", "/c")]
    assert overlapping("/a", ROOT, []) == []


@pytest.mark.parametrize(
    ("overlaps", "shared", "verdict"),
    [
        ([], False, CREATE),
        ([], True, CREATE),
        ([("t1", "/w")], True, CREATE),  # shared: each task names the other
        ([("t1", "/w")], False, WorkspaceOverlap),
    ],
)
def test_a_task_is_made_in_an_overlapping_workspace_only_when_it_shares(
    overlaps: list[tuple[str, str]], shared: bool, verdict: Any
) -> None:
    got = creation_verdict("/w", overlaps, shared)
    if verdict is WorkspaceOverlap:
        assert isinstance(got, WorkspaceOverlap) and got.others == overlaps
    else:
        assert got == verdict


@pytest.mark.parametrize("module", ["admission", "dialect"])
def test_the_store_decisions_import_no_database_and_nothing_of_the_store_but_records(
    module: str,
) -> None:
    """Pure: facts in, a verdict out. A database module here would let a decision read."""
    import ast
    import importlib

    source = importlib.import_module(f"settled.store.{module}").__file__
    assert source is not None
    with open(source, encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not {"sqlite3", "psycopg", "settled.store.sql", "settled.store.sqlite"} & imported
    assert {name for name in imported if name and name.startswith("settled.store")} == set()
