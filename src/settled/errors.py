"""Typed errors of settled, each mapped to one CLI exit code.

Owns the error vocabulary and the exit-code table of the CLI contract (DESIGN.md):
2 usage or bad input, 3 blocked / not complete (and no space: the home's filesystem is below
its reserve, see home.py), 4 key conflict or sealed admission.
Every message names the offending value and, where there is one, the way out.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_BLOCKED = 3
EXIT_CONFLICT = 4


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
        super().__init__(f"task {task} is {state}: admission is sealed, no new command may start")
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


class StaleWrite(SettledError):
    """A compare-and-set lost: the record is not in the state or generation the writer assumed."""


class BoundaryUnavailable(SettledError):
    exit_code = EXIT_USAGE


class NotSettled(SettledError):
    """A wait ran out before the session settled; the session goes on."""

    exit_code = EXIT_BLOCKED


class OwnerLaunchFailed(SettledError):
    """The session was admitted but its owner did not report; recovery will decide its fate."""


class StorageFailed(SettledError):
    """The home's filesystem refused a write or a read (EIO and the like): what was being done
    did not happen, or not wholly. Named with the path, never a traceback."""

    def __init__(self, message: str, path: str, errno_name: str | None = None) -> None:
        super().__init__(message)
        self.path, self.errno_name = path, errno_name

    def to_json(self) -> dict[str, object]:
        return {**super().to_json(), "path": self.path, "errno": self.errno_name}


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
