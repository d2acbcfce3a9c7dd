"""The store written once: every statement and method body of `Store`, over a thin dialect.

`SQLStore` holds the records, transitions and seals; a subclass (`sqlite.py`, `postgres.py`)
brings only what its database does its own way: how a transaction is opened, made durable and
retried (`_transact`), how a read is made (`_fetch`), the notification a change sends
(`_notify`), and the lock that serializes task creations (`_serialize_creations`). Statements
are portable text (`store/dialect.py`): where the database has row locks, the rows that decide
are locked before they are read (a session's row FOR UPDATE before its compare-and-set; the
task row FOR SHARE during admission, so a seal, a fence or a session becoming unknown waits for
admissions in flight; FOR NO KEY UPDATE before a task transition); on SQLite one write lock
taken before any read does the same. Every compare-and-set that loses is StaleWrite, never a
silent no-op. What is admitted and where a task may be made is decided by `store/admission.py`
inside the transaction that records it. Never touches processes, logs or the workspace.

Over 400 lines for a reason: it is the 45 methods of one protocol (`Store`) and their
statements, written once where they were written twice; grouped as the protocol is (tasks,
hosts, sessions, the close join), each short.
"""

from __future__ import annotations

import json
import time

from settled.canonical import canonical_bytes
from settled.errors import StaleWrite, UnknownHost, UnknownSession, UnknownTask
from settled.identity import new_id
from settled.receipts import checked, seal_refusal
from settled.records import HostRecord, LiveSession, OwnerInfo, SessionRecord, TaskRecord
from settled.states import (
    ADMITTED,
    OWNER_RETURNS,
    TASK_COMPLETE,
    TASK_OPEN,
    UNKNOWN,
    IllegalTransition,
    next_session_state,
    next_task_state,
    states_accepting,
)
from settled.store import loads
from settled.store.admission import (
    REUSE,
    admission_verdict,
    creation_verdict,
    enforce,
    key_verdict,
    overlapping,
)
from settled.store.rows import (
    HOST_COLUMNS,
    LIVE_COLUMNS,
    RECEIPT_EVENTS,
    SESSION_COLUMNS,
    HiddenSets,
    checked_fact,
    fact_digest,
    host_from_row,
    live_from_row,
    session_from_row,
    stored_isolation,
    stored_receipt,
    task_from_row,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Final, TypeVar

    from settled.store.dialect import Dialect
    from settled.store.rows import HiddenSet

    T = TypeVar("T")
    # An open transaction's cursor: sqlite3's connection or psycopg's cursor. Each `execute`
    # returns something with fetchone, fetchall and rowcount.
    Cursor = Any

# "user" is quoted: a reserved word in PostgreSQL, an identifier either way.
TASK_COLUMNS: Final = (
    'task, key, workspace, state, generation, created_at, "user", shared_workspace, host, frozen, '
    "sandbox, ignore_rules, defaults, workspace_identity"
)
SELECT_TASK: Final = f"SELECT {TASK_COLUMNS} FROM tasks"
SELECT_SESSION: Final = f"SELECT {SESSION_COLUMNS} FROM sessions"
LIVE: Final = "state IN ('admitted', 'running', 'settling')"


def launch_sets(
    boundary: str | None, boundary_ref: str | None, isolation: dict[str, Any] | None
) -> tuple[dict[str, Any], HiddenSet | None]:
    """The boundary's columns a claim records with the owner (none when it names no boundary),
    and the hidden set its isolation names, to store in the same transaction."""
    if boundary is None:
        return {}, None
    sets: dict[str, Any] = {"boundary": boundary, "boundary_ref": boundary_ref}
    if isolation is None:
        return sets, None
    sets["isolation"], hidden_set = stored_isolation(isolation)
    return sets, hidden_set


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


class SQLStore:
    """`Store` over a SQL database; a subclass sets `dialect` and brings the hooks below."""

    dialect: Dialect

    def __init__(self) -> None:
        self._hidden_sets = HiddenSets(self._hidden_set)

    # -- what a database does its own way ----------------------------------------------------

    def _transact(self, work: Callable[[Cursor], T], *, durable: bool = True) -> T:
        """`work` in one write transaction. `durable=False`: committed (visible at once)
        without waiting for the disk, for facts a power cut may lose (see `Store`)."""
        raise NotImplementedError

    def _fetch(self, statement: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """Every row of one read, outside any transaction (the statement is the dialect's)."""
        raise NotImplementedError

    def _notify(self, cur: Cursor, task: str, session: str = "") -> None:
        """Tell waiters (`await_change`) at commit that the task or session changed."""

    def _serialize_creations(self, cur: Cursor) -> None:
        """Hold creations of tasks one at a time until commit, so two cannot both pass the
        workspace overlap check."""

    # -- statements ----------------------------------------------------------------------

    def _run(self, cur: Cursor, portable: str, args: tuple[Any, ...] = ()) -> Any:
        return cur.execute(self.dialect.sql(portable), args)

    def _read(self, portable: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self._fetch(self.dialect.sql(portable), args)

    def _read_one(self, portable: str, args: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
        rows = self._read(portable, args)
        return rows[0] if rows else None

    def _updated(self, cur: Cursor, portable: str, args: tuple[Any, ...]) -> list[str]:
        """Run an UPDATE; the task of each row it changed (by RETURNING where the database
        notifies; a database that sends no notification learns only how many: '' each)."""
        if self.dialect.returning:
            return [str(row[0]) for row in self._run(cur, f"{portable} RETURNING task", args)]
        return [""] * max(0, self._run(cur, portable, args).rowcount)

    def _hidden_set(self, digest: str, cur: Cursor | None = None) -> str | None:
        """By `cur` inside a transaction: a store may have one connection."""
        query, args = "SELECT dirs FROM hidden_sets WHERE digest=?", (digest,)
        row = (
            self._run(cur, query, args).fetchone()
            if cur is not None
            else self._read_one(query, args)
        )
        return None if row is None else str(row[0])

    def _store_hidden(self, cur: Cursor, hidden_set: HiddenSet | None) -> None:
        """Once per distinct list: every later session that hides the same directories names it."""
        if hidden_set is not None:
            self._run(
                cur,
                "INSERT INTO hidden_sets(digest, dirs) VALUES (?, ?) ON CONFLICT DO NOTHING",
                hidden_set,
            )

    # -- tasks ---------------------------------------------------------------------------

    def create_task(
        self,
        key: str,
        workspace: str,
        user: tuple[int, int] | None = None,
        *,
        shared_workspace: bool = False,
        host: str | None = None,
        ignore_rules: dict[str, Any] | None = None,
        defaults: dict[str, Any] | None = None,
        workspace_identity: dict[str, Any] | None = None,
    ) -> tuple[TaskRecord, bool]:
        def work(cur: Cursor) -> tuple[TaskRecord, bool]:
            self._serialize_creations(cur)  # the overlap is decided where it is recorded
            row = self._run(cur, f"{SELECT_TASK} WHERE key=?", (key,)).fetchone()
            if row:
                return task_from_row(row), False
            candidates = self._run(  # one host's: not another's paths
                cur,
                "SELECT task, workspace, workspace_identity FROM tasks WHERE state != ? "
                "AND (host IS NULL OR CAST(? AS TEXT) IS NULL OR host = ?) ORDER BY created_at",
                (TASK_COMPLETE, host, host),
            ).fetchall()
            others = overlapping(
                workspace, workspace_identity, ((t, p, loads(i)) for t, p, i in candidates)
            )
            enforce(creation_verdict(workspace, others, shared_workspace))
            record = TaskRecord(
                new_id("t"), key, workspace, TASK_OPEN, 1, time.time(), user, shared_workspace,
                host=host, ignore_rules=ignore_rules, defaults=defaults,
                workspace_identity=workspace_identity,
            )  # fmt: skip
            self._run(
                cur,
                f"INSERT INTO tasks ({TASK_COLUMNS}) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, ?, ?, ?)",
                (
                    record.task, key, workspace, record.state, 1, record.created_at,
                    _json(None if user is None else list(user)), int(shared_workspace), host,
                    _json(ignore_rules), _json(defaults), _json(workspace_identity),
                ),
            )  # fmt: skip
            for other, _path in others:  # each names the other in its close receipt
                cur.executemany(
                    self.dialect.sql(
                        "INSERT INTO workspace_shares VALUES (?, ?, ?) ON CONFLICT DO NOTHING"
                    ),
                    [
                        (record.task, other, record.created_at),
                        (other, record.task, record.created_at),
                    ],
                )
            self._notify(cur, record.task)
            return record, True

        return self._transact(work)

    def discard_task(self, task: str) -> bool:
        def work(cur: Cursor) -> bool:
            self._serialize_creations(cur)
            locked = self._run(
                cur,
                "SELECT 1 FROM tasks WHERE task=? AND state=? AND generation=1 FOR UPDATE",
                (task, TASK_OPEN),
            ).fetchone()
            if locked is None:
                return False
            deleted = self._run(  # a new statement, after the lock: it sees every committed use
                cur,
                "DELETE FROM tasks WHERE task=?"
                " AND NOT EXISTS (SELECT 1 FROM sessions WHERE sessions.task=tasks.task)"
                " AND NOT EXISTS (SELECT 1 FROM close_steps WHERE close_steps.task=tasks.task)"
                " AND NOT EXISTS (SELECT 1 FROM checkpoints WHERE checkpoints.task=tasks.task)",
                (task,),
            )
            if deleted.rowcount != 1:
                return False
            self._run(cur, "DELETE FROM workspace_shares WHERE task=? OR other=?", (task, task))
            return True

        return self._transact(work)

    def record_sandbox(self, task: str, facts: dict[str, Any]) -> TaskRecord:
        def work(cur: Cursor) -> TaskRecord:
            updated = self._run(
                cur,
                "UPDATE tasks SET sandbox=? WHERE task=? AND sandbox IS NULL",
                (json.dumps(facts, sort_keys=True), task),
            ).rowcount
            row = self._run(cur, f"{SELECT_TASK} WHERE task=?", (task,)).fetchone()
            if row is None:
                raise UnknownTask(task)
            if updated != 1:
                raise StaleWrite(f"task {task} has its sandbox recorded already")
            self._notify(cur, task)
            return task_from_row(row)

        return self._transact(work)

    def workspace_shares(self, task: str) -> list[str]:
        rows = self._read(
            "SELECT other FROM workspace_shares WHERE task=? ORDER BY created_at, other", (task,)
        )
        return [r[0] for r in rows]

    def get_task(self, task: str) -> TaskRecord:
        row = self._read_one(f"{SELECT_TASK} WHERE task=?", (task,))
        if row is None:
            raise UnknownTask(task)
        return task_from_row(row)

    def list_tasks(self, limit: int = 1000) -> list[TaskRecord]:
        rows = self._read(f"{SELECT_TASK} ORDER BY created_at DESC, task LIMIT ?", (limit,))
        return [task_from_row(r) for r in rows]

    def find_task(self, key: str) -> TaskRecord | None:
        row = self._read_one(f"{SELECT_TASK} WHERE key=?", (key,))
        return None if row is None else task_from_row(row)

    def workspaces(self) -> list[str]:
        return [r[0] for r in self._read("SELECT DISTINCT workspace FROM tasks")]

    def add_hidden_paths(self, paths: list[str]) -> None:
        def work(cur: Cursor) -> None:
            self._run(
                cur,
                "INSERT INTO meta(key, value) VALUES('hidden_paths', '[]') ON CONFLICT DO NOTHING",
            )
            row = self._run(
                cur, "SELECT value FROM meta WHERE key='hidden_paths' FOR UPDATE"
            ).fetchone()
            known = set(json.loads(row[0])) if row else set()
            if known >= set(paths):
                return
            self._run(
                cur,
                "UPDATE meta SET value=? WHERE key='hidden_paths'",
                (json.dumps(sorted(known | set(paths))),),
            )

        self._transact(work)

    def hidden_paths(self) -> list[str]:
        row = self._read_one("SELECT value FROM meta WHERE key='hidden_paths'")
        return list(json.loads(row[0])) if row else []

    # -- hosts ---------------------------------------------------------------------------

    def register_host(self, host: str, name: str, home: str) -> HostRecord:
        found = self.get_host(host)
        if found is not None:  # an open writes nothing once registered (a full disk)
            return found

        def work(cur: Cursor) -> HostRecord:
            self._run(
                cur,
                "INSERT INTO hosts (host, name, home, registered_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (host) DO NOTHING",
                (host, name, home, time.time()),
            )
            row = self._run(cur, f"SELECT {HOST_COLUMNS} FROM hosts WHERE host=?", (host,))
            return host_from_row(row.fetchone() or ())

        return self._transact(work)

    def get_host(self, host: str) -> HostRecord | None:
        row = self._read_one(f"SELECT {HOST_COLUMNS} FROM hosts WHERE host=?", (host,))
        return None if row is None else host_from_row(row)

    def hosts(self) -> list[HostRecord]:
        rows = self._read(f"SELECT {HOST_COLUMNS} FROM hosts ORDER BY registered_at, host")
        return [host_from_row(r) for r in rows]

    def vanish_host(self, host: str, why: str) -> list[str]:
        def work(cur: Cursor) -> list[str]:
            found = self._run(cur, "SELECT 1 FROM hosts WHERE host=? FOR UPDATE", (host,))
            if found.fetchone() is None:
                raise UnknownHost(host)
            self._run(
                cur,
                "UPDATE hosts SET vanished_at=?, vanished_why=? "
                "WHERE host=? AND vanished_at IS NULL",
                (time.time(), why, host),
            )
            for task in self._updated(
                cur,
                "UPDATE tasks SET frozen=? WHERE host=? AND frozen IS NULL AND state != ?",
                (why, host, TASK_COMPLETE),
            ):
                self._notify(cur, task)
            rows = self._run(
                cur,
                "SELECT task FROM tasks WHERE host=? AND frozen IS NOT NULL ORDER BY created_at",
                (host,),
            ).fetchall()
            return [r[0] for r in rows]

        return self._transact(work)

    # -- sessions ------------------------------------------------------------------------

    def admit(
        self, task: str, key: str, digest: str, spec: dict[str, Any]
    ) -> tuple[SessionRecord, bool]:
        """The spec's canonical text is made before the transaction: every other writer of
        the store may queue on it while it is open."""
        text = canonical_bytes(spec).decode()

        def by_key(cur: Cursor) -> SessionRecord | None:
            row = self._run(cur, f"{SELECT_SESSION} WHERE task=? AND key=?", (task, key))
            found = row.fetchone()
            hidden = self._hidden_sets.via(lambda digest: self._hidden_set(digest, cur))
            return None if found is None else session_from_row(found, hidden)

        def work(cur: Cursor) -> tuple[SessionRecord | None, str, bool]:
            found = self._run(  # held until commit: no seal, fence or freeze slips under us
                cur, "SELECT state, generation, frozen FROM tasks WHERE task=? FOR SHARE", (task,)
            ).fetchone()
            if found is None:
                raise UnknownTask(task)
            existing = by_key(cur)
            if enforce(key_verdict(existing, key, digest)) == REUSE:
                return existing, key, True
            state, generation, frozen = found
            unknown = self._run(
                cur,
                "SELECT session FROM sessions WHERE task=? AND state='unknown' LIMIT 1",
                (task,),
            ).fetchone()
            unknown_session = None if unknown is None else unknown[0]
            enforce(admission_verdict(task, state, frozen, unknown_session))
            session = new_id("s")
            values = (session, task, key, digest, text, ADMITTED, generation, time.time())
            inserted, row = self._insert_session(cur, values)
            if not inserted:  # a concurrent admission of this key committed first: it stands
                winner = by_key(cur)
                assert winner is not None
                enforce(key_verdict(winner, key, digest))
                return winner, key, True
            self._notify(cur, task, session)
            return None if row is None else session_from_row(row, self._hidden_sets), session, False

        record, session, reused = self._transact(work)
        if record is None:  # read after commit, outside the transaction
            record = self.get_session(session)
        return record, reused

    def _insert_session(
        self, cur: Cursor, values: tuple[Any, ...]
    ) -> tuple[bool, tuple[Any, ...] | None]:
        """Insert an admitted session unless its key is taken: whether it was inserted, and
        its row where the database returns it from the same statement (RETURNING)."""
        statement = (
            "INSERT INTO sessions (session, task, key, digest, spec, state, generation, "
            "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (task, key) DO NOTHING"
        )
        if self.dialect.returning:
            row = self._run(cur, f"{statement} RETURNING {SESSION_COLUMNS}", values).fetchone()
            return row is not None, row
        return self._run(cur, statement, values).rowcount == 1, None

    def get_session(self, session: str) -> SessionRecord:
        row = self._read_one(f"{SELECT_SESSION} WHERE session=?", (session,))
        if row is None:
            raise UnknownSession(session)
        return session_from_row(row, self._hidden_sets)

    def find_session(self, task: str, key: str) -> SessionRecord | None:
        row = self._read_one(f"{SELECT_SESSION} WHERE task=? AND key=?", (task, key))
        return session_from_row(row, self._hidden_sets) if row else None

    def list_sessions(self, task: str) -> list[SessionRecord]:
        rows = self._read(f"{SELECT_SESSION} WHERE task=? ORDER BY created_at, session", (task,))
        return [session_from_row(r, self._hidden_sets) for r in rows]

    def _transition(
        self, cur: Cursor, session: str, generation: int, event: str, sets: dict[str, Any]
    ) -> None:
        """The compare-and-set every state change goes through."""
        expected = states_accepting(event)
        if event == "lose" and self.dialect.row_locks:  # freezes the task's admission: wait
            self._run(  # for admissions in flight (SQLite's write lock already excludes them)
                cur,
                "SELECT 1 FROM tasks WHERE task=(SELECT task FROM sessions WHERE session=?) "
                "FOR NO KEY UPDATE",
                (session,),
            )
        row = self._run(
            cur,
            "SELECT task, state, generation, receipt IS NULL, owner IS NOT NULL FROM sessions "
            "WHERE session=? FOR UPDATE",
            (session,),
        ).fetchone()
        if row is None:
            raise UnknownSession(session)
        task, state, current_generation, no_receipt, owned = row
        if state not in expected or current_generation != generation:
            raise StaleWrite(
                f"session {session}: {event} expects state in {list(expected)} at generation "
                f"{generation}, found {state!r} at generation {current_generation}"
            )
        if state == UNKNOWN and event in OWNER_RETURNS and not (no_receipt and owned):
            raise StaleWrite(  # its owner settled it unproven ("lose"), or none ever claimed it
                f"session {session}: {event} of an unknown session is its owner's return, "
                "and this one has a receipt already or was never claimed"
            )
        new_state = next_session_state(state, event)
        assignments = "".join(f", {column}=?" for column in sets)
        changed = self._run(
            cur,
            f"UPDATE sessions SET state=?{assignments} "
            "WHERE session=? AND state=? AND generation=?",
            (new_state, *sets.values(), session, state, generation),
        )
        if changed.rowcount != 1:  # the row is locked: this is a bug, not a race
            raise StaleWrite(f"session {session}: {event} lost its compare-and-set")
        self._notify(cur, task, session)

    def _update_live(self, cur: Cursor, session: str, generation: int, sets: dict[str, Any]) -> str:
        """A field update that changes no state but still must hold the generation; returns
        the session's task ('' where nothing is notified)."""
        assignments = ", ".join(f"{column}=?" for column in sets)
        changed = self._updated(
            cur,
            f"UPDATE sessions SET {assignments} WHERE session=? AND generation=? "
            "AND state IN ('running', 'settling')",
            (*sets.values(), session, generation),
        )
        if not changed:
            raise StaleWrite(f"session {session} is not live at generation {generation}")
        return changed[0]

    def claim(
        self,
        session: str,
        generation: int,
        owner: OwnerInfo,
        *,
        boundary: str | None = None,
        boundary_ref: str | None = None,
        isolation: dict[str, Any] | None = None,
    ) -> SessionRecord:
        sets: dict[str, Any] = {"owner": json.dumps(owner.to_json()), "started_at": time.time()}
        launch, hidden_set = launch_sets(boundary, boundary_ref, isolation)
        sets |= launch

        def work(cur: Cursor) -> None:
            self._store_hidden(cur, hidden_set)
            self._transition(cur, session, generation, "claim", sets)

        self._transact(work)
        return self.get_session(session)

    def record_launch(
        self,
        session: str,
        generation: int,
        boundary: str,
        boundary_ref: str | None,
        command_pid: int | None,
        command_start_time: int | None,
        isolation: dict[str, Any] | None = None,
        *,
        durable: bool = True,
    ) -> None:
        """`durable=False`: for facts of this boot only (a pid), which no power cut can make
        wrong: every process of the boot dies with it. Others see the write at once either way."""
        sets: dict[str, Any] = {
            "boundary": boundary,
            "boundary_ref": boundary_ref,
            "command_pid": command_pid,
            "command_start_time": command_start_time,
        }
        hidden_set = None
        if isolation is not None:
            sets["isolation"], hidden_set = stored_isolation(isolation)

        def work(cur: Cursor) -> None:
            self._store_hidden(cur, hidden_set)
            self._notify(cur, self._update_live(cur, session, generation, sets), session)

        self._transact(work, durable=durable)

    def heartbeat(
        self, session: str, generation: int, lease_until: float, stdout: int, stderr: int
    ) -> str | None:
        """Not made durable: a renewal lost to a power cut is harmless, since the next boot has
        another boot id, and 200 owners renewing every few seconds must not queue behind 200
        flushes a second. A session that became unknown at this generation (its owner was cut
        off from the store past its lease) and that nobody took over is revived: its owner is
        back (states.py, `revive`)."""

        def work(cur: Cursor) -> str | None:
            row = self._run(
                cur,
                "SELECT owner, cancel_requested, state, generation FROM sessions "
                "WHERE session=? FOR UPDATE",
                (session,),
            ).fetchone()
            if row is None:
                raise UnknownSession(session)
            if row[2] == UNKNOWN and row[3] == generation:
                self._transition(cur, session, generation, "revive", {"unknown_why": None})
            owner = json.loads(row[0]) if row[0] else {}
            owner["lease_until"] = lease_until
            task = self._update_live(cur, session, generation, {"owner": json.dumps(owner)})
            self._run(  # a durable cursor never moves backwards
                cur,
                "UPDATE sessions SET stdout_durable=GREATEST(stdout_durable, ?), "
                "stderr_durable=GREATEST(stderr_durable, ?) WHERE session=?",
                (stdout, stderr, session),
            )
            self._notify(cur, task, session)
            return row[1]  # type: ignore[no-any-return]

        return self._transact(work, durable=False)

    def settle_begin(self, session: str, generation: int) -> None:
        self._transact(lambda cur: self._transition(cur, session, generation, "settle_begin", {}))

    def write_receipt(
        self, session: str, generation: int, receipt: dict[str, Any], event: str = "receipt"
    ) -> SessionRecord:
        if event not in RECEIPT_EVENTS:
            raise StaleWrite(f"a receipt settles a session only by {RECEIPT_EVENTS}, not {event!r}")
        checked(receipt, f"the receipt offered for session {session}")  # refused unsealed
        output = receipt.get("output", {})
        text, hidden_set = stored_receipt(receipt)  # before the transaction: others queue on it
        sets = {
            "receipt": text,
            "settled_at": time.time(),
            **{
                f"{stream}_durable": output[stream]["cursor"]
                for stream in ("stdout", "stderr")
                if stream in output
            },
        }

        def work(cur: Cursor) -> None:
            self._store_hidden(cur, hidden_set)
            self._transition(cur, session, generation, event, sets)

        self._transact(work)
        return self.get_session(session)

    def mark_unknown(self, session: str, generation: int, why: str) -> SessionRecord:
        """The owner is gone without a receipt: unknown, never failed (rule 4)."""
        sets = {"unknown_why": why}
        self._transact(lambda cur: self._transition(cur, session, generation, "lose", sets))
        return self.get_session(session)

    def take_over(self, session: str, generation: int) -> int:
        """Fence an unknown session's old owner: recovery writes at the next generation, and
        every later write of the old owner (heartbeat, receipt) is refused."""

        def work(cur: Cursor) -> None:
            changed = self._updated(
                cur,
                "UPDATE sessions SET generation=generation+1 "
                "WHERE session=? AND generation=? AND state='unknown'",
                (session, generation),
            )
            if len(changed) != 1:
                raise StaleWrite(
                    f"session {session} is not unknown at generation {generation}: another "
                    "recovery took it over, or it settled"
                )
            self._notify(cur, changed[0], session)

        self._transact(work)
        return generation + 1

    def note_unknown(self, session: str, why: str) -> None:
        """Recovery inspected an unknown session and could not prove it dead: say why."""
        self._transact(
            lambda cur: self._run(
                cur,
                "UPDATE sessions SET unknown_why=? WHERE session=? AND state='unknown'",
                (why, session),
            )
        )

    def unknown_sessions(self, task: str | None = None) -> list[SessionRecord]:
        where, args = ("AND task=?", (task,)) if task else ("", ())
        rows = self._read(
            f"{SELECT_SESSION} WHERE state='unknown' {where} ORDER BY created_at", args
        )
        return [session_from_row(r, self._hidden_sets) for r in rows]

    def live_sessions(self, task: str | None = None) -> list[SessionRecord]:
        rows = self._live_rows(SESSION_COLUMNS, task)
        return [session_from_row(r, self._hidden_sets) for r in rows]

    def live_owners(self, task: str | None = None) -> list[LiveSession]:
        return [live_from_row(r) for r in self._live_rows(LIVE_COLUMNS, task)]

    def _live_rows(self, columns: str, task: str | None) -> list[tuple[Any, ...]]:
        """``columns`` of every live session (of ``task``, if given), oldest first."""
        where, args = ("AND task=?", (task,)) if task else ("", ())
        return self._read(
            f"SELECT {columns} FROM sessions WHERE {LIVE} {where} ORDER BY created_at", args
        )

    def request_cancel(self, session: str, reason: str) -> SessionRecord:
        def work(cur: Cursor) -> None:
            for task in self._updated(
                cur,
                f"UPDATE sessions SET cancel_requested=? WHERE session=? "
                f"AND cancel_requested IS NULL AND {LIVE}",
                (reason, session),
            ):
                self._notify(cur, task, session)

        self._transact(work)
        return self.get_session(session)

    # -- sealed logs ---------------------------------------------------------------------

    def record_seal(self, session: str, stream: str, fact: dict[str, Any]) -> dict[str, Any]:
        """Record where the sealed copy of a settled stream is (once: the first stands and is
        returned). Refused (StaleWrite) unless the session is settled and the fact's length
        and digest are its receipt's cursor and digest for that stream."""
        text = canonical_bytes(fact).decode()

        def work(cur: Cursor) -> dict[str, Any]:
            row = self._run(
                cur, "SELECT task, state, receipt FROM sessions WHERE session=?", (session,)
            ).fetchone()
            if row is None:
                raise UnknownSession(session)
            refusal = seal_refusal(session, stream, row[1], loads(row[2]), fact)
            if refusal is not None:
                raise StaleWrite(refusal)
            self._run(
                cur,
                "INSERT INTO log_seals (session, stream, fact, recorded_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (session, stream) DO NOTHING",
                (session, stream, text, time.time()),
            )
            kept = self._run(
                cur,
                "SELECT fact FROM log_seals WHERE session=? AND stream=?",
                (session, stream),
            ).fetchone()
            self._notify(cur, str(row[0]), session)
            return dict(json.loads(kept[0]))

        return self._transact(work)

    def log_seals(self, task: str, session: str | None = None) -> dict[str, dict[str, Any]]:
        """The recorded seals of the task's sessions (or of one), by session, then stream."""
        where, args = ("AND s.session=?", (task, session)) if session else ("", (task,))
        rows = self._read(
            "SELECT l.session, l.stream, l.fact FROM log_seals l "
            f"JOIN sessions s ON s.session=l.session WHERE s.task=? {where}",
            args,
        )
        seals: dict[str, dict[str, Any]] = {}
        for name, stream, fact in rows:
            seals.setdefault(str(name), {})[str(stream)] = json.loads(fact)
        return seals

    # -- the close join and checkpoints --------------------------------------------------

    def _task_transition(self, cur: Cursor, task: str, event: str) -> str:
        row = self._run(
            cur, "SELECT state FROM tasks WHERE task=? FOR NO KEY UPDATE", (task,)
        ).fetchone()
        if row is None:
            raise UnknownTask(task)
        try:
            new_state = next_task_state(row[0], event)
        except IllegalTransition as exc:
            raise StaleWrite(f"task {task}: {exc}") from None
        self._run(
            cur, "UPDATE tasks SET state=? WHERE task=? AND state=?", (new_state, task, row[0])
        )
        self._notify(cur, task)
        return new_state

    def task_event(self, task: str, event: str) -> TaskRecord:
        self._transact(lambda cur: self._task_transition(cur, task, event))
        return self.get_task(task)

    def record_close_step(
        self,
        task: str,
        step: str,
        fact: dict[str, Any],
        *,
        event: str | None = None,
        fence: int | None = None,
        durable: bool = True,
    ) -> dict[str, Any]:
        """Record a step's fact once; a second recording returns the first (never re-runs).
        Its ``event`` and ``fence``, if any, in the same transaction (see ``Store``): made
        after the insert, so a refused one rolls the insert back."""
        text = canonical_bytes(fact).decode()

        def work(cur: Cursor) -> dict[str, Any]:
            if self._run(cur, "SELECT 1 FROM tasks WHERE task=?", (task,)).fetchone() is None:
                raise UnknownTask(task)  # named, not the foreign key's IntegrityError
            inserted = self._run(
                cur,
                "INSERT INTO close_steps (task, step, fact, recorded_at, digest) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT (task, step) DO NOTHING",
                (task, step, text, time.time(), fact_digest(text)),
            )
            if inserted.rowcount != 1:
                row = self._run(
                    cur,
                    "SELECT fact, digest FROM close_steps WHERE task=? AND step=?",
                    (task, step),
                ).fetchone()
                return checked_fact(task, step, row[0], row[1])
            if event is not None:
                self._task_transition(cur, task, event)
            if fence is not None:
                self._fence(cur, task, fence)
            self._notify(cur, task)
            return fact

        return self._transact(work, durable=durable)

    def close_steps(self, task: str) -> dict[str, dict[str, Any]]:
        rows = self._read("SELECT step, fact, digest FROM close_steps WHERE task=?", (task,))
        return {step: checked_fact(task, step, fact, digest) for step, fact, digest in rows}

    def record_checkpoint(
        self, task: str, generation: int, receipt: dict[str, Any], index_ref: str | None
    ) -> None:
        """Refused from a fenced generation: only the task's current generation may publish."""
        text = canonical_bytes(receipt).decode()

        def work(cur: Cursor) -> None:
            row = self._run(
                cur, "SELECT generation FROM tasks WHERE task=? FOR SHARE", (task,)
            ).fetchone()
            if row is None:
                raise UnknownTask(task)
            if row[0] != generation:
                raise StaleWrite(
                    f"task {task}: a checkpoint from generation {generation} is refused; the "
                    f"runtime generation is {row[0]} (fenced)"
                )
            self._run(
                cur,
                "INSERT INTO checkpoints (manifest, task, generation, receipt, index_ref, "
                "created_at) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (receipt["manifest"], task, generation, text, index_ref, time.time()),
            )

        self._transact(work)

    def latest_checkpoint(self, task: str) -> tuple[dict[str, Any], str | None] | None:
        row = self._read_one(
            "SELECT receipt, index_ref FROM checkpoints WHERE task=? "
            f"ORDER BY created_at DESC, {self.dialect.insertion_order} DESC LIMIT 1",
            (task,),
        )
        if row is None:
            return None
        return checked(json.loads(row[0]), f"the checkpoint receipt of task {task}"), row[1]

    def fence(self, task: str, generation: int) -> int:
        """Advance the runtime generation past `generation`; a stale fence is refused."""

        def work(cur: Cursor) -> None:
            self._fence(cur, task, generation)
            self._notify(cur, task)

        self._transact(work)
        return generation + 1

    def _fence(self, cur: Cursor, task: str, generation: int) -> None:
        fenced = self._run(
            cur,
            "UPDATE tasks SET generation=generation+1 WHERE task=? AND generation=?",
            (task, generation),
        )
        if fenced.rowcount != 1:
            raise StaleWrite(f"task {task} is not at generation {generation}: already fenced")
