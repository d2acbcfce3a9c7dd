"""The contract every Store implementation must pass: SQLite and PostgreSQL.

The store under test always comes from the `store_factory` fixture: a function that returns a
fresh Store for a directory (the same directory opens the same store again). It is parametrized
over BACKENDS; to add PostgreSQL, add a Backend whose `open` maps the directory to its own
database or schema and whose raw hooks (set a task's or a session's state, read and write the
schema version) do the same in SQL. Nothing else here names a backend, including the children of
the concurrency tests, which open the store by backend name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import pg
import psycopg
import pytest

from settled import states
from settled.boundary.pidns import has_cap_sys_admin
from settled.canonical import canonical_bytes
from settled.errors import (
    AdmissionSealed,
    HomeUnusable,
    KeyConflict,
    ReceiptTampered,
    StaleWrite,
    StoreUnreachable,
    UnknownSession,
    UnknownTask,
    WorkspaceOverlap,
)
from settled.receipts import seal
from settled.records import OwnerInfo, SessionRecord
from settled.states import (
    ADMITTED,
    LIVE_STATES,
    RUNNING,
    SESSION_STATES,
    SESSION_TRANSITIONS,
    SETTLED,
    SETTLING,
    UNKNOWN,
)
from settled.store import Store, dialect, schema
from settled.store.postgres import PostgresStore, open_postgres
from settled.store.rows import fact_digest
from settled.store.schema import SCHEMA_VERSION
from settled.store.sqlite import SQLiteStore

# --- backends -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    name: str
    open: Callable[[str], Store]
    # Raw hooks the public interface deliberately lacks, for arranging states under test.
    set_task_state: Callable[[Store, str, str], None]
    set_session_state: Callable[[Store, str, str], None]
    read_schema_version: Callable[[str], int | None]
    write_schema_version: Callable[[str, int], None]
    schema_version: int
    fetch: Callable[[Store, str, tuple[Any, ...]], list[tuple[Any, ...]]]  # raw SQL, ? params
    fixture: str | None = None  # a fixture that must run first (a server to start)


def _sqlite_path(directory: str) -> str:
    return os.path.join(directory, "settled.db")


def _sqlite_open(directory: str) -> Store:
    return SQLiteStore(_sqlite_path(directory))


def _sqlite_set_task_state(store: Store, task: str, state: str) -> None:
    cast(SQLiteStore, store)._db.execute("UPDATE tasks SET state=? WHERE task=?", (state, task))


def _sqlite_set_session_state(store: Store, session: str, state: str) -> None:
    cast(SQLiteStore, store)._db.execute(
        "UPDATE sessions SET state=? WHERE session=?", (state, session)
    )


def _sqlite_fetch(store: Store, query: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    with cast(SQLiteStore, store)._db as db:
        return db.execute(query, args).fetchall()


def _sqlite_read_schema_version(directory: str) -> int | None:
    with contextlib.closing(sqlite3.connect(_sqlite_path(directory))) as db:
        row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    return None if row is None else int(row[0])


def _sqlite_write_schema_version(directory: str, version: int) -> None:
    with contextlib.closing(sqlite3.connect(_sqlite_path(directory))) as db, db:
        db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(version),))


def _pg_open(directory: str) -> Store:
    return open_postgres(pg.url_for_directory(directory))


def _pg_open_one_connection(directory: str) -> Store:
    """The store of an owner that may start no thread (it unshared its PID namespace): one
    connection, no pool. The whole contract runs on it too."""
    return PostgresStore(pg.url_for_directory(directory), pooled=False)


def _pg_execute(store: Store, query: str, args: tuple[Any, ...]) -> None:
    with cast(PostgresStore, store)._connection() as conn:
        conn.execute(query, args)  # type: ignore[arg-type]


def _pg_fetch(store: Store, query: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    with cast(PostgresStore, store)._connection() as conn:
        cursor = conn.execute(query.replace("?", "%s"), args)  # type: ignore[arg-type]
        return cursor.fetchall() if cursor.description else []


def _pg_set_task_state(store: Store, task: str, state: str) -> None:
    _pg_execute(store, "UPDATE tasks SET state=%s WHERE task=%s", (state, task))


def _pg_set_session_state(store: Store, session: str, state: str) -> None:
    _pg_execute(store, "UPDATE sessions SET state=%s WHERE session=%s", (state, session))


def _pg_read_schema_version(directory: str) -> int | None:
    with psycopg.connect(pg.url_for_directory(directory)) as conn:
        row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    return None if row is None else int(row[0])


def _pg_write_schema_version(directory: str, version: int) -> None:
    with psycopg.connect(pg.url_for_directory(directory)) as conn:
        conn.execute("UPDATE meta SET value=%s WHERE key='schema_version'", (str(version),))


POSTGRESQL = Backend(
    name="postgresql",
    open=_pg_open,
    set_task_state=_pg_set_task_state,
    set_session_state=_pg_set_session_state,
    read_schema_version=_pg_read_schema_version,
    write_schema_version=_pg_write_schema_version,
    schema_version=SCHEMA_VERSION,
    fetch=_pg_fetch,
    fixture="pg_cluster",
)

BACKENDS: dict[str, Backend] = {
    "sqlite": Backend(
        name="sqlite",
        open=_sqlite_open,
        set_task_state=_sqlite_set_task_state,
        set_session_state=_sqlite_set_session_state,
        read_schema_version=_sqlite_read_schema_version,
        write_schema_version=_sqlite_write_schema_version,
        schema_version=SCHEMA_VERSION,
        fetch=_sqlite_fetch,
    ),
    "postgresql": POSTGRESQL,
    "postgresql-one-connection": dataclasses.replace(
        POSTGRESQL, name="postgresql-one-connection", open=_pg_open_one_connection
    ),
}

StoreFactory = Callable[[str], Store]


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Backend:
    chosen = BACKENDS[request.param]
    if chosen.fixture is not None:
        request.getfixturevalue(chosen.fixture)
    return chosen


@pytest.fixture
def store_factory(backend: Backend) -> Iterator[StoreFactory]:
    """A function returning a fresh Store for a directory; every store it made is closed after."""
    opened: list[Store] = []

    def factory(directory: str) -> Store:
        store = backend.open(directory)
        opened.append(store)
        return store

    yield factory
    for store in opened:
        with contextlib.suppress(Exception):
            store.close()


@pytest.fixture
def home(tmp_path: Any) -> str:
    return str(tmp_path)


@pytest.fixture
def store(store_factory: StoreFactory, home: str) -> Store:
    return store_factory(home)


# --- helpers ------------------------------------------------------------------------------

DIGEST_A = "sha256:" + "a" * 64
DIGEST_B = "sha256:" + "b" * 64
SPEC = {"v": "settled.command/v1", "argv": ["echo", "ünï"], "cwd": ".", "timeout": 1.5}
OWNER = OwnerInfo(pid=4242, start_time=123456, boot_id="boot-1", lease_until=1_000_000_000.5)
OTHER_OWNER = OwnerInfo(pid=4343, start_time=654321, boot_id="boot-1", lease_until=1_000_000_001.0)
BIG = 3 * 2**31 + 7  # a cursor past 32 bits: 2 GB/s for a few seconds

_keys = itertools.count()


def receipt(stdout: int = 1234, stderr: int = 56, **extra: Any) -> dict[str, Any]:
    """A sealed receipt: the store refuses one whose digest does not hold, on write and read."""
    return seal(
        {
            "kind": "process",
            "v": 1,
            "authority": "owner",
            "death": {"boundary": "pidns", "evidence": "init reaped", "source": "owner"},
            "exit": {"code": 0, "signal": None, "reason": "exit"},
            "output": {
                "stdout": {"cursor": stdout, "digest": "blake3:" + "1" * 64},
                "stderr": {"cursor": stderr, "digest": "blake3:" + "2" * 64},
                "drain": "complete",
            },
            "stragglers": [{"pid": 7, "argv": ["sleep", "∞"]}],
            "elapsed_s": 0.1,
            "nested": {"empty": {}, "list": [], "bool": True, "big": BIG},
            "issued_at": 1.0,
            **extra,
        }
    )


def new_task(store: Store) -> str:
    n = next(_keys)  # each task its own workspace: overlapping an open task's is refused
    record, _ = store.create_task(f"task-key-{n}", f"/workspace-{n}")
    return record.task


def admit(store: Store, task: str, key: str | None = None, digest: str = DIGEST_A) -> SessionRecord:
    record, _ = store.admit(task, key or f"key-{next(_keys)}", digest, SPEC)
    return record


def drive(store: Store, task: str, state: str) -> SessionRecord:
    """A fresh session brought to `state` through the store's own transitions."""
    record = admit(store, task)
    s, g = record.session, record.generation
    if state == RUNNING:
        store.claim(s, g, OWNER)
    elif state == SETTLING:
        store.claim(s, g, OWNER)
        store.settle_begin(s, g)
    elif state == SETTLED:
        store.write_receipt(s, g, receipt())
    elif state == UNKNOWN:  # as a detector loses a claimed session: no receipt
        store.claim(s, g, OWNER)
        store.mark_unknown(s, g, "its owner's lease lapsed")
    record = store.get_session(s)
    assert record.state == state
    return record


def apply(store: Store, record: SessionRecord, event: str, generation: int | None = None) -> None:
    """Send one state-machine event through the store method that performs it."""
    g = record.generation if generation is None else generation
    if event == "claim":
        store.claim(record.session, g, OWNER)
    elif event == "settle_begin":
        store.settle_begin(record.session, g)
    elif event == "revive":  # the owner's heartbeat at its generation
        store.heartbeat(record.session, g, 2e9, 0, 0)
    else:
        store.write_receipt(record.session, g, receipt(), event=event)


# --- tasks --------------------------------------------------------------------------------


def test_create_task_is_idempotent_per_key(store: Store) -> None:
    first, created = store.create_task("tk", "/ws")
    again, created_again = store.create_task("tk", "/ws")
    assert (created, created_again) == (True, False)
    assert again == first


def test_create_task_again_returns_the_first_workspace(store: Store) -> None:
    first, _ = store.create_task("tk", "/ws")
    again, created = store.create_task("tk", "/other")
    assert not created
    assert again.workspace == "/ws" == first.workspace


def test_create_task_with_another_key_is_another_task(store: Store) -> None:
    one, _ = store.create_task("tk-1", "/ws-1")
    two, created = store.create_task("tk-2", "/ws-2")
    assert created
    assert one.task != two.task


@pytest.mark.parametrize("second", ["/ws", "/ws/inner", "/"])
def test_a_workspace_overlapping_an_open_tasks_is_refused_and_not_recorded(
    store: Store, second: str
) -> None:
    first, _ = store.create_task("tk-1", "/ws")
    with pytest.raises(WorkspaceOverlap) as caught:
        store.create_task("tk-2", second)
    assert caught.value.others == [(first.task, "/ws")]
    _again, created = store.create_task("tk-2", "/elsewhere")  # the key was never taken
    assert created and store.workspace_shares(first.task) == []


def test_a_shared_workspace_is_recorded_on_both_tasks(store: Store) -> None:
    first, _ = store.create_task("tk-1", "/ws")
    second, _ = store.create_task("tk-2", "/ws/inner", shared_workspace=True)
    assert second.shared_workspace and not first.shared_workspace
    assert store.get_task(second.task).shared_workspace is True
    assert store.workspace_shares(first.task) == [second.task]
    assert store.workspace_shares(second.task) == [first.task]


def test_a_complete_tasks_workspace_is_free_again(store: Store, backend: Backend) -> None:
    first, _ = store.create_task("tk-1", "/ws")
    backend.set_task_state(store, first.task, states.TASK_COMPLETE)
    second, created = store.create_task("tk-2", "/ws")
    assert created and store.workspace_shares(second.task) == []


FS = 7  # one filesystem's device number; the inodes below are its directories


def _identity(root: int, *above: int, dev: int = FS) -> dict[str, Any]:
    """A workspace identity as `task new` records it (workspace/rootid.py)."""
    return {"dev": dev, "ino": root, "ancestors": [[dev, ino] for ino in above]}


FIRST_IDENTITY = _identity(10, 5, 2)  # inode 10, in 5, in the filesystem's root 2


@pytest.mark.parametrize(
    "second",
    [
        _identity(10, 8, 2),  # the same directory under another path: a bind mount
        _identity(11, 8, 2, 10),  # a directory inside it, bound elsewhere (its own chain)
        _identity(5, 2),  # the directory holding it, under another path
    ],
    ids=["same", "inside", "holding"],
)
def test_a_workspace_overlapping_by_identity_is_refused_whatever_its_path(
    store: Store, second: dict[str, Any]
) -> None:
    first, _ = store.create_task("tk-1", "/ws", workspace_identity=FIRST_IDENTITY)
    with pytest.raises(WorkspaceOverlap) as caught:
        store.create_task("tk-2", "/elsewhere/bound", workspace_identity=second)
    assert caught.value.others == [(first.task, "/ws")]


def test_a_shared_workspace_by_identity_is_recorded_on_both_tasks(store: Store) -> None:
    first, _ = store.create_task("tk-1", "/ws", workspace_identity=FIRST_IDENTITY)
    second, created = store.create_task(
        "tk-2", "/mnt/bound", workspace_identity=_identity(10, 8, 2), shared_workspace=True
    )
    assert created and store.workspace_shares(first.task) == [second.task]
    assert store.workspace_shares(second.task) == [first.task]


def test_identities_of_other_directories_or_filesystems_do_not_overlap(store: Store) -> None:
    store.create_task("tk-1", "/ws", workspace_identity=FIRST_IDENTITY)
    _sibling, created = store.create_task("tk-2", "/ws-2", workspace_identity=_identity(12, 5, 2))
    assert created
    _other_fs, created = store.create_task(
        "tk-3", "/mnt/other", workspace_identity=_identity(10, 5, 2, dev=FS + 1)
    )
    assert created


def test_the_workspace_identity_is_stored_with_the_task(store: Store) -> None:
    made, _ = store.create_task("tk-1", "/ws", workspace_identity=FIRST_IDENTITY)
    assert made.workspace_identity == FIRST_IDENTITY
    assert store.get_task(made.task).workspace_identity == FIRST_IDENTITY
    assert store.get_task(made.task).to_json()["workspace_identity"] == FIRST_IDENTITY


def test_a_task_made_before_identities_overlaps_by_path_alone(store: Store) -> None:
    old, _ = store.create_task("tk-1", "/ws")  # no identity: as a task of an older settled
    assert old.workspace_identity is None
    _new, created = store.create_task("tk-2", "/mnt/bound", workspace_identity=FIRST_IDENTITY)
    assert created  # nothing recorded to compare with: its path does not overlap
    with pytest.raises(WorkspaceOverlap):
        store.create_task("tk-3", "/ws/inner", workspace_identity=_identity(30, 10, 5, 2))


def test_a_new_task_is_open(store: Store) -> None:
    record, _ = store.create_task("tk", "/ws")
    assert record.state == states.TASK_OPEN
    assert record.key == "tk"
    assert record.workspace == "/ws"
    assert store.get_task(record.task) == record


def test_get_task_of_an_unknown_id_raises_unknown_task(store: Store) -> None:
    with pytest.raises(UnknownTask, match="t_nope") as caught:
        store.get_task("t_nope")
    assert caught.value.task == "t_nope"


def test_find_task_names_the_task_of_a_key_and_writes_nothing(store: Store) -> None:
    made, _ = store.create_task("tk-found", "/ws-found")
    found = store.find_task("tk-found")
    assert found is not None and found.task == made.task and found.workspace == "/ws-found"
    assert store.find_task("tk-never-made") is None


def test_a_task_still_as_created_can_be_discarded_and_its_key_reused(store: Store) -> None:
    record, _ = store.create_task("tk", "/ws")
    assert store.discard_task(record.task) is True
    with pytest.raises(UnknownTask):
        store.get_task(record.task)
    again, created = store.create_task("tk", "/other")
    assert created and again.task != record.task and again.workspace == "/other"
    assert store.discard_task(record.task) is False  # already gone


def test_a_task_that_was_used_is_never_discarded(store: Store) -> None:
    used, _ = store.create_task("tk-used", "/ws-used")
    store.admit(used.task, "k1", DIGEST_A, SPEC)
    sealed, _ = store.create_task("tk-sealed", "/ws-sealed")
    store.task_event(sealed.task, "seal")
    for record in (used, sealed):
        assert store.discard_task(record.task) is False
        assert store.get_task(record.task).task == record.task


def test_get_session_of_an_unknown_id_raises_unknown_session(store: Store) -> None:
    with pytest.raises(UnknownSession, match="s_nope"):
        store.get_session("s_nope")


# --- admission ----------------------------------------------------------------------------


def test_admit_new_is_admitted_at_the_task_generation(store: Store) -> None:
    task = new_task(store)
    record, reused = store.admit(task, "k1", DIGEST_A, SPEC)
    assert reused is False
    assert record.state == ADMITTED
    assert record.generation == store.get_task(task).generation
    assert (record.task, record.key, record.digest) == (task, "k1", DIGEST_A)
    assert record.spec == SPEC
    assert record.owner is None
    assert record.receipt is None
    assert record.cancel_requested is None
    assert (record.stdout_durable, record.stderr_durable) == (0, 0)
    assert store.get_session(record.session) == record


def test_admit_same_key_same_digest_reuses_the_session(store: Store) -> None:
    task = new_task(store)
    first, _ = store.admit(task, "k1", DIGEST_A, SPEC)
    again, reused = store.admit(task, "k1", DIGEST_A, SPEC)
    assert reused is True
    assert again == first
    assert len(store.list_sessions(task)) == 1


def test_admit_reuse_returns_the_session_as_it_is_after_claim(store: Store) -> None:
    task = new_task(store)
    first, _ = store.admit(task, "k1", DIGEST_A, SPEC)
    claimed = store.claim(first.session, first.generation, OWNER)
    again, reused = store.admit(task, "k1", DIGEST_A, SPEC)
    assert reused is True
    assert again.session == first.session
    assert again.state == RUNNING
    assert again == claimed


def test_admit_reuse_returns_the_session_as_it_is_after_its_receipt(store: Store) -> None:
    task = new_task(store)
    first, _ = store.admit(task, "k1", DIGEST_A, SPEC)
    store.claim(first.session, first.generation, OWNER)
    settled = store.write_receipt(first.session, first.generation, receipt())
    again, reused = store.admit(task, "k1", DIGEST_A, SPEC)
    assert reused is True
    assert again.state == SETTLED
    assert again.receipt == receipt()
    assert again == settled


def test_admit_reuse_returns_an_unknown_session_as_unknown(store: Store) -> None:
    task = new_task(store)
    first, _ = store.admit(task, "k1", DIGEST_A, SPEC)
    store.write_receipt(first.session, first.generation, receipt(), event="lose")
    again, reused = store.admit(task, "k1", DIGEST_A, SPEC)
    assert reused is True
    assert again.state == UNKNOWN


def test_admit_reuse_still_answers_after_the_task_is_sealed(store: Store, backend: Backend) -> None:
    task = new_task(store)
    first, _ = store.admit(task, "k1", DIGEST_A, SPEC)
    backend.set_task_state(store, task, states.TASK_SEALED)
    again, reused = store.admit(task, "k1", DIGEST_A, SPEC)
    assert reused is True
    assert again == first


def test_admit_same_key_other_digest_is_a_key_conflict_naming_both_and_the_session(
    store: Store,
) -> None:
    task = new_task(store)
    first, _ = store.admit(task, "k1", DIGEST_A, SPEC)
    with pytest.raises(KeyConflict) as caught:
        store.admit(task, "k1", DIGEST_B, {**SPEC, "argv": ["other"]})
    message = str(caught.value)
    assert DIGEST_A in message
    assert DIGEST_B in message
    assert first.session in message
    assert "'k1'" in message
    data = caught.value.to_json()
    assert data["error"] == "KeyConflict"
    assert data["existing_digest"] == DIGEST_A
    assert data["requested_digest"] == DIGEST_B
    assert data["session"] == first.session
    assert data["task"] == task
    assert data["key"] == "k1"
    assert data["message"] == message
    assert caught.value.exit_code == 4


def test_a_key_conflict_creates_no_row_and_changes_nothing(store: Store) -> None:
    task = new_task(store)
    first, _ = store.admit(task, "k1", DIGEST_A, SPEC)
    with pytest.raises(KeyConflict):
        store.admit(task, "k1", DIGEST_B, SPEC)
    assert store.list_sessions(task) == [first]


def test_the_same_key_in_another_task_is_another_session(store: Store) -> None:
    one, two = new_task(store), new_task(store)
    first, _ = store.admit(one, "k1", DIGEST_A, SPEC)
    second, reused = store.admit(two, "k1", DIGEST_B, SPEC)
    assert reused is False
    assert second.session != first.session


@pytest.mark.parametrize("event", [None, "seal"])
def test_a_close_step_of_an_unknown_task_raises_unknown_task(
    store: Store, event: str | None
) -> None:
    with pytest.raises(UnknownTask, match="t_nope"):
        store.record_close_step("t_nope", "final_pending", {"final": None}, event=event)


def test_admit_to_an_unknown_task_raises_unknown_task(store: Store) -> None:
    with pytest.raises(UnknownTask, match="t_missing"):
        store.admit("t_missing", "k1", DIGEST_A, SPEC)


@pytest.mark.parametrize("state", [states.TASK_SEALED, states.TASK_CLOSING, states.TASK_COMPLETE])
def test_admit_a_new_key_to_a_task_not_open_is_sealed(
    store: Store, backend: Backend, state: str
) -> None:
    task = new_task(store)
    backend.set_task_state(store, task, state)
    with pytest.raises(AdmissionSealed) as caught:
        store.admit(task, "k-new", DIGEST_A, SPEC)
    assert task in str(caught.value)
    assert state in str(caught.value)
    assert caught.value.exit_code == 4
    assert store.list_sessions(task) == []


def test_list_sessions_is_in_admission_order(store: Store) -> None:
    task = new_task(store)
    made = [admit(store, task, key=f"k{i}") for i in range(5)]
    assert [r.session for r in store.list_sessions(task)] == [r.session for r in made]


# --- compare-and-set ----------------------------------------------------------------------


def test_claim_moves_admitted_to_running_with_the_owner(store: Store) -> None:
    record = admit(store, new_task(store))
    claimed = store.claim(record.session, record.generation, OWNER)
    assert claimed.state == RUNNING
    assert claimed.owner == OWNER
    assert claimed.generation == record.generation
    assert claimed.started_at is not None
    assert store.get_session(record.session) == claimed


def test_a_second_claim_raises_stale_write_and_keeps_the_first_owner(store: Store) -> None:
    record = admit(store, new_task(store))
    claimed = store.claim(record.session, record.generation, OWNER)
    with pytest.raises(StaleWrite, match=record.session):
        store.claim(record.session, record.generation, OTHER_OWNER)
    assert store.get_session(record.session) == claimed


def test_claim_at_a_wrong_generation_raises_stale_write_and_changes_nothing(store: Store) -> None:
    record = admit(store, new_task(store))
    with pytest.raises(StaleWrite):
        store.claim(record.session, record.generation + 1, OWNER)
    with pytest.raises(StaleWrite):
        store.claim(record.session, record.generation - 1, OWNER)
    assert store.get_session(record.session) == record


def test_a_claim_records_its_boundary_in_the_same_write(store: Store) -> None:
    """One durable write before anything runs: the owner, the boundary and its isolation."""
    record = admit(store, new_task(store))
    isolation = {"policy": "auto", "cgroup": "namespace, read-only"}
    claimed = store.claim(
        record.session, record.generation, OWNER,
        boundary="cgroup2", boundary_ref="/sys/fs/cgroup/x", isolation=isolation,
    )  # fmt: skip
    assert claimed.state == RUNNING and claimed.owner == OWNER
    assert (claimed.boundary, claimed.boundary_ref) == ("cgroup2", "/sys/fs/cgroup/x")
    assert claimed.isolation == isolation
    assert claimed.command_pid is None
    assert store.get_session(record.session) == claimed


def _isolation_hiding(others: int) -> dict[str, Any]:
    """A plan's record that hides the home and `others` other tasks' workspaces."""
    dirs = ["/srv/home/.settled", *(f"/srv/work/task-{n:04d}-{'x' * 20}" for n in range(others))]
    return {
        "policy": "auto", "home_hidden": True, "pinned": 2, "cgroup": "namespace, read-only",
        "hidden": {"dirs": dirs, "files": ["/srv/home/tokens"]},
    }  # fmt: skip


def _claimed_and_settled(store: Store, task: str, isolation: dict[str, Any]) -> SessionRecord:
    record = admit(store, task)
    store.claim(
        record.session, record.generation, OWNER,
        boundary="pidns", boundary_ref="ref", isolation=isolation,
    )  # fmt: skip
    return store.write_receipt(record.session, record.generation, receipt(isolation=isolation))


def _stored_sizes(store: Store, backend: Backend, task: str) -> list[tuple[int, int]]:
    return backend.fetch(
        store, "SELECT length(receipt), length(isolation) FROM sessions WHERE task=?", (task,)
    )


def test_a_long_hidden_list_is_stored_once_and_every_read_gives_it_back_whole(
    store: Store, store_factory: StoreFactory, backend: Backend, home: str
) -> None:
    """A home that hosted a thousand tasks hides a thousand workspaces from every command: the
    list is written once for all the sessions that hide it, not into each claim and receipt,
    and every reader (another process's store included) sees the receipt as its owner sealed it."""
    isolation = _isolation_hiding(1000)
    task = new_task(store)
    settled = [_claimed_and_settled(store, task, isolation) for _ in range(3)]
    reader = store_factory(home)  # nothing read before: the list comes from the database
    for record in settled:
        again = reader.get_session(record.session)
        assert again == record
        assert again.isolation == isolation and again.receipt is not None
        assert again.receipt["isolation"] == isolation
    assert [r.session for r in reader.list_sessions(task)] == [r.session for r in settled]
    retried = store_factory(home)  # a retry's admission reads it inside its own transaction
    assert retried.admit(task, settled[0].key, DIGEST_A, SPEC) == (settled[0], True)
    inline = len(canonical_bytes(isolation))  # ~38 KB, each
    for receipt_chars, isolation_chars in _stored_sizes(store, backend, task):
        assert receipt_chars < 1500 and isolation_chars < 600, (receipt_chars, isolation_chars)
    digest = fact_digest(canonical_bytes(isolation["hidden"]["dirs"]).decode())
    stored = backend.fetch(store, "SELECT length(dirs) FROM hidden_sets WHERE digest=?", (digest,))
    assert len(stored) == 1 and inline - 200 < stored[0][0] < inline


def test_a_short_hidden_list_stays_in_the_row(store: Store, backend: Backend) -> None:
    isolation = _isolation_hiding(3)
    task = new_task(store)
    record = _claimed_and_settled(store, task, isolation)
    rows = backend.fetch(
        store, "SELECT receipt, isolation FROM sessions WHERE session=?", (record.session,)
    )
    assert all(isolation["hidden"]["dirs"][-1] in text for text in rows[0])
    assert store.get_session(record.session).isolation == isolation


@pytest.mark.parametrize("damage", ["edited", "deleted", "miscounted"])
def test_a_damaged_hidden_list_is_refused_not_read(
    store: Store, store_factory: StoreFactory, backend: Backend, home: str, damage: str
) -> None:
    """The list is part of what the receipt's digest seals: edited or gone, no reader decides
    from the session, as for an edited receipt."""
    isolation = _isolation_hiding(40)
    record = _claimed_and_settled(store, new_task(store), isolation)
    digest = fact_digest(canonical_bytes(isolation["hidden"]["dirs"]).decode())
    if damage == "edited":  # one workspace fewer: the command could have seen it
        shorter = canonical_bytes(isolation["hidden"]["dirs"][:-1]).decode()
        backend.fetch(store, "UPDATE hidden_sets SET dirs=? WHERE digest=?", (shorter, digest))
    elif damage == "deleted":
        backend.fetch(store, "DELETE FROM hidden_sets WHERE digest=?", (digest,))
    else:  # the row's count, outside what the digest covers
        backend.fetch(
            store,
            "UPDATE sessions SET receipt=replace(receipt, '\"dirs_count\":41', "
            "'\"dirs_count\":40') WHERE session=?",
            (record.session,),
        )
    with pytest.raises(ReceiptTampered, match="hidden directories of the process receipt"):
        store_factory(home).get_session(record.session)


def test_a_lost_claim_records_no_boundary(store: Store) -> None:
    record = admit(store, new_task(store))
    store.claim(record.session, record.generation, OWNER)
    with pytest.raises(StaleWrite):
        store.claim(record.session, record.generation, OTHER_OWNER, boundary="cgroup2")
    assert store.get_session(record.session).boundary is None


def test_a_launch_recorded_without_the_flush_is_read_like_any_other(store: Store) -> None:
    """durable=False skips the flush to disk (a pid means nothing after a power cut), never
    the commit: every reader sees it at once, and the compare-and-set still holds."""
    record = drive(store, new_task(store), RUNNING)
    store.record_launch(record.session, record.generation, "pidns", "ref", 42, 7, durable=False)
    after = store.get_session(record.session)
    assert (after.boundary, after.boundary_ref, after.command_pid) == ("pidns", "ref", 42)
    with pytest.raises(StaleWrite):
        store.record_launch(
            record.session, record.generation + 1, "pidns", "r", 1, 2, durable=False
        )
    store.record_launch(record.session, record.generation, "pidns", "ref", 42, 7)  # FULL again


def test_live_owners_are_the_live_sessions_with_their_owner_state_and_generation(
    store: Store,
) -> None:
    """Recovery's look reads `live_owners`: the same sessions as `live_sessions`, in its order,
    each with the fields that look decides on, for every live and final state of two tasks."""
    task, other = new_task(store), new_task(store)
    for state in (ADMITTED, RUNNING, SETTLING, SETTLED, UNKNOWN):
        drive(store, task, state)
        drive(store, other, state)
    for scope in (task, other, None):
        full = store.live_sessions(scope)
        light = store.live_owners(scope)
        assert [
            (r.session, r.task, r.state, r.generation, r.owner, r.created_at) for r in full
        ] == [(r.session, r.task, r.state, r.generation, r.owner, r.created_at) for r in light]
        assert all(r.live for r in light)
    assert {r.state for r in store.live_owners(task)} == {ADMITTED, RUNNING, SETTLING}


def test_claim_of_an_unknown_session_raises_unknown_session(store: Store) -> None:
    with pytest.raises(UnknownSession):
        store.claim("s_nope", 1, OWNER)


@pytest.mark.parametrize("state", [RUNNING, SETTLING])
def test_record_launch_on_a_claimed_session_stores_the_launch(store: Store, state: str) -> None:
    record = drive(store, new_task(store), state)
    store.record_launch(record.session, record.generation, "pidns", "ref-1", 999, 777)
    after = store.get_session(record.session)
    assert (after.boundary, after.boundary_ref) == ("pidns", "ref-1")
    assert (after.command_pid, after.command_start_time) == (999, 777)
    assert after.state == state


def test_record_launch_accepts_unknown_pid_and_ref(store: Store) -> None:
    record = drive(store, new_task(store), RUNNING)
    store.record_launch(record.session, record.generation, "subreaper", None, None, None)
    after = store.get_session(record.session)
    assert after.boundary == "subreaper"
    assert (after.boundary_ref, after.command_pid, after.command_start_time) == (None, None, None)


@pytest.mark.parametrize("state", [ADMITTED, SETTLED, UNKNOWN])
def test_record_launch_on_a_session_not_claimed_and_live_raises_stale_write(
    store: Store, state: str
) -> None:
    record = drive(store, new_task(store), state)
    with pytest.raises(StaleWrite, match=record.session):
        store.record_launch(record.session, record.generation, "pidns", "ref", 1, 2)
    assert store.get_session(record.session) == record


def test_record_launch_at_a_wrong_generation_raises_stale_write(store: Store) -> None:
    record = drive(store, new_task(store), RUNNING)
    with pytest.raises(StaleWrite):
        store.record_launch(record.session, record.generation + 1, "pidns", "ref", 1, 2)
    assert store.get_session(record.session) == record


@pytest.mark.parametrize("state", [RUNNING, SETTLING])
def test_heartbeat_renews_the_lease_and_publishes_durable_cursors(store: Store, state: str) -> None:
    record = drive(store, new_task(store), state)
    assert store.heartbeat(record.session, record.generation, 2_000_000_000.25, 10, 20) is None
    assert store.heartbeat(record.session, record.generation, 2_000_000_001.5, BIG, 40) is None
    after = store.get_session(record.session)
    assert after.owner is not None
    assert after.owner.lease_until == 2_000_000_001.5
    assert (after.owner.pid, after.owner.start_time, after.owner.boot_id) == (
        OWNER.pid,
        OWNER.start_time,
        OWNER.boot_id,
    )
    assert (after.stdout_durable, after.stderr_durable) == (BIG, 40)
    assert after.state == state


@pytest.mark.parametrize("state", [ADMITTED, SETTLED, UNKNOWN])
def test_heartbeat_on_a_session_not_claimed_and_live_raises_stale_write(
    store: Store, state: str
) -> None:
    record = drive(store, new_task(store), state)
    if state == UNKNOWN:  # one its owner settled unproven (a detector's is revived: the fence)
        record = drive(store, new_task(store), RUNNING)
        record = store.write_receipt(record.session, record.generation, receipt(), event="lose")
    with pytest.raises(StaleWrite, match=record.session):
        store.heartbeat(record.session, record.generation, 2e9, 1, 1)
    assert store.get_session(record.session) == record


def test_heartbeat_at_a_wrong_generation_raises_stale_write(store: Store) -> None:
    record = drive(store, new_task(store), RUNNING)
    with pytest.raises(StaleWrite):
        store.heartbeat(record.session, record.generation + 1, 2e9, 1, 1)
    assert store.get_session(record.session) == record


def test_heartbeat_of_an_unknown_session_raises_unknown_session(store: Store) -> None:
    with pytest.raises(UnknownSession):
        store.heartbeat("s_nope", 1, 2e9, 1, 1)


def test_settle_begin_then_receipt_settles_with_the_receipt_exactly(store: Store) -> None:
    record = drive(store, new_task(store), RUNNING)
    store.settle_begin(record.session, record.generation)
    assert store.get_session(record.session).state == SETTLING
    written = receipt(stdout=BIG, stderr=99)
    settled = store.write_receipt(record.session, record.generation, written)
    assert settled.state == SETTLED
    assert settled.receipt == written
    assert settled.settled_at is not None
    assert store.get_session(record.session) == settled


def test_a_receipt_publishes_the_durable_cursors_it_names(store: Store) -> None:
    record = drive(store, new_task(store), RUNNING)
    store.heartbeat(record.session, record.generation, 2e9, 10, 5)
    settled = store.write_receipt(record.session, record.generation, receipt(BIG, 4321))
    assert (settled.stdout_durable, settled.stderr_durable) == (BIG, 4321)


def test_a_second_receipt_raises_stale_write_and_keeps_the_first(store: Store) -> None:
    record = drive(store, new_task(store), RUNNING)
    first = store.write_receipt(record.session, record.generation, receipt(stdout=1))
    with pytest.raises(StaleWrite, match=record.session):
        store.write_receipt(record.session, record.generation, receipt(stdout=2))
    assert store.get_session(record.session) == first


def _seal_fact(stdout: int = 1234, digest: str = "blake3:" + "1" * 64) -> dict[str, Any]:
    return {"manifest": "blake3:" + "9" * 64, "chunks": 1, "length": stdout, "digest": digest}


def test_a_seal_is_a_fact_of_its_own_recorded_once_beside_a_settled_receipt(store: Store) -> None:
    task = new_task(store)
    record = drive(store, task, SETTLED)
    other = drive(store, task, SETTLED)
    assert store.log_seals(task) == {}
    first = store.record_seal(record.session, "stdout", _seal_fact())
    assert first == _seal_fact()
    again = {**_seal_fact(), "manifest": "blake3:" + "8" * 64}  # another attempt's manifest
    assert store.record_seal(record.session, "stdout", again) == first  # the first stands
    stderr = {"manifest": "blake3:" + "7" * 64, "chunks": 1, "length": 56,
              "digest": "blake3:" + "2" * 64}  # fmt: skip
    store.record_seal(other.session, "stderr", stderr)
    assert store.log_seals(task) == {
        record.session: {"stdout": first},
        other.session: {"stderr": stderr},
    }
    assert store.log_seals(task, record.session) == {record.session: {"stdout": first}}
    assert store.get_session(record.session).receipt == receipt()  # the receipt is untouched


@pytest.mark.parametrize("state", [ADMITTED, RUNNING, SETTLING, UNKNOWN])
def test_a_seal_of_a_session_not_settled_is_refused(store: Store, state: str) -> None:
    record = drive(store, new_task(store), state)
    with pytest.raises(StaleWrite, match="only a settled session"):
        store.record_seal(record.session, "stdout", _seal_fact())
    assert store.log_seals(record.task) == {}


@pytest.mark.parametrize(
    "fact",
    [
        _seal_fact(stdout=1235),  # a longer log than the receipt counted
        _seal_fact(digest="blake3:" + "3" * 64),  # other bytes
        {"chunks": 1, "length": 1234, "digest": "blake3:" + "1" * 64},  # no manifest
        {"manifest": None, "chunks": 0, "length": 1234, "digest": "blake3:" + "1" * 64},  # empty
    ],
    ids=["length", "digest", "manifest", "empty"],
)
def test_a_seal_that_disagrees_with_the_receipt_is_refused(
    store: Store, fact: dict[str, Any]
) -> None:
    record = drive(store, new_task(store), SETTLED)
    with pytest.raises(StaleWrite, match="seal offered"):
        store.record_seal(record.session, "stdout", fact)
    with pytest.raises(StaleWrite, match="stdout or stderr"):
        store.record_seal(record.session, "index", _seal_fact())
    assert store.log_seals(record.task) == {}


def test_a_receipt_at_a_wrong_generation_raises_stale_write(store: Store) -> None:
    record = drive(store, new_task(store), RUNNING)
    with pytest.raises(StaleWrite):
        store.write_receipt(record.session, record.generation + 1, receipt())
    assert store.get_session(record.session) == record


def test_a_receipt_with_event_lose_makes_the_session_unknown(store: Store) -> None:
    record = drive(store, new_task(store), RUNNING)
    lost = store.write_receipt(record.session, record.generation, receipt(), event="lose")
    assert lost.state == UNKNOWN
    assert lost.receipt == receipt()


def test_an_unknown_session_its_owner_settled_unproven_settles_only_by_recover(
    store: Store,
) -> None:
    claimed = drive(store, new_task(store), RUNNING)
    store.write_receipt(claimed.session, claimed.generation, receipt(), event="lose")
    record = store.get_session(claimed.session)
    assert record.state == UNKNOWN
    with pytest.raises(StaleWrite):
        store.write_receipt(record.session, record.generation, receipt())
    with pytest.raises(StaleWrite):  # nor does its owner's heartbeat revive it
        store.heartbeat(record.session, record.generation, 2e9, 0, 0)
    recovered = store.write_receipt(
        record.session, record.generation, receipt(source="recovery"), event="recover"
    )
    assert recovered.state == SETTLED
    assert recovered.receipt == receipt(source="recovery")


# --- the fence: an owner back after an outage, or recovery, never both ------------------------


def test_an_owner_back_before_a_take_over_revives_its_session_and_fences_recovery(
    store: Store,
) -> None:
    record = drive(store, new_task(store), UNKNOWN)
    s, g = record.session, record.generation
    assert store.heartbeat(s, g, 2e9, 3, 4) is None  # the owner's renewal, after the outage
    revived = store.get_session(s)
    assert (revived.state, revived.generation, revived.unknown_why) == (RUNNING, g, None)
    assert revived.owner is not None and revived.owner.lease_until == 2e9
    with pytest.raises(StaleWrite, match="not unknown"):
        store.take_over(s, g)  # recovery comes second: it takes nothing
    settled = store.write_receipt(s, g, receipt())
    assert (settled.state, settled.generation) == (SETTLED, g)


def test_an_owner_late_receipt_settles_an_unknown_session_nobody_took_over(store: Store) -> None:
    record = drive(store, new_task(store), UNKNOWN)
    settled = store.write_receipt(record.session, record.generation, receipt())
    assert (settled.state, settled.generation) == (SETTLED, record.generation)
    assert settled.receipt == receipt()
    with pytest.raises(StaleWrite):
        store.take_over(record.session, record.generation)


def test_after_a_take_over_every_write_of_the_old_owner_is_stale(store: Store) -> None:
    record = drive(store, new_task(store), UNKNOWN)
    s, g = record.session, record.generation
    assert store.take_over(s, g) == g + 1
    for late in (
        lambda: store.heartbeat(s, g, 2e9, 0, 0),
        lambda: store.write_receipt(s, g, receipt()),
        lambda: store.settle_begin(s, g),
        lambda: store.record_launch(s, g, "cgroup2", "ref", 1, 2),
    ):
        with pytest.raises(StaleWrite):
            late()
    assert store.get_session(s).state == UNKNOWN
    recovered = store.write_receipt(s, g + 1, receipt(source="recovery"), event="recover")
    assert (recovered.state, recovered.receipt) == (SETTLED, receipt(source="recovery"))


def test_a_never_claimed_unknown_session_is_not_revived_by_a_heartbeat(store: Store) -> None:
    record = admit(store, new_task(store))
    lost = store.mark_unknown(record.session, record.generation, "no owner claimed it")
    with pytest.raises(StaleWrite):
        store.heartbeat(lost.session, lost.generation, 2e9, 0, 0)
    assert store.get_session(lost.session).state == UNKNOWN


def test_write_receipt_refuses_events_that_do_not_settle(store: Store) -> None:
    record = drive(store, new_task(store), ADMITTED)
    with pytest.raises((StaleWrite, ValueError)):
        store.write_receipt(record.session, record.generation, receipt(), event="claim")
    assert store.get_session(record.session) == record


# --- the transition table -----------------------------------------------------------------

EVENTS = sorted({event for (_, event) in SESSION_TRANSITIONS})
# The docstring names the trigger of running -> settling (exit|deadline|cancel); the table names
# the store event that records it.
DOC_EVENT_NAMES = {"exit|deadline|cancel": "settle_begin"}


def _docstring_transitions() -> dict[tuple[str, str], str]:
    table: dict[tuple[str, str], str] = {}
    for line in (states.__doc__ or "").splitlines():
        diagram = line.split("(")[0].strip()
        if "-->" not in diagram:
            continue
        parts = re.split(r"\s+--(\S+?)-->\s+", diagram)
        for i in range(0, len(parts) - 2, 2):
            event = DOC_EVENT_NAMES.get(parts[i + 1], parts[i + 1])
            for source in parts[i].split("|"):
                for target in parts[i + 2].split("|"):
                    assert (source, event) not in table, line
                    table[(source, event)] = target
    return table


def test_the_transition_table_is_the_docstring_diagram() -> None:
    assert _docstring_transitions() == SESSION_TRANSITIONS


def test_settled_is_final_and_every_live_state_can_become_unknown() -> None:
    assert not [key for key in SESSION_TRANSITIONS if key[0] == SETTLED]
    assert {s for (s, e) in SESSION_TRANSITIONS if e == "lose"} == set(LIVE_STATES)
    assert set(SESSION_STATES) - {SETTLED} == set(LIVE_STATES) | {UNKNOWN}
    assert SESSION_TRANSITIONS[(UNKNOWN, "recover")] == SETTLED
    # an unknown session ends by recovery's receipt, or by its own owner's return (a late
    # receipt, or a heartbeat that revives it), never by anything else
    assert {key: v for key, v in SESSION_TRANSITIONS.items() if key[0] == UNKNOWN} == {
        (UNKNOWN, "recover"): SETTLED,
        (UNKNOWN, "receipt"): SETTLED,
        (UNKNOWN, "revive"): RUNNING,
    }


def _cases(pairs: list[tuple[str, str]]) -> list[Any]:
    return [pytest.param(state, event, id=f"{state}-{event}") for state, event in pairs]


LEGAL = sorted(SESSION_TRANSITIONS)
# The owner's heartbeat performs "revive" on an unknown session; on a live one it renews the
# lease and changes no state (the heartbeat tests), so those two pairs are neither.
RENEWALS = {(RUNNING, "revive"), (SETTLING, "revive")}
ILLEGAL = sorted(
    set(itertools.product(SESSION_STATES, EVENTS)) - set(SESSION_TRANSITIONS) - RENEWALS
)


@pytest.mark.parametrize(("state", "event"), _cases(LEGAL))
def test_every_legal_transition_is_performed_by_the_store(
    store: Store, state: str, event: str
) -> None:
    record = drive(store, new_task(store), state)
    apply(store, record, event)
    after = store.get_session(record.session)
    assert after.state == SESSION_TRANSITIONS[(state, event)]
    assert after.generation == record.generation


@pytest.mark.parametrize(("state", "event"), _cases(ILLEGAL))
def test_every_illegal_transition_raises_stale_write_and_changes_nothing(
    store: Store, state: str, event: str
) -> None:
    record = drive(store, new_task(store), state)
    with pytest.raises(StaleWrite, match=record.session):
        apply(store, record, event)
    assert store.get_session(record.session) == record


@pytest.mark.parametrize(("state", "event"), _cases(LEGAL))
def test_every_legal_transition_at_a_wrong_generation_raises_stale_write(
    store: Store, state: str, event: str
) -> None:
    record = drive(store, new_task(store), state)
    with pytest.raises(StaleWrite):
        apply(store, record, event, generation=record.generation + 1)
    assert store.get_session(record.session) == record


@pytest.mark.parametrize("event", EVENTS)
def test_transitions_out_of_settling_with_settling_arranged_directly(
    store: Store, backend: Backend, event: str
) -> None:
    """The settling row of the table, reached with raw SQL while settle_begin is broken."""
    record = drive(store, new_task(store), RUNNING)
    backend.set_session_state(store, record.session, SETTLING)
    store.heartbeat(record.session, record.generation, 2e9, 7, 8)
    store.record_launch(record.session, record.generation, "pidns", "ref", 1, 2)
    record = store.get_session(record.session)
    assert (record.state, record.stdout_durable, record.boundary_ref) == (SETTLING, 7, "ref")
    expected = SESSION_TRANSITIONS.get((SETTLING, event))
    if (SETTLING, event) in RENEWALS:
        apply(store, record, event)
        assert store.get_session(record.session).state == SETTLING
    elif expected is None:
        with pytest.raises(StaleWrite, match=record.session):
            apply(store, record, event)
        assert store.get_session(record.session) == record
    else:
        apply(store, record, event)
        assert store.get_session(record.session).state == expected


def test_an_event_outside_the_table_is_refused(store: Store) -> None:
    record = drive(store, new_task(store), RUNNING)
    with pytest.raises((StaleWrite, ValueError)):
        store.write_receipt(record.session, record.generation, receipt(), event="teleport")
    assert store.get_session(record.session) == record


# --- cancel -------------------------------------------------------------------------------


def test_request_cancel_is_set_once_and_heartbeat_returns_it(store: Store) -> None:
    record = drive(store, new_task(store), RUNNING)
    first = store.request_cancel(record.session, "user asked")
    assert first.cancel_requested == "user asked"
    second = store.request_cancel(record.session, "deadline of close")
    assert second.cancel_requested == "user asked"
    assert store.heartbeat(record.session, record.generation, 2e9, 0, 0) == "user asked"
    assert store.heartbeat(record.session, record.generation, 2e9, 0, 0) == "user asked"


def test_a_cancel_before_the_claim_is_seen_by_the_claimer(store: Store) -> None:
    record = admit(store, new_task(store))
    store.request_cancel(record.session, "changed my mind")
    claimed = store.claim(record.session, record.generation, OWNER)
    assert claimed.cancel_requested == "changed my mind"


def test_request_cancel_changes_no_state(store: Store) -> None:
    record = drive(store, new_task(store), RUNNING)
    after = store.request_cancel(record.session, "stop")
    assert after.state == RUNNING
    assert after.generation == record.generation


def test_request_cancel_of_a_settled_session_changes_nothing(store: Store) -> None:
    record = drive(store, new_task(store), SETTLED)
    after = store.request_cancel(record.session, "too late")
    assert after == record


def test_request_cancel_of_an_unknown_session_raises_unknown_session(store: Store) -> None:
    with pytest.raises(UnknownSession):
        store.request_cancel("s_nope", "stop")


# --- schema -------------------------------------------------------------------------------


def test_a_new_store_records_its_schema_version(store: Store, backend: Backend, home: str) -> None:
    assert backend.read_schema_version(home) == backend.schema_version


def test_reopening_an_existing_store_keeps_its_data(store_factory: StoreFactory, home: str) -> None:
    store = store_factory(home)
    task = new_task(store)
    settled = drive(store, task, SETTLED)
    running = drive(store, task, RUNNING)
    store.heartbeat(running.session, running.generation, 2e9, BIG, 3)
    before_task = store.get_task(task)
    before = store.list_sessions(task)
    store.close()

    reopened = store_factory(home)
    assert reopened.get_task(task) == before_task
    assert reopened.list_sessions(task) == before
    assert reopened.get_session(settled.session).receipt == receipt()
    again, reused = reopened.admit(task, running.key, running.digest, SPEC)
    assert reused is True
    assert again.stdout_durable == BIG
    reopened.close()
    assert store_factory(home).list_sessions(task) == before


def test_a_store_with_a_newer_schema_is_refused_naming_both_versions(
    store_factory: StoreFactory, backend: Backend, home: str
) -> None:
    store_factory(home).close()
    newer = backend.schema_version + 41
    backend.write_schema_version(home, newer)
    with pytest.raises(HomeUnusable) as caught:
        store_factory(home)
    message = str(caught.value)
    assert f"v{newer}" in message
    assert f"v{backend.schema_version}" in message
    assert backend.read_schema_version(home) == newer  # refused, not downgraded


# The statements of steps 1..11 as each dialect applies them, as the stores applied them when
# each wrote its own copy: a released step never changes (a store it made must open as it did).
RELEASED_STEPS = 11
RELEASED_DIGESTS = {
    "sqlite": "59d86f5d3ade00356ac449c82f315f2a7b26cef62abbc1a7a09768d10f59f38b",
    "postgresql": "29a67ee0fee18e5310c3affdeedbad739298d651ed4b362d7cb025a38badfb39",
}


def test_one_migration_list_renders_the_released_statements_for_every_dialect() -> None:
    """One list, rendered per dialect: a step added is applied by every backend, and the
    statements of the released steps are exactly those each store applied before."""
    assert sorted(schema.MIGRATIONS) == list(range(1, SCHEMA_VERSION + 1))
    for chosen in (dialect.SQLITE, dialect.POSTGRESQL):
        released = [schema.statements(chosen, step) for step in range(1, RELEASED_STEPS + 1)]
        text = json.dumps(released).encode()
        assert hashlib.sha256(text).hexdigest() == RELEASED_DIGESTS[chosen.name], chosen.name
    sqlite_1, postgres_1 = (
        schema.statements(d, 1)[1] for d in (dialect.SQLITE, dialect.POSTGRESQL)
    )
    assert "command_pid         INTEGER," in sqlite_1 and "created_at          REAL" in sqlite_1
    assert "command_pid         BIGINT," in postgres_1 and "DOUBLE PRECISION" in postgres_1
    assert 'ADD COLUMN "user" TEXT' in schema.statements(dialect.POSTGRESQL, 4)[1]
    assert "seq" in schema.statements(dialect.POSTGRESQL, 2)[1]
    assert "seq" not in schema.statements(dialect.SQLITE, 2)[1]


# --- concurrency, across processes --------------------------------------------------------

SPAWN = multiprocessing.get_context("spawn")
JOIN_S = 15.0  # each bound; a whole test stays under its 60 s timeout


@contextlib.contextmanager
def children(processes: list[Any]) -> Iterator[list[Any]]:
    """Start every process; whatever happens, none is left behind when the block ends."""
    try:
        for process in processes:
            process.start()
        yield processes
    finally:
        deadline = time.monotonic() + JOIN_S
        for process in processes:
            if process.pid is not None:
                process.join(max(0.1, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(5)
        leftover = [p.pid for p in processes if p.is_alive()]
        assert not leftover, f"children still alive after kill: {leftover}"


def collect(queue: Any, count: int, timeout: float = JOIN_S) -> list[tuple[Any, ...]]:
    deadline = time.monotonic() + timeout
    return [queue.get(timeout=max(0.1, deadline - time.monotonic())) for _ in range(count)]


def _report_error(queue: Any, who: str, exc: BaseException) -> None:
    queue.put(("error", who, f"{type(exc).__name__}: {exc}", traceback.format_exc()))


def _child_admit(backend: str, directory: str, task: str, barrier: Any, queue: Any) -> None:
    who = f"admitter {os.getpid()}"
    try:
        store = BACKENDS[backend].open(directory)
        try:
            barrier.wait(JOIN_S)
            record, reused = store.admit(task, "the-key", DIGEST_A, SPEC)
            queue.put(("ok", record.session, reused, record.state))
        finally:
            store.close()
    except BaseException as exc:
        _report_error(queue, who, exc)


ADMITTERS = 20


@pytest.mark.timeout(60)
def test_concurrent_admits_of_one_key_create_exactly_one_session(
    store_factory: StoreFactory, backend: Backend, home: str
) -> None:
    store = store_factory(home)
    task = new_task(store)
    barrier = SPAWN.Barrier(ADMITTERS)
    queue = SPAWN.Queue()
    procs = [
        SPAWN.Process(target=_child_admit, args=(backend.name, home, task, barrier, queue))
        for _ in range(ADMITTERS)
    ]
    with children(procs):
        results = collect(queue, ADMITTERS)
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors
    assert [p.exitcode for p in procs] == [0] * ADMITTERS
    assert sorted(r[2] for r in results) == [False] + [True] * (ADMITTERS - 1)
    sessions = {r[1] for r in results}
    assert len(sessions) == 1
    assert [r.session for r in store.list_sessions(task)] == list(sessions)


WRITERS, READERS = 8, 4
SESSIONS_PER_WRITER, HEARTBEATS_PER_SESSION = 5, 16  # 5 x (admit, claim, launch, 16, receipt)


def _lease(writer: int, session: int, beat: int) -> float:
    return 2_000_000_000.0 + writer * 10_000 + session * 100 + beat


def _child_writer(
    backend: str, directory: str, task: str, writer: int, barrier: Any, queue: Any
) -> None:
    who = f"writer {writer}"
    try:
        store = BACKENDS[backend].open(directory)
        try:
            barrier.wait(JOIN_S)
            writes = 0
            for j in range(SESSIONS_PER_WRITER):
                record, reused = store.admit(task, f"w{writer}-s{j}", DIGEST_A, SPEC)
                assert not reused, record
                store.claim(record.session, record.generation, OWNER)
                store.record_launch(
                    record.session, record.generation, "pidns", f"ref-{writer}-{j}", writer, j
                )
                writes += 3
                for beat in range(HEARTBEATS_PER_SESSION):
                    cancel = store.heartbeat(
                        record.session,
                        record.generation,
                        _lease(writer, j, beat),
                        (beat + 1) * 1000 + writer,
                        (beat + 1) * 10 + j,
                    )
                    assert cancel is None
                    writes += 1
                final = receipt(stdout=BIG + writer, stderr=10**6 + j, writer=writer, n=j)
                store.write_receipt(record.session, record.generation, final)
                writes += 1
            queue.put(("ok", who, writes))
        finally:
            store.close()
    except BaseException as exc:
        _report_error(queue, who, exc)


def _child_reader(
    backend: str, directory: str, task: str, barrier: Any, stop: Any, queue: Any
) -> None:
    who = f"reader {os.getpid()}"
    try:
        store = BACKENDS[backend].open(directory)
        try:
            barrier.wait(JOIN_S)
            reads = 0
            seen: dict[str, tuple[int, int]] = {}
            while not stop.is_set():
                store.get_task(task)
                for record in store.list_sessions(task):
                    cursors = (record.stdout_durable, record.stderr_durable)
                    last = seen.get(record.session, (0, 0))
                    if cursors[0] < last[0] or cursors[1] < last[1]:
                        raise AssertionError(
                            f"{record.session} cursors went back {last}->{cursors}"
                        )
                    seen[record.session] = cursors
                    store.get_session(record.session)
                    reads += 1
                reads += 2
            queue.put(("ok", who, reads))
        finally:
            store.close()
    except BaseException as exc:
        _report_error(queue, who, exc)


@pytest.mark.timeout(60)
def test_concurrent_writers_and_readers_never_see_database_is_locked(
    store_factory: StoreFactory, backend: Backend, home: str
) -> None:
    store = store_factory(home)
    task = new_task(store)
    barrier = SPAWN.Barrier(WRITERS + READERS)
    stop = SPAWN.Event()
    queue = SPAWN.Queue()
    writers = [
        SPAWN.Process(target=_child_writer, args=(backend.name, home, task, w, barrier, queue))
        for w in range(WRITERS)
    ]
    readers = [
        SPAWN.Process(target=_child_reader, args=(backend.name, home, task, barrier, stop, queue))
        for _ in range(READERS)
    ]
    try:
        with children(writers + readers):
            results = collect(queue, WRITERS)
            stop.set()
            results += collect(queue, READERS)
    finally:
        stop.set()
    errors = [r for r in results if r[0] == "error"]
    assert not [e for e in errors if "database is locked" in e[2]], errors
    assert not errors, errors
    assert [p.exitcode for p in writers + readers] == [0] * (WRITERS + READERS)
    per_writer = 3 + HEARTBEATS_PER_SESSION + 1
    assert sorted(r[2] for r in results if r[1].startswith("writer")) == (
        [SESSIONS_PER_WRITER * per_writer] * WRITERS
    )
    assert all(r[2] > 0 for r in results if r[1].startswith("reader"))

    sessions = {r.key: r for r in store.list_sessions(task)}
    assert len(sessions) == WRITERS * SESSIONS_PER_WRITER
    last = HEARTBEATS_PER_SESSION - 1
    for w in range(WRITERS):
        for j in range(SESSIONS_PER_WRITER):
            record = sessions[f"w{w}-s{j}"]
            assert record.state == SETTLED
            assert record.receipt == receipt(stdout=BIG + w, stderr=10**6 + j, writer=w, n=j)
            assert (record.stdout_durable, record.stderr_durable) == (BIG + w, 10**6 + j)
            assert (record.boundary_ref, record.command_pid, record.command_start_time) == (
                f"ref-{w}-{j}",
                w,
                j,
            )
            assert record.owner is not None
            assert record.owner.lease_until == _lease(w, j, last)


def _open_fresh_concurrently(backend: Backend, directory: str, count: int) -> list[str]:
    barrier = threading.Barrier(count)
    errors: list[str] = []

    def one() -> None:
        try:
            barrier.wait(10)
            backend.open(directory).close()
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return errors


@pytest.mark.timeout(60)
def test_concurrent_first_opens_of_a_fresh_store_all_succeed(backend: Backend) -> None:
    # Threads, not processes, so that enough rounds fit in a few seconds; SQLite's locks between
    # connections of one process behave as between processes. Here 4 threads hit the race in about
    # one round in ten (400 rounds take ~5 s once it is fixed); 20 spawned processes opening one
    # fresh home fail the same way in about one round in five.
    with tempfile.TemporaryDirectory() as root:
        for attempt in range(400):
            directory = os.path.join(root, str(attempt))
            os.mkdir(directory)
            errors = _open_fresh_concurrently(backend, directory, 4)
            assert not errors, f"round {attempt}: {errors}"


def test_close_facts_of_an_older_store_are_sealed_once_by_the_migration(tmp_path: Any) -> None:
    """A v3 store's close facts are sealed as they are when it is migrated, and only then: a
    fact whose digest is later reset is refused, not sealed again on the next open."""
    path = os.path.join(str(tmp_path), "settled.db")
    SQLiteStore(path).close()
    with sqlite3.connect(path) as db:
        db.execute(
            "INSERT INTO tasks (task, key, workspace, state, generation, created_at) "
            "VALUES ('t_1', 'k', '/w', 'sealed', 1, 0)"
        )
        db.execute(
            "INSERT INTO close_steps (task, step, fact, recorded_at) "
            "VALUES ('t_1', 'sealed', '{\"sealed_at\":1}', 0)"
        )
        db.execute("UPDATE meta SET value='3' WHERE key='schema_version'")
        db.execute("ALTER TABLE close_steps DROP COLUMN digest")
        db.execute("ALTER TABLE sessions DROP COLUMN isolation")
        db.execute("ALTER TABLE tasks DROP COLUMN user")
        db.execute("ALTER TABLE tasks DROP COLUMN shared_workspace")
        db.execute("ALTER TABLE tasks DROP COLUMN sandbox")
        db.execute("ALTER TABLE tasks DROP COLUMN ignore_rules")
        db.execute("DROP TABLE workspace_shares")
        db.execute("DROP TABLE hosts")
        db.execute("DROP TABLE hidden_sets")
        db.execute("ALTER TABLE tasks DROP COLUMN defaults")
        db.execute("ALTER TABLE tasks DROP COLUMN workspace_identity")
        db.execute("ALTER TABLE tasks DROP COLUMN host")
        db.execute("ALTER TABLE tasks DROP COLUMN frozen")
        db.execute("DROP TABLE log_seals")
    store = SQLiteStore(path)
    assert store.close_steps("t_1") == {"sealed": {"sealed_at": 1}}
    store.close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE close_steps SET digest='unsealed'")  # the old marker
    store = SQLiteStore(path)
    with pytest.raises(ReceiptTampered, match="sealed"):
        store.close_steps("t_1")
    store.close()


# --- races of two processes, threads in each ----------------------------------------------

RACERS_PER_PROCESS = 8


def _child_admit_and_claim(
    backend: str, directory: str, task: str, barrier: Any, queue: Any
) -> None:
    """Eight threads, one store each: admit the one key, then try to claim what came back."""

    def one(n: int) -> None:
        who = f"racer {os.getpid()}/{n}"
        try:
            store = BACKENDS[backend].open(directory)
            try:
                barrier.wait(JOIN_S)
                record, reused = store.admit(task, "the-key", DIGEST_A, SPEC)
                owner = OwnerInfo(os.getpid(), n, "boot-race", 2e9)
                try:
                    store.claim(record.session, record.generation, owner)
                    claimed = True
                except StaleWrite:
                    claimed = False
                queue.put(("ok", record.session, reused, claimed))
            finally:
                store.close()
        except BaseException as exc:
            _report_error(queue, who, exc)

    threads = [threading.Thread(target=one, args=(n,)) for n in range(RACERS_PER_PROCESS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S * 2)


@pytest.mark.timeout(90)
def test_a_sixteen_way_admission_race_across_two_processes_launches_once(
    store_factory: StoreFactory, backend: Backend, home: str
) -> None:
    store = store_factory(home)
    task = new_task(store)
    racers = 2 * RACERS_PER_PROCESS
    barrier = SPAWN.Barrier(racers)
    queue = SPAWN.Queue()
    procs = [
        SPAWN.Process(
            target=_child_admit_and_claim, args=(backend.name, home, task, barrier, queue)
        )
        for _ in range(2)
    ]
    with children(procs):
        results = collect(queue, racers, timeout=JOIN_S * 3)
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors
    assert sorted(r[2] for r in results) == [False] + [True] * (racers - 1)
    assert sorted(r[3] for r in results) == [False] * (racers - 1) + [True]
    sessions = {r[1] for r in results}
    assert len(sessions) == 1
    (only,) = store.list_sessions(task)
    assert {only.session} == sessions and only.state == RUNNING


OVERLAP_ROUNDS = 25


def _child_create_overlapping(
    backend: str, directory: str, side: int, barrier: Any, queue: Any
) -> None:
    """Each round: create a task whose workspace is the other side's, or lies inside it."""
    who = f"creator {side}"
    try:
        store = BACKENDS[backend].open(directory)
        try:
            outcomes = []
            for round_ in range(OVERLAP_ROUNDS):
                workspace = f"/race-{round_}" + ("/inner" if side else "")
                barrier.wait(JOIN_S)
                try:
                    _record, created = store.create_task(f"race-{side}-{round_}", workspace)
                    outcomes.append("created" if created else "found")
                except WorkspaceOverlap:
                    outcomes.append("overlap")
            queue.put(("ok", side, outcomes))
        finally:
            store.close()
    except BaseException as exc:
        _report_error(queue, who, exc)


@pytest.mark.timeout(90)
def test_two_processes_creating_overlapping_workspaces_at_once_one_wins_each_round(
    store_factory: StoreFactory, backend: Backend, home: str
) -> None:
    store = store_factory(home)
    barrier = SPAWN.Barrier(2)
    queue = SPAWN.Queue()
    procs = [
        SPAWN.Process(
            target=_child_create_overlapping, args=(backend.name, home, side, barrier, queue)
        )
        for side in (0, 1)
    ]
    with children(procs):
        results = collect(queue, 2, timeout=JOIN_S * 3)
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors
    by_side = {r[1]: r[2] for r in results}
    for round_ in range(OVERLAP_ROUNDS):
        assert sorted((by_side[0][round_], by_side[1][round_])) == ["created", "overlap"]
    assert len(store.workspaces()) == OVERLAP_ROUNDS


def test_await_change_returns_when_its_time_is_up(store: Store) -> None:
    record = admit(store, new_task(store))
    for _ in range(2):  # the first call of a notifying store only starts to listen
        store.await_change((record.session,), 0.05)
    assert store.get_session(record.session) == record


# --- PostgreSQL only: notifications and unreachable servers ---------------------------------


def _child_settle(url: str, session: str, generation: int, queue: Any, claim: bool = True) -> None:
    try:
        store = open_postgres(url)
        try:
            if claim:
                store.claim(session, generation, OWNER)
            store.write_receipt(session, generation, receipt())
            queue.put(("ok",))
        finally:
            store.close()
    except BaseException as exc:
        _report_error(queue, "settler", exc)


WAIT_S = 60.0  # each wait of the waiter; the test gives up long before a second one ends


@pytest.mark.timeout(60)
def test_a_write_from_another_process_wakes_await_change(
    pg_cluster: pg.Cluster, tmp_path: Any
) -> None:
    """The waiter asks for far longer than the test may run: it can only have finished in time
    by being woken, and it saw the receipt that the other process wrote."""
    url = pg.url_for_directory(str(tmp_path))
    store = open_postgres(url)
    try:
        record = admit(store, new_task(store))
        listening = threading.Event()
        seen: list[SessionRecord] = []

        def waiter() -> None:
            store.await_change((record.session,), WAIT_S)  # starts listening, returns at once
            listening.set()
            while not (now := store.get_session(record.session)).receipt:
                store.await_change((record.session,), WAIT_S)
            seen.append(now)

        thread = threading.Thread(target=waiter, daemon=True)
        thread.start()
        assert listening.wait(JOIN_S)
        queue = SPAWN.Queue()
        settler = SPAWN.Process(
            target=_child_settle, args=(url, record.session, record.generation, queue)
        )
        with children([settler]):
            assert collect(queue, 1) == [("ok",)]
        thread.join(JOIN_S)
        assert not thread.is_alive(), "the notification did not wake the waiter"
        assert [r.state for r in seen] == [SETTLED] and seen[0].receipt == receipt()
    finally:
        store.close()


@pytest.mark.timeout(60)
def test_a_session_watch_without_an_owner_here_is_woken_by_the_store(
    pg_cluster: pg.Cluster, tmp_path: Any
) -> None:
    """SessionWatch.wait on a session whose owner is not on this host (none recorded yet):
    it sleeps in await_change, and the receipt written elsewhere (settling it unclaimed, as a
    cancel before the launch does) ends the wait."""
    from settled.owner.liveness import LocalOwners
    from settled.sessions import SessionWatch

    url = pg.url_for_directory(str(tmp_path))
    store = open_postgres(url)
    try:
        record = admit(store, new_task(store))
        queue = SPAWN.Queue()
        settler = SPAWN.Process(
            target=_child_settle, args=(url, record.session, record.generation, queue, False)
        )
        with children([settler]):
            view = SessionWatch(store, LocalOwners()).wait(record.session, timeout=JOIN_S)
            assert collect(queue, 1) == [("ok",)]
        assert view["state"] == SETTLED and "receipt" in view
    finally:
        store.close()


def _unreachable_cases(cluster: pg.Cluster) -> dict[str, tuple[str, str]]:
    """name -> (url, what the message must name)."""
    down = pg.free_port()
    return {
        "wrong password": (cluster.url(password="not-" + pg.PASSWORD), "password"),
        "missing database": (cluster.url(database="no_such_db"), "no_such_db"),
        "server down": (
            cluster.url().replace(f":{cluster.port}/", f":{down}/"),
            f"127.0.0.1:{down}/{pg.DATABASE}",
        ),
        "bad port": (cluster.url().replace(f":{cluster.port}/", ":notaport/"), "notaport"),
        "not postgresql": (cluster.url().replace("postgresql://", "mysql://"), "mysql"),
    }


@pytest.mark.parametrize(
    "case", ["wrong password", "missing database", "server down", "bad port", "not postgresql"]
)
def test_an_unusable_server_is_one_line_naming_it_never_the_password(
    pg_cluster: pg.Cluster, case: str
) -> None:
    url, named = _unreachable_cases(pg_cluster)[case]
    with pytest.raises(StoreUnreachable) as caught:
        open_postgres(url)
    message = str(caught.value)
    assert "\n" not in message
    assert named in message
    assert pg.PASSWORD not in message and pg.PASSWORD not in repr(caught.value.to_json())
    assert caught.value.exit_code == 1
    error = caught.value  # no driver exception chained to it: a CLI prints no traceback
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


# --- close steps recorded with what they change --------------------------------------------


def test_a_close_step_is_recorded_with_its_task_event_in_one_transaction(store: Store) -> None:
    task = new_task(store)
    store.task_event(task, "seal")
    fact = {"sessions": []}
    assert store.record_close_step(task, "receipts", fact, event="close_begin") is fact
    assert store.get_task(task).state == "closing"
    assert store.close_steps(task)["receipts"] == fact
    again = store.record_close_step(task, "receipts", {"other": 1}, event="close_begin")
    assert again == fact  # the first stands, and the event is not applied twice
    assert store.get_task(task).state == "closing"


def test_a_refused_event_or_fence_records_no_fact(store: Store) -> None:
    task = new_task(store)
    with pytest.raises(StaleWrite):  # an open task cannot begin to close
        store.record_close_step(task, "receipts", {"sessions": []}, event="close_begin")
    assert "receipts" not in store.close_steps(task) and store.get_task(task).state == "open"
    generation = store.get_task(task).generation
    with pytest.raises(StaleWrite):  # a fence from a generation the task is not at
        store.record_close_step(task, "fenced", {"g": 1}, fence=generation + 5)
    assert "fenced" not in store.close_steps(task)
    assert store.get_task(task).generation == generation


def test_a_fence_is_recorded_with_its_close_step(store: Store) -> None:
    task = new_task(store)
    generation = store.get_task(task).generation
    fact = {"fenced_generation": generation, "generation": generation + 1}
    assert store.record_close_step(task, "fenced", fact, fence=generation) is fact
    assert store.get_task(task).generation == generation + 1
    assert store.record_close_step(task, "fenced", {"x": 2}, fence=generation) == fact
    assert store.get_task(task).generation == generation + 1  # not fenced twice


def test_a_close_step_recorded_without_waiting_for_the_disk_is_seen_and_kept_at_once(
    store: Store, store_factory: StoreFactory, home: str
) -> None:
    """``durable=False`` changes only when the disk has it: the fact, its event and its fence
    are committed in one transaction, read by another connection at once, recorded once, and
    the store's next durable write is durable as before (SQLite: back to synchronous=FULL)."""
    task = new_task(store)
    store.task_event(task, "seal")
    fact = {"sessions": []}
    recorded = store.record_close_step(task, "receipts", fact, event="close_begin", durable=False)
    assert recorded is fact
    other = store_factory(home)
    assert other.close_steps(task)["receipts"] == fact
    assert other.get_task(task).state == "closing"
    again = store.record_close_step(task, "receipts", {"x": 1}, event="close_begin", durable=False)
    assert again == fact
    if isinstance(store, SQLiteStore):
        assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL again
    generation = store.get_task(task).generation
    fenced = {"fenced_generation": generation}
    assert (
        store.record_close_step(task, "fenced", fenced, fence=generation, durable=False) is fenced
    )
    assert other.get_task(task).generation == generation + 1


# --- the in-process turn of SQLite writers ------------------------------------------------


def test_a_write_waits_for_a_turn_held_forever_only_as_long_as_the_busy_timeout(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn decides nothing: a thread of this process that holds it and never lets go (as
    if stuck) delays another writer by the busy timeout at most, and SQLite's lock then decides."""
    from settled.store import sqlite as module

    store = SQLiteStore(os.path.join(str(tmp_path), "settled.db"))
    try:
        monkeypatch.setattr(module, "BUSY_TIMEOUT_S", 0.2)
        stuck = module._TURNS.of(store._turn_key)
        assert stuck.acquire(False)
        try:
            task = new_task(store)  # a write in this thread, past the held turn
        finally:
            stuck.release()
        assert store.get_task(task).state == "open"
        new_task(store)  # the turn is taken and given back as usual
        assert stuck.acquire(False)
        stuck.release()
    finally:
        store.close()


def test_a_forked_child_writes_though_a_parent_thread_held_the_turn_at_the_fork(
    tmp_path: Any,
) -> None:
    from settled.store import sqlite as module

    path = os.path.join(str(tmp_path), "settled.db")
    store = SQLiteStore(path)
    try:
        turn = module._TURNS.of(store._turn_key)
        assert turn.acquire(False)  # held, as by another thread at the fork
        try:
            child = os.fork()
            if child == 0:  # pragma: no cover - reports through its exit status
                code = 1
                try:
                    code = 0 if module._TURNS.of(store._turn_key).acquire(False) else 2
                finally:
                    os._exit(code)
        finally:
            turn.release()
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        store.close()


UNSHARED_OPEN = """
import sys, threading
from settled.boundary import linux
from settled.boundary.pidns import threads_refused
from settled.store.postgres import open_postgres
print("refused" if threads_refused() else "allowed")
linux.unshare(linux.CLONE_NEWPID)  # as an owner whose command's namespace could not be cloned
try:
    threading.Thread(target=print).start()
    print("a thread started")
except RuntimeError:
    print("no thread may start")
print("refused" if threads_refused() else "allowed")
store = open_postgres(sys.argv[1], pooled=not threads_refused())
print("pooled" if store._pool is not None else "one connection", len(store.list_tasks()))
store.close()
"""


@pytest.mark.timeout(60)
def test_a_process_that_may_start_no_thread_opens_the_store_on_one_connection(
    pg_cluster: pg.Cluster, tmp_path: Any
) -> None:
    """After unshare(CLONE_NEWPID) the kernel refuses a process any thread, and a pool's
    workers are threads: such an owner failed at its store's open and left no receipt. It now
    sees so (``threads_refused``) and opens one connection, and reads and writes through it."""
    if not has_cap_sys_admin():
        pytest.skip("unsharing a PID namespace needs CAP_SYS_ADMIN")
    out = subprocess.run(
        [sys.executable, "-c", UNSHARED_OPEN, pg.url_for_directory(str(tmp_path))],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert out == ["allowed", "no thread may start", "refused", "one connection 0"]
