"""The launcher's half of starting an owner: prepare, claim for it, hand over its orders.

A fresh owner is a new interpreter: ~7-10 ms before it can run a line, and the store, the
records and the isolation planner cost it as much again to import. The launcher (in the caller's
process, where all of that is loaded) does the owner's first steps instead, while the owner's
interpreter starts:

1. `prepare`: read the session, its task and its spec; choose the boundary, plan the isolation
   (with the task's pod, found or made: boundary/podhost.py) and create what lives outside the
   owner's process (the session's cgroup, made ahead of need: named for its session, so
   recovery finds it, and never shared);
2. the owner says its pid (its first line on the readiness pipe), and `claim_for` makes the
   claim for that process: the compare-and-set with its pid, start time, boot id and lease, and
   the boundary and isolation recorded in the same write (one fsync before anything runs);
3. only then, `orders`: what the owner needs to start the command, through a pipe only it
   holds (marshal: the owner has it loaded). An owner that gets no orders (EOF) runs nothing;
4. the owner reports that its command runs, and `record_running` records the pid and the
   boundary's final ref (not fsynced: a pid means nothing after a power cut).

A lost claim (recovery fenced the session meanwhile, another launch won) discards what
`prepare` made. The claim still names the owner's process and its lease, so everything after
it (heartbeats, receipt, recovery when the owner dies) is the same as when the owner claimed
for itself; the fault point `owner.after_claim` is the owner's first step once it has orders.
Must never: send orders without a successful claim, or claim for a process other than the
owner that reported.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import time

from settled import boundary as boundaries
from settled import faults
from settled.backends import bound_backends
from settled.boundary import limits, poddirs, podhost, procfs
from settled.boundary.isolation import (
    IsolationPlan,
    IsolationUnavailable,
    isolation_facts,
    make_plan,
)
from settled.boundary.viewplan import is_within
from settled.errors import BoundaryUnavailable, StaleWrite
from settled.helper_process import NoReport, ReportReader
from settled.home import last_words_path, log_path, read_home_id, session_dir, stdin_path
from settled.identity import CommandSpec
from settled.log.interleave import index_path
from settled.owner.lease import lease_seconds
from settled.records import OwnerInfo, SessionRecord, TaskRecord
from settled.store import Store

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

ORDERS_VERSION = 1
CD_AND_EXEC = 'cd -- "$0" && exec "$@"'  # an enter may start in the sandbox's root


def sandbox_entry(task: TaskRecord) -> dict[str, Any] | None:
    """The task's command sandbox (provider, id, enter prefix), or None when its commands run
    on this host (the local sandbox, or a task made before sandboxes were recorded)."""
    facts = task.sandbox
    if not facts or not facts.get("enter"):
        return None
    return {
        "provider": facts.get("provider"),
        "sandbox": facts.get("sandbox"),
        "enter": list(facts["enter"]),
    }


def entered(sandbox: dict[str, Any] | None, cwd: str, argv: list[str]) -> list[str]:
    """What the owner executes: the command itself, or inside a command sandbox its enter
    prefix, then /bin/sh entering `cwd` there and exec-ing the command (the digest stays the
    command's own)."""
    if sandbox is None:
        return argv
    return [*sandbox["enter"], "/bin/sh", "-c", CD_AND_EXEC, cwd, *argv]


_BACKEND_DIRS: dict[str, tuple[str, ...]] = {}


def backend_dirs(home: str) -> tuple[str, ...]:
    """The directories of the home's store and objects when they lie outside the home (two
    homes on one `--store sqlite:///...`): covered like another task's workspace wherever a
    root of the command's view holds them. Read once per home and process (a home's binding
    never changes)."""
    if home not in _BACKEND_DIRS:
        bound = bound_backends(home)
        found = []
        if bound.store_scheme == "sqlite":
            found.append(os.path.dirname(os.path.realpath(bound.store[len("sqlite://") :])))
        if bound.objects_scheme == "file":
            found.append(os.path.realpath(bound.objects[len("file://") :]))
        real = os.path.realpath(home)
        _BACKEND_DIRS[home] = tuple(d for d in found if not is_within(d, real))
    return _BACKEND_DIRS[home]


class Prepared:
    """One session, ready to be claimed: its boundary made, or why it cannot be."""

    def __init__(self, store: Store, home: str, record: SessionRecord, launched_at: float) -> None:
        self.home, self.record, self.launched_at = home, record, launched_at
        self.task = store.get_task(record.task)
        self.spec = CommandSpec.from_json(record.spec)
        self.sandbox = sandbox_entry(self.task)
        self.kind: str | None = None
        self.plan: IsolationPlan | None = None
        self.boundary: boundaries.Boundary | None = None
        self.failure: tuple[str, str, str] | None = None  # (reason, stage, error)
        self.claimed_at = 0.0
        self.claimed: SessionRecord | None = None
        explicit, task_defaults = asked_limits(self.spec, self.task)
        self.limits = limits.effective(explicit, limits.defaults()["session"], task_defaults)

    def make(self, store: Store) -> None:
        """Choose the boundary, plan the isolation, create the boundary (not yet recorded)."""
        try:
            self.kind = boundaries.choose(self.spec.boundary, pid_namespace=self.sandbox is None)
            self.plan = self._plan(store, self.kind)
            boundary = boundaries.make(self.kind, self.record.task, self.record.session, self.plan)
            boundary.create()
            self.boundary = boundary
            self._serve_proxy(self.plan, self.kind)
        except BoundaryUnavailable as exc:
            self.failure = ("not_started", "boundary", str(exc))
        except IsolationUnavailable as exc:
            self.failure = ("not_started", "isolation", str(exc))
            self.discard()  # made before the proxy refused it
        if self.failure is None:
            self.failure = self._limit_v2()

    def _serve_proxy(self, plan: IsolationPlan, kind: str) -> None:
        """`--network proxy`: the home's proxy serves the session before it is claimed (its
        task's listener made, its ledger opened, its patterns kept). The proxy knows whose a
        connection is by the session's cgroup v2: a boundary without one gets no proxy (under
        `auto` with no pattern asked, the host's network, its receipt saying why; else
        refused), as a plan without a pod got none (podhost.attach)."""
        if plan.network != "proxy":
            return
        if "cgroup2" not in kind:
            why = (f"--network proxy: the boundary {kind} has no cgroup v2 of the session's, "
                   "by which the proxy tells whose each connection is")  # fmt: skip
            if plan.policy != "auto" or self.spec.allow_hosts:
                raise IsolationUnavailable(why)
            podhost.without_network(plan, why)
            return
        from settled.netproxy.lifecycle import ProxyUnavailable, serve

        try:
            serve(self.home, self.record.task, self.record.session, self.spec.allow_hosts)
        except (ProxyUnavailable, OSError) as exc:
            raise IsolationUnavailable(f"--network proxy: {exc}") from None

    def _limit_v2(self) -> tuple[str, str, str] | None:
        """Write the limits of the controllers the v2 hierarchy gives into the session's v2
        cgroup (made here, before the claim); the v1 ones are the owner's placer's. A limit
        asked for explicitly that this host cannot enforce refuses the session."""
        values = {name: fact["value"] for name, fact in self.limits.items()}
        explicit = {n: v for n, v in values.items() if self.limits[n]["source"] == "explicit"}
        why = limits.refusal(explicit)
        if why is None:
            v2 = [c for c, w in limits.controllers().items() if w["version"] == "v2"]
            path = self.boundary.birth_cgroup() if self.boundary is not None else None
            if not v2 or path is None:
                return None
            try:
                limits.enable_v2(os.path.dirname(path), limits.defaults()["ceiling"])
                limits.write_all({c: path for c in v2}, "v2", values)
                return None
            except OSError as exc:
                why = f"writing the limits into {path}: {exc}"
        self.discard()
        return ("not_started", "limits", why)

    def _plan(self, store: Store, kind: str) -> IsolationPlan:
        """What the command may see and do, from facts checked here: this process's
        capabilities (the owner's are the same: it is this process's child, or its
        zygote's), every task's workspace, the paths a server asked to hide."""
        network = getattr(self.spec, "network", "host")
        if self.sandbox is not None:
            if network != "host":
                raise IsolationUnavailable(
                    f"--network {network}: the command runs inside sandbox "
                    f"{self.sandbox['sandbox']}, whose network settled does not build"
                )
            return IsolationPlan(
                self.spec.isolation, no_new_privs=False,
                missing={"all": f"the command runs inside sandbox {self.sandbox['sandbox']} "
                         f"(provider {self.sandbox['provider']}) through its enter command: "
                         "its isolation is the sandbox's, which settled neither builds nor checks"},
            )  # fmt: skip
        uid, gid = self.spec.user if self.spec.user is not None else (None, None)
        pod_dirs = None
        if self.spec.isolation != "none":  # the task's /tmp, /var/tmp, /dev/shm and $HOME
            owner = (os.geteuid() if uid is None else uid, os.getegid() if gid is None else gid)
            try:
                pod_dirs = poddirs.ensure(self.home, self.record.task, *owner)
            except OSError as exc:
                raise IsolationUnavailable(f"the task's pod directories: {exc}") from None
        plan = make_plan(
            self.spec.isolation,
            workspace=self.task.workspace,
            home=self.home,
            other_workspaces=[  # and what else of settled's must stay out of reach
                *(w for w in store.workspaces() if w != self.task.workspace),
                *backend_dirs(self.home),
                *(h.home for h in store.hosts() if h.home != self.home),  # a shared store's
            ],
            hidden_files=store.hidden_paths(),
            pid_namespace=kind in boundaries.PID_NAMESPACE_KINDS,
            uid=uid,
            gid=gid,
            writable=self.spec.writable,
            readable=self.spec.readable,
            pod_dirs=pod_dirs,
            command_home=dict(self.spec.env).get("HOME"),
            workspace_identity=_recorded_root(self.task),
        )
        plan.network = network  # joined by the init, with the pod (podhost.attach, podnet)
        podhost.attach(plan, self.home, self.record.task, fallback=not self.spec.allow_hosts)
        return plan

    def discard(self) -> None:
        """The claim was lost (or never made): remove what `make` created."""
        if self.boundary is not None:
            self.boundary.discard()
            self.boundary = None


def _recorded_root(task: TaskRecord) -> tuple[int, int] | None:
    """The workspace's (dev, ino) recorded at `task new`, which the command's bind must find
    (None: a task made before identities, bound by its path as it was)."""
    identity = task.workspace_identity
    return None if identity is None else (int(identity["dev"]), int(identity["ino"]))


def asked_limits(spec: CommandSpec, task: TaskRecord) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the exec's own limits, the task's defaults), by limit name. The spec holds the limit
    each exec runs under (its own, else its task's default: runtime.exec), so a value equal to
    the task's default is counted as the task's."""
    defaults = {name: (task.defaults or {}).get(name) for name in limits.LIMITS}
    explicit = {
        name: value
        for name in limits.LIMITS
        if (value := getattr(spec, name)) is not None and value != defaults[name]
    }
    return explicit, defaults


def prepare(store: Store, home: str, session: str, launched_at: float) -> Prepared:
    """`launched_at`: when the owner's process was asked for (the receipt's timings)."""
    prepared = Prepared(store, home, store.get_session(session), launched_at)
    prepared.make(store)
    return prepared


def claim_for(
    store: Store, prepared: Prepared, owner_pid: int, start_time: int | None = None
) -> SessionRecord:
    """The claim, for the owner process `owner_pid` (started at `start_time`, read at its spawn,
    else now), with the boundary recorded in the same write. Raises StaleWrite when it is lost."""
    record = prepared.record
    if start_time is None:
        start_time = procfs.start_time(owner_pid)
    owner = OwnerInfo(
        owner_pid,
        start_time or 0,  # 0: gone already, so never alive for liveness
        procfs.boot_id(),
        time.time() + lease_seconds(),
        host=read_home_id(prepared.home),
    )
    if prepared.boundary is None or prepared.plan is None:
        claimed = store.claim(record.session, record.generation, owner)
    else:
        claimed = store.claim(
            record.session,
            record.generation,
            owner,
            boundary=prepared.boundary.kind,
            boundary_ref=prepared.boundary.ref_before_start(owner_pid),
            isolation=isolation_facts(prepared.plan, prepared.sandbox),
        )
    prepared.claimed_at = time.time()
    prepared.claimed = claimed
    return claimed


def orders(prepared: Prepared, claimed: SessionRecord) -> bytes:
    """What the owner needs to start the command (marshal: plain values only)."""
    record, spec, home = prepared.record, prepared.spec, prepared.home
    boundary = prepared.boundary
    cwd = os.path.join(prepared.task.workspace, spec.cwd)
    given = {
        "v": ORDERS_VERSION,
        "session": record.session,
        "task": record.task,
        "generation": claimed.generation,
        "timings": {
            "admitted_at": record.created_at,
            "launched_at": prepared.launched_at,
            "claimed_at": prepared.claimed_at,
        },
        "never_ran": prepared.failure,
        "cancel": claimed.cancel_requested,
        "boundary": prepared.kind if boundary is not None else None,
        "hierarchy": boundary.hierarchy if boundary is not None else None,
        "plan": prepared.plan.fields() if prepared.plan is not None else None,
        "sandbox": prepared.sandbox,
        "limits": {name: fact["value"] for name, fact in prepared.limits.items()},
        "limit_sources": {name: fact["source"] for name, fact in prepared.limits.items()},
        "ceiling": limits.defaults()["ceiling"],
        "argv": entered(prepared.sandbox, cwd, spec.exec_argv),
        "cwd": cwd,
        "env": dict(spec.env),
        "stdin": stdin_path(home, spec.stdin_digest) if spec.stdin_digest else None,
        "session_dir": session_dir(home, record.session),
        "last_words": last_words_path(home, record.session),
        "logs": {
            "stdout": log_path(home, record.session, "stdout"),
            "stderr": log_path(home, record.session, "stderr"),
            "index": index_path(session_dir(home, record.session)),
        },
    }
    return marshal.dumps(given)


def record_running(store: Store, prepared: Prepared, report: dict[str, Any]) -> None:
    """Record the command's pid and the boundary's ref as the owner reported them, as soon as it
    reports (the owner records them too, once its store is open, if this did not happen). A
    session the owner has already settled, or recovery fenced, is left as it is."""
    claimed, boundary = prepared.claimed, prepared.boundary
    if claimed is None or boundary is None:
        return
    with contextlib.suppress(StaleWrite):
        store.record_launch(
            claimed.session,
            claimed.generation,
            boundary.kind,
            report.get("ref"),
            report.get("pid"),
            report.get("start"),
            durable=False,
        )


READ_TIMEOUT_S = 30.0


def hand_over(
    store: Store,
    prepared: Prepared,
    reader: ReportReader,
    orders_fd: int,
    timeout: float,
    spawned: tuple[int, int | None] | None = None,
) -> dict[str, Any]:
    """Steps 2-4 with an owner whose interpreter is starting: its readiness report, or
    {"error": why}. `spawned`: the owner's pid and start time, known from its spawn (a fresh
    owner: the claim is then made while its interpreter starts); else the owner says its pid
    first thing. Closes `orders_fd` (an owner that got no orders exits having run nothing)."""
    owner_pid, start_time = spawned if spawned is not None else (None, None)
    try:
        if owner_pid is None:
            hello = _next(reader, timeout)
            if "owner_pid" not in hello:
                prepared.discard()
                return hello if "error" in hello else {"error": f"unexpected report {hello!r}"}
            owner_pid = int(hello["owner_pid"])
            said = True
        else:
            said = False
        faults.point("launcher.before_claim")
        try:
            claimed = claim_for(store, prepared, owner_pid, start_time)
        except StaleWrite as exc:  # settled meanwhile (never started, found unclaimed): no orders
            prepared.discard()
            return {"error": "claim lost", "detail": str(exc)}
        except BaseException:
            prepared.discard()
            raise
        try:
            _write_all(orders_fd, orders(prepared, claimed))
        except BrokenPipeError:
            return {"error": "the owner exited before it took its orders; see owner.log"}
    finally:
        os.close(orders_fd)
    if not said:
        hello = _next(reader, timeout)
        if hello.get("owner_pid") != owner_pid:
            return hello if "error" in hello else {"error": f"unexpected report {hello!r}"}
    report = _next(reader, timeout)
    if report.get("state") == "running":
        record_running(store, prepared, report)
        return {k: report[k] for k in ("state", "owner_pid", "pid", "boundary") if k in report}
    return report


def _next(reader: ReportReader, timeout: float) -> dict[str, Any]:
    try:
        report = reader.next(time.monotonic() + timeout)
    except NoReport as exc:
        if exc.why == "timeout":
            return {"error": f"the owner did not report within {timeout:.0f} s"}
        return {"error": "the owner exited before it reported; see owner.log"}
    except ValueError as exc:
        return {"error": f"the owner's report is not JSON: {exc}"}
    return report if isinstance(report, dict) else {"error": f"bad report {report!r}"}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
