"""The workspace service: the one way the Runtime reaches a task's workspace and its checkpoints.

Owns what the Runtime asks of the workspace layer, each answered by the module that decides it:
the task's journal watch (`journal/lifecycle.py`), where a workspace may be (`placement.py`),
the identity of its root (`rootid.py`), the ignore rules bound at `task new` (`ignore.py`),
the home's object store (`settled.objects.open_object_store`), restore and verify of a
manifest (`restore.py`, `verify.py`), and the checkpoints (`checkpoint.py`'s `Checkpoints`:
the final scan, the checkpoint and its read-back; the close join reaches them through this
service, its `Workspace`).

Must never: import at module level what only some verbs need. An exec has its task's workspace
watched through here and must load no checkpoint code, and `settled status` none of this
(tests/test_startup.py): each part is imported and made on first use.
"""

from __future__ import annotations

import functools

from settled.errors import BadInput, SettledError
from settled.home import journal_socket, run_dir

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

    from settled.objects import ObjectStore
    from settled.records import SessionRecord, TaskRecord
    from settled.store import Store
    from settled.workspace.checkpoint import Checkpoints
    from settled.workspace.restore import RestoreResult as RestoreResult  # what restore returns


def load_for_calls() -> None:
    """Import now what this service imports on first use for the CLI's verbs (the journal's
    lifecycle, placement, the root's identity, ignore rules and the checkpoint): for the home's
    zygote, before it forks one worker per call (runtime.load_for_calls)."""
    import settled.workspace.checkpoint
    import settled.workspace.ignore
    import settled.workspace.journal.lifecycle
    import settled.workspace.placement
    import settled.workspace.rootid  # noqa: F401 - the last of them


class WorkspaceService:
    """What the Runtime asks of the workspace layer; the close join's `Workspace`."""

    def __init__(self, home: str, store: Store, objects: ObjectStore | None = None) -> None:
        """``objects``: an object store chosen by the caller (a test's S3 bucket); by default
        the home's own (``open_object_store``), opened on first use."""
        self.home, self.store = home, store
        self._objects = objects

    @functools.cached_property
    def objects(self) -> ObjectStore:
        if self._objects is None:
            from settled.objects import open_object_store

            self._objects = open_object_store(self.home)
        return self._objects

    @functools.cached_property
    def checkpoints(self) -> Checkpoints:
        """The scans and checkpoints of this home's tasks (made at the first that needs them)."""
        from settled.workspace.checkpoint import Checkpoints

        return Checkpoints(self.home, self.store, self.objects)

    def close(self) -> None:
        if "checkpoints" in self.__dict__:
            self.checkpoints.close()

    # -- the journal ----------------------------------------------------------------------

    def socket(self) -> str:
        return journal_socket(self.home)

    def watch(self, task: TaskRecord) -> None:
        """Have the home's journal watch the task's workspace (one request when it already
        runs; it is started otherwise). A kernel that refuses the watches or the inotify
        instance is not an error here: the journal then says it cannot vouch, and the scans
        are full. Raises JournalUnavailable if no journal can be started or reached."""
        from settled.workspace.journal.lifecycle import ensure_watching

        ensure_watching(task.task, task.workspace, run_dir(self.home))

    def release(self, task: TaskRecord) -> None:
        """The close is done with this workspace: the journal stops watching it."""
        self.checkpoints.release(task)

    def forget_journal(self, task: TaskRecord) -> None:
        """The task's creation is undone: no watch and no sequence state of it remain."""
        self.checkpoints.forget_journal(task)

    def stop_journal(self) -> None:
        """Stop this home's journal daemon and return once it let go of its lock."""
        from settled.workspace.journal.lifecycle import stop

        stop(self.socket())

    # -- a task's workspace, bound at task new ------------------------------------------

    def default_workspaces(self) -> str:
        """Where the workspaces settled makes for a task live (placement.default_workspaces)."""
        from settled.workspace.placement import default_workspaces

        return default_workspaces(self.home)

    def check_placement(self, asked: str, root: str) -> None:
        """BadInput for a workspace that cannot be right (placement.check_workspace)."""
        from settled.workspace.placement import check_workspace

        check_workspace(asked, root, self.home)

    def root_identity(self, asked: str, root: str) -> dict[str, Any]:
        """The identity of the resolved workspace `root` that the task records (rootid): every
        scan and every command's bind must find that directory there. BadInput if it cannot be
        opened as a directory without following a symlink (it changed since it was resolved)."""
        from settled.workspace import rootid

        try:
            return rootid.read(root)
        except OSError as error:
            raise BadInput(
                f"--workspace {asked!r}: cannot open {root} as a directory without following a "
                f"symlink: {error.strerror or error}"
            ) from None

    def check_ignore(self, patterns: Sequence[str]) -> None:
        """Refuse a pattern that is not gitignore syntax, before anything is made."""
        from settled.workspace.ignore import compile_rules

        compile_rules(list(patterns))

    def bind_ignore(self, root: str, patterns: Sequence[str]) -> dict[str, Any]:
        """The task's ignore rules: the root's `.settledignore`, then `patterns`, read once."""
        from settled.workspace.ignore import bind

        return bind(root, list(patterns)).record()

    # -- checkpoints, restore and verify ------------------------------------------------

    def final_scan(self, task: TaskRecord, *, incremental: bool = False) -> dict[str, Any]:
        return self.checkpoints.final_scan(task, incremental=incremental)

    def checkpoint(
        self, task: TaskRecord, scan_fact: dict[str, Any], sessions: list[SessionRecord]
    ) -> dict[str, Any]:
        return self.checkpoints.checkpoint(task, scan_fact, sessions)

    def checkpoint_now(self, task: TaskRecord, *, incremental: bool = True) -> dict[str, Any]:
        return self.checkpoints.checkpoint_now(task, incremental=incremental)

    def check_manifest(self, manifest: str) -> None:
        """BadInput unless `manifest` is a manifest id (<algo>:<hex>) this home's object store
        holds."""
        from settled.objects.hashing import parse_digest

        try:
            parse_digest(manifest)
        except SettledError:
            raise BadInput(
                f"{manifest!r} is neither a task (t_...) nor a manifest id (<algo>:<hex>)"
            ) from None
        if not self.objects.recorded().has(manifest):
            raise BadInput(f"unknown manifest {manifest}: not in {self.objects.location}")

    def restore(self, manifest: str, dest: str, *, same_owner: bool = False) -> RestoreResult:
        from settled.workspace.restore import restore

        return restore(self.objects.recorded(), manifest, dest, same_owner=same_owner)

    def verify(self, manifest: str, *, read_data: bool = False) -> dict[str, Any]:
        from settled.workspace.verify import verify_manifest

        verified = self.checkpoints.verified
        recorded = self.objects.recorded()  # an older upload that hashes right serves
        result = verify_manifest(recorded, manifest, read_data=read_data, record=verified)
        return result.to_json()
