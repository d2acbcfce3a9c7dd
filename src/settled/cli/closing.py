"""`settled close` as a person at a terminal sees it: what a long close waits for, every few
seconds, and how to go on after Ctrl-C.

Why: a close waits for the task's running commands, up to its deadline (600 s unless
--deadline says otherwise), and said nothing meanwhile; an interrupted close left the task
sealed with no word that `settled close T` finishes it.

The progress is printed by a thread that never touches the store (a store connection is one
thread's): it knows the sessions the close waits for from before the close began, and sees
each end by its owner's exit handle (a pidfd: the owner writes the receipt, then exits). Only
when stderr is a terminal: a script or a harness reading stderr gets no such lines.

Must never: print on stdout (the close's result, one JSON object with --json), change what
the close does, or outlive the verb (the thread is stopped and joined before it returns).
"""

from __future__ import annotations

import select
import sys
import threading
import time

from settled.printable import printable
from settled.states import is_live

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TextIO

    from settled.runtime import CloseResult, Runtime

PROGRESS_EVERY_S = 3.0  # a line this often while a close runs
DEFAULT_DEADLINE_S = 600.0  # close/join.py's, not imported here (tests/test_cli_habits.py)
COMMAND_SHOWN = 60  # characters of a command's words in a progress line


class Waited:
    """A session the close waits for (or stops, a service): its words and its owner's handle."""

    __slots__ = ("claimed", "command", "handle", "service", "session", "started_at")

    def __init__(
        self, session: str, command: str, started_at: float | None, service: bool,
        handle: int | None, claimed: bool = True,
    ) -> None:  # fmt: skip
        self.session, self.command, self.started_at = session, command, started_at
        self.service, self.handle, self.claimed = service, handle, claimed


def close_with_progress(
    rt: Runtime, task: str, final: str | None, deadline: float | None, err: TextIO | None = None
) -> CloseResult:
    """`rt.close_task`, with a progress line every PROGRESS_EVERY_S on a terminal's stderr."""
    err = sys.stderr if err is None else err
    if not _is_terminal(err):
        return rt.close_task(task, final, deadline)
    waited = _waited_for(rt, task)
    progress = Progress(task, waited, rt.close_deadline_s(task, deadline), err)
    progress.start()
    try:
        return rt.close_task(task, final, deadline)
    finally:
        progress.stop()
        for item in waited:
            if item.handle is not None:
                rt.close_exit_handle(item.handle)


def blocked_words(task: str, blocked: dict[str, Any]) -> str:
    """A blocked close for a person: what it owes and to whom, then, when the close tried to
    recover the session itself (close/join.py), what recovery found and the command to go on
    with (`why`, `next`)."""
    from settled.render import blocked_text

    text = blocked_text(task, blocked)
    if blocked.get("why"):
        text += f"\n  {printable(str(blocked['why']))}"
        if blocked.get("next"):
            text += f"\n  then: {printable(str(blocked['next']))}"
    return text


def interrupted_line(task: str) -> str:
    """What Ctrl-C on a close prints: what stands, and the command that finishes it."""
    return (
        f"settled: close of {task} interrupted; what it recorded stands, and no new command "
        f"may start in it if it was sealed. Finish it: settled close {task}"
    )


def _is_terminal(err: TextIO) -> bool:
    try:
        return err.isatty()
    except (ValueError, OSError):
        return False


def _waited_for(rt: Runtime, task: str) -> list[Waited]:
    waited: list[Waited] = []
    try:
        for view in rt.task_status(task)["sessions"]:
            if not is_live(view["state"]):
                continue
            session = view["session"]
            record = rt.session_record(session)
            spec = record.spec
            command = printable(view.get("command") or "")
            if len(command) > COMMAND_SHOWN:
                command = command[: COMMAND_SHOWN - 1] + "…"
            waited.append(Waited(session, command, view.get("started_at"),
                                 bool(spec.get("service")), rt.exit_handle(session),
                                 record.owner is not None))  # fmt: skip
    except BaseException:  # no handle opened so far outlives the failure
        for item in waited:
            if item.handle is not None:
                rt.close_exit_handle(item.handle)
        raise
    return waited


class Progress:
    """The thread that prints what the close waits for until `stop`."""

    def __init__(
        self, task: str, waited: list[Waited], deadline: float | None, err: TextIO,
        clock: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self.task, self.waited, self.err = task, waited, err
        self.deadline = DEFAULT_DEADLINE_S if deadline is None else deadline
        self.clock, self.began = clock, clock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="close-progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(PROGRESS_EVERY_S):
            try:
                self.err.write(self.line() + "\n")
                self.err.flush()
            except (OSError, ValueError):
                return  # the terminal went away: the close goes on without its lines

    def line(self) -> str:
        """One progress line: the sessions still running (each with its command and age), or
        the close's later steps once none is."""
        now = self.clock()
        so_far = f"{now - self.began:.0f}s so far of a {self.deadline:g} s deadline"
        running = [item for item in self.waited if not _ended(item)]
        if not running:
            return (
                f"settled: closing {self.task}: its sessions have settled; scanning and "
                f"checkpointing the workspace ({so_far})"
            )
        shown = ", ".join(_described(item, now) for item in running[:3])
        more = f" and {len(running) - 3} more" if len(running) > 3 else ""
        return f"settled: closing {self.task}: waiting for {shown}{more} ({so_far})"


def _described(item: Waited, now: float) -> str:
    age = f", running {now - item.started_at:.0f}s" if item.started_at else ""
    if not item.claimed:  # its launcher may be gone: settled never started at the deadline
        age = ", not claimed by an owner yet"
    what = "service being stopped" if item.service else "session"
    return f"{what} {item.session} ({item.command}{age})"


def _ended(item: Waited) -> bool:
    """Whether the session's owner has exited (its handle is readable); a session without a
    handle (no owner of this host to watch) is taken as still running."""
    if item.handle is None:
        return False
    try:
        return bool(select.select([item.handle], [], [], 0)[0])
    except (OSError, ValueError):
        return True
