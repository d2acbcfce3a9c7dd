"""The store's schema: one list of migrations, rendered for each database, and the one way
they are applied.

A migration is written once with four words a dialect fills in (`Dialect.ddl`): the integer
type of cursors, pids and generations (64-bit: SQLite's INTEGER is already), the floating type
of times, the column `user` (a reserved word in PostgreSQL, quoted), and `seq`, the insertion
order PostgreSQL's checkpoints need where SQLite's rowid gives it. The statements a dialect
applies are those each store applied before there was one list: a store created by an older
settled opens as it did (`tests/test_store.py` pins each step's statements by digest). A step,
once released, is never edited: a change is a new step.

`apply` runs the missing steps on an open transaction, each statement through `execute`, so
the stores keep only how they lock the migration (SQLite's write lock, PostgreSQL's advisory
lock) and how they learn the version. Never touches processes, logs or the workspace.
"""

from __future__ import annotations

from settled.errors import HomeUnusable
from settled.store.rows import fact_digest

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Final

    from settled.store.dialect import Dialect

    Execute = Callable[[str, tuple[Any, ...]], Any]  # runs one statement, returns a cursor

SCHEMA_VERSION: Final = 12
SEALS_CLOSE_FACTS: Final = 4  # the migration that seals the close facts an older settled wrote

MIGRATIONS: Final[dict[int, str]] = {
    1: """
    CREATE TABLE tasks (
        task        TEXT PRIMARY KEY,
        key         TEXT NOT NULL UNIQUE,
        workspace   TEXT NOT NULL,
        state       TEXT NOT NULL,
        generation  {bigint} NOT NULL,
        created_at  {double} NOT NULL
    );
    CREATE TABLE sessions (
        session             TEXT PRIMARY KEY,
        task                TEXT NOT NULL REFERENCES tasks(task),
        key                 TEXT NOT NULL,
        digest              TEXT NOT NULL,
        spec                TEXT NOT NULL,
        state               TEXT NOT NULL,
        generation          {bigint} NOT NULL,
        owner               TEXT,
        boundary            TEXT,
        boundary_ref        TEXT,
        command_pid         {bigint},
        command_start_time  {bigint},
        stdout_durable      {bigint} NOT NULL DEFAULT 0,
        stderr_durable      {bigint} NOT NULL DEFAULT 0,
        cancel_requested    TEXT,
        created_at          {double} NOT NULL,
        started_at          {double},
        settled_at          {double},
        receipt             TEXT,
        UNIQUE (task, key)
    );
    CREATE INDEX sessions_by_task ON sessions(task, created_at)
    """,
    2: """
    CREATE TABLE close_steps (
        task        TEXT NOT NULL REFERENCES tasks(task),
        step        TEXT NOT NULL,
        fact        TEXT NOT NULL,
        recorded_at {double} NOT NULL,
        PRIMARY KEY (task, step)
    );
    CREATE TABLE checkpoints (
        manifest    TEXT NOT NULL,
        task        TEXT NOT NULL REFERENCES tasks(task),
        generation  {bigint} NOT NULL,
        receipt     TEXT NOT NULL,
        index_ref   TEXT,
        created_at  {double} NOT NULL,
        {seq}
        PRIMARY KEY (task, manifest)
    );
    CREATE INDEX checkpoints_by_task ON checkpoints(task, created_at)
    """,
    3: """
    ALTER TABLE sessions ADD COLUMN unknown_why TEXT
    """,
    4: """
    ALTER TABLE sessions ADD COLUMN isolation TEXT;
    ALTER TABLE tasks ADD COLUMN {user} TEXT;
    ALTER TABLE close_steps ADD COLUMN digest TEXT
    """,
    5: """
    ALTER TABLE tasks ADD COLUMN shared_workspace INTEGER NOT NULL DEFAULT 0;
    CREATE TABLE workspace_shares (
        task        TEXT NOT NULL REFERENCES tasks(task),
        other       TEXT NOT NULL REFERENCES tasks(task),
        created_at  {double} NOT NULL,
        PRIMARY KEY (task, other)
    )
    """,
    6: """
    CREATE TABLE hosts (
        host          TEXT PRIMARY KEY,
        name          TEXT NOT NULL,
        home          TEXT NOT NULL,
        registered_at {double} NOT NULL,
        vanished_at   {double},
        vanished_why  TEXT
    );
    ALTER TABLE tasks ADD COLUMN host TEXT;
    ALTER TABLE tasks ADD COLUMN frozen TEXT
    """,
    7: """
    ALTER TABLE tasks ADD COLUMN sandbox TEXT
    """,
    8: """
    ALTER TABLE tasks ADD COLUMN ignore_rules TEXT
    """,
    9: """
    CREATE TABLE hidden_sets (
        digest  TEXT PRIMARY KEY,
        dirs    TEXT NOT NULL
    )
    """,
    10: """
    ALTER TABLE tasks ADD COLUMN defaults TEXT
    """,
    11: """
    ALTER TABLE tasks ADD COLUMN workspace_identity TEXT
    """,
    12: """
    CREATE TABLE log_seals (
        session     TEXT NOT NULL REFERENCES sessions(session),
        stream      TEXT NOT NULL,
        fact        TEXT NOT NULL,
        recorded_at {double} NOT NULL,
        PRIMARY KEY (session, stream)
    )
    """,
}


def statements(dialect: Dialect, step: int) -> list[str]:
    """The statements of migration `step` as `dialect` applies them, in order. A line the
    dialect leaves empty (SQLite's `seq`) is dropped."""
    text = MIGRATIONS[step].format(**dialect.ddl)
    kept = "\n".join(line for line in text.split("\n") if line.strip() or not line)
    return [statement.strip() for statement in kept.split(";") if statement.strip()]


def refuse_newer(version: int, where: str, instead: str) -> None:
    """A store a newer settled migrated is never written by this one."""
    if version > SCHEMA_VERSION:
        raise HomeUnusable(
            f"the store at {where} has schema v{version}, newer than this settled "
            f"(v{SCHEMA_VERSION}); upgrade settled or use another {instead}"
        )


def apply(dialect: Dialect, execute: Execute, version: int) -> None:
    """Bring a store at schema `version` (not newer: `refuse_newer`) to SCHEMA_VERSION inside
    the caller's transaction, which holds the store's migration lock: each missing step's
    statements, the close facts an older settled wrote sealed once (in their migration, never
    on a later open), and the new version recorded."""
    for step in range(version + 1, SCHEMA_VERSION + 1):
        for statement in statements(dialect, step):
            execute(statement, ())
        if step == SEALS_CLOSE_FACTS:
            _seal_old_close_facts(dialect, execute)
    if version != SCHEMA_VERSION:  # an open writes nothing once migrated (a full disk)
        execute(
            dialect.sql(
                "INSERT INTO meta(key, value) VALUES('schema_version', ?) "
                "ON CONFLICT(key) DO UPDATE SET value=excluded.value"
            ),
            (str(SCHEMA_VERSION),),
        )


def _seal_old_close_facts(dialect: Dialect, execute: Execute) -> None:
    rows = execute("SELECT task, step, fact FROM close_steps", ()).fetchall()
    for task, step, fact in rows:  # facts an older settled wrote: sealed as they are
        execute(
            dialect.sql("UPDATE close_steps SET digest=? WHERE task=? AND step=?"),
            (fact_digest(fact), task, step),
        )
