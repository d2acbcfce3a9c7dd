"""Typed errors of settled, each mapped to one CLI exit code.

Owns the error vocabulary and the exit-code table of the CLI contract (DESIGN.md), `EXIT_CODES`:
the one list `settled --help` prints and the README repeats (tests/test_verbs.py checks all
three agree). The CLI exits with no code outside it. No space (the home's filesystem below its
reserve, see home.py) is 3, like any other block; an I/O error of the home's disk is 1. Every
message names the offending value and, where there is one, the way out.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_BLOCKED = 3
EXIT_CONFLICT = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for git killed by a closed pipe

# Every exit code the CLI can return, and what it means: one row per code, in order.
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success: done, complete, or a receipt with proven death exists",
    EXIT_FAILURE: "failure: settled could not do it and the one line on stderr names why; "
    "`internal error` there is a bug, please report it",
    EXIT_USAGE: "usage or bad input: nothing was recorded or launched",
    EXIT_BLOCKED: "blocked, not settled or not proven: the output names by what",
    EXIT_CONFLICT: "key conflict, sealed or frozen admission, or a task of another host: "
    "the first command (or host) stands",
    EXIT_INTERRUPTED: "interrupted (SIGINT): what was recorded stands",
    EXIT_BROKEN_PIPE: "the reader of stdout went away (a pipe into `head`): settled stopped "
    "writing, quietly, as git does; what was recorded stands",
}


def exit_code_lines() -> list[str]:
    """The exit-code table as `settled --help` prints it, one line per code."""
    return [f"  {code:>3}  {meaning}" for code, meaning in EXIT_CODES.items()]


class SettledError(Exception):
    """Base of every error settled raises on purpose."""

    exit_code = EXIT_FAILURE

    @property
    def kind(self) -> str:
        return type(self).__name__

    def to_json(self) -> dict[str, object]:
        return {"error": self.kind, "message": str(self)}


class BadInput(SettledError):
    """Refused at admission: nothing was recorded or launched."""

    exit_code = EXIT_USAGE


class UnknownTask(BadInput):
    def __init__(self, task: str) -> None:
        super().__init__(f"unknown task {task!r}: create one with `settled task new`")
        self.task = task


class UnknownSession(BadInput):
    def __init__(self, session: str) -> None:
        super().__init__(f"unknown session {session!r}")
        self.session = session


class HomeUnusable(BadInput):
    """The settled home cannot hold the store, logs and objects."""


class WorkspaceOverlap(BadInput):
    """The workspace is, holds or lies in another open task's: two tasks' checkpoints would
    each claim the other's writes. Asked for with `--shared-workspace`, it is allowed and both
    close receipts say so."""

    def __init__(self, workspace: str, others: list[tuple[str, str]]) -> None:
        named = ", ".join(f"{task} ({path})" for task, path in others)
        super().__init__(
            f"--workspace {workspace!r} overlaps the workspace of open task(s) {named}; close "
            "them first, choose another directory, or pass --shared-workspace to share it"
        )
        self.workspace, self.others = workspace, others

    def to_json(self) -> dict[str, object]:
        tasks = [{"task": task, "workspace": path} for task, path in self.others]
        return {**super().to_json(), "workspace": self.workspace, "overlaps": tasks}


class StoreMissing(HomeUnusable):
    """The home's store is gone but what it accounted for remains (logs, objects, the home's
    identity): a fresh store there would forget every task, so nothing is opened."""

    def __init__(self, home: str, store: str, remains: dict[str, int]) -> None:
        found = ", ".join(f"{count} {what}" for what, count in remains.items() if count)
        super().__init__(
            f"{store} is missing but {found} remain in {home}: restore the store (from a "
            "backup of that file) or move the home away; settled never starts a new store "
            "beside another one's logs and objects"
        )
        self.home, self.store, self.remains = home, store, remains

    def to_json(self) -> dict[str, object]:
        return {**super().to_json(), "home": self.home, "store": self.store,
                "remains": self.remains}  # fmt: skip


class KeyConflict(SettledError):
    """Same invocation key, different command: the first one stands, nothing is launched."""

    exit_code = EXIT_CONFLICT

    def __init__(self, task: str, key: str, existing: str, requested: str, session: str) -> None:
        super().__init__(
            f"key {key!r} in task {task} is already bound to session {session} with digest "
            f"{existing}; this request has digest {requested}. Use a new key for a new command."
        )
        self.task, self.key, self.session = task, key, session
        self.existing_digest, self.requested_digest = existing, requested

    def to_json(self) -> dict[str, object]:
        return {
            **super().to_json(),
            "task": self.task,
            "key": self.key,
            "session": self.session,
            "existing_digest": self.existing_digest,
            "requested_digest": self.requested_digest,
        }


class AdmissionSealed(SettledError):
    exit_code = EXIT_CONFLICT

    def __init__(self, task: str, state: str) -> None:
        then = (
            "start a new task with `settled task new`"
            if state == "complete"  # states.TASK_COMPLETE: its close is done
            else f"it is being closed: run `settled close {task}` to finish closing it"
        )
        super().__init__(
            f"task {task} is {state}: admission is sealed, no new command may start; {then}"
        )
        self.task, self.state = task, state


class AdmissionFrozen(SettledError):
    """Recovery is inspecting a session whose owner vanished (rule 4)."""

    exit_code = EXIT_BLOCKED

    def __init__(self, task: str, session: str) -> None:
        super().__init__(
            f"task {task} is frozen while session {session} is unknown; "
            "run `settled recover` to inspect its boundary"
        )
        self.task, self.session = task, session


class WrongHost(SettledError):
    """The task is bound to another host: its sessions' owners run there, and only there can a
    new one start or a close join them. Reads (status, explain, logs, restore, verify, wait)
    work from any host."""

    exit_code = EXIT_CONFLICT

    def __init__(self, task: str, host: str, name: str | None, here: str, verb: str) -> None:
        named = f"{host} ({name})" if name else host
        super().__init__(
            f"task {task} runs on host {named}, not on this host {here}: `{verb}` it there "
            f"(or, if that host is gone for good, `settled recover --host {host}`)"
        )
        self.task, self.host, self.host_name, self.here = task, host, name, here


class LogElsewhere(SettledError):
    """The stream's bytes are in another host's home and no sealed copy of them exists (yet):
    a session's logs are sealed after its receipt (a failed seal is retried by its owner and
    its close), and only a home whose object store lives outside it seals."""

    exit_code = EXIT_BLOCKED

    def __init__(self, session: str, stream: str, host: str | None) -> None:
        super().__init__(
            f"the {stream} of session {session} is in the home of host {host} and has no "
            "sealed copy: read it there, or wait for its receipt and seal (a home whose objects "
            "live outside it seals every stream after the receipt; its close retries a failed "
            "seal and names a stream it could not seal)"
        )
        self.session, self.stream, self.host = session, stream, host


class TaskFrozen(SettledError):
    """The task's host was declared vanished (`settled recover --host`): nothing more may be
    admitted, since no owner there can be trusted to run it."""

    exit_code = EXIT_CONFLICT

    def __init__(self, task: str, why: str) -> None:
        super().__init__(f"task {task} is frozen for good: {why}; start a new task")
        self.task, self.why = task, why


class UnknownHost(BadInput):
    def __init__(self, host: str) -> None:
        super().__init__(f"no host {host!r} is recorded in this store (`settled hosts` lists them)")
        self.host = host


class ReceiptTampered(SettledError):
    """A stored receipt or close fact no longer hashes to the digest it was sealed with: it was
    edited (or damaged) after it was written. Nothing is decided from it."""

    exit_code = EXIT_BLOCKED

    def __init__(self, what: str, recorded: object, actual: str) -> None:
        super().__init__(
            f"{what} does not match its digest (recorded {recorded}, its bytes hash to "
            f"{actual}): it was changed after it was written, so nothing is decided from it"
        )
        self.what, self.recorded, self.actual = what, recorded, actual

    def to_json(self) -> dict[str, object]:
        return {**super().to_json(), "what": self.what, "recorded": self.recorded,
                "actual": self.actual}  # fmt: skip


class WorkspaceReplaced(SettledError):
    """The task's workspace path no longer names the directory bound at `task new` (another
    directory, a symlink or nothing is there now): scanning it would checkpoint another tree,
    so nothing is scanned and the close stays where it is until that directory is back."""

    exit_code = EXIT_BLOCKED

    def __init__(
        self, workspace: str, recorded: tuple[int, int], found: tuple[int, int] | None, why: str
    ) -> None:
        seen = f"{why} {found[0]}:{found[1]}" if found is not None else why
        super().__init__(
            f"the workspace {workspace!r} is not the directory bound at task new (device:inode "
            f"{recorded[0]}:{recorded[1]}), found {seen}; put that directory back there and "
            "run it again"
        )
        self.workspace, self.recorded, self.found, self.why = workspace, recorded, found, why

    def to_json(self) -> dict[str, object]:
        found = None if self.found is None else {"dev": self.found[0], "ino": self.found[1]}
        return {**super().to_json(), "workspace": self.workspace,
                "recorded": {"dev": self.recorded[0], "ino": self.recorded[1]},
                "found": found, "why": self.why}  # fmt: skip


class StaleWrite(SettledError):
    """A compare-and-set lost: the record is not in the state or generation the writer assumed."""


class BoundaryUnavailable(SettledError):
    exit_code = EXIT_USAGE


class NotSettled(SettledError):
    """A wait ran out before the session settled; the session goes on."""

    exit_code = EXIT_BLOCKED


class OwnerLaunchFailed(SettledError):
    """The session was admitted but its owner did not report. Claimed by no owner, it is
    settled at once as never started (its receipt says why); claimed, recovery decides."""


class SandboxFailed(SettledError):
    """A sandbox provider's command failed, timed out or did not confirm: nothing it did is
    evidence, and the message names which (with the end of its stderr)."""


class StorageFailed(SettledError):
    """The home's filesystem refused a write or a read (EIO and the like): what was being done
    did not happen, or not wholly. Named with the path, never a traceback."""

    def __init__(self, message: str, path: str, errno_name: str | None = None) -> None:
        super().__init__(message)
        self.path, self.errno_name = path, errno_name

    def to_json(self) -> dict[str, object]:
        return {**super().to_json(), "path": self.path, "errno": self.errno_name}


class StoreUnreachable(SettledError):
    """The authority store's server cannot be used: refused, unreachable, a wrong password, a
    missing database. Named by host:port/database and the server's reason, never the password
    and never a driver traceback; nothing was recorded by the call that met it."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"the store at {where} is unreachable: {reason}")
        self.where, self.reason = where, reason

    def to_json(self) -> dict[str, object]:
        return {**super().to_json(), "store": self.where, "reason": self.reason}


class SpaceExhausted(StorageFailed):
    """The home's filesystem has less free space than its reserve (or none at all): admission
    refuses, and a write that found the disk full says so. Exit 3: blocked until space is freed
    (or the reserve lowered with SETTLED_RESERVE_BYTES); HTTP 507."""

    exit_code = EXIT_BLOCKED

    def __init__(self, message: str, path: str, free: int | None, reserve: int | None) -> None:
        super().__init__(message, path, "ENOSPC")
        self.free, self.reserve = free, reserve

    def to_json(self) -> dict[str, object]:
        return {**super().to_json(), "free_bytes": self.free, "reserve_bytes": self.reserve}


class CursorOutOfRange(ValueError):
    """A cursor outside ``[0, end]`` of the stored stream.

    A ValueError, not a SettledError: every face maps it on its own (HTTP 416 with the end,
    exit 2, a tool error naming the cursor)."""

    def __init__(self, cursor: int, end: int, stream: str, what: str = "cursor") -> None:
        self.cursor = cursor
        self.end = end
        self.stream = stream
        if cursor < 0:
            message = f"{what} {cursor} is negative ({stream} has {end} bytes stored)"
        else:
            message = f"{what} {cursor} is beyond the end of {stream} ({end} bytes stored)"
        super().__init__(message)
