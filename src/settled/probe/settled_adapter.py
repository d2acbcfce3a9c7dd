"""The `settled` adapter: the essay's checklist against settled, each answer read from its receipts.

The experiments are written once against `settled_backends.Backend`, so the library on a fresh
home and a service URL answer the same questions the same way; each runs in a task of its own
that is closed at its end (`Backend.finish`), so nothing of an experiment outlives it. An
answer holds only when every fact it names was checked here: bytes compared with what the
command wrote, digests recomputed, receipts cross-checked with `explain`, and the kernel's
process table swept for anything of the command still running.
Must never: take a receipt's word where the experiment can check it, kill an owner it has not
identified, or call "holds" what it could not look at (it says what it could not reach).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import blake3

from settled.probe import questions as q
from settled.probe.host import Sweep, kill_if, wait_gone
from settled.probe.settled_backends import Backend, CannotLook, owner_here, owners_gone
from settled.states import UNKNOWN

UNKNOWN_WITHIN_S = 15.0  # how long status may take to see an owner's death


class SettledAdapter:
    """`settled probe --runtime settled` (a fresh home) or `--runtime http://HOST:PORT`."""

    name = "settled"

    def __init__(self, sweep: Sweep, backend: Backend) -> None:
        self.sweep, self.backend = sweep, backend
        self.sessions: dict[str, list[str]] = {}  # question -> the sessions it made, for demo
        self.tasks: list[str] = []  # every task it made, each closed at its experiment's end

    def describe(self) -> dict[str, str]:
        return {
            "name": self.name,
            "version": f"settled {self.backend.version}",
            "how": "Runtime.exec / wait / close_task / explain / recover"
            if self.backend.on_this_machine
            else "the HTTP API through settled.client",
            "where": self.backend.where,
        }

    def experiments(self) -> dict[str, q.Experiment]:
        return q.experiments_of(self)

    def close(self) -> None:
        self.backend.close()

    # -- one task per experiment ----------------------------------------------------------

    @contextlib.contextmanager
    def _task(self) -> Iterator[str]:
        """A task for one experiment, closed at its end, its owners checked gone."""
        task = self.backend.new_task()
        self.tasks.append(task)
        try:
            yield task
        finally:
            self.backend.finish(task)
            owners_gone(self.backend.owners(task))

    def _exec(self, question: str, task: str, shell: str, key: str | None = None,
              **options: Any) -> str:  # fmt: skip
        admitted = self.backend.exec(
            task, shell, key or f"probe-{question}", self.sweep.env(question), **options
        )
        self.sessions.setdefault(question, []).append(admitted.session)
        return admitted.session

    def _receipt(self, session: str) -> dict[str, Any]:
        view = self.backend.wait(session)
        receipt = view.get("receipt")
        if not isinstance(receipt, dict):
            raise AssertionError(f"session {session} is {view.get('state')} with no receipt")
        return receipt

    # -- the experiments ------------------------------------------------------------------

    def retry(self, scratch: str) -> q.Outcome:
        del scratch
        env = self.sweep.env("retry")
        with self._task() as task:
            lost = self.backend.lose_response(task, q.LAUNCH, "probe-retry", env)
            again = self.backend.exec(task, q.LAUNCH, "probe-retry", env)
            self.sessions.setdefault("retry", []).append(again.session)
            receipt = self._receipt(again.session)
            sessions = self.backend.task_sessions(task)
            launches = q.count(self.backend.read_file(task, "launches.txt"))
        ok = again.reused and sessions == [again.session] and launches == 1
        return q.judged(
            ok,
            f"{_launches(launches)}: the retry got the same session {again.session} "
            f"(reused={str(again.reused).lower()}), {len(sessions)} session(s) in the task",
            how_lost=lost, session=again.session, reused=again.reused, sessions=sessions,
            launches=launches, receipt=receipt["digest"],
        )  # fmt: skip

    def long_line(self, scratch: str) -> q.Outcome:
        del scratch
        with self._task() as task:
            session = self._exec("long_line", task, q.LONG_LINE)
            receipt = self._receipt(session)
            got = self.backend.output(session)
        return _bit_for_bit(got, b"x" * q.LINE_BYTES, receipt)

    def binary(self, scratch: str) -> q.Outcome:
        del scratch
        with self._task() as task:
            session = self._exec("binary", task, q.BINARY)
            receipt = self._receipt(session)
            got = self.backend.output(session)
            witness = self.backend.read_file(task, "random.sha256").split(b" ")[0].decode()
        return _bit_for_bit(got, None, receipt, "sha256:" + witness)

    def silent(self, scratch: str) -> q.Outcome:
        del scratch
        with self._task() as task:
            started = time.monotonic()
            session = self._exec(
                "silent", task, q.SILENT, timeout=q.SILENT_TIMEOUT_S, grace=q.GRACE_S
            )
            receipt = self._receipt(session)
            returned = time.monotonic() - started
            left = self.sweep.left("silent")
        ended, death = receipt["exit"], receipt["death"]
        ran = float(ended.get("elapsed_s") or 0.0)
        on_time = ran <= q.SILENT_TIMEOUT_S + q.GRACE_S + q.ON_TIME_SLACK_S
        ok = ended.get("reason") == "timeout" and on_time and death["proven"] and not left
        return q.judged(
            ok,
            f"{ended.get('reason')} after {ran:.2f} s by the owner's clock, the receipt after "
            f"{returned:.2f} s; tree proven dead by {death['boundary']}",
            exit=ended, death_proven=death["proven"], boundary=death["boundary"],
            receipt_after_s=round(returned, 3), receipt=receipt["digest"],
            running_after_the_call=[p.to_json() for p in left],
        )  # fmt: skip

    def holder(self, scratch: str) -> q.Outcome:
        del scratch
        with self._task() as task:
            started = time.monotonic()
            session = self._exec("holder", task, q.HOLDER, grace=q.GRACE_S)
            receipt = self._receipt(session)
            returned = time.monotonic() - started
            left = self.sweep.left("holder")
        death, stragglers = receipt["death"], receipt.get("stragglers") or []
        named = "; ".join(f"`{s['cmdline']}` stopped by {s['stopped_by']}" for s in stragglers)
        ok = bool(death["proven"]) and not left
        return q.judged(
            ok,
            f"receipt after {returned:.2f} s; {named or 'no straggler'}; proven dead by "
            f"{death['boundary']} ({death['source']})",
            death=death, stragglers=stragglers, receipt=receipt["digest"],
            running_after_the_call=[p.to_json() for p in left],
        )  # fmt: skip

    def owner_killed(self, scratch: str) -> q.Outcome:
        del scratch
        with self._task() as task:
            return self._owner_killed(task)

    def _owner_killed(self, task: str) -> q.Outcome:
        session = self._exec("owner_killed", task, q.KILLED, timeout=120.0, grace=q.GRACE_S)
        _until(lambda: q.count(self.backend.peek(session)) >= 1, 30.0, "the command's launch")
        owner = self.backend.status(session).get("owner") or {}
        why_not = owner_here(owner)
        if why_not is not None:
            return q.not_applicable(f"killing the owner needs its host: {why_not}", owner=owner)
        pid, started = int(owner["pid"]), owner.get("start_time")
        killed = kill_if(pid, started)
        gone = wait_gone(pid, started, 10.0)
        seen = _until(
            lambda: self.backend.status(session)["state"] == UNKNOWN, UNKNOWN_WITHIN_S, None
        )
        view = self.backend.status(session)
        env = self.sweep.env("owner_killed")
        retry = self.backend.exec(
            task, q.KILLED, "probe-owner_killed", env, timeout=120.0, grace=q.GRACE_S
        )
        other = self.backend.refusal(task, q.DONE, "probe-owner_killed-other", {})
        recovered = self.backend.recover(task)
        receipt = self._receipt(session)
        after = self.backend.exec(  # settled by recovery: a retry still gets it, not a relaunch
            task, q.KILLED, "probe-owner_killed", env, timeout=120.0, grace=q.GRACE_S
        )
        launches = q.count(self.backend.read_file(task, "launches.txt"))
        death = receipt["death"]
        ok = (
            killed and gone and seen and launches == 1
            and all(r.reused and r.session == session for r in (retry, after))
            and bool(death["proven"]) and death["source"] == "recovery"
        )  # fmt: skip
        return q.judged(
            ok,
            f"owner pid {pid} SIGKILLed; status said {view['state']}; the retry got the same "
            f"session ({retry.state}), a new exec was {_refused(other)}; recovery proved it "
            f"dead by {death['boundary']}; a retry after that got it again; {_launches(launches)}",
            owner=owner, killed=killed, status_after_the_kill=view["state"],
            why=view.get("why"), retry={"session": retry.session, "reused": retry.reused,
            "state": retry.state}, retry_after_recovery={"session": after.session,
            "reused": after.reused, "state": after.state}, other_exec=other,
            recovered=recovered, death=death,
            drain=receipt["output"]["drain"], launches=launches, receipt=receipt["digest"],
        )  # fmt: skip

    def late_write(self, scratch: str) -> q.Outcome:
        del scratch
        token = f"late-{secrets.token_hex(8)}"
        with self._task() as task:
            session = self._exec("late_write", task, q.LATE_WRITE.format(token=token))
            receipt = self._receipt(session)
            close = self.backend.close_task(task)
            checkpoint = close["checkpoint"]
            covered = checkpoint["covers"]["terminal_mutations"].get(session, {})
            covers = int(covered.get("seq", -1)) <= int(checkpoint["watermark"])
            verified = bool(checkpoint["read_back"]["verified"])
            evidence = {
                "manifest": checkpoint["manifest"], "watermark": checkpoint["watermark"],
                "terminal_mutation": receipt.get("terminal_mutation"), "read_back": verified,
                "checkpoint_receipt": checkpoint["digest"], "close_receipt": close["digest"],
            }  # fmt: skip
            try:
                restored = self.backend.in_checkpoint(task, "late.txt")
            except CannotLook as exc:
                return q.judged(
                    covers and verified,
                    f"by the receipts: checkpoint {checkpoint['manifest'][:19]}… covers mutation "
                    f"{checkpoint['watermark']} ≥ the command's last ({covered.get('seq')}), read "
                    f"back verified; its bytes not read ({exc})",
                    **evidence,
                )
        same = restored == token.encode()
        return q.judged(
            same and covers and verified,
            f"late.txt restored from checkpoint {checkpoint['manifest'][:19]}… with the bytes "
            f"written ({len(restored or b'')} bytes), mutation {covered.get('seq')} covered, "
            "read back verified" if same else f"late.txt {'differs' if restored else 'is missing'} "
            f"in checkpoint {checkpoint['manifest'][:19]}…",
            restored=None if restored is None else restored.decode(errors="replace"),
            written=token, **evidence,
        )  # fmt: skip

    def fenced(self, scratch: str) -> q.Outcome:
        del scratch
        with self._task() as task:
            session = self._exec("fenced", task, q.DONE)
            self._receipt(session)
            close = self.backend.close_task(task)
            fence = close["fence"]
            sealed = self.backend.refusal(task, q.DONE, "probe-fenced-after", {})
            try:
                stale: str | None = self.backend.stale_write(task)
                tried = True
            except CannotLook as exc:
                stale, tried = str(exc), False
        exec_refused = (sealed or "").startswith("AdmissionSealed")
        write_refused = (stale or "").startswith("StaleWrite") if tried else True
        words = (
            f"generation {fence['fenced_generation']} → {fence['generation']}; a checkpoint "
            f"write from generation {fence['fenced_generation']}: "
            + ((stale or "ACCEPTED").split(":")[0] if tried else f"not tried ({stale})")
            + f"; exec: {(sealed or 'ADMITTED').split(':')[0]}"
        )
        return q.judged(
            exec_refused and write_refused, words, fence=fence, exec_after_close=sealed,
            stale_write=stale if tried else None, stale_write_tried=tried,
            close_receipt=close["digest"],
        )  # fmt: skip

    def receipt(self, scratch: str) -> q.Outcome:
        del scratch
        with self._task() as task:
            session = self._exec("receipt", task, q.DONE)
            process = self._receipt(session)
            close = self.backend.close_task(task)
            explained = self.backend.explain(task)
        allowed = explained.get("allowed_by") or {}
        named = {r["session"]: r["digest"] for r in allowed.get("process_receipts", [])}
        ok = (
            explained.get("complete") is True
            and named.get(session) == process["digest"]
            and allowed.get("checkpoint_receipt") == close["checkpoint"]["digest"]
        )
        return q.judged(
            ok,
            f"close receipt {close['digest'][:19]}…; explain names process receipt "
            f"{process['digest'][:19]}… and checkpoint receipt "
            f"{str(allowed.get('checkpoint_receipt'))[:19]}…, each matching the stored one",
            close_receipt=close["digest"], process_receipt=process["digest"],
            allowed_by=allowed, words=explained.get("words"),
        )  # fmt: skip


def _launches(count: int) -> str:
    return f"{count} launch" + ("" if count == 1 else "es")


def _refused(refusal: str | None) -> str:
    """`refused (AdmissionFrozen)`, or ADMITTED when nothing refused it."""
    return f"refused ({refusal.split(':')[0]})" if refusal else "ADMITTED"


def _until(check: Callable[[], bool], timeout: float, what: str | None) -> bool:
    """Poll `check` until true or `timeout`; a named wait that runs out raises."""
    give_up = time.monotonic() + timeout
    while not check():
        if time.monotonic() > give_up:
            if what is not None:
                raise TimeoutError(f"{what} did not happen within {timeout:g} s")
            return False
        time.sleep(0.05)
    return True


def _bit_for_bit(
    got: bytes, want: bytes | None, receipt: dict[str, Any], want_digest: str | None = None
) -> q.Outcome:
    """Holds when the stored stdout is the bytes written (or hashes to the command's own
    sha256), its length is the receipt's final cursor, and its BLAKE3 is the receipt's digest."""
    stdout = receipt["output"]["stdout"]
    digest = "blake3:" + blake3.blake3(got).hexdigest()
    wanted = want_digest or q.sha256(want or b"")
    same = q.sha256(got) == wanted
    ok = same and stdout["cursor"] == len(got) and stdout["digest"] == digest
    return q.judged(
        ok,
        f"{len(got):,} bytes at cursor {stdout['cursor']:,}, "
        + ("bit for bit" if same else "DIFFERENT from what was written")
        + f", the receipt's digest {'matches' if stdout['digest'] == digest else 'DIFFERS'}"
        + f", drain {receipt['output']['drain']}",
        received=len(got), received_sha256=q.sha256(got), written_sha256=wanted,
        cursor=stdout["cursor"], receipt_digest=stdout["digest"], recomputed=digest,
        drain=receipt["output"]["drain"], receipt=receipt["digest"],
    )  # fmt: skip
