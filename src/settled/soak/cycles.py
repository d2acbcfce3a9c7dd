"""One crash cycle per family of fault points: crash a real process there, do what a real
caller does next, and check every invariant.

Owns: for an owner point, an exec whose owner dies there, then recovery and the same exec
retried; for a recovery point, a `settled recover` process killed there (the session's owner
already dead, its command running), then the recovery retried; for a checkpoint point, a
`settled checkpoint` (or `settled close`) killed there, then the checkpoint retried and restored;
for a close point, a `settled close` killed there, then the close retried by the library and by
the CLI; for a server point, a `settled serve` killed answering (an admission, a stream, a
close), then the same request to the run's standing server. Each returns whether the process
really died at its point (False: the point was not reached, e.g. another recoverer was first).

Must never: count a crash it did not see (the process must die of SIGKILL naming the point, or
an owner vanish without a receipt), skip a check because the point was not reached, or retry
anything a real caller would not (a retry reuses the key; a close is simply asked again).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Callable
from typing import TYPE_CHECKING

from settled.errors import SettledError
from settled.soak import checks, procs
from settled.soak.plan import Attempt, Violation, Work

if TYPE_CHECKING:
    from settled.client import Client
    from settled.soak.lane import Lane

CLOSE_DEADLINE_S = 30.0
OWNER_LOST_RUNNING = "owner.after_spawn"  # a recovery crash's session: its command runs on
CLI_SHARE = 0.25  # of the owner crashes, those whose exec is a `settled exec` process


def owner(lane: Lane, attempt: Attempt) -> bool:
    lane.open_task()
    work = attempt.work()
    by_cli = attempt.rng.random() < CLI_SHARE  # a fresh owner from a CLI process, or warm
    if by_cli:
        session = lane.launch_by_cli(work, point=attempt.point)
    else:
        session = lane.launch(work, point=attempt.point)
    crashed = lane.await_owner(session, attempt.point)
    checks.observe(lane.rt, lane.seen, session)
    lane.retry(work, session, by_cli)  # while it is unknown: never relaunched
    lane.recover()
    lane.retry(work, session, by_cli)
    lane.settle(session)
    lane.plant_truncate(session)
    lane.check_sessions([session])
    return crashed


def recovery(lane: Lane, attempt: Attempt) -> bool:
    lane.open_task()
    work = Work(attempt.key, attempt.rng.choice((8, 64)), pause=60.0)  # running when recovered
    session = lane.launch(work, point=OWNER_LOST_RUNNING)
    lane.await_owner(session, OWNER_LOST_RUNNING)
    checks.observe(lane.rt, lane.seen, session)
    done = procs.cli(lane.home, "recover", "--json", point=attempt.point)
    crashed = _crashed(done, attempt.point, "converges", "settled recover")
    checks.observe(lane.rt, lane.seen, session)
    lane.retry(work, session)
    lane.recover()
    lane.settle(session)
    lane.check_sessions([session])
    return crashed


def checkpoint(lane: Lane, attempt: Attempt) -> bool:
    if attempt.rng.random() < 0.5:
        return close(lane, attempt)  # the same points, reached by the close's own checkpoint
    task = lane.open_task()
    work = attempt.work()
    session = lane.launch(work)
    lane.settle(session)
    lane.check_sessions([session])
    done = procs.cli(lane.home, "checkpoint", task.task, "--json", point=attempt.point)
    crashed = _crashed(done, attempt.point, "converges", "settled checkpoint")
    try:
        receipt = lane.rt.checkpoint(task.task)
    except SettledError as exc:
        raise Violation("converges", f"the checkpoint retried after the crash: {exc}") from exc
    receipt.pop("scan", None)  # what the scan saw, beside the sealed receipt
    checks.checkpoint_restores(lane.rt, task.task, task.workspace, receipt, lane.scratch)
    return crashed


def close(lane: Lane, attempt: Attempt) -> bool:
    task = lane.open_task()
    work = attempt.work()
    session = lane.launch(work)  # often still running when the close begins: it waits for it
    args = ("close", task.task, "--json", "--deadline", str(CLOSE_DEADLINE_S))
    done = procs.cli(lane.home, *args, point=attempt.point)
    crashed = _crashed(done, attempt.point, "close_converges", "settled close")
    checks.observe(lane.rt, lane.seen, session)
    receipt = lane.close_by_library()
    if not crashed and json.loads(done.stdout) != receipt:
        raise Violation(
            "close_converges",
            f"task {task.task}: the close that was not "
            "crashed answered another receipt than the one asked again",
        )
    lane.finish_task(receipt)
    return crashed


def _crashed(
    done: subprocess.CompletedProcess[bytes], point: str, invariant: str, what: str
) -> bool:
    """Whether the process died at its point; one that did not must have succeeded."""
    if procs.crashed_at(done.returncode, done.stderr, point):
        return True
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace")[-500:]
        raise Violation(invariant, f"{what} exited {done.returncode}: {said}")
    return False


def server(lane: Lane, attempt: Attempt) -> bool:
    armed = lane.server(attempt)
    try:
        return SERVER_CYCLES[attempt.point](lane, attempt, armed)
    finally:
        armed.stop()


def _first_client(armed: procs.Server, token: str) -> Client:
    from settled.client import Client, Retry

    return Client(armed.url, token, retry=Retry(attempts=1), timeout=60.0)


def _reached(armed: procs.Server, failed: bool, point: str) -> bool:
    if failed and not armed.crashed():
        raise RuntimeError(
            f"the request to the server armed at {point} failed, yet the server "
            f"did not crash there: {armed.said()[-2000:]!r}"
        )
    return failed


def server_admission(lane: Lane, attempt: Attempt, armed: procs.Server) -> bool:
    from settled.client import TransportFailed

    task = lane.open_task()
    work = attempt.work()
    options = {"shell": work.shell, "key": work.key, "env": lane.env_for(work.key)}
    with _first_client(armed, lane.token) as first:
        try:
            first.exec(task.task, **options)  # type: ignore[arg-type]
            failed = False
        except TransportFailed:
            failed = True
    crashed = _reached(armed, failed, attempt.point)
    with lane.client() as second:
        again = second.exec(task.task, **options)  # type: ignore[arg-type]
    if not again.reused:
        raise Violation(
            "duplicate_launch",
            f"{work.key}: admitted before the server crashed (or answered), yet the retry "
            f"launched session {again.session} anew",
        )
    lane.seen.expect(again.session, work.key, work.stdout, work.file)
    lane.settle(again.session)
    lane.check_sessions([again.session])
    return crashed


def server_stream(lane: Lane, attempt: Attempt, armed: procs.Server) -> bool:
    from settled.client import TransportFailed

    lane.open_task()
    work = Work(attempt.key, attempt.rng.choice((64, 400)), pause=0.0, step=0.02)
    session = lane.launch(work)
    via = attempt.rng.choice(("output", "events"))
    received = b""
    with _first_client(armed, lane.token) as first:
        stream = first.stream(session, "stdout", via=via)
        try:
            for data in stream:
                received += data
            failed = False
        except TransportFailed:
            failed = True
    crashed = _reached(armed, failed, attempt.point)
    with lane.client() as second:
        rest = b"".join(second.stream(session, "stdout", start=len(received), via=via))
    lane.settle(session)
    receipt = lane.check_sessions([session])[0]
    stored = checks.read_log(lane.rt, session, int(receipt["output"]["stdout"]["cursor"]))
    if received + rest != stored:
        raise Violation(
            "lost_byte",
            f"session {session}: the {via} stream read through a "
            f"server crash at cursor {len(received)} gave other bytes than the log",
        )
    return crashed


def server_close(lane: Lane, attempt: Attempt, armed: procs.Server) -> bool:
    from settled.client import Blocked, TransportFailed

    task = lane.open_task()
    lane.launch(attempt.work())
    answered: dict[str, object] | None = None
    with _first_client(armed, lane.token) as first, contextlib.suppress(TransportFailed):
        answered = first.close_task(task.task, deadline=CLOSE_DEADLINE_S)  # None: it crashed
    crashed = _reached(armed, answered is None, attempt.point)
    with lane.client() as second:
        try:
            receipt = second.close_task(task.task, deadline=CLOSE_DEADLINE_S)
        except Blocked as exc:
            raise Violation(
                "close_converges",
                f"task {task.task}: the close retried after "
                f"the server crashed is blocked on {exc.blocked_on}",
            ) from exc
    if lane.close_by_library() != receipt or answered not in (None, receipt):
        raise Violation(
            "close_converges",
            f"task {task.task}: the server's retried close "
            "answered another receipt than the library's",
        )
    lane.finish_task(receipt)
    return crashed


def cli_close_receipt(lane: Lane, task: str) -> dict[str, object]:
    done = procs.cli(lane.home, "close", task, "--json")
    if done.returncode != 0:
        raise Violation(
            "close_converges",
            f"task {task}: a repeated `settled close` exited "
            f"{done.returncode}: {done.stderr.decode(errors='replace')[-500:]}",
        )
    answer: dict[str, object] = json.loads(done.stdout)
    return answer


CYCLES: dict[str, Callable[[Lane, Attempt], bool]] = {
    "owner": owner,
    "recovery": recovery,
    "checkpoint": checkpoint,
    "close": close,
    "server": server,
}
SERVER_CYCLES: dict[str, Callable[[Lane, Attempt, procs.Server], bool]] = {
    "server.after_admission": server_admission,
    "server.mid_stream": server_stream,
    "server.before_close_response": server_close,
}
