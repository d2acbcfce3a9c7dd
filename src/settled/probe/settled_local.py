"""`settled probe --runtime settled`: settled as a library, on a home made for the probe.

A Runtime on a fresh temporary home (never the user's: `settled probe` refuses --home), removed
whole with its journal stopped when the probe is done; or, for `settled demo`, the Runtime it is
given, whose home it leaves in place. It can do what only the host can: restore a checkpoint,
and write to the store with a fenced generation as a late writer would.
Must never: open the user's home, or leave a task of its own open.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any

from settled import __version__
from settled.errors import SettledError, StaleWrite
from settled.probe.settled_backends import CLOSE_DEADLINE_S, WAIT_S, Admitted, ProbeBroke
from settled.runtime import Runtime
from settled.states import UNKNOWN, is_live


class LocalBackend:
    """settled as a library: a Runtime on a fresh temporary home (or, for `settled demo`, the
    Runtime it is given, whose home it leaves in place)."""

    on_this_machine = True

    def __init__(self, runtime: Runtime | None = None) -> None:
        self._owns = runtime is None
        self.rt = runtime or Runtime(tempfile.mkdtemp(prefix="settled-probe-home-"))
        self.where = f"{'a fresh home' if self._owns else 'home'} {self.rt.home}"
        self.version = __version__

    def new_task(self) -> str:
        return self.rt.new_task().task

    def exec(self, task: str, shell: str, key: str, env: dict[str, str],
             timeout: float | None = None, grace: float | None = None) -> Admitted:  # fmt: skip
        a = self.rt.exec(task, shell=shell, key=key, env=env, timeout=timeout, grace=grace)
        return Admitted(a.session, a.reused, a.state)

    def refusal(self, task: str, shell: str, key: str, env: dict[str, str]) -> str | None:
        try:
            self.exec(task, shell, key, env)
        except SettledError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def lose_response(self, task: str, shell: str, key: str, env: dict[str, str]) -> str:
        self.exec(task, shell, key, env)  # the answer is dropped here, unread
        return "the first exec's answer was dropped unread, as a crash between call and reply would"

    def wait(self, session: str, timeout: float = WAIT_S) -> dict[str, Any]:
        return self.rt.wait(session, timeout)

    def status(self, session: str) -> dict[str, Any]:
        return self.rt.session_status(session)

    def task_sessions(self, task: str) -> list[str]:
        return [str(row["session"]) for row in self.rt.task_status(task)["sessions"]]

    def output(self, session: str) -> bytes:
        final = self.rt.final_cursor(session, "stdout") or 0
        chunks, cursor = [], 0
        while cursor < final:
            chunk = self.rt.read(session, "stdout", cursor, min(final - cursor, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            cursor += len(chunk)
        return b"".join(chunks)

    def peek(self, session: str) -> bytes:
        with contextlib.suppress(SettledError, OSError):
            return self.rt.read(session, "stdout", 0, 1 << 16)
        return b""

    def read_file(self, task: str, name: str) -> bytes:
        path = os.path.join(self.rt.task_record(task).workspace, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return b""
        with os.fdopen(fd, "rb") as handle:
            return handle.read()

    def close_task(self, task: str) -> dict[str, Any]:
        result = self.rt.close_task(task, deadline=CLOSE_DEADLINE_S)
        if not result.complete or result.receipt is None:
            raise ProbeBroke(f"close of {task} is blocked on {result.blocked_on}")
        return dict(result.receipt)

    def explain(self, task: str) -> dict[str, Any]:
        return self.rt.explain(task)

    def recover(self, task: str) -> list[dict[str, Any]]:
        return self.rt.recover(task)

    def in_checkpoint(self, task: str, name: str) -> bytes | None:
        dest = tempfile.mkdtemp(prefix="settled-probe-restore-")
        try:
            self.rt.restore(task, dest)
            path = os.path.join(dest, name)
            if not os.path.isfile(path) or os.path.islink(path):
                return None
            with open(path, "rb") as handle:
                return handle.read()
        finally:
            shutil.rmtree(dest, ignore_errors=True)

    def stale_write(self, task: str) -> str | None:
        """What a writer still holding the fenced generation would do last: record the
        checkpoint of the close's own final scan. The store must refuse it."""
        now = self.rt.task_record(task)
        stale = now.replace(generation=now.generation - 1)
        scan = self.rt.store.close_steps(task)["final_scan"]
        try:
            self.rt.workspace.checkpoint(stale, scan, [])
        except StaleWrite as exc:
            return f"StaleWrite: {exc}"
        return None

    def finish(self, task: str) -> list[str]:
        done: list[str] = []
        view = self.rt.task_status(task)
        if view["state"] == "complete":
            return done
        for row in view["sessions"]:
            if is_live(str(row["state"])):
                self.rt.cancel(str(row["session"]), "the probe's experiment is over")
                done.append(f"cancelled {row['session']}")
        for row in view["sessions"]:
            with contextlib.suppress(SettledError):
                self.rt.wait(str(row["session"]), WAIT_S)
        if any(r["state"] == UNKNOWN for r in self.rt.task_status(task)["sessions"]):
            self.rt.recover(task)
            done.append("recovered its unknown sessions")
        self.close_task(task)
        return done

    def owners(self, task: str) -> list[dict[str, Any]]:
        rows = self.rt.task_status(task)["sessions"]
        return [self.rt.session_status(str(r["session"])).get("owner") or {} for r in rows]

    def close(self) -> None:
        """A home made for the probe: its journal stopped, its Runtime closed, and the home
        removed whole. A Runtime it was given stays its giver's."""
        if not self._owns:
            return
        try:
            self.rt.stop_journal()
            self.rt.release_pods()
        finally:
            self.rt.close()
            shutil.rmtree(self.rt.home, ignore_errors=True)
