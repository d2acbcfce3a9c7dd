"""The library API: what the CLI, the HTTP service and the MCP tools all call.

`Runtime` is the facade over its parts, each a module of this package over `Composition`
(composition.py: the one place that chooses each implementation): admission (admission.py),
tasks (tasks.py), the output's reads (logreads.py); here are the facts, the close, recovery,
hosts, restore and verify. Everything after admission belongs to the owner; the runtime only
reads facts and asks the owner to act.
"""

from __future__ import annotations

from settled import grammar
from settled.backends import seals_logs
from settled.errors import BadInput
from settled.faults import ALL_POINTS as ALL_POINTS  # named for `settled close --list-fault-points`
from settled.home import storage_error as storage_error  # for the CLI: one line for a disk error
from settled.receipts import sealed_copy
from settled.records import OwnerFacts, SessionRecord, TaskRecord
from settled.runtime.admission import Admission as Admission
from settled.runtime.admission import Admissions
from settled.runtime.composition import LAUNCHERS as LAUNCHERS
from settled.runtime.composition import MAX_WAIT, _on_disk
from settled.runtime.composition import VERB_RUNNER as VERB_RUNNER
from settled.runtime.composition import load_for_calls as load_for_calls
from settled.runtime.composition import open_launcher as open_launcher
from settled.runtime.composition import ready_home as ready_home
from settled.runtime.logreads import STREAMS as STREAMS
from settled.runtime.logreads import LogReads
from settled.runtime.tasks import Tasks
from settled.states import SETTLED, TASK_COMPLETE, TASK_OPEN
from settled.status import session_status, task_state_word, task_status

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from settled.close.join import CloseJoin
    from settled.close.join import CloseResult as CloseResult  # what close_task returns
    from settled.log.reader import StreamLog as StreamLog  # the type of stream_log()
    from settled.owner.launcher import Launcher as Launcher  # the seam faces may share
    from settled.workspace.service import RestoreResult


class Runtime(Admissions, Tasks, LogReads):
    """`launcher="warm"` keeps a pre-imported zygote (this Runtime's child) that forks owners in
    ~2 ms instead of a fresh interpreter per session; worth it for a long-lived caller. The
    default comes from SETTLED_LAUNCHER, else "fresh"."""

    def owner_facts(self, record: SessionRecord) -> OwnerFacts | None:
        return self.sessions.owner_facts(record)

    def session_status(self, session: str) -> dict[str, Any]:
        """The session's view; where the home's objects live outside it, a settled session's
        also names each stream's sealed copy (`sealed`: the fact, or None while not sealed):
        the seal follows the receipt, a fact of its own (owner/sealing.py)."""
        view = self.sessions.status(grammar.check_id("session", session))
        if view["state"] == SETTLED and seals_logs(self.home):
            recorded = self.store.log_seals(view["task"], session).get(session, {})
            view["sealed"] = {
                stream: sealed_copy(view.get("receipt"), recorded, stream) for stream in STREAMS
            }
        return view

    def task_status(self, task: str) -> dict[str, Any]:
        record = self.store.get_task(grammar.check_id("task", task))
        views = [session_status(s, self.owner_facts(s)) for s in self.store.list_sessions(task)]
        view = task_status(record, views)
        if record.state != TASK_OPEN:  # computed from the close's facts, never stored
            explained = self.explain(task)
            view["complete"] = explained["complete"]
            if not explained["complete"]:
                if explained["blocked"]:
                    view["state"] = "blocked"
                view["blocked_on"] = explained["blocked_on"]
                view["why"] = explained["words"]
        return view

    def list_tasks(self, limit: int = 50) -> list[dict[str, Any]]:
        """The newest tasks of the store, newest first, each with its session counts; a task
        that is no longer open says whether its close proved completion (computed, as
        `explain` does, never read from a stored status)."""
        rows = []
        for record in self.store.list_tasks(limit):
            sessions = self.store.list_sessions(record.task)
            row: dict[str, Any] = {
                "task": record.task,
                "key": record.key,
                "state": task_state_word(record),
                "workspace": record.workspace,
                "created_at": record.created_at,
                "sessions": len(sessions),
                "live": sum(1 for s in sessions if s.live),
                "host": record.host,
            }
            if record.state != TASK_OPEN:
                row["complete"] = self.explain(record.task)["complete"]
            rows.append(row)
        return rows

    def task_ids(self, limit: int = 50) -> list[str]:
        """The newest ``limit`` tasks' ids, newest first: one read of the store, no session
        or close read (what the live view of /ui lists before it reads the tasks it must)."""
        grammar.check_int("limit", limit, 1, grammar.MAX_CURSOR)
        return [record.task for record in self.store.list_tasks(limit)]

    def wait(self, session: str, timeout: float | None = None) -> dict[str, Any]:
        """Block until the session has a receipt (or is unknown); the session's clock, not ours.
        Raises NotSettled when `timeout` passes first; the session goes on."""
        grammar.check_id("session", session)
        return self.sessions.wait(session, grammar.optional_seconds("timeout", timeout, MAX_WAIT))

    def recover_lost(self, session: str) -> dict[str, Any]:
        """What `wait` does before it answers unknown, for a face that waits on a loop of its
        own (HTTP `?wait=`): recover the session now if its owner's process is gone, or settle
        it never started if no owner claimed it within the claim bound; its status after."""
        self.sessions.recover_lost(grammar.check_id("session", session))
        return self.sessions.status(session)

    def cancel(self, session: str, reason: str = "cancel requested") -> dict[str, Any]:
        """Ask the owner to stop the session (TERM, grace, KILL over the whole boundary)."""
        reason = grammar.check_text("reason", reason, grammar.MAX_REASON_BYTES)
        grammar.check_id("session", session)
        self._on_this_host(self.store.get_task(self.store.get_session(session).task), "cancel")
        return self.sessions.cancel(session, reason)

    @_on_disk("close")
    def close_task(
        self, task: str, final: str | None = None, deadline: float | None = None
    ) -> CloseResult:
        """Run (or resume) the close join; a repeated close returns the same receipt."""
        grammar.check_id("task", task)
        grammar.optional_text("final", final, grammar.MAX_FINAL_BYTES)
        deadline = grammar.optional_seconds("deadline", deadline, grammar.MAX_DEADLINE_S)
        record = self.store.get_task(task)
        if record.state != TASK_COMPLETE:  # a complete task's receipt is read from anywhere
            self._on_this_host(record, "close")
        return self._close_join(task, final, deadline).run()

    def close_deadline_s(self, task: str, deadline: float | None = None) -> float:
        """The deadline a close of `task` given `deadline` would keep, in seconds from now: the
        one an interrupted close recorded unless `deadline` is sooner (close/deadline.py), for
        a person's progress line; the close decides it again when it waits."""
        import time

        from settled.close.deadline import close_deadline
        from settled.close.join import DEFAULT_DEADLINE_S

        pending = self.store.close_steps(grammar.check_id("task", task)).get("final_pending", {})
        now = time.time()
        return round(
            max(0.0, close_deadline(pending, deadline, now, DEFAULT_DEADLINE_S).at - now), 1
        )

    def _close_join(
        self, task: str, final: str | None = None, deadline: float | None = None
    ) -> CloseJoin:
        from settled.boundary.pod import LocalPods
        from settled.close.join import CloseJoin
        from settled.owner.sealing import CloseSeals

        pods = LocalPods(self.home)
        seals = CloseSeals(self.home, self.store, lambda: self.workspace.objects)
        return CloseJoin(
            self.store, self.workspace, self.sessions, task, final, deadline, pods, seals
        )

    @_on_disk("recover")
    def recover(self, task: str | None = None) -> list[dict[str, Any]]:
        """Inspect every session whose owner is gone; settle those with evidence (rule 4)."""
        if task is not None:
            self._on_this_host(self.store.get_task(grammar.check_id("task", task)), "recover")
        return self.recovery.recover(task)

    @_on_disk("recover --host")
    def recover_host(self, host: str) -> dict[str, Any]:
        """Declare another host gone for good: freeze its tasks (never a relaunch), mark its
        unsettled sessions unknown, and settle those its sandbox provider proves dead."""
        host = grammar.check_id("host", host)
        if host == self.host:
            raise BadInput(f"host {host} is this host: `settled recover` inspects its sessions")
        why = f"host {host} was declared vanished from host {self.host}"
        frozen = self.store.vanish_host(host, why)
        results = [
            self.recovery.recover_vanished(record, why)
            for task in frozen
            for record in self.store.list_sessions(task)
            if record.state != SETTLED
        ]
        return {"host": host, "frozen_tasks": frozen, "sessions": results}

    def hosts(self) -> list[dict[str, Any]]:
        """Every host of the store, and which one this is."""
        return [{**h.to_json(), "this": h.host == self.host} for h in self.store.hosts()]

    @_on_disk("checkpoint")
    def checkpoint(self, task: str, *, incremental: bool = True) -> dict[str, Any]:
        """Checkpoint an open task's workspace now (the close always does its own full scan)."""
        task = grammar.check_id("task", task)
        return self.workspace.checkpoint_now(self.store.get_task(task), incremental=incremental)

    def explain(self, task: str) -> dict[str, Any]:
        """Computed from the close's recorded facts alone (close.decide), so reading it costs
        no close join and no workspace."""
        from settled.close.decide import explain
        from settled.close.facts import read_close_facts

        facts = read_close_facts(self.store, grammar.check_id("task", task))
        view = explain(facts)
        if view.get("state") == TASK_OPEN and facts.task.frozen:  # the word every view uses
            view = {**view, "state": task_state_word(facts.task), "frozen": facts.task.frozen}
        return view

    def clocks(self, task: str, limit: int = 50) -> dict[str, Any]:
        """The four clocks of the task's newest ``limit`` sessions and the task's close receipt
        (settled.clocks), computed from the same recorded facts as ``explain``, with each live
        session's owner observed now (a dead owner shows its session unknown, never failed)."""
        from settled.clocks import task_clocks
        from settled.close.facts import read_close_facts

        facts = read_close_facts(self.store, grammar.check_id("task", task))
        grammar.check_int("limit", limit, 1, grammar.MAX_CURSOR)
        owners = {s.session: self.owner_facts(s) for s in facts.sessions if s.live}
        return task_clocks(facts, owners, limit)

    def exit_handle(self, session: str) -> int | None:
        """A handle (a pidfd) that becomes readable when the live session's owner exits, or
        None (no owner yet, an owner on another host, or none alive). The owner writes its
        receipt before it exits, so whoever wakes on it reads the receipt; an owner that dies
        without one wakes it too, and the status then says unknown. Close it with
        ``close_exit_handle``."""
        return self.sessions.exit_handle(grammar.check_id("session", session))

    def close_exit_handle(self, handle: int) -> None:
        self.sessions.liveness.close_handle(handle)

    def await_change(self, topics: tuple[str, ...], seconds: float) -> None:
        """Block until the store may have changed for one of ``topics`` (task or session ids;
        ``"*"``: anything) or ``seconds`` pass: a wakeup where the store notifies (PostgreSQL),
        a bounded sleep where it does not (SQLite). Spurious wakeups happen: read again."""
        self.store.await_change(topics, grammar.check_seconds("seconds", seconds, MAX_WAIT))

    def restore(self, target: str, dest: str, *, same_owner: bool = False) -> RestoreResult:
        """Rebuild a task's last checkpoint (or a manifest id) into an empty directory that is
        not (and is not under) a symlink. Every entry is the caller's and set-id bits it has
        not earned are dropped, unless ``same_owner`` (root only) restores every recorded owner."""
        grammar.check_text("target", target, grammar.MAX_KEY_BYTES, 1)
        grammar.check_path("dest", dest)
        manifest = self._manifest_of(target, "close it first")[1]
        return self.workspace.restore(manifest, dest, same_owner=same_owner)

    def verify(self, target: str, *, read_data: bool = False) -> dict[str, Any]:
        """Check everything a task's last checkpoint (or a manifest id) reaches, like ``restic
        check``: the manifest and every tree re-hashed and parsed, every blob present at its
        size, or with ``read_data`` re-hashed. Nothing is trusted and nothing is repaired;
        ``verified`` is False and ``problems`` names each object (and its paths) otherwise."""
        task, manifest = self._manifest_of(target, "checkpoint or close it")
        return {"task": task, **self.workspace.verify(manifest, read_data=read_data)}

    def _manifest_of(self, target: str, how: str) -> tuple[str | None, str]:
        """The task (None for a manifest id) and the manifest that `target` names: a task's
        last checkpoint, else a manifest id of this home's object store. BadInput for a task
        without a checkpoint (`how` says what makes one) and for any other target."""
        grammar.check_text("target", target, grammar.MAX_KEY_BYTES, 1)
        if target.startswith("t_"):
            task = self.store.get_task(target).task
            latest = self.store.latest_checkpoint(task)
            if latest is None:
                raise BadInput(f"task {target} has no checkpoint yet: {how}")
            return task, str(latest[0]["manifest"])
        self.workspace.check_manifest(target)
        return None, target

    def task_record(self, task: str) -> TaskRecord:
        """The task as recorded (UnknownTask if there is none): what a face checks a caller's
        scope against, or shows."""
        return self.store.get_task(grammar.check_id("task", task))

    def session_record(self, session: str) -> SessionRecord:
        """The session as recorded (UnknownSession if there is none); its state is the
        stored one, not the status projection ``session_status`` computes."""
        return self.store.get_session(grammar.check_id("session", session))
