"""A lane of the soak: one process that runs crash cycles one after another on tasks of its own,
while the other lanes run theirs on the same home.

Owns: the lane's Runtime (a warm launcher, so an owner starts in milliseconds; each exec arms
the fault point of its own owner only), its current task with a service printing ticks
throughout (the concurrent session every crash happens beside), what it observed
(`checks.Observed`), and the protocol with the driver: one JSON line in (`{"attempt": n}` or
`{"finish": true}`, or a server fault's `{"launch": n, "kind": k}` then `{"check": n,
"sessions": [...]}`), one JSON line out per line in, on the descriptor that was stdout (stdout
itself then goes to stderr, so nothing settled prints can corrupt it).

Must never: arm a fault in its own process (it strips SETTLED_FAULT at start and arms only the
environment an exec hands to its owner, for that exec), leave a process of its own behind (an
armed server or CLI is ended on every way out), or stop at a violation without saying which.

`SETTLED_SOAK_PLANT` (tests only) plants a violation the checks must catch: `relaunch` runs
each command a second time under another key, `truncate` cuts a crashed session's log below
its durable cursor, `owner_lost` kills an owner in a server fault's round
(`outage_cycle.kill_owner`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

from settled.errors import AdmissionFrozen, NotSettled, OwnerLaunchFailed, SettledError
from settled.runtime import Runtime
from settled.soak import checks, cycles, outage_cycle, procs
from settled.soak.plan import OUTPUT_DIR, Attempt, Fault, Violation, Work, ticker

if TYPE_CHECKING:
    from settled.client import Client
    from settled.records import TaskRecord

PLANT_ENV = "SETTLED_SOAK_PLANT"
RECOVERABLE = ("cgroup2+pidns", "pidns")  # boundaries whose death recovery can prove alone


class Unsupported(RuntimeError):
    """This machine cannot run the soak (said in one line, not as a traceback)."""


SETTLE_S = 90.0


class Lane:
    def __init__(self, config: dict[str, Any]) -> None:
        self.home, self.scratch = config["home"], config["scratch"]
        self.index, self.seed = int(config["lane"]), int(config["seed"])
        self.points = tuple(config["points"])
        self.server_url, self.token = config["server"], config["token"]
        self.mark = str(config["mark"])
        self.plant = os.environ.pop(PLANT_ENV, None)
        self.rt = Runtime(self.home, launcher="warm")
        self.seen = checks.Observed()
        self.task: TaskRecord | None = None
        self.ticker: str | None = None
        self.made = 0

    def abandon(self) -> None:
        """On the way out: a task not closed (the driver went away, or stopped the lane) is
        destroyed, so its sessions end with evidence; then the Runtime and its zygote."""
        try:
            if self.task is not None:
                with contextlib.suppress(SettledError):
                    self.rt.destroy_task(self.task.task)
        finally:
            self.rt.close()

    # -- tasks and sessions -------------------------------------------------------------------

    def open_task(self) -> TaskRecord:
        """The lane's open task, made (with its ticking service) if the last one was closed."""
        if self.task is not None:
            return self.task
        workspace = os.path.join(self.scratch, "workspaces", f"lane{self.index}-{self.made}")
        os.makedirs(os.path.join(workspace, OUTPUT_DIR))
        self.made += 1
        self.task = self.rt.new_task(workspace)
        key = f"tick-{self.task.task}"
        self.ticker = self.exec(key, ticker(key), service=True).session
        self.seen.expect(self.ticker, key, None)
        boundary = self.rt.session_record(self.ticker).boundary
        if boundary not in RECOVERABLE:
            raise Unsupported(
                f"this machine runs commands in boundary {boundary}, where a lost owner's "
                f"session stays unknown for good; the soak needs one of {RECOVERABLE}, whose "
                "death recovery can prove"
            )
        return self.task

    def env_for(self, key: str) -> dict[str, str]:
        """A command's explicit environment: the run's mark (so nothing of it outlives the
        run) and its logical key (so a check finds any process of it still running)."""
        return {procs.MARK_ENV: self.mark, procs.KEY_ENV: key.removesuffix(".again")}

    def exec(self, key: str, shell: str, point: str | None = None, service: bool = False) -> Any:
        """`Runtime.exec` in the lane's task; with `point`, its owner (only) is armed there.
        A task frozen by a lost owner (another lane's recovery may be at it) is recovered
        and asked again, as the error tells a caller to."""
        task = self.open_task().task
        if point is not None:
            os.environ["SETTLED_FAULT"] = f"{point}:crash"  # the warm launcher hands it over
        try:
            for tries in (1, 2):
                try:
                    return self.rt.exec(
                        task, shell=shell, key=key, env=self.env_for(key), service=service
                    )
                except AdmissionFrozen:
                    if tries == 2:
                        raise
                    self.recover()
        finally:
            os.environ.pop("SETTLED_FAULT", None)
        raise AssertionError("unreachable")

    def launch(self, work: Work, point: str | None = None) -> str:
        try:
            session: str = self.exec(work.key, work.shell, point).session
        except OwnerLaunchFailed:
            session = self.session_of(work.key)
        return self._launched(work, session)

    def launch_by_cli(self, work: Work, point: str | None = None) -> str:
        """`settled exec` in a process of its own (a fresh owner, armed at `point`): the
        session it answers, or, when its owner died before it could answer, the key's."""
        answer = self.exec_by_cli(work, point)
        session = self.session_of(work.key) if answer is None else str(answer["session"])
        return self._launched(work, session)

    def _launched(self, work: Work, session: str) -> str:
        self.seen.expect(session, work.key, work.stdout, work.file)
        if self.plant == "relaunch":
            again = self.exec(f"{work.key}.again", work.shell).session
            self.seen.expect(again, work.key, work.stdout, work.file)
            self.settle(again)
        return session

    def exec_by_cli(self, work: Work, point: str | None = None) -> dict[str, Any] | None:
        """`settled exec --json`: its answer, or None when it failed (its owner died before
        it reported); a frozen task is recovered and the exec asked again, as a caller would."""
        task = self.open_task().task
        env = [f"--env={name}={value}" for name, value in self.env_for(work.key).items()]
        args = ("exec", "--task", task, "--key", work.key, *env, "--json", "--")
        for tries in (1, 2):
            done = procs.cli(self.home, *args, work.shell, point=point)
            if done.returncode == 0:
                answer: dict[str, Any] = json.loads(done.stdout)
                return answer
            if tries == 1 and b"AdmissionFrozen" in done.stdout:
                self.recover()
                continue
            if not any(v["key"] == work.key for v in self.rt.task_status(task)["sessions"]):
                raise Violation(
                    "converges",
                    f"`settled exec` of {work.key} exited "
                    f"{done.returncode} without admitting it: {done.stderr[-500:]!r}",
                )
            break
        return None

    def session_of(self, key: str) -> str:
        task = self.open_task().task
        [session] = [v["session"] for v in self.rt.task_status(task)["sessions"] if v["key"] == key]
        return str(session)

    def await_owner(self, session: str, point: str) -> bool:
        """Until the session settles (its owner never reached the point: False) or its owner
        is gone without a receipt, having said it crashed at its point (True). An owner dead
        before it said its pid to a warm launcher leaves a receipt all the same: its
        launcher's, settling the session as never started (True when it said so)."""
        give_up, pause = time.monotonic() + SETTLE_S, 0.002
        while True:
            record = self.rt.session_record(session)
            if record.receipt is not None:
                by_launcher = record.receipt["owner"].get("role") == "launcher"
                return by_launcher and self._owner_said_crash(session, point)
            facts = self.rt.owner_facts(record) if record.owner is not None else None
            if facts is not None and not facts.alive:
                return self._owner_said_crash(session, point)
            if time.monotonic() > give_up:
                raise Violation(
                    "converges",
                    f"session {session}: its owner neither settled nor died in {SETTLE_S:.0f} s",
                )
            time.sleep(pause)
            pause = min(pause * 1.5, 0.05)

    def _owner_said_crash(self, session: str, point: str) -> bool:
        """Whether the owner's stderr (owner.log, beside its logs) names its fault point: an
        owner gone for another reason (fenced, starved) is no crash of ours."""
        directory = os.path.dirname(self.rt.stream_log(session, "stdout").path)
        try:
            with open(os.path.join(directory, "owner.log"), "rb") as handle:
                return f"crash at fault point {point}\n".encode() in handle.read()
        except FileNotFoundError:
            return False

    def recover(self) -> None:
        try:
            self.rt.recover(self.open_task().task)
        except SettledError as exc:
            raise Violation("converges", f"recovery raised {type(exc).__name__}: {exc}") from exc

    def retry(self, work: Work, session: str, by_cli: bool = False) -> None:
        """The same exec again, as a caller whose call failed does (through the face it used):
        the same session, reused, whatever state it is in."""
        if by_cli:
            answer = self.exec_by_cli(work)
            if answer is None:
                raise Violation("converges", f"the retried `settled exec` of {work.key} failed")
            reused, again = bool(answer["reused"]), str(answer["session"])
        else:
            admission = self.exec(work.key, work.shell)
            reused, again = admission.reused, admission.session
        if not reused or again != session:
            invariant = "relaunch" if session in self.seen.lost_owner else "duplicate_launch"
            raise Violation(
                invariant,
                f"the retry of {work.key} got session {again} (reused {reused}) instead of "
                f"{session}",
            )

    def settle(self, session: str) -> None:
        """Until the session has its receipt; a lost owner's session is recovered."""
        give_up = time.monotonic() + SETTLE_S
        while (left := give_up - time.monotonic()) > 0:
            try:
                view = self.rt.wait(session, timeout=min(left, 5.0))
            except NotSettled:
                continue
            if view["state"] == "settled":
                return
            self.recover()
            if self.rt.session_record(session).state == "settled":
                return
        why = self.rt.session_status(session).get("why")
        raise Violation(
            "converges",
            f"session {session} did not settle in {SETTLE_S:.0f} s (recovered too): {why}",
        )

    def check_sessions(self, sessions: list[str]) -> list[dict[str, Any]]:
        receipts = [checks.settled_session(self.rt, self.seen, s) for s in sessions]
        checks.launched_once(self.rt, self.seen, self.open_task().workspace, sessions)
        return receipts

    def check_ticker(self) -> None:
        if self.task is not None and self.ticker is not None:
            checks.observe(self.rt, self.seen, self.ticker)

    def plant_truncate(self, session: str) -> None:
        """(tests only) Cut the settled log below a cursor published durable: the receipt's
        final one, or a higher one seen while it ran."""
        receipt = self.rt.session_record(session).receipt or {}
        final = int(receipt.get("output", {}).get("stdout", {}).get("cursor", 0))
        durable = max(self.seen.durable.get(session, 0), final)
        if self.plant == "truncate" and durable > 0:
            os.truncate(self.rt.stream_log(session, "stdout").path, durable - 1)

    # -- the close ----------------------------------------------------------------------------

    def close_by_library(self) -> dict[str, Any]:
        task = self.open_task().task
        try:
            result = self.rt.close_task(task, deadline=cycles.CLOSE_DEADLINE_S)
        except SettledError as exc:
            raise Violation(
                "close_converges",
                f"task {task}: the retried close raised {type(exc).__name__}: {exc}",
            ) from exc
        if not result.complete or result.receipt is None:
            raise Violation(
                "close_converges",
                f"task {task}: the retried close is blocked on {result.blocked_on}",
            )
        return result.receipt

    def finish_task(self, receipt: dict[str, Any]) -> None:
        """Every close of a closed task answers the same receipt, and it is no false success;
        the next cycle gets a new task."""
        task = self.open_task()
        if cycles.cli_close_receipt(self, task.task) != receipt:
            raise Violation(
                "close_converges",
                f"task {task.task}: a repeated `settled close` answered another receipt",
            )
        checks.closed_task(self.rt, self.seen, task.task, task.workspace, receipt, self.scratch)
        self.task = self.ticker = None

    # -- the server ---------------------------------------------------------------------------

    def server(self, attempt: Attempt) -> procs.Server:
        log = os.path.join(self.scratch, f"serve-{attempt.number}.log")
        return procs.Server(self.home, self.token, log, attempt.point)

    def client(self) -> Client:
        from settled.client import Client

        return Client(self.server_url, self.token, timeout=60.0)

    # -- one attempt --------------------------------------------------------------------------

    def run(self, attempt: Attempt) -> dict[str, Any]:
        result: dict[str, Any] = {"attempt": attempt.number, "point": attempt.point}
        started = time.monotonic()
        try:
            result["crashed"] = cycles.CYCLES[attempt.family](self, attempt)
            self.check_ticker()
        except Violation as violation:
            result["violation"] = violation.to_json()
        except Unsupported as exc:
            result["error"] = str(exc)
        except Exception:  # the soak's own failure, not settled's: said whole
            result["error"] = traceback.format_exc()
        result["seconds"] = round(time.monotonic() - started, 4)
        return result

    def finish(self) -> dict[str, Any]:
        """Close the open task as a caller would at the end, and check it."""
        result: dict[str, Any] = {"finished": self.index}
        try:
            if self.task is not None:
                self.check_ticker()
                self.finish_task(self.close_by_library())
        except Violation as violation:
            result["violation"] = violation.to_json()
        except Exception:
            result["error"] = traceback.format_exc()
        return result


def main(argv: list[str]) -> int:
    config = json.loads(argv[0])
    answers = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    os.environ.pop("SETTLED_FAULT", None)
    signal.signal(signal.SIGTERM, _exit_on_term)
    lane = Lane(config)
    try:
        for line in sys.stdin:
            message = json.loads(line)
            if "attempt" in message:
                attempt = Attempt(lane.seed, int(message["attempt"]), lane.points)
                answer = lane.run(attempt)
            elif "launch" in message:  # a server fault's round: its commands, then its checks
                fault = Fault(lane.seed, int(message["launch"]), str(message["kind"]), 0.0)
                answer = outage_cycle.launch(lane, fault)
            elif "check" in message:
                answer = outage_cycle.check(lane, list(message["sessions"]))
            else:
                answer = lane.finish()
            answers.write(json.dumps(answer) + "\n")
    finally:
        lane.abandon()
    return 0


def _exit_on_term(_signum: int, _frame: object) -> None:
    raise SystemExit(143)  # unwinds: an armed server or CLI in flight is ended on the way


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
