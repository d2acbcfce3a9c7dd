"""Tasks: their creation (`task new`, all or nothing: a creation that fails leaves no row,
directory, sandbox or journal state) and the destruction of their sandbox (`task destroy`).

Must never: make anything for a retried key whose task exists (it is returned as it is), or
record a task whose workspace, grants or ignore rules were not checked first.
"""

from __future__ import annotations

import contextlib
import os

from settled import grammar, grants, netpolicy
from settled.errors import BadInput, SettledError
from settled.home import check_reserve
from settled.records import TaskRecord
from settled.runtime.composition import Composition, _on_disk
from settled.runtime.refusals import limits_of, resolve_user
from settled.states import SETTLED, TASK_OPEN

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from settled.requests import TaskRequest


def _same_workspace(asked: str | None, recorded: str, defaults: str) -> bool:
    """Whether a retried `task new` asks for the workspace its key's task has: the same
    directory, or none when the task has one settled made (a retry of `task new --key K`)."""
    if asked is None:
        return os.path.dirname(recorded) == os.path.realpath(defaults)
    return os.path.realpath(asked) == recorded


class Tasks(Composition):
    """The Runtime's tasks: made, and their sandbox destroyed."""

    def new_task(
        self, workspace: str | None = None, key: str | None = None, **options: Any
    ) -> TaskRecord:
        """``create_task`` with the request's options as keywords (`requests.TaskRequest`'s
        names): what a caller in this process writes."""
        from settled.requests import TaskRequest

        return self.create_task(TaskRequest(workspace=workspace, key=key, **options))

    @_on_disk("task new")
    def create_task(self, request: TaskRequest) -> TaskRecord:
        """`user` (UID[:GID], a name, or a (uid, gid) pair) is the default uid/gid of the
        task's commands; an exec may name another. `writable` and `readable` are grants every
        command of the task gets besides its own, `memory`, `pids` and `cpus` its default
        limits (an exec's own replace them), `network` its default network ("proxy", the
        Runtime's default, "none" or "host") and `allow_hosts` its default --allow-host
        patterns (netpolicy); each is checked here (settled.grants). A
        workspace that cannot be right is refused (placement.check_workspace), and so is one
        overlapping another open task's unless `shared_workspace` (then both tasks' close
        receipts name each other). Refused below the home's reserve. `ignore`: gitignore
        patterns added after the workspace's `.settledignore`; both are bound here, once
        (workspace.ignore)."""
        import shutil
        import tempfile

        from settled.identity import new_key

        grammar.optional_key("key", request.key)
        extra = list(request.ignore)
        self.workspace.check_ignore(extra)  # a bad pattern is refused before anything is made
        if request.workspace is not None:
            grammar.check_path("workspace", request.workspace)
        uid_gid = resolve_user(request.user)  # bad input is refused, a retry's too
        limits = limits_of(request.memory, request.pids, request.cpus, {})
        if request.network is not None:
            from settled.identity import NETWORK_POLICIES

            grammar.check_choice("network", request.network, NETWORK_POLICIES)
        patterns = netpolicy.check_allowed(
            "allow_hosts", request.allow_hosts or (), request.network
        )
        granted = {kind: grants.resolve(kind, paths) for kind, paths in
                   (("writable", request.writable), ("readable", request.readable))}  # fmt: skip
        if request.key is None or (retried := self.store.find_task(request.key)) is None:
            check_reserve(self.home, "task new")  # a retry needs no space: it gets its task
        elif _same_workspace(request.workspace, retried.workspace, self._made_workspaces()):
            if retried.state == TASK_OPEN:
                self._ensure_journal(retried)
            return retried
        made = None
        workspace = request.workspace
        if workspace is None:
            workspace = made = tempfile.mkdtemp(prefix="workspace-", dir=self._default_workspaces())
        try:  # all or nothing: a creation that fails leaves no row, directory or journal state
            if made is not None and uid_gid is not None:
                os.chown(made, *uid_gid)  # the task's commands run as its user
            root = os.path.realpath(workspace)
            if not os.path.isdir(root):
                raise BadInput(f"--workspace {workspace!r} is not a directory")
            self.workspace.check_placement(workspace, root)
            identity = self.workspace.root_identity(workspace, root)
            for kind, paths in granted.items():
                self._refuse_held(kind, paths, root)
            rules = self.workspace.bind_ignore(root, extra)  # read once: a command cannot widen it
            made_sandbox: dict[str, Any] | None = None
            defaults: dict[str, Any] = {k: list(v) for k, v in granted.items() if v}
            defaults.update({k: v for k, v in limits.items() if v is not None})
            if request.network is not None:
                defaults["network"] = request.network
            if patterns:
                defaults["allow_hosts"] = list(patterns)
            record, created = self.store.create_task(
                request.key or new_key(), root, uid_gid, shared_workspace=request.shared_workspace,
                host=self.host, ignore_rules=rules, defaults=defaults or None,
                workspace_identity=identity,
            )  # fmt: skip
            try:
                if not created and record.workspace != root:
                    raise BadInput(
                        f"task key {record.key!r} already names task {record.task} with "
                        f"workspace {record.workspace}, not {root}"
                    )
                if created:  # its sandbox, recorded before any command can be admitted
                    made_sandbox = self.sandbox.create(record.task)
                    record = self.store.record_sandbox(record.task, made_sandbox)
                if record.state == TASK_OPEN:
                    self._ensure_journal(record)
            except BaseException:
                if created and not self._undo_task(record):
                    made = None  # the task was used meanwhile: its workspace stays
                elif created and made_sandbox is not None:
                    self._undo_sandbox(record.replace(sandbox=made_sandbox))
                raise
        except BaseException:
            if made is not None:
                shutil.rmtree(made, ignore_errors=True)
            raise
        return record

    def _undo_task(self, record: TaskRecord) -> bool:
        """Delete a task whose creation failed, and its journal state; False if it was used
        meanwhile (a concurrent creation with the same key admitted a command), then it stays."""
        if not self.store.discard_task(record.task):
            return False
        self.workspace.forget_journal(record)
        return True

    def _undo_sandbox(self, record: TaskRecord) -> None:
        """End the sandbox of a task whose creation failed after it was made; a provider that
        cannot is not the error the caller sees (the creation's own is)."""
        with contextlib.suppress(SettledError):
            self.sandbox.destroy(record, [])

    def _made_workspaces(self) -> str:
        """Where the workspaces settled makes live (WorkspaceService.default_workspaces)."""
        return self.workspace.default_workspaces()

    def _default_workspaces(self) -> str:
        path = self._made_workspaces()
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    @_on_disk("task destroy")
    def destroy_task(self, task: str) -> dict[str, Any]:
        """Destroy the task's sandbox: evidence for every session inside it. Sessions outside
        any sandbox (subreaper, pgroup) stay unknown. The task's pod namespaces end with it
        (its IPC objects, keys and loopback); its pod directories stay until it closes."""
        record = self.store.get_task(grammar.check_id("task", task))
        if record.host not in (None, self.host) and self.sandbox.name != "local":
            return self._destroy_elsewhere(record)
        self._on_this_host(record, "task destroy")  # a local sandbox is reached from its host
        self.recovery.detect(task)  # a lost owner's session is unknown, whatever destroy says
        sessions = self.store.list_sessions(task)
        destroyed = self.sandbox.destroy(record, sessions)  # SandboxFailed: nothing is evidence
        self.recovery.detect(task, force=True)
        results = self.recovery.recover(
            task, source="sandbox-destroyed", evidence=destroyed.evidence, destroying=True
        )
        if self.sandbox.name == "local":  # its processes are dead: so are its namespaces now
            from settled.boundary.pod import LocalPods

            LocalPods(self.home).release_namespaces(task)
        reported = {result["session"] for result in results}
        for was_live in (s for s in sessions if s.live and s.session not in reported):
            # settled meanwhile by its own owner or a racing destroy: say what it is now
            now = self.store.get_session(was_live.session)
            results.append({"session": now.session, "state": now.state, "by": "another"})
        return {
            "task": task,
            "provider": self.sandbox.name,
            "sandbox": destroyed.facts,
            "sessions": results,
        }

    def _destroy_elsewhere(self, record: TaskRecord) -> dict[str, Any]:
        """Destroy another host's task through a provider that reaches it from here. Its
        owners, if their host lives, settle their own sessions (they see the command die);
        sessions of a vanished host settle from the provider's confirmation."""
        sessions = self.store.list_sessions(record.task)
        destroyed = self.sandbox.destroy(record, sessions)  # SandboxFailed: nothing is evidence
        host = self.store.get_host(record.host) if record.host else None
        results: list[dict[str, Any]] = []
        for session in sessions:
            if session.state == SETTLED:
                continue
            if host is not None and host.vanished_at is not None:
                why = host.vanished_why or f"host {host.host} vanished"
                results.append(self.recovery.recover_vanished(session, why, destroyed.evidence))
            else:
                now = self.store.get_session(session.session)
                results.append({"session": now.session, "state": now.state, "by": "its owner"})
        return {
            "task": record.task,
            "provider": self.sandbox.name,
            "sandbox": destroyed.facts,
            "sessions": results,
        }
