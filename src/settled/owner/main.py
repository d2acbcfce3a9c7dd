"""Entry point of the session owner process (started by launcher.py with `python -I -S`).

Owns one session from claim to receipt: claim (CAS with pid, start time, boot id and a lease),
boundary, spawn, supervision, evidence, receipt. Imports only the standard library, sqlite3 and
blake3 (about 10 ms of interpreter and ~50 ms of imports here, bench/admission.py); never imports
the CLI, the HTTP stack or anything heavy.
Exit status is for the log only: the receipt in the store is the answer.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

from settled import boundary as boundaries
from settled import faults
from settled.backends import seals_logs
from settled.boundary import procfs
from settled.boundary.isolation import IsolationPlan, IsolationUnavailable, make_plan
from settled.boundary.spawn import ChildIO, Launch, SpawnFailed
from settled.errors import BoundaryUnavailable, StaleWrite, StorageFailed
from settled.home import (
    SpaceGuard,
    journal_socket,
    last_words_path,
    log_path,
    make_session_dir,
    read_home_id,
    stdin_path,
    storage_error,
)
from settled.identity import CommandSpec
from settled.log.flush import FLUSH_ENV, Flusher, flush_every
from settled.log.interleave import IndexWriter, index_path
from settled.log.writer import StreamWriter, enlarge_pipe
from settled.owner.last_words import LastWords
from settled.owner.lease import STALE_BEATS, LeaseKeeper, Renew
from settled.owner.supervise import Outcome, OwnerSignals, Streams, Supervisor
from settled.receipts import exit_fact, not_started_fact, process_receipt
from settled.records import OwnerInfo, SessionRecord, TaskRecord
from settled.store import Store, open_store

LEASE_S = float(os.environ.get("SETTLED_LEASE_S") or 15.0)  # tests shorten it
HEARTBEAT_S = LEASE_S / 5  # five renewals per lease: a starved owner has four to spare
LOG_CAP_ENV = "SETTLED_LOG_CAP"
# "1": splice where the log is out of the command's reach. Off by default: measured slower than
# read + write here (bench/drain.py: the digest must read the bytes back, so no copy is saved).
LOG_SPLICE_ENV = "SETTLED_LOG_SPLICE"


def command_environment(spec: CommandSpec) -> dict[str, str]:
    """Exactly the spec's environment, never the owner's: everything the command sees was
    chosen at admission and is in the command digest (settled.environment)."""
    return dict(spec.env)


def sealed_stdin(data_path: str) -> int:
    """The stored stdin as a sealed memfd: the command reads the bytes but cannot reopen the
    stored copy through /proc/self/fd/0 and change it for the next session that uses it."""
    import fcntl

    fd = os.memfd_create("settled-stdin", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with open(data_path, "rb") as source:
            while chunk := source.read(1 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
        seals = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


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


class Ready:
    """The launcher's readiness pipe: one JSON line once the command runs (or cannot)."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        if fd is not None:
            os.set_inheritable(fd, False)

    def send(self, **fields: Any) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):  # the launcher went away; the session goes on
            os.write(self.fd, (json.dumps(fields) + "\n").encode())
        os.close(self.fd)
        self.fd = None


class Owner:
    def __init__(self, store: Store, home: str, record: SessionRecord, ready: Ready) -> None:
        self.store, self.home, self.record, self.ready = store, home, record, ready
        self.spec = CommandSpec.from_json(record.spec)
        self.generation = record.generation
        self.timings: dict[str, float] = {"admitted_at": record.created_at}
        self.boundary_kind: str | None = None
        self.plan: IsolationPlan | None = None
        self.sandbox: dict[str, Any] | None = None  # the task's command sandbox, if it has one
        self.streams: Streams | None = None
        self.last_words: LastWords | None = None
        self.store_trouble: str | None = None  # the first renewal the store could not write
        self.lease = LeaseKeeper(self._renewals, stale_after=STALE_BEATS * HEARTBEAT_S)
        self.flusher = Flusher(flush_every(os.environ.get(FLUSH_ENV)))  # fsyncs behind the drain

    # -- the session, start to receipt ---------------------------------------------------

    def run(self) -> int:
        signals = OwnerSignals()
        me = os.getpid()
        claim = OwnerInfo(
            me, procfs.start_time(me) or 0, procfs.boot_id(), time.time() + LEASE_S,
            host=read_home_id(self.home),
        )  # fmt: skip
        try:
            record = self.store.claim(self.record.session, self.generation, claim)
        except StaleWrite as exc:
            self.ready.send(error="claim lost", detail=str(exc))
            return 1
        self.timings["claimed_at"] = time.time()
        faults.point("owner.after_claim")
        cancel = record.cancel_requested or signals.stop_reason
        if cancel:
            return self._never_ran("cancelled", "admission", cancel)
        try:  # before anything runs: a place to say why, should the receipt not fit later
            make_session_dir(self.home, self.record.session)
            self.last_words = LastWords(last_words_path(self.home, self.record.session))
        except OSError as exc:
            typed = storage_error(exc, self.home, "reserving the owner's last words")
            return self._never_ran("not_started", "space", str(typed or exc))
        # Started before the boundary: once this process has unshared a PID namespace for its
        # children, the kernel refuses it any new thread (CLONE_THREAD across PID namespaces).
        # It idles until the supervise loop asks for its first renewal.
        self.lease.start()
        self.flusher.start()  # likewise before the boundary; idle until the streams exist
        try:
            return self._launch(record, signals)
        finally:
            self.lease.close()
            self.flusher.close()

    def _launch(self, record: SessionRecord, signals: OwnerSignals) -> int:
        """From the claimed session to its receipt: boundary, spawn, supervision, settle."""
        me = os.getpid()
        task = self.store.get_task(record.task)
        self.sandbox = sandbox_entry(task)
        try:
            self.boundary_kind = boundaries.choose(
                self.spec.boundary, pid_namespace=self.sandbox is None
            )
            self.plan = self._plan(task, self.boundary_kind)
            boundary = boundaries.make(self.boundary_kind, record.task, record.session, self.plan)
            boundary.setup()
        except BoundaryUnavailable as exc:
            return self._never_ran("not_started", "boundary", str(exc))
        except IsolationUnavailable as exc:
            return self._never_ran("not_started", "isolation", str(exc))
        # Recorded before anything can run inside it, so recovery always knows where to look
        # and what the command could do (a cgroup it could leave is no evidence to recovery).
        self.store.record_launch(
            record.session, self.generation, boundary.kind, boundary.ref, None, None,
            isolation=self._isolation(),
        )  # fmt: skip
        faults.point("owner.after_boundary")
        streams = self.streams = self._open_streams()
        stdin_fd = self._open_stdin()
        out_w, err_w = streams.fds.pop("stdout_w"), streams.fds.pop("stderr_w")
        cwd = os.path.join(task.workspace, self.spec.cwd)
        env = command_environment(self.spec)
        argv = entered(self.sandbox, cwd, self.spec.exec_argv)
        launch = Launch(argv, cwd, env, ChildIO(stdin_fd, out_w, err_w), self.plan)
        started = time.monotonic()
        self.timings["spawned_at"] = time.time()  # the wall-clock twin of `started`
        try:
            pid = boundary.start(launch)
        except SpawnFailed as exc:
            for fd in (stdin_fd, out_w, err_w):
                os.close(fd)
            boundary.await_empty(5.0)
            boundary.teardown()
            return self._never_ran("not_started", exc.stage, str(exc), streams)
        # fork, boundary, isolated view, privileges and exec, until exec is known to succeed
        self.timings["spawn_s"] = round(time.monotonic() - started, 6)
        for fd in (stdin_fd, out_w, err_w):
            os.close(fd)
        self.store.record_launch(
            record.session,
            self.generation,
            boundary.kind,
            boundary.ref,
            pid,
            procfs.start_time(pid),
        )
        faults.point("owner.after_spawn")
        self.ready.send(state="running", owner_pid=me, pid=pid, boundary=boundary.kind)
        supervisor = Supervisor(
            boundary,
            streams,
            timeout=self.spec.timeout,
            grace=self.spec.grace,
            lease=self.lease,
            heartbeat_every=HEARTBEAT_S,
            signals=signals,
            settling=self._settle_begin,
        )
        try:
            outcome = supervisor.run(started)
        except StaleWrite as exc:
            # Fenced: recovery took this session over (we were stopped or starved past our
            # lease). Its boundary, log and receipt are recovery's now; touch nothing, leave.
            print(f"owner fenced, exiting without a receipt: {exc}", file=sys.stderr)
            return 3
        boundary.teardown()
        return self._settle(outcome, streams)

    # -- pieces --------------------------------------------------------------------------

    def _settle_begin(self) -> None:
        """Record that the session is settling. A disk that refuses it does not stop the owner:
        the receipt settles a running session as well (states.py), and draining matters more."""
        try:
            self.store.settle_begin(self.record.session, self.generation)
        except StorageFailed as exc:
            self.store_trouble = self.store_trouble or str(exc)

    def _open_streams(self) -> Streams:
        directory = make_session_dir(self.home, self.record.session)
        cap_text = os.environ.get(LOG_CAP_ENV)
        cap = int(cap_text) if cap_text else None
        space = SpaceGuard(self.home)  # both streams stop storing at the home's reserve
        splice = os.environ.get(LOG_SPLICE_ENV) == "1" and self._log_out_of_reach()
        writers = {
            name: StreamWriter(
                log_path(self.home, self.record.session, name), cap, space, splice=splice
            )
            for name in ("stdout", "stderr")
        }
        fds: dict[str, int] = {}
        for name in ("stdout", "stderr"):
            read_end, write_end = os.pipe2(os.O_CLOEXEC)
            enlarge_pipe(read_end)
            fds[name], fds[f"{name}_w"] = read_end, write_end
        index = IndexWriter(index_path(directory))
        return Streams(fds, writers, index=index, flusher=self.flusher)

    def _log_out_of_reach(self) -> bool:
        """Whether nothing but this owner can write the session's logs while it drains: the
        command's mount namespace hides the home and its PID namespace (with its own /proc)
        hides this process and its descriptors. Only then may a log splice and hash its bytes
        back from the file (log/writer.py); otherwise it hashes what it writes."""
        plan = self.plan
        return (
            plan is not None
            and self.sandbox is None
            and plan.mount_namespace
            and plan.home in plan.hide_dirs
            and plan.private_proc
            and self.boundary_kind in boundaries.PID_NAMESPACE_KINDS
        )

    def _plan(self, task: TaskRecord, kind: str) -> IsolationPlan:
        """What the command may see and do, from facts checked here: this process's
        capabilities, every task's workspace, the paths a server asked to hide."""
        if self.sandbox is not None:
            return IsolationPlan(
                self.spec.isolation, no_new_privs=False,
                missing={"all": f"the command runs inside sandbox {self.sandbox['sandbox']} "
                         f"(provider {self.sandbox['provider']}) through its enter command: "
                         "its isolation is the sandbox's, which settled neither builds nor checks"},
            )  # fmt: skip
        uid, gid = self.spec.user if self.spec.user is not None else (None, None)
        plan = make_plan(
            self.spec.isolation,
            workspace=task.workspace,
            home=self.home,
            other_workspaces=[w for w in self.store.workspaces() if w != task.workspace],
            hidden_files=self.store.hidden_paths(),
            pid_namespace=kind in boundaries.PID_NAMESPACE_KINDS,
            uid=uid,
            gid=gid,
            writable=self.spec.writable,
        )
        if plan.mount_namespace or plan.drop_caps:
            from settled.boundary import linux

            linux.capget()  # loads libc before the fork: the child only calls
        return plan

    def _isolation(self) -> dict[str, Any]:
        """The plan as recorded and receipted, naming the sandbox the command ran inside."""
        assert self.plan is not None
        if self.sandbox is None:
            return self.plan.to_json()
        return {**self.plan.to_json(), "sandbox": self.sandbox}

    def _open_stdin(self) -> int:
        if self.spec.stdin_digest is None:
            return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        return sealed_stdin(stdin_path(self.home, self.spec.stdin_digest))

    @contextlib.contextmanager
    def _renewals(self) -> Iterator[Renew]:
        """Entered in the lease keeper's thread at its first renewal: a store connection of its
        own (a SQLite connection serves one thread), opened by the factory the owner's came from."""
        store = open_store(self.home)
        try:
            yield lambda alive_at: self._heartbeat(store, alive_at)
        finally:
            store.close()

    def _heartbeat(self, store: Store, alive_at: float) -> str | None:
        """Renew the lease from `alive_at` (when the loop asked) and publish the durable cursors.
        Safe beside the loop's appends: `sync` reads a writer's cursor once, and an append moves
        the cursor only after its write returned, so the fsync covers every byte it names."""
        assert self.streams is not None  # the loop asks only once the streams exist
        durable = {name: writer.sync() for name, writer in self.streams.writers.items()}
        if self.streams.index is not None:
            self.streams.index.sync()
        try:
            return store.heartbeat(
                self.record.session,
                self.generation,
                alive_at + LEASE_S,
                durable["stdout"],
                durable["stderr"],
            )
        except StorageFailed as exc:
            # The store's disk refused the renewal: not a reason to stop draining. The lease is
            # not extended, so if this lasts, the session shows unknown (and recovery may fence
            # this owner) exactly as for a starved owner; the next beat tries again.
            self.store_trouble = self.store_trouble or str(exc)
            return None

    def _settle(self, outcome: Outcome, streams: Streams) -> int:
        self.lease.close()  # ended by the supervisor already; no thread outlives the settle
        summaries = streams.close()
        assert outcome.evidence is not None
        terminal_mutation = self._terminal_mutation()
        now = time.monotonic()
        self.timings.update(
            {
                "exited_after_s": round((outcome.exited or now) - outcome.started, 6),
                "evidence_after_exit_s": round(
                    (outcome.evidence_at or now) - (outcome.exited or now), 6
                ),
                "settled_at": time.time(),
            }
        )
        if outcome.stop_decided is not None and outcome.reason in ("timeout", "cancelled"):
            self.timings["stop_to_evidence_s"] = round(
                (outcome.evidence_at or now) - outcome.stop_decided, 6
            )
        elapsed = (outcome.exited - outcome.started) if outcome.exited else None
        receipt = self._receipt(
            death=outcome.evidence.to_json("owner"),
            exit=exit_fact(
                outcome.wait_status,
                outcome.reason,
                shell=self.spec.shell is not None,
                elapsed_s=elapsed,
            ),
            output={
                **self._sealed({name: s.to_json() for name, s in summaries.items()}),
                "drain": "complete" if outcome.drain_complete else "incomplete",
            },
            stragglers=outcome.stragglers,
            terminal_mutation=terminal_mutation,
        )
        faults.point("owner.before_receipt")
        event = "receipt" if outcome.evidence.proven else "lose"
        return self._write_receipt(receipt, event)

    def _write_receipt(self, receipt: dict[str, Any], event: str = "receipt") -> int:
        """Write the receipt; if the disk refuses it, leave the reason in the last words (whose
        block was reserved at claim), so recovery and status can say why this session is
        unknown instead of finding a silent owner."""
        try:
            faults.point("owner.receipt_write")
            self.store.write_receipt(self.record.session, self.generation, receipt, event=event)
        except StorageFailed as exc:
            failure = str(exc)
        except OSError as exc:
            failure = str(storage_error(exc, self.home, "writing the receipt") or exc)
        else:
            return 0
        self.say_last_words(
            f"the owner could not write its receipt: {failure}",
            receipt=receipt["digest"],
            output={
                name: {k: receipt["output"][name].get(k) for k in ("cursor", "dropped")}
                for name in ("stdout", "stderr")
            },
        )
        return 4

    def say_last_words(self, reason: str, **facts: Any) -> None:
        """Record why this owner ends without a receipt (also on its owner.log, if it can)."""
        if self.store_trouble:
            facts.setdefault("store_trouble", self.store_trouble)
        if self.last_words is not None:
            self.last_words.record(reason, **facts)
        with contextlib.suppress(OSError, ValueError):
            print(f"settled owner: {reason}", file=sys.stderr, flush=True)

    def _never_ran(
        self, reason: str, stage: str, error: str, streams: Streams | None = None
    ) -> int:
        """Settle a session whose command never started: its receipt says why, not an exit code."""
        self.lease.close()  # it never renewed; it ends before the receipt all the same
        if streams is None:
            streams = self._open_streams()
        summaries = self._sealed({n: s.to_json() for n, s in streams.close().items()})
        self.timings["settled_at"] = time.time()
        receipt = self._receipt(
            death={
                "boundary": self.boundary_kind,
                "proven": True,
                "evidence": f"the command never started ({stage}): no process of it ever ran",
                "source": "owner",
                "observed": {"stage": stage},
            },
            exit={**not_started_fact(stage, error), "reason": reason},
            output={
                "stdout": summaries["stdout"],
                "stderr": summaries["stderr"],
                "drain": "complete",
            },
            stragglers=[],
            terminal_mutation={"seq": None, "source": "none", "why": "the command never ran"},
        )
        code = self._write_receipt(receipt)
        self.ready.send(state="settled", owner_pid=os.getpid(), error=error)
        return code

    def _sealed(self, facts: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Each stream's fact, with its sealed copy in the object store named when the home's
        objects live outside it (log/seal.py). A seal that fails is named in the fact and
        does not stop the receipt: death and cursors are proven all the same, and the log
        still lies in the home."""
        if not seals_logs(self.home):
            return facts
        from settled.log.seal import seal_stream  # after death: off the launch path
        from settled.workspace.open_objects import open_object_store

        started = time.monotonic()
        try:
            objects = open_object_store(self.home)
            for name, fact in facts.items():
                path = log_path(self.home, self.record.session, name)
                fact["sealed"] = seal_stream(objects, path, fact["cursor"], fact["digest"])
        except BaseException as exc:  # never the receipt's cost: a library's panic is named too
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            for fact in facts.values():
                fact.setdefault("sealed", {"error": f"{type(exc).__name__}: {exc}"})
        self.timings["seal_s"] = round(time.monotonic() - started, 6)
        return facts

    def _terminal_mutation(self) -> dict[str, Any]:
        """The journal's watermark read after death evidence: every write of the session's
        processes completed before it, so each is at or below this sequence number."""
        # imported after evidence, off the launch path
        from settled.workspace.journal import client as journal_client

        return journal_client.terminal_mutation(journal_socket(self.home), self.record.task)

    def _receipt(self, **facts: Any) -> dict[str, Any]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        isolation = (
            {**self._isolation(), "env_removed": list(self.spec.env_removed)}
            if self.plan is not None
            else {"policy": self.spec.isolation, "applied": False,
                  "why": "the command never started, so no isolation was built"}
        )  # fmt: skip
        return process_receipt(
            isolation=isolation,
            session=self.record.session,
            task=self.record.task,
            key=self.record.key,
            command_digest=self.record.digest,
            generation=self.generation,
            owner={
                "pid": os.getpid(),
                "maxrss_kib": usage.ru_maxrss,
                "cpu_s": round(usage.ru_utime + usage.ru_stime, 6),
            },
            timings=self.timings,
            **facts,
        )


OWNER_HOME_ENV = "SETTLED_OWNER_HOME"


def main(argv: list[str] | None = None) -> int:
    """argv: SESSION READY_FD; the home comes in SETTLED_OWNER_HOME, so that it is not on the
    command line, which /proc shows to everyone (a PID namespace's init is a fork of this
    process). Forks once so the launcher can reap the parent at once."""
    session, ready_text = (argv if argv is not None else sys.argv[1:])[:2]
    home = os.environ.pop(OWNER_HOME_ENV)
    if os.fork() != 0:
        os._exit(0)
    return run_session(home, session, int(ready_text) if ready_text != "-" else None)


def run_session(home: str, session: str, ready_fd: int | None) -> int:
    os.chdir("/")
    ready = Ready(ready_fd)
    store = open_store(home)
    owner: Owner | None = None
    try:
        record = store.get_session(session)
        owner = Owner(store, home, record, ready)
        return owner.run()
    except BaseException as exc:
        ready.send(error=f"owner failed: {exc!r}")
        if owner is not None and not isinstance(exc, SystemExit | KeyboardInterrupt):
            owner.say_last_words(f"the owner failed: {exc!r}")
        raise
    finally:
        if owner is not None and owner.last_words is not None:
            owner.last_words.close()
        store.close()


if __name__ == "__main__":
    sys.exit(main())
