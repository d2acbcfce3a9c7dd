"""The library API: what the CLI, the HTTP service and the MCP tools all call.

Admission (rule 1) happens here: validate everything first, record the session with a
conditional insert, and launch an owner only for the admission that created it. Everything after
admission belongs to the owner; the runtime only reads facts and asks the owner to act.
"""

from __future__ import annotations

import _thread
import contextlib
import functools
import os

from settled import boundary as boundaries
from settled import grammar, grants, netpolicy
from settled.backends import bind, credential_names
from settled.errors import BadInput, LogElsewhere, OwnerLaunchFailed, SettledError, WrongHost
from settled.faults import ALL_POINTS as ALL_POINTS  # named for `settled close --list-fault-points`
from settled.home import (
    check_reserve,
    ensure_home_id,
    last_words_path,
    log_path,
    prepare_home,
    resolve_home,
    session_dir,
    stdin_path,
    storage_errors,
)
from settled.home import storage_error as storage_error  # for the CLI: one line for a disk error
from settled.owner.liveness import HostedOwners
from settled.records import Frozen, OwnerFacts, SessionRecord, TaskRecord
from settled.sessions import WAKE_BOUND_S, SessionWatch
from settled.states import SETTLED, TASK_COMPLETE, TASK_OPEN
from settled.status import session_status, task_status
from settled.store import Store, open_store

# What only some verbs need is imported where it is used: `settled status` and the other
# readers must not pay for the checkpoint code, the launchers, recovery, the close join, the
# command's identity or the log readers, nor for `typing` (tests/test_startup.py holds the line).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence
    from typing import Any, Concatenate, ParamSpec, TypeVar

    from settled.boundary.sandbox import SandboxProvider
    from settled.close.join import CloseJoin
    from settled.close.join import CloseResult as CloseResult  # what close_task returns
    from settled.environment import CallerEnv
    from settled.identity import CommandSpec
    from settled.log.interleave import Chunk
    from settled.log.reader import StreamLog as StreamLog  # the type of stream_log()
    from settled.log.view import Window
    from settled.owner.launcher import Launcher as Launcher  # the seam faces may share
    from settled.recovery import Recovery
    from settled.requests import ExecRequest, TaskRequest
    from settled.workspace.checkpoint import WorkspaceService
    from settled.workspace.restore import RestoreResult

    _P = ParamSpec("_P")
    _R = TypeVar("_R")
    _T = TypeVar("_T")


class Admission(Frozen):
    """What an exec answers: the session (new or reused) and its state at that moment."""

    __slots__ = (
        "boundary",
        "digest",
        "key",
        "owner_pid",
        "pid",
        "reused",
        "session",
        "state",
        "task",
    )
    session: str
    task: str
    key: str
    digest: str
    reused: bool
    state: str
    owner_pid: int | None
    pid: int | None
    boundary: str | None

    def __init__(
        self,
        session: str,
        task: str,
        key: str,
        digest: str,
        reused: bool,
        state: str,
        owner_pid: int | None = None,
        pid: int | None = None,
        boundary: str | None = None,
    ) -> None:
        self._fill(locals())

    def to_json(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "task": self.task,
            "key": self.key,
            "digest": self.digest,
            "reused": self.reused,
            "state": self.state,
            "owner_pid": self.owner_pid,
            "pid": self.pid,
            "boundary": self.boundary,
        }


class _Admitting:
    """Admissions of one key in this process, one at a time until the store answered.

    A retry storm sends a key's duplicates together, most of them into one process (a server's
    threads, a harness's pool): each would find no session, look for vanished owners over every
    live session of the task and queue on the store's write lock, to learn that another one
    inserted the row. Here the first runs the admission and the others wait for its answer
    (woken by it, never by a timer), then read the session as any later retry does. Nothing is
    decided here: the store's conditional insert still admits exactly one, across processes."""

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()  # the builtin: `settled status` loads no threading
        self._running: dict[tuple[str, str, str], _thread.LockType] = {}

    @contextlib.contextmanager
    def turn(self, home: str, task: str, key: str) -> Iterator[bool]:
        """True to the caller that admits the key now; False, once that one has the store's
        answer (or failed), to a caller that came meanwhile: it reads the answer instead."""
        name = (home, task, key)
        with self._lock:
            running = self._running.get(name)
            if running is None:
                mine = self._running[name] = _thread.allocate_lock()
                mine.acquire()  # held until the answer: the others block on it
        if running is not None:
            with running:  # each waiter in turn, as the first lets go
                pass
            yield False
            return
        try:
            yield True
        finally:
            with self._lock:
                del self._running[name]
            mine.release()


_ADMITTING = _Admitting()
LAUNCHERS = ("fresh", "warm", "home")
# The home's zygote also runs the command line's verbs, each in a worker it forks with the
# caller's stdio, directory and environment: a CLI call then costs a fork, not ~25 ms of
# imports (cli/thin.py asks, cli/worker.py answers). A name, not an import: the Runtime
# composes no face; the zygote imports it when it starts.
HOME_FACE = "settled.cli.worker:serve"


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
    import settled.recovery
    import settled.workspace.checkpoint
    import settled.workspace.ignore
    import settled.workspace.journal.lifecycle
    import settled.workspace.placement  # noqa: F401 - the last of them


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

        return HomeLauncher(face=HOME_FACE)
    from settled.owner.zygote import WarmLauncher

    return WarmLauncher()


def _resolve_user(user: str | tuple[int, int] | list[int] | None) -> tuple[int, int] | None:
    if user is None:
        return None
    from settled.identity import check_user, parse_user

    if isinstance(user, str):
        return parse_user(user)
    return check_user(tuple(user))


def _limits(
    memory: int | None, pids: int | None, cpus: float | None, defaults: dict[str, Any]
) -> dict[str, Any]:
    """An exec's limits: each its own when given, else its task's default (none: the host's,
    decided where the session's cgroups are made, boundary/limits.py)."""
    return {
        "memory": grammar.check_memory("memory", memory)
        if memory is not None
        else defaults.get("memory"),
        "pids": grammar.check_pids("pids", pids) if pids is not None else defaults.get("pids"),
        "cpus": grammar.check_cpus("cpus", cpus) if cpus is not None else defaults.get("cpus"),
    }


STREAMS = ("stdout", "stderr")
MAX_WAIT = grammar.MAX_WAIT_S


def _session_stream(session: str, stream: str) -> str:
    """The session id, once it and the stream name are inside their grammar (a stream name
    is part of a log's path)."""
    grammar.check_choice("stream", stream, STREAMS)
    return grammar.check_id("session", session)


def _same_workspace(asked: str | None, recorded: str, defaults: str) -> bool:
    """Whether a retried `task new` asks for the workspace its key's task has: the same
    directory, or none when the task has one settled made (a retry of `task new --key K`)."""
    if asked is None:
        return os.path.dirname(recorded) == os.path.realpath(defaults)
    return os.path.realpath(asked) == recorded


def _root_identity(asked: str, root: str) -> dict[str, Any]:
    """The identity of the resolved workspace `root` that the task records (workspace.rootid):
    every scan and every command's bind must find that directory there. BadInput if it cannot
    be opened as a directory without following a symlink (it changed since it was resolved)."""
    from settled.workspace import rootid

    try:
        return rootid.read(root)
    except OSError as error:
        raise BadInput(
            f"--workspace {asked!r}: cannot open {root} as a directory without following a "
            f"symlink: {error.strerror or error}"
        ) from None


def _check_isolation(spec: CommandSpec, kind: str) -> None:
    """Refuse before recording what the owner could only refuse later: `strict` on a machine
    that lacks a protection, or a `--user` this process cannot switch to."""
    if spec.isolation == "none" and spec.user is None:
        return
    from settled.boundary.isolation import IsolationUnavailable, check_available

    try:
        check_available(
            "strict" if spec.isolation == "strict" else "auto",
            pid_namespace=kind in boundaries.PID_NAMESPACE_KINDS,
            uid=spec.user[0] if spec.user is not None else None,
            writable=spec.writable,
        )
    except IsolationUnavailable as exc:
        raise BadInput(str(exc)) from None


def _check_limits(spec: CommandSpec) -> None:
    """Refuse, before recording, a limit asked for (by the exec or its task) that this host
    cannot enforce, its controller missing (boundary/limits.py), or below what a session's
    first processes take (pids: the namespace's init and the command)."""
    from settled.boundary import limits

    explicit = {"memory": spec.memory, "pids": spec.pids, "cpus": spec.cpus}
    if all(value is None for value in explicit.values()):
        return
    why = limits.refusal(explicit)
    if why is not None:
        raise BadInput(why)


def _check_sandbox(spec: CommandSpec, task: TaskRecord, provider: str) -> bool:
    """Whether the command will run through the task's sandbox's enter prefix; refuses what
    settled could not then honour (its own isolation, a uid, a granted path, a network of
    the task's own) and a task whose sandbox another provider made (or none yet), since this
    one could neither enter nor end it."""
    made_by = (task.sandbox or {}).get("provider", "local")
    if made_by != provider:
        raise BadInput(
            f"task {task.task} has a {made_by} sandbox, and this settled uses the {provider} "
            "provider (SETTLED_SANDBOX): it can neither enter nor destroy it"
        )
    if not (task.sandbox or {}).get("enter"):
        return False
    refused = [
        (spec.isolation == "strict", "--isolation strict"),
        (spec.user is not None, "--user"),
        (bool(spec.writable), "--writable"),
        (bool(spec.readable), "--readable"),
        (spec.network != "host", f"--network {spec.network}"),
    ]
    for asked, what in refused:
        if asked:
            raise BadInput(
                f"{what}: task {task.task} runs its commands inside its {provider} sandbox, "
                "whose own isolation and user apply there; settled cannot apply or check it"
            )
    return True


def _on_disk(
    what: str,
) -> Callable[[Callable[Concatenate[Runtime, _P], _R]], Callable[Concatenate[Runtime, _P], _R]]:
    """A verb whose writes may meet a full or failing disk: the error is SpaceExhausted /
    StorageFailed naming the home's filesystem (home.storage_errors), for every face."""

    def wrap(
        method: Callable[Concatenate[Runtime, _P], _R],
    ) -> Callable[Concatenate[Runtime, _P], _R]:
        @functools.wraps(method)
        def run(self: Runtime, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            with storage_errors(self.home, what):
                return method(self, *args, **kwargs)

        return run

    return wrap


class Runtime:
    """`launcher="warm"` keeps a pre-imported zygote (this Runtime's child) that forks owners in
    ~2 ms instead of a fresh interpreter per session; worth it for a long-lived caller. The
    default comes from SETTLED_LAUNCHER, else "fresh"."""

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
        name = os.uname().nodename  # what gethostname(2) returns, without importing socket
        self.host = self.store.register_host(ensure_home_id(self.home), name, self.home).host
        self.sessions = SessionWatch(
            self.store, HostedOwners(self.host), last_words=self._last_words
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
        from settled.workspace.checkpoint import WorkspaceService

        return WorkspaceService(self.home, self.store)

    @functools.cached_property
    def recovery(self) -> Recovery:
        from settled.recovery import Recovery

        return Recovery(self.store, self.sessions, lambda: self.sandbox, self.home, self.host)

    def _ensure_journal(self, record: TaskRecord) -> None:
        """Have the home's journal watch the task's workspace (one request when it already
        runs; it is started otherwise). A kernel that refuses the watches or the inotify
        instance is not an error here: the journal then says it cannot vouch, and the scans
        are full. Raises JournalUnavailable if no journal can be started or reached. Called
        here, not through the workspace service, so an exec loads no checkpoint code."""
        from settled.home import run_dir
        from settled.workspace.journal.lifecycle import ensure_watching

        ensure_watching(record.task, record.workspace, run_dir(self.home))

    def stop_journal(self) -> None:
        """Stop this home's journal daemon and return once it let go of its lock: for a
        caller that made a home for a moment (`settled probe`) and ends what it started. A
        task still open then has no watch: its next checkpoint is a full scan."""
        from settled.home import journal_socket
        from settled.workspace.journal.lifecycle import stop

        stop(journal_socket(self.home))

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

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def hide_paths(self, paths: list[str]) -> None:
        """Files no session of this home may see from now on (a server's tokens file): each
        is covered in every command's mount namespace."""
        self.store.add_hidden_paths([os.path.realpath(p) for p in paths])

    # -- tasks ---------------------------------------------------------------------------

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
        from settled.workspace.ignore import bind as bind_ignore
        from settled.workspace.ignore import compile_rules
        from settled.workspace.placement import check_workspace, default_workspaces

        grammar.optional_key("key", request.key)
        extra = list(request.ignore)
        compile_rules(extra)  # a bad pattern is refused before anything is made
        if request.workspace is not None:
            grammar.check_path("workspace", request.workspace)
        uid_gid = _resolve_user(request.user)  # bad input is refused, a retry's too
        limits = _limits(request.memory, request.pids, request.cpus, {})
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
        elif _same_workspace(request.workspace, retried.workspace, default_workspaces(self.home)):
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
            check_workspace(workspace, root, self.home)
            identity = _root_identity(workspace, root)
            for kind, paths in granted.items():
                self._refuse_held(kind, paths, root)
            rules = bind_ignore(root, extra).record()  # read once: a command cannot widen it
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

    def _refuse_held(self, kind: str, paths: Sequence[str], workspace: str) -> None:
        """BadGrant for a grant that opens the home, another task's workspace or a store or
        object directory of this home (settled.grants)."""
        grants.refuse_held(
            kind, paths, home=self.home, workspace=workspace,
            workspaces=self.store.workspaces(),
            evidence_dirs=grants.evidence_dirs(self.backends.store, self.backends.objects),
            other_homes=[h.home for h in self.store.hosts() if h.home != self.home],
        )  # fmt: skip

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

    def _default_workspaces(self) -> str:
        from settled.workspace.placement import default_workspaces

        path = default_workspaces(self.home)
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    # -- admission -----------------------------------------------------------------------

    def exec(
        self,
        task: str,
        argv: Sequence[str] | None = None,
        shell: str | None = None,
        **options: Any,
    ) -> Admission:
        """``admit`` with the request's options as keywords (`requests.ExecRequest`'s names):
        what a caller in this process writes, a test, the soak or the probe."""
        from settled.requests import ExecRequest

        return self.admit(task, ExecRequest(argv=argv, shell=shell, **options))

    @_on_disk("exec")
    def admit(self, task: str, request: ExecRequest) -> Admission:
        """Admit a command idempotently; only the admission that creates it launches it.

        `isolation` is "auto" (every protection this machine gives; the receipt names any
        missing), "strict" (refused unless every one is available) or "none"; `user` runs the
        command as another uid/gid (default: the task's, else the caller's). The command
        sees the system's directories read-only, its workspace, its task's own /tmp,
        /var/tmp, /dev/shm and HOME, and nothing else of the host but the `writable` and
        `readable` grants (its own and its task's; settled.grants refuses a grant of `/`, of
        the home, of another task's workspace or of a store directory). `memory` (bytes),
        `pids` and `cpus` limit it (else its task's defaults, else the host's); `network`
        is "proxy" (the default: its task's own network namespace, whose one way out is the
        home's proxy, which records each connection in the session's ledger), "none" (its
        task's own loopback only) or "host" (the host's network, which its receipt names),
        else its task's default; `allow_hosts` (netpolicy patterns, else its task's) limits
        where the proxy lets it go. A command run inside a task's command sandbox has the
        sandbox's network ("host" for settled). The proxy's variables (HTTP_PROXY...) are in
        its env and digest. Refused
        (SpaceExhausted) while the home's filesystem is below its reserve.

        The command's environment is the base (PATH, HOME, LANG) overlaid by `inherit` (names
        taken from this process's environment) or all of it with `inherit_env` (less
        settled's own variables and the home's credentials, named in `env_removed`), then
        `env`; `inherited` names variables of `env` a remote caller took from its own. All of
        it is in the digest (settled.environment)."""
        from settled.environment import STANDARD_PATH, base_environment, compose, path_in_view
        from settled.identity import (
            DEFAULT_GRACE_S,
            CommandSpec,
            new_key,
            normalize_env,
            resolve_cwd,
        )

        grammar.optional_key("key", request.key)
        timeout = (
            request.timeout or None
        )  # 0 is no limit, as timeout(1) reads it: one rule, every face
        if request.stdin is not None and not isinstance(request.stdin, bytes):
            raise BadInput(f"stdin must be bytes, not {type(request.stdin).__name__}")
        record = self.store.get_task(grammar.check_id("task", task))
        self._on_this_host(record, "exec")
        run_as = _resolve_user(request.user) or record.user
        defaults = record.defaults or {}
        limits = _limits(request.memory, request.pids, request.cpus, defaults)
        granted = {}
        for kind, asked in (("writable", request.writable), ("readable", request.readable)):
            granted[kind] = grants.resolve(kind, [*asked, *defaults.get(kind, ())])
            self._refuse_held(kind, granted[kind], record.workspace)
        enters = bool((record.sandbox or {}).get("enter"))
        builds_nothing = enters or request.isolation == "none"  # no namespace to put a proxy in
        chosen_network = (
            request.network or defaults.get("network") or ("host" if builds_nothing else "proxy")
        )
        explicit = dict(normalize_env(request.env or {}))
        if chosen_network == "proxy":  # where the proxy is, unless the command says otherwise
            explicit = {**dict(netpolicy.proxy_env()), **explicit}
        caller = self._caller_env(request.inherit, request.inherit_env)
        if stray := sorted(set(request.inherited) - set(explicit)):
            raise BadInput(f"inherited names {stray} are not in env")
        given = compose(base_environment(run_as and run_as[0]), caller, explicit)
        from_caller = "PATH" in request.inherited or (
            "PATH" in caller.env and "PATH" not in explicit
        )
        if from_caller and not builds_nothing:  # no tool planted in the task's own dirs
            shown = (record.workspace, *granted["writable"], *granted["readable"])
            given["PATH"] = path_in_view(given["PATH"], given.get("HOME"), shown) or STANDARD_PATH
        spec = CommandSpec(
            argv=tuple(request.argv) if request.argv is not None else None,
            shell=request.shell,
            cwd=resolve_cwd(record.workspace, request.cwd),
            env=normalize_env(given),
            stdin_digest=self._keep_stdin(request.stdin) if request.stdin is not None else None,
            timeout=timeout,
            grace=request.grace if request.grace is not None else DEFAULT_GRACE_S,
            boundary=request.boundary,
            service=request.service,
            isolation=request.isolation,
            user=run_as,
            writable=granted["writable"],
            readable=granted["readable"],
            memory=limits["memory"],
            pids=limits["pids"],
            cpus=limits["cpus"],
            network=chosen_network,
            allow_hosts=netpolicy.check_allowed(  # a text is refused, never taken letter by letter
                "allow_hosts",
                tuple(defaults.get("allow_hosts", ()))
                if request.allow_hosts is None
                else request.allow_hosts,
                chosen_network,
            ),
            inherited=(*(n for n in caller.inherited if n not in explicit), *request.inherited),
            env_removed=caller.removed,
        )
        entered = _check_sandbox(spec, record, self._sandbox_name)
        # refuse an impossible boundary before recording
        kind = boundaries.choose(spec.boundary, pid_namespace=not entered)
        if not entered:
            _check_isolation(spec, kind)
        _check_limits(spec)
        key = request.key or new_key()
        while True:
            existing = self.store.find_session(task, key)
            if existing is not None and existing.digest == spec.digest:
                return self._admission(existing, reused=True)  # a retry: nothing to inspect
            with _ADMITTING.turn(self.home, task, key) as first:
                if not first:
                    continue  # this process admitted the key meanwhile: read its answer
                check_reserve(self.home, f"exec in task {task}")  # a retry still gets its session
                self.recovery.detect(task)  # a session whose owner vanished freezes admission
                session, reused = self.store.admit(task, key, spec.digest, spec.to_json())
            break
        if reused:
            return self._admission(session, reused=True)
        try:
            self._ensure_journal(record)  # one request when watched; restarts a lost daemon
            report = self._launch(session.session)
        except BaseException as exc:
            self._unlaunched(session.session, f"{type(exc).__name__}: {exc}")
            raise
        if "error" in report:
            self._unlaunched(session.session, str(report["error"]))
        return self._admission(self.store.get_session(session.session), False, report)

    def view_roots(
        self, task: str, writable: Sequence[str], readable: Sequence[str], isolation: str
    ) -> tuple[str, ...] | None:
        """The host directories a command of `task` would see (the distribution's, its
        workspace, its grants and its task's), or None when it sees the host's whole tree
        (no isolation, or a sandbox of its own): for a person's hint, never a decision."""
        from settled.boundary.viewplan import SYSTEM_ROOTS

        record = self.store.get_task(grammar.check_id("task", task))
        if isolation == "none" or (record.sandbox or {}).get("enter"):
            return None
        defaults = record.defaults or {}
        granted = [
            *writable,
            *readable,
            *defaults.get("writable", ()),
            *defaults.get("readable", ()),
        ]
        return (*SYSTEM_ROOTS, record.workspace, *granted)

    def _unlaunched(self, session: str, why: str) -> None:
        """A launch that failed before any owner was claimed settles its session as never
        started (recovery.settle_unlaunched), so that its task is not frozen for it. A store
        that cannot take the receipt either leaves it as it was: unknown once the launch
        timeout passes, as before; the launch's own error is what the caller is told, so no
        error of this second attempt (a busy or failing store, of either backend) replaces it."""
        with contextlib.suppress(Exception):
            self.recovery.settle_unlaunched(session, why)

    def _caller_env(self, names: Sequence[str], whole: bool) -> CallerEnv:
        """This process's variables for the command, never the home's credentials or any
        value naming the home unless asked for by name. SETTLED_INHERIT names the caller's
        standing `--inherit` list (those unset are skipped)."""
        from settled.environment import CallerEnv, from_caller, standing_inherit

        environ = dict(os.environ)
        standing = [name for name in standing_inherit(environ) if name in environ]
        if not names and not whole and not standing:
            return CallerEnv()
        withheld = credential_names(self.backends, environ)
        withheld += [name for name, value in environ.items() if self.home in value]
        return from_caller([*names, *standing], whole, environ, withheld)

    def _on_this_host(self, record: TaskRecord, verb: str) -> None:
        """WrongHost unless the task's owners run on this host (a task from before hosts
        were recorded is this home's). Reads never ask."""
        if record.host is None or record.host == self.host:
            return
        owner = self.store.get_host(record.host)
        raise WrongHost(record.task, record.host, owner.name if owner else None, self.host, verb)

    def _keep_stdin(self, data: bytes) -> str:
        import hashlib

        from settled.atomic import write_atomic

        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        path = stdin_path(self.home, digest)
        if not os.path.exists(path):
            write_atomic(path, data)
        return digest

    def _admission(
        self, record: SessionRecord, reused: bool, report: dict[str, Any] | None = None
    ) -> Admission:
        if report and "error" in report and record.state != SETTLED:
            raise OwnerLaunchFailed(f"session {record.session}: {report['error']}")
        return Admission(
            session=record.session,
            task=record.task,
            key=record.key,
            digest=record.digest,
            reused=reused,
            state=self.sessions.status_of(record)["state"],
            owner_pid=record.owner.pid if record.owner else None,
            pid=record.command_pid,
            boundary=record.boundary,
        )

    # -- facts ---------------------------------------------------------------------------

    def owner_facts(self, record: SessionRecord) -> OwnerFacts | None:
        return self.sessions.owner_facts(record)

    def session_status(self, session: str) -> dict[str, Any]:
        return self.sessions.status(grammar.check_id("session", session))

    def task_status(self, task: str) -> dict[str, Any]:
        record = self.store.get_task(grammar.check_id("task", task))
        views = [session_status(s, self.owner_facts(s)) for s in self.store.list_sessions(task)]
        view = task_status(record, views)
        if record.state != TASK_OPEN:  # computed from the close's facts, never stored
            explained = self.explain(task)
            view["complete"] = explained["complete"]
            if not explained["complete"]:
                if explained["blocked"]:
                    view["state"] = "blocked"
                view["blocked_on"] = explained["blocked_on"]
                view["why"] = explained["words"]
        return view

    def list_tasks(self, limit: int = 50) -> list[dict[str, Any]]:
        """The newest tasks of the store, newest first, each with its session counts; a task
        that is no longer open says whether its close proved completion (computed, as
        `explain` does, never read from a stored status)."""
        rows = []
        for record in self.store.list_tasks(limit):
            sessions = self.store.list_sessions(record.task)
            row: dict[str, Any] = {
                "task": record.task,
                "key": record.key,
                "state": record.state,
                "workspace": record.workspace,
                "created_at": record.created_at,
                "sessions": len(sessions),
                "live": sum(1 for s in sessions if s.live),
                "host": record.host,
            }
            if record.state != TASK_OPEN:
                row["complete"] = self.explain(record.task)["complete"]
            rows.append(row)
        return rows

    def task_ids(self, limit: int = 50) -> list[str]:
        """The newest ``limit`` tasks' ids, newest first: one read of the store, no session
        or close read (what the live view of /ui lists before it reads the tasks it must)."""
        grammar.check_int("limit", limit, 1, grammar.MAX_CURSOR)
        return [record.task for record in self.store.list_tasks(limit)]

    def wait(self, session: str, timeout: float | None = None) -> dict[str, Any]:
        """Block until the session has a receipt (or is unknown); the session's clock, not ours.
        Raises NotSettled when `timeout` passes first; the session goes on."""
        grammar.check_id("session", session)
        return self.sessions.wait(session, grammar.optional_seconds("timeout", timeout, MAX_WAIT))

    @contextlib.contextmanager
    def pauses(self, session: str) -> Iterator[Callable[[float], None]]:
        """A sleep for whoever follows the session's output, `pause(seconds)`: it wakes at once
        when a byte is stored in the session's log (an inotify watch, log/watch.py) and when
        the session's owner exits, so a relay sees output and the end of a command then, not
        at a poll (sessions.pauses); `seconds` bounds it. Where neither can be watched, it polls."""
        from settled.log.watch import LogWatch  # ctypes only once a follower first waits

        watch = LogWatch(session_dir(self.home, grammar.check_id("session", session)))
        try:
            with self.sessions.pauses(session, wake=watch) as pause:
                yield pause
        finally:
            watch.close()

    def cancel(self, session: str, reason: str = "cancel requested") -> dict[str, Any]:
        """Ask the owner to stop the session (TERM, grace, KILL over the whole boundary)."""
        reason = grammar.check_text("reason", reason, grammar.MAX_REASON_BYTES)
        grammar.check_id("session", session)
        self._on_this_host(self.store.get_task(self.store.get_session(session).task), "cancel")
        return self.sessions.cancel(session, reason)

    # -- close, explain, restore ---------------------------------------------------------

    @_on_disk("close")
    def close_task(
        self, task: str, final: str | None = None, deadline: float | None = None
    ) -> CloseResult:
        """Run (or resume) the close join; a repeated close returns the same receipt."""
        grammar.check_id("task", task)
        grammar.optional_text("final", final, grammar.MAX_FINAL_BYTES)
        deadline = grammar.optional_seconds("deadline", deadline, grammar.MAX_DEADLINE_S)
        record = self.store.get_task(task)
        if record.state != TASK_COMPLETE:  # a complete task's receipt is read from anywhere
            self._on_this_host(record, "close")
        return self._close_join(task, final, deadline).run()

    def _close_join(
        self, task: str, final: str | None = None, deadline: float | None = None
    ) -> CloseJoin:
        from settled.boundary.pod import LocalPods
        from settled.close.join import CloseJoin

        pods = LocalPods(self.home)
        return CloseJoin(self.store, self.workspace, self.sessions, task, final, deadline, pods)

    @_on_disk("recover")
    def recover(self, task: str | None = None) -> list[dict[str, Any]]:
        """Inspect every session whose owner is gone; settle those with evidence (rule 4)."""
        if task is not None:
            self._on_this_host(self.store.get_task(grammar.check_id("task", task)), "recover")
        return self.recovery.recover(task)

    @_on_disk("recover --host")
    def recover_host(self, host: str) -> dict[str, Any]:
        """Declare another host gone for good: freeze its tasks (never a relaunch), mark its
        unsettled sessions unknown, and settle those its sandbox provider proves dead."""
        host = grammar.check_id("host", host)
        if host == self.host:
            raise BadInput(f"host {host} is this host: `settled recover` inspects its sessions")
        why = f"host {host} was declared vanished from host {self.host}"
        frozen = self.store.vanish_host(host, why)
        results = [
            self.recovery.recover_vanished(record, why)
            for task in frozen
            for record in self.store.list_sessions(task)
            if record.state != SETTLED
        ]
        return {"host": host, "frozen_tasks": frozen, "sessions": results}

    def hosts(self) -> list[dict[str, Any]]:
        """Every host of the store, and which one this is."""
        return [{**h.to_json(), "this": h.host == self.host} for h in self.store.hosts()]

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
            task, source="sandbox-destroyed", evidence=destroyed.evidence
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

    @_on_disk("checkpoint")
    def checkpoint(self, task: str, *, incremental: bool = True) -> dict[str, Any]:
        """Checkpoint an open task's workspace now (the close always does its own full scan)."""
        task = grammar.check_id("task", task)
        return self.workspace.checkpoint_now(self.store.get_task(task), incremental=incremental)

    def explain(self, task: str) -> dict[str, Any]:
        """Computed from the close's recorded facts alone (close.decide), so reading it costs
        no close join and no workspace."""
        from settled.close.decide import explain
        from settled.close.facts import read_close_facts

        return explain(read_close_facts(self.store, grammar.check_id("task", task)))

    def clocks(self, task: str, limit: int = 50) -> dict[str, Any]:
        """The four clocks of the task's newest ``limit`` sessions and the task's close receipt
        (settled.clocks), computed from the same recorded facts as ``explain``, with each live
        session's owner observed now (a dead owner shows its session unknown, never failed)."""
        from settled.clocks import task_clocks
        from settled.close.facts import read_close_facts

        facts = read_close_facts(self.store, grammar.check_id("task", task))
        grammar.check_int("limit", limit, 1, grammar.MAX_CURSOR)
        owners = {s.session: self.owner_facts(s) for s in facts.sessions if s.live}
        return task_clocks(facts, owners, limit)

    def exit_handle(self, session: str) -> int | None:
        """A handle (a pidfd) that becomes readable when the live session's owner exits, or
        None (no owner yet, an owner on another host, or none alive). The owner writes its
        receipt before it exits, so whoever wakes on it reads the receipt; an owner that dies
        without one wakes it too, and the status then says unknown. Close it with
        ``close_exit_handle``."""
        return self.sessions.exit_handle(grammar.check_id("session", session))

    def close_exit_handle(self, handle: int) -> None:
        self.sessions.liveness.close_handle(handle)

    def await_change(self, topics: tuple[str, ...], seconds: float) -> None:
        """Block until the store may have changed for one of ``topics`` (task or session ids;
        ``"*"``: anything) or ``seconds`` pass: a wakeup where the store notifies (PostgreSQL),
        a bounded sleep where it does not (SQLite). Spurious wakeups happen: read again."""
        self.store.await_change(topics, grammar.check_seconds("seconds", seconds, MAX_WAIT))

    def restore(self, target: str, dest: str, *, same_owner: bool = False) -> RestoreResult:
        """Rebuild a task's last checkpoint (or a manifest id) into an empty directory that is
        not (and is not under) a symlink. Every entry is the caller's and set-id bits it has
        not earned are dropped, unless ``same_owner`` (root only) restores every recorded owner."""
        from settled.workspace.restore import restore

        grammar.check_text("target", target, grammar.MAX_KEY_BYTES, 1)
        grammar.check_path("dest", dest)
        manifest = target
        if target.startswith("t_"):
            latest = self.store.latest_checkpoint(self.store.get_task(target).task)
            if latest is None:
                raise BadInput(f"task {target} has no checkpoint yet: close it first")
            manifest = latest[0]["manifest"]
        return restore(self.workspace.objects, manifest, dest, same_owner=same_owner)

    def verify(self, target: str, *, read_data: bool = False) -> dict[str, Any]:
        """Check everything a task's last checkpoint (or a manifest id) reaches, like ``restic
        check``: the manifest and every tree re-hashed and parsed, every blob present at its
        size, or with ``read_data`` re-hashed. Nothing is trusted and nothing is repaired;
        ``verified`` is False and ``problems`` names each object (and its paths) otherwise."""
        from settled.workspace.hashing import parse_digest
        from settled.workspace.verify import verify_manifest

        grammar.check_text("target", target, grammar.MAX_KEY_BYTES, 1)
        task = None
        if target.startswith("t_"):
            task = self.store.get_task(target).task
            latest = self.store.latest_checkpoint(task)
            if latest is None:
                raise BadInput(f"task {target} has no checkpoint yet: checkpoint or close it")
            manifest = str(latest[0]["manifest"])
        else:
            manifest = target
            try:
                parse_digest(manifest)
            except SettledError:
                raise BadInput(
                    f"{target!r} is neither a task (t_...) nor a manifest id (<algo>:<hex>)"
                ) from None
            if not self.workspace.objects.has(manifest):
                raise BadInput(
                    f"unknown manifest {manifest}: not in {self.workspace.objects.location}"
                )
        result = verify_manifest(
            self.workspace.objects, manifest, read_data=read_data, record=self.workspace.verified
        )
        return {"task": task, **result.to_json()}

    # -- output --------------------------------------------------------------------------

    def final_cursor(self, session: str, stream: str) -> int | None:
        """The stream's final cursor once the session settled; None while it may still grow."""
        record = self.store.get_session(_session_stream(session, stream))
        if record.receipt is not None:
            return int(record.receipt["output"][stream]["cursor"])
        if not record.live:
            from settled.log.reader import stored_length

            return stored_length(log_path(self.home, session, stream))
        return None

    def read(self, session: str, stream: str, start: int = 0, size: int = 1 << 20) -> bytes:
        """Up to ``size`` stored bytes of the stream from cursor ``start`` (CursorOutOfRange
        past what is stored)."""
        grammar.check_cursor("start", start)
        grammar.check_int("size", size, 1, grammar.MAX_CURSOR)
        from settled.log.reader import read_range

        final = self.final_cursor(_session_stream(session, stream), stream)  # bounds the read
        return read_range(self._log_file(session, stream), start, size, final)

    def follow(
        self, session: str, stream: str, start: int = 0, timeout: float | None = None
    ) -> Iterator[bytes]:
        """The stream from cursor ``start`` as it grows, ending exactly at its final cursor;
        ``timeout`` bounds the whole follow (TimeoutError names the cursor reached)."""
        from settled.log.reader import follow

        grammar.check_cursor("start", start)
        timeout = grammar.optional_seconds("timeout", timeout, MAX_WAIT)
        self.store.get_session(_session_stream(session, stream))
        path = self._log_file(session, stream)
        final = functools.partial(self.final_cursor, session, stream)
        return self._woken(session, lambda pause: follow(
            path, start, final, timeout=timeout, sleep=pause,
            poll_interval=WAKE_BOUND_S))  # fmt: skip

    def _merged_limits(self, session: str) -> tuple[dict[str, int], bool]:
        """The cursors each stream may be served to in the merged view, and whether final
        (settled or recovered: the receipt's cursors, so never past what recovery proved)."""
        finals = {name: self.final_cursor(session, name) for name in ("stdout", "stderr")}
        if all(v is not None for v in finals.values()):
            return {k: int(v or 0) for k, v in finals.items()}, True
        from settled.log.reader import stored_length

        now = {n: stored_length(log_path(self.home, session, n)) for n in ("stdout", "stderr")}
        return now, False

    def read_merged(self, session: str, start: int = 0, size: int = 1 << 20) -> list[Chunk]:
        """Up to ``size`` bytes of both streams in the order the owner stored them, from
        merged cursor ``start`` (a byte offset into the merged view), as chunks tagged with
        stream, stream cursor and merged cursor. A chunk with ``ordered`` False is a tail the
        index did not cover (an old session without one: stdout then stderr). While the
        session runs, only the ordered prefix is served, so every merged cursor resumes."""
        from settled.log import interleave

        grammar.check_cursor("start", start)
        grammar.check_int("size", size, 1, grammar.MAX_CURSOR)
        self.store.get_session(session)
        limits, final = self._merged_limits(session)
        directory = session_dir(self.home, session)
        if not final:
            limits = interleave.ordered_limits(directory, limits)
        return interleave.read_merged(directory, limits, start, size)

    def follow_merged(
        self, session: str, start: int = 0, timeout: float | None = None
    ) -> Iterator[Chunk]:
        """The merged view from merged cursor ``start`` as it grows, ending at both final
        cursors; ``timeout`` bounds the whole follow."""
        from settled.log import interleave

        grammar.check_cursor("start", start)
        timeout = grammar.optional_seconds("timeout", timeout, MAX_WAIT)
        self.store.get_session(session)
        directory = session_dir(self.home, session)
        limits = functools.partial(self._merged_limits, session)
        return self._woken(session, lambda pause: interleave.follow_merged(
            directory, limits, start, timeout=timeout, sleep=pause,
            poll_interval=WAKE_BOUND_S))  # fmt: skip

    def _woken(
        self, session: str, make: Callable[[Callable[[float], None]], Iterator[_T]]
    ) -> Iterator[_T]:
        """A follow whose pauses end when a byte is stored or the session's owner exits
        (checked eagerly by the caller; this generator only runs it), so new bytes and the end
        of a stream are seen at once."""
        with self.pauses(session) as pause:
            yield from make(pause)

    def view(self, session: str, stream: str, budget: int) -> str:
        """The model view of everything stored of the stream, within ``budget`` UTF-8 bytes,
        its marker naming the omitted range as ``settled logs --from`` reads it."""
        grammar.check_int("budget", budget, 0, grammar.MAX_BUDGET)
        return self.window(_session_stream(session, stream), stream, 0, budget)[0].text

    def window(
        self, session: str, stream: str, cursor: int, budget: int, *, marker: str | None = None
    ) -> tuple[Window, bool]:
        """The model view of the stream from ``cursor`` to what exists now (its final cursor
        once settled, else the bytes stored), within ``budget`` UTF-8 bytes; and whether that
        end is the final cursor. ``marker`` words the line naming the omitted range (a
        template over stream, a, b, n and session; default ``log.view.MARKER``). Reads at
        most ``2 * budget`` bytes; a cursor past the end raises CursorOutOfRange."""
        from settled.log.reader import stored_length
        from settled.log.view import MARKER, read_window

        grammar.check_cursor("cursor", cursor)
        grammar.check_int("budget", budget, 0, grammar.MAX_BUDGET)
        final = self.final_cursor(session, stream)
        path = self._log_file(session, stream)
        end = final if final is not None else stored_length(path)
        view = read_window(path, cursor, end, budget, stream, session, marker=marker or MARKER)
        return view, final == end

    def _log_file(self, session: str, stream: str) -> str:
        """Where the stream's bytes are read: the home's log, else (a session of another
        host, or a home rebuilt) its sealed copy, rebuilt here and checked by hash first."""
        path = log_path(self.home, session, stream)
        if os.path.exists(path):
            return path
        record = self.store.get_session(session)
        fact = (record.receipt or {}).get("output", {}).get(stream, {})
        sealed = fact.get("sealed")
        if not isinstance(sealed, dict) or "chunks" not in sealed:
            host = self.store.get_task(record.task).host
            if host not in (None, self.host):
                raise LogElsewhere(session, stream, host)
            return path  # this home's, not written yet: an empty stream so far
        from settled.log.seal import fetch_sealed

        dest = os.path.join(self.home, "sealed", session, stream)
        return fetch_sealed(self.workspace.objects, sealed, str(fact["digest"]), dest)

    def stream_log(self, session: str, stream: str) -> StreamLog:
        """The session's ``stream`` log ("stdout" or "stderr"), to read by cursor without a
        Runtime: its reads touch only the file, so an async streamer can poll it from worker
        threads that hold no store. The session is not looked up here."""
        from settled.log.reader import StreamLog as StreamLog  # the type of stream_log()

        _session_stream(session, stream)
        return StreamLog(log_path(self.home, session, stream), stream)

    def task_record(self, task: str) -> TaskRecord:
        """The task as recorded (UnknownTask if there is none): what a face checks a caller's
        scope against, or shows."""
        return self.store.get_task(grammar.check_id("task", task))

    def session_record(self, session: str) -> SessionRecord:
        """The session as recorded (UnknownSession if there is none); its state is the
        stored one, not the status projection ``session_status`` computes."""
        return self.store.get_session(grammar.check_id("session", session))


def ready_home(home: str | None = None) -> str:
    """The settled home ``home`` names (None: SETTLED_HOME, else home.default_home) as an
    absolute path, created private if missing; HomeUnusable if it cannot hold the store, the
    logs and the objects. What a Runtime opens, for a face that checks it before making any."""
    return prepare_home(resolve_home(home))
