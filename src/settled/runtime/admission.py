"""Admission (rule 1): validate everything first, record the session with a conditional insert,
and launch an owner only for the admission that created it. Everything after admission belongs
to the owner; the Runtime only reads facts and asks the owner to act.

Owns: `Runtime.admit` (and `exec`, its keyword form): the command spec an `ExecRequest` asks
for in its task (grants, limits, network, environment, stdin kept by digest), the refusals of
what this host or the task's sandbox could not honour, the key's admission through the store,
and the launch. Must never: record anything before every refusal that could apply ran, or
launch an owner for an admission that reused a session (a retry whose session no owner claimed
within the bound gets it settled never started: DESIGN.md, admission).
"""

from __future__ import annotations

import _thread
import contextlib
import os

from settled import boundary as boundaries
from settled import grammar, grants, netpolicy
from settled.backends import credential_names
from settled.errors import BadInput, OwnerLaunchFailed
from settled.home import check_reserve, stdin_path
from settled.records import Frozen, SessionRecord
from settled.recovery_decide import never_claimed
from settled.runtime.composition import Composition, _on_disk
from settled.runtime.refusals import (
    check_isolation,
    check_limits,
    check_sandbox,
    limits_of,
    resolve_user,
)
from settled.states import SETTLED
from settled.store.admission import REUSE, enforce, key_verdict

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from typing import Any

    from settled.environment import CallerEnv
    from settled.requests import ExecRequest


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


class Admissions(Composition):
    """The Runtime's admission of commands."""

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
        run_as = resolve_user(request.user) or record.user
        defaults = record.defaults or {}
        limits = limits_of(request.memory, request.pids, request.cpus, defaults)
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
        entered = check_sandbox(spec, record, self._sandbox_name)
        # refuse an impossible boundary before recording
        kind = boundaries.choose(spec.boundary, pid_namespace=not entered)
        if not entered:
            check_isolation(spec, kind)
        check_limits(spec)
        key = request.key or new_key()
        while True:
            existing = self.store.find_session(task, key)  # a retry, or KeyConflict, first:
            if enforce(key_verdict(existing, key, spec.digest)) == REUSE:  # nothing paid yet
                assert existing is not None
                return self._reused(existing)  # a retry: nothing to inspect
            with _ADMITTING.turn(self.home, task, key) as first:
                if not first:
                    continue  # this process admitted the key meanwhile: read its answer
                check_reserve(self.home, f"exec in task {task}")  # a retry still gets its session
                self.recovery.detect(task)  # a session whose owner vanished freezes admission
                session, reused = self.store.admit(task, key, spec.digest, spec.to_json())
            break
        if reused:
            return self._reused(session)
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

    def _reused(self, record: SessionRecord) -> Admission:
        """A retry's answer: the key's one session, never launched again (only the admission
        that created it launches it). One that no owner claimed within the claim bound (its
        launcher is gone) is settled never started first (recovery.settle_unclaimed, the
        compare-and-set a late launcher loses): the retry answers that receipt, whose
        `not_started` says why, and never a session that would never run. Within the bound its
        launch may still be under way: it is answered `admitted`, and a wait on it ends."""
        if never_claimed(record) and self.recovery.settle_unclaimed(record.session):
            record = self.store.get_session(record.session)
        return self._admission(record, reused=True)

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
