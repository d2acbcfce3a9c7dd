"""The few words in which the store's two databases differ, and nothing else.

Every statement of the store is written once (`store/sql.py`, `store/schema.py`) in a portable
text: `?` for each argument, a row lock as the statement's last clause (`FOR UPDATE`, `FOR NO KEY
UPDATE`, `FOR SHARE`), `GREATEST(a, b)` for the larger of two values. `Dialect.sql` turns it into
the text a database runs: PostgreSQL's `%s` arguments, and on SQLite no row lock (its one write
lock, taken by BEGIN IMMEDIATE before any read, already serializes every writer) and `MAX`.
The words of the schema (`DDL`) and the column that gives checkpoints their insertion order
are the rest. Pure: no database, no I/O.
"""

from __future__ import annotations

import functools
import re

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final

_ROW_LOCK = re.compile(r"\s+FOR (?:NO KEY UPDATE|UPDATE|SHARE)\s*$")


class Dialect:
    """`row_locks`: the database has row locks, taken before the reads that decide.
    `returning`: a changed row is read back by RETURNING in its statement (PostgreSQL, for the
    notification a change sends and the admitted session), where SQLite counts rows."""

    __slots__ = ("ddl", "insertion_order", "name", "returning", "row_locks")

    def __init__(
        self,
        name: str,
        ddl: dict[str, str],
        *,
        row_locks: bool,
        returning: bool,
        insertion_order: str,
    ) -> None:
        self.name = name
        self.ddl = ddl
        self.row_locks = row_locks
        self.returning = returning
        self.insertion_order = insertion_order

    @functools.lru_cache(maxsize=1024)  # noqa: B019 - two instances, alive as long as the module
    def sql(self, portable: str) -> str:
        """The statement this database runs for a portable one (the module's docstring)."""
        if self.row_locks:
            return portable.replace("?", "%s")
        return _ROW_LOCK.sub("", portable).replace("GREATEST(", "MAX(")


SQLITE: Final = Dialect(
    "sqlite",
    {"bigint": "INTEGER", "double": "REAL", "user": "user", "seq": ""},
    row_locks=False,
    returning=False,
    insertion_order="rowid",
)
# BIGINT where SQLite's INTEGER holds cursors, pids and generations (64-bit there); "user" is
# quoted (a reserved word here); checkpoints get `seq`, the insertion order SQLite's rowid gives.
POSTGRESQL: Final = Dialect(
    "postgresql",
    {
        "bigint": "BIGINT",
        "double": "DOUBLE PRECISION",
        "user": '"user"',
        "seq": "seq         BIGINT GENERATED ALWAYS AS IDENTITY,",
    },
    row_locks=True,
    returning=True,
    insertion_order="seq",
)
