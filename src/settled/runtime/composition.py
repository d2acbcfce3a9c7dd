"""What a Runtime is made of, and the one place that chooses each part: the home, its store,
this host, the sessions' watch and the owners' liveness, the sandbox provider, the workspace
service, recovery, and the launcher of owners (`open_launcher`). The Runtime's parts
(`admission.py`, `tasks.py`, `logreads.py`, and `runtime/__init__.py`'s facade) are classes over
this one, each adding its verbs.

Must never: decide a verb (each part does), or import what only some verbs need at module
level: `settled status` must not pay for the checkpoint code, the launchers, recovery, the
close join, the command's identity or the log readers, nor for `typing` (tests/test_startup.py
holds the line), so each part is made on first use.
"""

from __future__ import annotations

import functools
import os

from settled import grammar, grants
from settled.backends import bind
from settled.errors import BadInput, WrongHost
from settled.home import (
    ensure_home_id,
    last_words_path,
    prepare_home,
    resolve_home,
    storage_errors,
)
from settled.owner.liveness import HostedOwners
from settled.records import TaskRecord
from settled.sessions import SessionWatch
from settled.store import Store, open_store

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any, Concatenate, ParamSpec, Self, TypeVar

    from settled.boundary.sandbox import SandboxProvider
    from settled.owner.launcher import Launcher
    from settled.recovery import Recovery
    from settled.workspace.service import WorkspaceService

    _C = TypeVar("_C", bound="Composition")
    _P = ParamSpec("_P")
    _R = TypeVar("_R")


LAUNCHERS = ("fresh", "warm", "home")


# The home's zygote also runs the command line's verbs, each in a worker it forks with the
# caller's stdio, directory and environment: a CLI call then costs a fork, not ~25 ms of
# imports (cli/thin.py asks, cli/worker.py answers). A name, not an import: the Runtime
# composes no face (a CLI, a server); the zygote imports it when it starts.
VERB_RUNNER = "settled.cli.worker:serve"


def _check_launcher_kind(kind: str | None) -> str:
    kind = kind or os.environ.get("SETTLED_LAUNCHER") or "fresh"
    if kind not in LAUNCHERS:
        raise BadInput(f"launcher {kind!r} is not one of {', '.join(LAUNCHERS)}")
    return kind


def load_for_calls() -> None:
    """Import now what the Runtime imports on first use for the CLI's verbs (recovery, the
    journal's lifecycle, log watching, the environment, task placement and ignore rules, the
    close join and the checkpoint): the home's zygote calls this before it forks one worker per
    call (cli/worker.py), so no worker imports them again."""
    import settled.close.join
    import settled.environment  # with pwd
    import settled.log.watch
    import settled.recovery  # noqa: F401 - the last of them
    from settled.workspace.service import load_for_calls as load_workspace

    load_workspace()


def open_launcher(kind: str | None = None) -> Launcher:
    """A launcher of `kind` that many Runtimes of one process may share; its opener closes
    it. "fresh": a new interpreter per owner; "warm": this process's own zygote; "home": the
    home's zygote, shared by every process of the home's user (what the CLI uses: a CLI call
    is a new process each time). Default SETTLED_LAUNCHER, else "fresh"."""
    kind = _check_launcher_kind(kind)
    if kind == "fresh":
        from settled.owner.launcher import FreshLauncher

        return FreshLauncher()
    if kind == "home":
        from settled.owner.home_launcher import HomeLauncher

        return HomeLauncher(verb_runner=VERB_RUNNER)
    from settled.owner.zygote import WarmLauncher

    return WarmLauncher()


MAX_WAIT = grammar.MAX_WAIT_S


def _on_disk(
    what: str,
) -> Callable[[Callable[Concatenate[_C, _P], _R]], Callable[Concatenate[_C, _P], _R]]:
    """A verb whose writes may meet a full or failing disk: the error is SpaceExhausted /
    StorageFailed naming the home's filesystem (home.storage_errors), for every face."""

    def wrap(
        method: Callable[Concatenate[_C, _P], _R],
    ) -> Callable[Concatenate[_C, _P], _R]:
        @functools.wraps(method)
        def run(self: _C, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            with storage_errors(self.home, what):
                return method(self, *args, **kwargs)

        return run

    return wrap


class Composition:
    """The parts every verb of a Runtime reaches; `Runtime`'s docstring says how to make one."""

    def __init__(
        self,
        home: str | None = None,
        launcher: str | None = None,
        *,
        shared_launcher: Launcher | None = None,
    ) -> None:
        """One Runtime per thread (it holds one SQLite connection). Threads of one process can
        share a launcher (`open_launcher()`) by passing the same `shared_launcher`; its opener
        closes it. Without one, this Runtime opens its own on first use and closes it."""
        self.home = ready_home(home)
        self.backends = bind(self.home)  # recorded at a home's first open; owners read it
        if shared_launcher is None:
            _check_launcher_kind(launcher)  # refuse an unknown kind now, not at the first exec
        self._launcher_kind = launcher
        self._sandbox_spec = os.environ.get("SETTLED_SANDBOX", "local")
        if self._sandbox_spec != "local":
            self.sandbox  # noqa: B018 -- a bad config is refused before anything is opened
        self.store: Store = open_store(self.home)
        self._hide_credential_files()
        name = os.uname().nodename  # what gethostname(2) returns, without importing socket
        self.host = self.store.register_host(ensure_home_id(self.home), name, self.home).host
        self.sessions = SessionWatch(
            self.store,
            HostedOwners(self.host, self.home),
            last_words=self._last_words,
            recover=self._recover_lost,
        )
        self._launcher: Launcher | None = shared_launcher
        self._owns_launcher = shared_launcher is None

    @functools.cached_property
    def sandbox(self) -> SandboxProvider:
        from settled.boundary.sandbox import open_sandbox

        return open_sandbox(self._sandbox_spec)

    @property
    def _sandbox_name(self) -> str:
        """The provider's name, without opening the local one: an exec asks only that."""
        return "local" if self._sandbox_spec == "local" else self.sandbox.name

    @functools.cached_property
    def workspace(self) -> WorkspaceService:
        """The one way to the workspace layer (workspace/service.py), light to make: an exec
        asks it for its task's journal watch and loads no checkpoint code."""
        from settled.workspace.service import WorkspaceService

        return WorkspaceService(self.home, self.store)

    @functools.cached_property
    def recovery(self) -> Recovery:
        from settled.recovery import Recovery

        return Recovery(self.store, self.sessions, lambda: self.sandbox, self.home, self.host)

    def _ensure_journal(self, record: TaskRecord) -> None:
        """Have the home's journal watch the task's workspace (WorkspaceService.watch)."""
        self.workspace.watch(record)

    def stop_journal(self) -> None:
        """Stop this home's journal daemon and return once it let go of its lock: for a
        caller that made a home for a moment (`settled probe`) and ends what it started. A
        task still open then has no watch: its next checkpoint is a full scan."""
        self.workspace.stop_journal()

    def release_pods(self) -> None:
        """Let go of every pod of this home (its pods namespace unpinned: each pod ends with
        its last session): for a caller that made a home for a moment and removes it whole
        (`settled probe`, `settled soak`). A task still open gets a new pod at its next
        session, and its receipt says the earlier one was lost. The home's proxy, which holds
        a listener in each pod's network namespace, is stopped first."""
        from settled.boundary import podhost
        from settled.netproxy import lifecycle

        lifecycle.stop(self.home)

        podhost.release_home(self.home)

    def _recover_lost(self, session: str, lapsed_lease: bool, closing: bool) -> object:
        """What a waiter or a close that meets a lost owner runs (recovery.py `recover_lost`)."""
        return self.recovery.recover_lost(session, lapsed_lease=lapsed_lease, closing=closing)

    def _last_words(self, session: str) -> dict[str, Any] | None:
        from settled.owner.last_words import read_last_words

        return read_last_words(last_words_path(self.home, session))

    def close(self) -> None:
        if self._launcher is not None and self._owns_launcher:
            self._launcher.close()
        self._launcher = None
        if "workspace" in self.__dict__:  # made on first use
            self.workspace.close()
        self.store.close()

    def _launch(self, session: str) -> dict[str, Any]:
        if self._launcher is None:
            self._launcher = open_launcher(self._launcher_kind)
        return self._launcher.launch(self.home, session, self.store)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _hide_credential_files(self) -> None:
        """The store's password files (backends.credential_files) are covered in every
        command's view, recorded once; a home with an embedded store has none (no read)."""
        from settled.backends import bound_backends, credential_files

        files = credential_files(bound_backends(self.home), dict(os.environ))
        if files and not set(files) <= set(self.store.hidden_paths()):
            self.store.add_hidden_paths(files)

    def hide_paths(self, paths: list[str]) -> None:
        """Files no session of this home may see from now on (a server's tokens file): each
        is covered in every command's mount namespace."""
        self.store.add_hidden_paths([os.path.realpath(p) for p in paths])

    def _on_this_host(self, record: TaskRecord, verb: str) -> None:
        """WrongHost unless the task's owners run on this host (a task from before hosts
        were recorded is this home's). Reads never ask."""
        if record.host is None or record.host == self.host:
            return
        owner = self.store.get_host(record.host)
        raise WrongHost(record.task, record.host, owner.name if owner else None, self.host, verb)

    def _refuse_held(self, kind: str, paths: Sequence[str], workspace: str) -> None:
        """BadGrant for a grant that opens the home, another task's workspace or a store or
        object directory of this home (settled.grants)."""
        grants.refuse_held(
            kind, paths, home=self.home, workspace=workspace,
            workspaces=self.store.workspaces(),
            evidence_dirs=grants.evidence_dirs(self.backends.store, self.backends.objects),
            other_homes=[h.home for h in self.store.hosts() if h.home != self.home],
        )  # fmt: skip


def ready_home(home: str | None = None) -> str:
    """The settled home ``home`` names (None: SETTLED_HOME, else home.default_home) as an
    absolute path, created private if missing; HomeUnusable if it cannot hold the store, the
    logs and the objects. What a Runtime opens, for a face that checks it before making any."""
    return prepare_home(resolve_home(home))
