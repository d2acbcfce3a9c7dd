"""load: 200 concurrent sessions of 1 MiB each under a retry storm of 10 duplicates per key.

One task, one workspace. Each of the N keys gets D admissions of the same command with the same
key, fired together (a per-key barrier) from a pool of T threads, each thread with its own
Runtime (one store connection): N*D admissions, of which exactly N may launch. Variants, one
after another: the fresh launcher (a new interpreter per owner), the warm launcher with a zygote
per Runtime, one warm launcher shared by every Runtime of the process, and the home's zygote that
every process of the home shares (owner/home_launcher.py: what a CLI user gets).
Every command appends one line to `launches/<key>` in the workspace, then blocks on a shared
flock gate the benchmark holds, so all N sessions are alive at once; once every admission has
returned the gate opens, each command writes `yes <key> | head -c 1 MiB` to stdout and, as its
last act, `date +%s.%N` to stderr. Then every session is waited to its receipt and the task is
closed.

Checked: every byte intact (receipt cursor == 1 MiB, receipt digest == blake3 of the expected
bytes, the log read back equals them), exactly one launch per key (one distinct session per
key, reused=False exactly once, one line in its launch file), every session settled with death
evidence (`death.proven`, the boundary recorded) and exit 0, no process or cgroup left.
Measured: admission latency (all, new, reused; and reused from one caller alone), exit-to-receipt
latency from the receipt's timings (exit = `spawned_at + exited_after_s`: when the owner saw the
exit, late under CPU contention; the command's own last stamp is the other anchor), wall times,
the close, the smallest lease slack over the live sessions, and memory: a sampler process reads
/proc every 50 ms for our owner processes (cmdline holds `settled.owner`, environment holds our
mark), their summed RSS and (every 10th sample) summed PSS, plus the receipts'
`owner.maxrss_kib`. No baseline: this is a correctness-under-load test; the latencies are
absolute and depend on the machine's other load (shown in the header).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import queue
import select
import shlex
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from common import (
    BENCH_DIR,
    MARK_ENV,
    MIB,
    await_exit,
    distribution,
    end_process,
    fmt,
    fs_of,
    header,
    kill_marked,
    log,
    machine,
    marked,
    md_table,
    runtime_launchers,
    scratch,
    source_revision,
)

FULL = {"sessions": 200, "duplicates": 10, "threads": 48, "bytes": MIB}
QUICK = {"sessions": 20, "duplicates": 3, "threads": 16, "bytes": MIB}
# variant -> (launcher, one zygote shared by every thread's Runtime); fresh first: what a CLI
# user gets without a home zygote; then a zygote per Runtime; then one zygote for the process
# (Runtime(shared_launcher=)); then the home's zygote (owner/home_launcher.py), the CLI's default
VARIANTS = {
    "fresh": ("fresh", False),
    "warm": ("warm", False),
    "warm-shared": ("warm", True),
    "home": ("home", False),  # the home's zygote, shared by every process (what the CLI uses)
}
VARIANTS_ENV = "SETTLED_LOAD_VARIANTS"  # comma-separated names: run only these
SESSIONS_ENV = "SETTLED_LOAD_SESSIONS"  # another number of keys, for an A/B between quick and full
WAIT_S = 300.0  # one session, gate open to receipt
BARRIER_S = 120.0
CLOSE_DEADLINE_S = 60.0
# A new admission's steps, from the receipt's timings (the caller's and the owner's clocks):
# the caller's admission and launch request; the launcher's queue, fork and the owner's hello;
# the claim (the store's write lock and fsync); its orders; the spawn; the owner's store and loop
STEPS = (
    ("admitted_at", "launched_at"),
    ("launched_at", "owner_at"),
    ("owner_at", "claimed_at"),
    ("claimed_at", "orders_at"),
    ("orders_at", "spawned_at"),
    ("spawned_at", "supervised_at"),
)
ADMISSION_FIELDS = ("key", "dup", "reused", "latency_s", "starts_zygote", "error", "called_at")
PROBES = 20  # reused admissions from one caller, with every session live and with none
SAMPLE_S = 0.05
PSS_EVERY = 10
PAGE = os.sysconf("SC_PAGE_SIZE")


def expected_bytes(key: str, size: int) -> bytes:
    line = (key + "\n").encode()
    return (line * (size // len(line) + 1))[:size]


def command(key: str, size: int, gate: str | None) -> str:
    parts = [f"echo $$ >> launches/{key}"]
    if gate is not None:
        parts.append(f"flock -s {shlex.quote(gate)} true")
    parts += [f"yes {key} | head -c {size}", "date +%s.%N >&2"]
    return " && ".join(parts)


# -- a thread pool whose threads each own a Runtime ---------------------------------------------


class _Job:
    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class RuntimePool:
    """T threads, each with its own Runtime (sqlite connections stay in their thread)."""

    def __init__(self, threads: int, home: str, launcher: str, shared: Any = None) -> None:
        self.home, self.launcher, self.shared = home, launcher, shared
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.ready = threading.Barrier(threads + 1, timeout=60.0)
        self.threads = [
            threading.Thread(target=self._loop, name=f"load-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self.threads:
            thread.start()
        self.ready.wait()  # every Runtime opened before the first admission

    def _loop(self) -> None:
        from settled.runtime import Runtime

        if self.shared is not None:
            rt = Runtime(self.home, shared_launcher=self.shared)
        else:
            rt = Runtime(self.home, launcher=self.launcher)
        try:
            self.ready.wait()
            while True:
                job = self.jobs.get()
                if job is None:
                    return
                try:
                    job.result = job.fn(rt)
                except BaseException as exc:  # reported by the caller, per job
                    job.error = exc
                finally:
                    job.done.set()
        finally:
            rt.close()  # its zygote, if any, exits with it

    def submit(self, fn: Callable[[Any], Any]) -> _Job:
        job = _Job(fn)
        self.jobs.put(job)
        return job

    def close(self) -> int:
        """Drop the jobs not yet started (an interrupted run), stop every thread; returns how
        many did not stop in time."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.error = RuntimeError("cancelled: the benchmark ended")
                job.done.set()
        for _ in self.threads:
            self.jobs.put(None)
        give_up = time.monotonic() + 60.0
        for thread in self.threads:
            thread.join(timeout=max(0.1, give_up - time.monotonic()))
        return sum(thread.is_alive() for thread in self.threads)


def _gather(jobs: list[_Job], timeout: float, what: str) -> None:
    give_up = time.monotonic() + timeout
    for i, job in enumerate(jobs):
        if not job.done.wait(max(0.0, give_up - time.monotonic())):
            raise RuntimeError(f"{what}: job {i} of {len(jobs)} not done after {timeout:.0f} s")


# -- memory sampler -----------------------------------------------------------------------------


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return None


class ProcSampler:
    """Every 50 ms: our owners, zygotes and journal in /proc and their summed RSS (PSS every
    10th sample). Ours = cmdline names a settled helper and the environment carries our mark;
    a zygote and a fresh owner (posix_spawned by its launcher) are children of the benchmark,
    a fork stub is a child of a zygote, a child of an owner is its command's namespace init or
    a fork about to exec the command; stubs and children are left out of the owner sum. Runs in
    its own process (`sample_main`) so the benchmark's 48 threads do not hold it off the GIL."""

    KINDS = ("owner", "zygote", "journal")

    def __init__(self, token: str, bench_pid: int) -> None:
        self.needle = f"{MARK_ENV}={token}".encode()
        self.bench = bench_pid
        self.bench_cmdline = _read(f"/proc/{bench_pid}/cmdline")
        self.kinds: dict[int, str | None] = {os.getpid(): ""}
        self.peak = {k: {"count": 0, "rss": 0, "pss": 0} for k in self.KINDS}
        self.peak_at: dict[str, float] = {}
        self.series: list[tuple[float, int, int]] = []  # (t, owners alive, owners' RSS bytes)
        self.sweep_s: list[float] = []
        self.pss_at_most = (0, 0)  # (owners alive, their summed PSS) at the fullest PSS sample
        self.interval_s: list[float] = []
        self.started = time.monotonic()

    def _classify(self, pid: int) -> str | None:
        cmd = _read(f"/proc/{pid}/cmdline")
        if not cmd:
            return None  # gone, a kernel thread, or caught mid-exec: look again next time
        if b"settled.owner" in cmd:
            kind = "owner"
        elif b"settled.workspace.journal" in cmd:
            kind = "journal"
        else:
            return "" if cmd != self.bench_cmdline else None  # a fork of ours may exec later
        env = _read(f"/proc/{pid}/environ")
        stat = _read(f"/proc/{pid}/stat")
        if env is None or stat is None or self.needle not in env.split(b"\0"):
            return ""
        fields = stat[stat.rindex(b")") + 2 :].split()
        ppid, sid = int(fields[1]), int(fields[3])
        if b"home_launcher" in cmd and pid == sid and self.kinds.get(ppid) != "zygote":
            kind = "zygote"  # the home's: its own session's leader; its forks share its cmdline
        elif kind == "owner" and ppid == self.bench:  # a fresh owner is the caller's own child
            kind = "zygote" if b"settled.owner.zygote" in cmd else "owner"
        elif kind == "owner" and self.kinds.get(ppid) == "zygote":
            kind = "stub"
        elif self.kinds.get(ppid) in ("owner", "journal"):
            kind = "child"  # forked to exec the command (or a helper): not yet exec'd
        return kind

    def sweep(self, with_pss: bool) -> None:
        t0 = time.monotonic()
        seen = set()
        sums = {k: {"count": 0, "rss": 0, "pss": 0} for k in self.KINDS}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            seen.add(pid)
            if pid not in self.kinds:
                kind = self._classify(pid)
                if kind is None:
                    continue
                self.kinds[pid] = kind
            kind = self.kinds[pid]
            if kind not in sums:
                continue
            statm = _read(f"/proc/{pid}/statm")
            if not statm:
                continue
            sums[kind]["count"] += 1
            sums[kind]["rss"] += int(statm.split()[1]) * PAGE
            if with_pss:
                rollup = _read(f"/proc/{pid}/smaps_rollup") or b""
                for line in rollup.splitlines():
                    if line.startswith(b"Pss:"):
                        sums[kind]["pss"] += int(line.split()[1]) * 1024
                        break
        for pid in [p for p in self.kinds if p not in seen]:
            del self.kinds[pid]
        now = t0 - self.started
        for kind, values in sums.items():
            peak = self.peak[kind]
            for name, value in values.items():
                if value > peak[name]:
                    peak[name] = value
                    if kind == "owner" and name == "rss":
                        self.peak_at["owner_rss"] = now
                        self.peak_at["owners_at_rss_peak"] = values["count"]
        if with_pss and sums["owner"]["count"] >= self.pss_at_most[0]:
            self.pss_at_most = (sums["owner"]["count"], sums["owner"]["pss"])
        if self.series:
            self.interval_s.append(now - self.series[-1][0])
        self.series.append((now, sums["owner"]["count"], sums["owner"]["rss"]))
        self.sweep_s.append(time.monotonic() - t0)

    def report(self) -> dict[str, Any]:
        step = max(1, len(self.series) // 400)  # keep the JSON small
        owners, pss = self.pss_at_most
        return {
            "peak": self.peak,
            "peak_at_s": self.peak_at,
            "owners_pss_at_most": {
                "owners": owners,
                "pss": pss,
                "per_owner": pss / owners if owners else 0,
            },
            "samples": len(self.series),
            "sweep_ms": distribution([s * 1e3 for s in self.sweep_s]),
            "interval_ms": distribution([s * 1e3 for s in self.interval_s]),
            "series": [[round(t, 3), n, rss] for t, n, rss in self.series[::step]],
        }


class LeaseWatch:
    """Every 500 ms, the smallest lease slack (lease_until - now) over the live sessions: how
    close an owner starved by the load came to being declared unknown by the next admission."""

    def __init__(self, db_path: str) -> None:
        self.db_path = db_path
        self.db: sqlite3.Connection | None = None
        self.min_slack: float | None = None
        self.min_at: float | None = None
        self.min_where: dict[str, Any] = {}
        self.samples = 0
        self.started = time.monotonic()

    def sample(self) -> None:
        if self.db is None:
            if not os.path.exists(self.db_path):
                return
            self.db = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=1.0)
        try:
            rows = self.db.execute(
                "SELECT session, state, owner FROM sessions WHERE state IN ('running', 'settling')"
            ).fetchall()
        except sqlite3.Error:
            return
        now = time.time()
        self.samples += 1
        for session, state, owner in rows:
            if not owner:
                continue
            slack = json.loads(owner)["lease_until"] - now
            if self.min_slack is None or slack < self.min_slack:
                self.min_slack, self.min_at = slack, time.monotonic() - self.started
                self.min_where = {"session": session, "state": state, "at": now}

    def report(self) -> dict[str, Any]:
        if self.db is not None:
            self.db.close()
        return {
            "min_slack_s": self.min_slack,
            "min_at_s": self.min_at,
            "min_where": self.min_where,
            "samples": self.samples,
        }


def sample_main(token: str, bench_pid: int, out_path: str, db_path: str) -> None:
    """The sampler process: sweep until stdin closes (or the benchmark is gone), then report."""
    sampler = ProcSampler(token, bench_pid)
    leases = LeaseWatch(db_path)
    n = 0
    while True:
        t0 = time.monotonic()
        sampler.sweep(n % PSS_EVERY == 0)
        if n % PSS_EVERY == 5:
            leases.sample()
        n += 1
        wait = max(0.0, SAMPLE_S - (time.monotonic() - t0))
        if select.select([sys.stdin], [], [], wait)[0] or os.getppid() != bench_pid:
            break
    tmp = out_path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump({**sampler.report(), "lease": leases.report()}, handle)
    os.replace(tmp, out_path)


class SamplerProcess:
    def __init__(self, token: str, out_path: str, db_path: str) -> None:
        self.out_path = out_path
        boot = (
            f"import sys; sys.path.insert(0, {BENCH_DIR!r}); import load; "
            "load.sample_main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])"
        )
        self.process: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-c", boot, token, str(os.getpid()), out_path, db_path],
            stdin=subprocess.PIPE,
        )
        self.result: dict[str, Any] = {}

    def stop(self) -> dict[str, Any]:
        process, self.process = self.process, None
        if process is None:
            return self.result
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(timeout=30.0)
        except subprocess.TimeoutExpired:
            log("warning: the memory sampler did not stop; killing it")
            process.kill()
            process.wait(timeout=5.0)
        with contextlib.suppress(OSError, ValueError), open(self.out_path) as handle:
            self.result = json.load(handle)
        return self.result


# -- one run ------------------------------------------------------------------------------------


class Gate:
    """An exclusive flock the commands wait on (shared) until every admission has returned."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def open(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the lock
            self.fd = None


def _admit(
    rt: Any, task: str, key: str, dup: int, shell: str, token: str, barrier: threading.Barrier
) -> dict[str, Any]:
    row: dict[str, Any] = {"key": key, "dup": dup}
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        row["barrier_broken"] = True
    # a warm Runtime of its own (not a shared launcher) starts its zygote at its first launch
    starts_zygote = getattr(rt, "_launcher_kind", None) == "warm" and rt._launcher is None
    started, row["called_at"] = time.perf_counter(), time.time()
    try:
        adm = rt.exec(task, shell=shell, key=key, env={MARK_ENV: token})
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["latency_s"] = time.perf_counter() - started
        return row
    row["latency_s"] = time.perf_counter() - started
    row.update(
        session=adm.session,
        reused=adm.reused,
        state=adm.state,
        owner_pid=adm.owner_pid,
        boundary=adm.boundary,
        starts_zygote=starts_zygote and not adm.reused,
    )
    return row


def _alone(rt: Any, task: str, key: str, shell: str, token: str, n: int) -> list[float]:
    """n reused admissions of one key, one after another from one caller: no contention."""
    out = []
    for _ in range(n):
        started = time.perf_counter()
        adm = rt.exec(task, shell=shell, key=key, env={MARK_ENV: token})
        out.append(time.perf_counter() - started)
        if not adm.reused:
            raise RuntimeError(f"a probe admission of {key} launched a second session")
    return out


def _wait(rt: Any, session: str) -> dict[str, Any]:
    view = rt.wait(session, timeout=WAIT_S)
    waited = time.time()
    record = rt.store.get_session(session)
    return {"view": view, "waited_at": waited, "stored_at": record.settled_at}


def _stamp(stderr: bytes) -> float | None:
    lines = stderr.decode(errors="replace").strip().splitlines()
    try:
        return float(lines[-1]) if lines else None
    except ValueError:
        return None


def _verify(
    rt: Any, p: dict[str, Any], workspace: str, keys: list[str], admissions: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Check each key's sessions, receipt, log and launch file; per-key facts for the JSON."""
    from blake3 import blake3

    by_key: dict[str, list[dict[str, Any]]] = {k: [] for k in keys}
    for row in admissions:
        by_key[row["key"]].append(row)
    counts = {
        "keys": len(keys),
        "admissions": len(admissions),
        "errors": sum("error" in r for r in admissions),
        "new": sum(r.get("reused") is False for r in admissions),
        "one_session": 0,
        "one_new": 0,
        "one_launch_line": 0,
        "bytes_intact": 0,
        "readback_intact": 0,
        "proven": 0,
        "boundary_recorded": 0,
        "exit_0": 0,
        "drain_complete": 0,
        "journal_barrier": 0,
    }
    problems: list[str] = []
    facts: dict[str, dict[str, Any]] = {}
    for key in keys:
        rows = by_key[key]
        sessions = {r["session"] for r in rows if "session" in r}
        counts["one_session"] += len(sessions) == 1
        counts["one_new"] += sum(r.get("reused") is False for r in rows) == 1
        try:
            with open(os.path.join(workspace, "launches", key), "rb") as handle:
                lines = handle.read().splitlines()
        except FileNotFoundError:
            lines = []
        counts["one_launch_line"] += len(lines) == 1
        if len(sessions) != 1 or len(lines) != 1:
            problems.append(f"{key}: sessions {sorted(sessions)}, launch lines {len(lines)}")
        for session in sessions:
            record = rt.store.get_session(session)
            receipt = record.receipt
            if receipt is None:
                problems.append(f"{key}: session {session} has no receipt ({record.state})")
                continue
            want = expected_bytes(key, p["bytes"])
            out = receipt["output"]["stdout"]
            intact = out["cursor"] == len(want) and out["digest"] == (
                "blake3:" + blake3(want).hexdigest()
            )
            got = rt.read(session, "stdout", 0, len(want) + 1)
            readback = got == want
            death = receipt["death"]
            counts["bytes_intact"] += intact
            counts["readback_intact"] += readback
            counts["proven"] += death.get("proven") is True
            counts["boundary_recorded"] += bool(death.get("boundary")) and bool(record.boundary)
            counts["exit_0"] += receipt["exit"].get("code") == 0
            counts["drain_complete"] += receipt["output"]["drain"] == "complete"
            counts["journal_barrier"] += receipt["terminal_mutation"].get("source") == "journal"
            if not (intact and readback and death.get("proven")):
                problems.append(
                    f"{key}: cursor {out['cursor']}, digest ok {intact}, read back {readback}, "
                    f"death {death}"
                )
            facts[session] = {
                "key": key,
                "receipt": receipt,
                "stored_at": record.settled_at,
                "stamp": _stamp(rt.read(session, "stderr", 0, 4096)),
            }
    counts["problems"] = problems[:50]
    return counts, facts


def _steps(admissions: list[dict[str, Any]], facts: dict[str, Any]) -> dict[str, Any]:
    """Each new admission's steps: the call to the store's admission (the caller's clock), then
    STEPS from the receipt's timings."""
    called = {r["session"]: r["called_at"] for r in admissions if r.get("reused") is False}
    first = [
        (f["receipt"]["timings"]["admitted_at"] - called[session]) * 1e3
        for session, f in facts.items()
        if session in called
    ]
    steps = {"called_at -> admitted_at": distribution(first)}
    for a, b in STEPS:
        times = [
            (f["receipt"]["timings"][b] - f["receipt"]["timings"][a]) * 1e3 for f in facts.values()
        ]
        steps[f"{a} -> {b}"] = distribution(times)
    return steps


def _latencies(admissions: list[dict[str, Any]], facts: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in admissions if "session" in r]
    out: dict[str, Any] = {
        "admission_ms": {
            "all": distribution([r["latency_s"] * 1e3 for r in ok]),
            "new": distribution([r["latency_s"] * 1e3 for r in ok if not r["reused"]]),
            "reused": distribution([r["latency_s"] * 1e3 for r in ok if r["reused"]]),
        }
    }
    if any(r.get("starts_zygote") for r in ok):
        out["admission_ms"]["new, starts its Runtime's zygote"] = distribution(
            [r["latency_s"] * 1e3 for r in ok if r.get("starts_zygote")]
        )
        out["admission_ms"]["new, zygote already running"] = distribution(
            [r["latency_s"] * 1e3 for r in ok if not r["reused"] and not r.get("starts_zygote")]
        )
    built, stored, stamped, evidence, spawned = [], [], [], [], []
    for fact in facts.values():
        t = fact["receipt"]["timings"]
        if "spawned_at" not in t or "exited_after_s" not in t:
            continue
        exit_at = t["spawned_at"] + t["exited_after_s"]
        built.append((t["settled_at"] - exit_at) * 1e3)
        if fact["stored_at"] is not None:
            stored.append((fact["stored_at"] - exit_at) * 1e3)
        if fact["stamp"] is not None:
            stamped.append((t["settled_at"] - fact["stamp"]) * 1e3)
        evidence.append(t.get("evidence_after_exit_s", float("nan")) * 1e3)
        spawned.append((t["spawned_at"] - t["admitted_at"]) * 1e3)
    out["exit_to_receipt_ms"] = {
        "built": distribution(built),
        "stored": distribution(stored),
        "built_from_stamp": distribution(stamped),
        "evidence_after_exit": distribution(evidence),
    }
    out["admitted_to_spawned_ms"] = distribution(spawned)
    out["new_admission_steps_ms"] = _steps(admissions, facts)
    out["owner_maxrss_kib"] = distribution(
        [float(f["receipt"]["owner"]["maxrss_kib"]) for f in facts.values()]
    )
    out["owner_cpu_ms"] = distribution(
        [f["receipt"]["owner"]["cpu_s"] * 1e3 for f in facts.values()]
    )
    return out


def run_once(root: str, variant: str, p: dict[str, Any]) -> dict[str, Any]:
    from settled.runtime import Runtime
    from settled.states import LIVE_STATES
    from settled.workspace.journal import lifecycle as journal_lifecycle
    from settled.workspace.journal import wire as journal_wire

    launcher, share = VARIANTS[variant]
    base = os.path.join(root, variant)
    home, workspace = os.path.join(base, "home"), os.path.join(base, "workspace")
    os.makedirs(os.path.join(workspace, "launches"))
    token = f"{os.getpid()}-load-{variant}-{os.urandom(4).hex()}"
    keys = [f"k{i:04d}" for i in range(p["sessions"])]
    use_gate = shutil.which("flock") is not None
    gate_path = os.path.join(base, "gate")
    rt: Any = None
    task: Any = None
    sampler: SamplerProcess | None = None
    gate: Gate | None = None
    pool: RuntimePool | None = None
    admissions: list[dict[str, Any]] = []
    barriers: list[threading.Barrier] = []
    shared: Any = None
    journal_pid: int | None = None
    result: dict[str, Any] = {
        "variant": variant,
        "launcher": launcher,
        "shared_launcher": share,
        "gate": use_gate,
        "token": token,
    }
    os.environ[MARK_ENV] = token  # owners, zygotes and the journal inherit it: the sampler's filter
    try:
        rt = Runtime(home, launcher=launcher)
        task = rt.new_task(workspace)
        socket = rt.workspace.socket()
        journal_pid = (journal_wire.ping(socket) or {}).get("pid")
        db_path = os.path.join(rt.home, "settled.db")
        sampler = SamplerProcess(token, os.path.join(base, "memory.json"), db_path)
        gate = Gate(gate_path) if use_gate else None
        if share:
            from settled.owner.zygote import WarmLauncher

            shared = WarmLauncher()
        pool = RuntimePool(p["threads"], home, launcher, shared)
        log(f"  {variant}: {p['threads']} runtimes open; {len(keys) * p['duplicates']} admissions")
        t_start, cpu_start = time.time(), time.process_time()
        jobs = []
        for key in keys:  # key-major: a key's duplicates are queued together, so never deadlock
            barrier = threading.Barrier(p["duplicates"], timeout=BARRIER_S)
            barriers.append(barrier)
            shell = command(key, p["bytes"], gate_path if use_gate else None)
            for dup in range(p["duplicates"]):
                jobs.append(
                    pool.submit(
                        lambda r, k=key, d=dup, s=shell, b=barrier: _admit(
                            r, task.task, k, d, s, token, b
                        )
                    )
                )
        _gather(jobs, 600.0, "admissions")
        t_admitted, cpu_admitted = time.time(), time.process_time()
        order = [(key, dup) for key in keys for dup in range(p["duplicates"])]
        admissions = [
            j.result if j.error is None else {"key": k, "dup": d, "error": repr(j.error)}
            for j, (k, d) in zip(jobs, order, strict=True)
        ]
        errors = [r["error"] for r in admissions if "error" in r]
        log(
            f"  {variant}: admissions done in {t_admitted - t_start:.1f} s, "
            f"{sum(r.get('reused') is False for r in admissions)} new, {len(errors)} errors"
            + (f" (first: {errors[0]})" if errors else "")
        )
        probe_shell = command(keys[0], p["bytes"], gate_path if use_gate else None)
        probe_live = _alone(rt, task.task, keys[0], probe_shell, token, PROBES)
        if gate is not None:
            gate.open()
        t_gate, cpu_gate = time.time(), time.process_time()
        sessions = sorted({r["session"] for r in admissions if "session" in r})
        waits = [pool.submit(lambda r, s=s: _wait(r, s)) for s in sessions]
        _gather(waits, WAIT_S + 60.0, "waits")
        t_waited, cpu_waited = time.time(), time.process_time()
        wait_errors = [repr(j.error) for j in waits if j.error is not None]
        log(f"  {variant}: {len(sessions)} receipts {t_waited - t_gate:.1f} s after the gate")
        memory = sampler.stop()
        probe_idle = _alone(rt, task.task, keys[0], probe_shell, token, PROBES)
        counts, facts = _verify(rt, p, workspace, keys, admissions)
        stored = [f["stored_at"] for f in facts.values() if f["stored_at"] is not None]
        t0 = time.perf_counter()
        close = rt.close_task(task.task, deadline=CLOSE_DEADLINE_S)
        close_s = time.perf_counter() - t0
        journal_gone = await_exit(journal_pid, 10.0)
        for fact in facts.values():
            end_process(fact["receipt"]["owner"]["pid"], "session owner")
        result.update(
            counts=counts,
            wait_errors=wait_errors[:20],
            errors=errors[:20],
            error_count=len(errors),
            latency=_latencies(admissions, facts),
            probes_ms={
                f"reused, one caller alone, {len(sessions)} sessions live": distribution(
                    [x * 1e3 for x in probe_live]
                ),
                "reused, one caller alone, 0 sessions live": distribution(
                    [x * 1e3 for x in probe_idle]
                ),
            },
            memory=memory,
            cpu=_cpu(cpu_admitted - cpu_start, cpu_waited - cpu_gate, facts),
            wall={
                "admissions_s": t_admitted - t_start,
                "gate_to_last_receipt_s": (max(stored) - t_gate) if stored else None,
                "gate_to_waits_done_s": t_waited - t_gate,
                "first_admission_to_last_receipt_s": (max(stored) - t_start) if stored else None,
                "close_s": close_s,
            },
            close={
                "complete": close.complete,
                "blocked_on": getattr(close, "blocked_on", None),
                "journal_exited": journal_gone,
                "checkpoint_verified": bool(
                    close.receipt and close.receipt["checkpoint"]["read_back"]["verified"]
                ),
                "all_commands_succeeded": bool(
                    close.receipt and close.receipt["outcome"]["all_commands_succeeded"]
                ),
            },
            admissions=[{k: v for k, v in r.items() if k in ADMISSION_FIELDS} for r in admissions],
            sessions=[
                {
                    "key": f["key"],
                    "session": session,
                    "timings": f["receipt"]["timings"],
                    "stored_at": f["stored_at"],
                    "stamp": f["stamp"],
                    "owner": f["receipt"]["owner"],
                    "boundary": f["receipt"]["death"]["boundary"],
                }
                for session, f in facts.items()
            ],
            fs=fs_of(home),
        )
    finally:
        for barrier in barriers:
            barrier.abort()  # an interrupted run: nobody waits on a barrier any more
        if gate is not None:
            gate.open()
        if sampler is not None:
            sampler.stop()
        if pool is not None:
            result["threads_left"] = pool.close()
        if rt is not None and task is not None:
            _cancel_live(rt, task.task, LIVE_STATES)
            _recover_unknown(rt, task.task)
            _await_owners(rt, task.task)
            result["cgroups_left"] = _tidy_cgroups(task.task)
            with contextlib.suppress(Exception):  # one journal per home: a close leaves it up
                journal_lifecycle.stop(rt.workspace.socket())
            await_exit(journal_pid, 10.0)  # it lets go of its lock before its process ends
        if rt is not None:
            rt.close()
        if shared is not None:
            shared.close()  # the creator of a shared launcher closes it
        if launcher == "home":
            _stop_home_zygote(home, token)
        os.environ.pop(MARK_ENV, None)
        result["left_what"] = [_describe(pid) for pid in marked(token)]
        result["left"] = len(kill_marked(token))
        if result["left"]:
            log(f"warning: killed {result['left']} leftover processes: {result['left_what']}")
        shutil.rmtree(base, ignore_errors=True)
    return result


def _cpu(admissions_s: float, waits_s: float, facts: dict[str, Any]) -> dict[str, Any]:
    """Where the CPU went: the benchmark process (the callers' threads) while admitting and
    while waiting, and the owners (each receipt's `owner.cpu_s`: its whole life)."""
    owners = [f["receipt"]["owner"]["cpu_s"] for f in facts.values()]
    return {
        "callers_admitting_s": admissions_s,
        "callers_waiting_s": waits_s,
        "owners_s": sum(owners),
        "owner_ms": distribution([c * 1e3 for c in owners]),
        "per_session_ms": (admissions_s + sum(owners)) * 1e3 / len(owners) if owners else None,
    }


def _stop_home_zygote(home: str, token: str) -> None:
    """The home's zygote outlives its callers until it idles out: the benchmark ends it, and
    waits for its process (it lets go of its lock a moment before it exits)."""
    zygotes = [
        pid for pid in marked(token) if b"home_launcher" in (_read(f"/proc/{pid}/cmdline") or b"")
    ]
    try:
        from settled.home import run_dir
        from settled.owner.home_launcher import stop

        stop(run_dir(home))
    except Exception as exc:
        log(f"warning: stopping the home's zygote: {exc!r}")
    for pid in zygotes:
        await_exit(pid, 10.0)


def _recover_unknown(rt: Any, task: str) -> None:
    """Sessions declared unknown (an owner missed its lease): recovery settles them with
    evidence from their boundary, so their cgroups go and their commands cannot linger."""
    try:
        unknown = [r.session for r in rt.store.list_sessions(task) if r.state == "unknown"]
        if unknown:
            log(f"warning: {len(unknown)} sessions are unknown; running recovery on them")
            rt.recover(task)
    except Exception as exc:
        log(f"warning: recovery of task {task}: {exc!r}")


def _describe(pid: int) -> str:
    cmd = (_read(f"/proc/{pid}/cmdline") or b"").replace(b"\0", b" ").decode(errors="replace")
    return f"{pid}: {cmd[:160]}"


def _await_owners(rt: Any, task: str) -> None:
    """Every owner exits after its receipt (or once fenced); wait for them, 20 s in all, so the
    marked-process sweep that follows only finds real stragglers."""
    from settled.boundary import procfs

    give_up = time.monotonic() + 20.0
    with contextlib.suppress(Exception):
        for record in rt.store.list_sessions(task):
            owner = record.owner
            if owner is None or procfs.start_time(owner.pid) != owner.start_time:
                continue  # gone already (or the pid is someone else's now)
            await_exit(owner.pid, max(0.0, give_up - time.monotonic()))


def _tidy_cgroups(task: str) -> list[str]:
    """The task's cgroups settled left behind (there should be none); removes the empty ones."""
    try:
        from settled.boundary.cgroup2 import ROOT_DIR_NAME, find_hierarchy

        task_dir = os.path.join(find_hierarchy(), ROOT_DIR_NAME, task)
    except Exception:
        return []
    if not os.path.isdir(task_dir):
        return []
    left = sorted(e for e in os.listdir(task_dir) if os.path.isdir(os.path.join(task_dir, e)))
    if left:
        log(f"warning: settled left {len(left)} cgroups under {task_dir}; removing them")
    for entry in left:
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(task_dir, entry))
    with contextlib.suppress(OSError):
        os.rmdir(task_dir)
    return left


def _cancel_live(rt: Any, task: str, live_states: Any) -> None:
    """An interrupted run: cancel every live session, then wait for them (bounded, together)."""
    try:
        live = [r.session for r in rt.store.list_sessions(task) if r.state in live_states]
    except Exception as exc:
        log(f"warning: cannot list the sessions to clean up: {exc!r}")
        return
    if live:
        log(f"warning: cancelling {len(live)} live sessions")
    for session in live:
        with contextlib.suppress(Exception):
            rt.cancel(session, "benchmark ended")
    give_up = time.monotonic() + 60.0
    for session in live:
        with contextlib.suppress(Exception):
            rt.wait(session, timeout=max(0.1, give_up - time.monotonic()))


def _offered(launcher: str, share: bool) -> bool:
    """This settled has the launcher (and, for a shared zygote, Runtime(shared_launcher=))."""
    import inspect

    from settled.runtime import Runtime

    if launcher not in runtime_launchers():
        return False
    return not share or "shared_launcher" in inspect.signature(Runtime).parameters


def run(quick: bool) -> tuple[dict[str, Any], str]:
    from settled.owner.lease import lease_seconds

    lease_s = lease_seconds()

    p = dict(QUICK if quick else FULL)
    if sessions := os.environ.get(SESSIONS_ENV):
        p["sessions"] = int(sessions)
    variants = [name for name, (launcher, share) in VARIANTS.items() if _offered(launcher, share)]
    if only := os.environ.get(VARIANTS_ENV):  # a subset, to profile one of them
        variants = [name for name in variants if name in only.split(",")]
    data: dict[str, Any] = {
        "benchmark": "load",
        "quick": quick,
        "machine": machine(),
        "revision": source_revision(),
        "params": {
            **p,
            "variants": {name: VARIANTS[name] for name in variants},
            "command": command("KEY", p["bytes"], "GATE"),
            "lease_s": lease_s,
        },
        "runs": {},
    }
    with scratch("load") as root:
        for variant in variants:
            log(f"load: {variant}, {p['sessions']} keys x {p['duplicates']} duplicates")
            data["runs"][variant] = run_once(root, variant, p)
    return data, render(data)


# -- tables -------------------------------------------------------------------------------------


def _ok(n: int, of: int) -> str:
    return f"{n}/{of}" if n == of else f"**{n}/{of}**"


def _left(r: dict[str, Any]) -> str:
    processes, cgroups = r.get("left", 0), len(r.get("cgroups_left", []))
    text = f"{processes} / {cgroups}"
    return f"**{text}**" if processes or cgroups else text


def _mib(n: float) -> str:
    return fmt(n / MIB, 1)


def _pss_per_owner(at: dict[str, Any] | None) -> str:
    if not at or not at["owners"]:
        return "-"
    return f"{at['owners']} / {_mib(at['pss'])} / {fmt(at['per_owner'] / MIB, 2)}"


def render(data: dict[str, Any]) -> str:
    p = data["params"]
    runs = data["runs"]
    total = p["sessions"] * p["duplicates"]
    parts = [
        header("load: concurrent sessions under a retry storm", data)
        + f" Source `{data.get('revision', '?')}`.",
        "",
        f"{p['sessions']} keys x {p['duplicates']} concurrent duplicate admissions = {total} "
        f"`Runtime.exec` calls from {p['threads']} threads (one Runtime each; `fresh`: a new "
        "interpreter per owner, `warm`: each Runtime forks owners from its own zygote, "
        "`warm-shared`: one zygote for all of them, `Runtime(shared_launcher=)`, `home`: the "
        "home's zygote that every process shares, what the CLI uses), one task; each "
        f"command appends a line to `launches/<key>`, waits on a flock gate held until every "
        f"admission returned (so all {p['sessions']} sessions are alive at once), then writes "
        f"{p['bytes'] // MIB} MiB (`yes <key> | head -c {p['bytes']}`) and its exit stamp to "
        "stderr. No baseline: invariants must hold exactly; times are absolute on a shared "
        "machine. Numbers in **bold** break an invariant.",
        "",
        "**Invariants** (per key; the counts must equal the number of keys)",
        "",
    ]
    rows = []
    for name, r in runs.items():
        c = r.get("counts")
        if c is None:
            rows.append([name, "run failed", *["-"] * 9])
            continue
        n = c["keys"]
        rows.append(
            [
                name,
                f"{c['admissions']} ({_ok(c['errors'], 0) if c['errors'] else 0} errors)",
                _ok(c["new"], n),
                _ok(c["one_session"], n),
                _ok(c["one_new"], n),
                _ok(c["one_launch_line"], n),
                _ok(min(c["bytes_intact"], c["readback_intact"]), n),
                _ok(min(c["proven"], c["boundary_recorded"]), n),
                _ok(min(c["exit_0"], c["drain_complete"]), n),
                _ok(c["journal_barrier"], n),
                _left(r),
            ]
        )
    parts.append(
        md_table(
            [
                "variant",
                "admissions",
                "launched (reused=False)",
                "1 session per key",
                "reused=False once",
                "1 launch line",
                "bytes intact (receipt + read back)",
                "death proven, boundary recorded",
                "exit 0, drain complete",
                "journal barrier answered",
                "left: processes / cgroups",
            ],
            rows,
        )
    )
    parts += ["", "**Admission latency** (`Runtime.exec` call to return, ms)", ""]
    rows = []
    for name, r in runs.items():
        latency = {**r.get("latency", {}).get("admission_ms", {}), **r.get("probes_ms", {})}
        for label, d in latency.items():
            rows.append(
                [name, label, d.get("n", 0), *(fmt(d.get(q)) for q in ("p50", "p90", "p99", "max"))]
            )
    parts.append(md_table(["variant", "admissions", "n", "p50", "p90", "p99", "max"], rows))
    parts += [
        "",
        "**Exit to receipt** (ms; exit = receipt `spawned_at + exited_after_s`; 'stored' = the "
        "store's `settled_at` of the receipt's commit; 'from stamp' anchors at the command's own "
        "last `date`; all sessions exit together when the gate opens, so this is under load)",
        "",
    ]
    labels = {
        "built": "exit -> receipt built (owner)",
        "stored": "exit -> receipt stored",
        "built_from_stamp": "stamp -> receipt built",
        "evidence_after_exit": "exit -> death evidence",
    }
    rows = []
    for name, r in runs.items():
        for label, d in r.get("latency", {}).get("exit_to_receipt_ms", {}).items():
            rows.append(
                [
                    name,
                    labels[label],
                    d.get("n", 0),
                    *(fmt(d.get(q)) for q in ("p50", "p90", "p99", "max")),
                ]
            )
    parts.append(md_table(["variant", "interval", "n", "p50", "p90", "p99", "max"], rows))
    steps = [
        (n, r["latency"]["new_admission_steps_ms"])
        for n, r in runs.items()
        if r.get("latency", {}).get("new_admission_steps_ms")
    ]
    if steps:
        parts += [
            "",
            "**A new admission, step by step** (ms, from each receipt's timings: where the "
            "time goes under load; `launched -> owner` is the launcher's queue and fork and "
            "the owner's first word, `owner -> claimed` the claim's wait for the store's write "
            "lock and its fsync)",
            "",
            md_table(
                ["variant", "step", "n", "p50", "p90", "p99", "max"],
                [
                    [
                        n,
                        step.replace("_at", ""),
                        d.get("n", 0),
                        *(fmt(d.get(q)) for q in ("p50", "p90", "p99", "max")),
                    ]
                    for n, by_step in steps
                    for step, d in by_step.items()
                ],
            ),
        ]
    parts += ["", "**Wall time and close**", ""]
    rows = []
    for name, r in runs.items():
        w, cl = r.get("wall"), r.get("close")
        if w is None or cl is None:
            continue
        drain = w["gate_to_last_receipt_s"]
        mib = p["sessions"] * p["bytes"] / MIB
        rows.append(
            [
                name,
                fmt(w["admissions_s"]),
                fmt(drain),
                fmt(mib / drain, 0) if drain else "-",
                fmt(w["first_admission_to_last_receipt_s"]),
                fmt(w["close_s"]),
                "yes" if cl["complete"] and cl["checkpoint_verified"] else "**no**",
            ]
        )
    parts.append(
        md_table(
            [
                "variant",
                f"{total} admissions (s)",
                "gate open -> last receipt stored (s)",
                "MiB/s settled",
                "first admission -> last receipt (s)",
                "close_task (s)",
                "close complete, checkpoint verified",
            ],
            rows,
        )
    )
    cpu = [(n, r["cpu"]) for n, r in runs.items() if r.get("cpu")]
    if cpu:
        parts += [
            "",
            "**CPU** (s; the callers' 2 cores are shared with every owner: the admission phase "
            "cannot be faster than its CPU over 2)",
            "",
            md_table(
                [
                    "variant",
                    "callers, admitting",
                    "callers, waiting",
                    "owners (sum)",
                    "owner p50 / max (ms)",
                    "callers' admitting + owners, per session (ms)",
                ],
                [
                    [
                        n,
                        fmt(c["callers_admitting_s"]),
                        fmt(c["callers_waiting_s"]),
                        fmt(c["owners_s"]),
                        f"{fmt(c['owner_ms'].get('p50'))} / {fmt(c['owner_ms'].get('max'))}",
                        fmt(c["per_session_ms"]),
                    ]
                    for n, c in cpu
                ],
            ),
        ]
    parts += [
        "",
        "**Memory** (peak over the run; /proc sampled every 50 ms, PSS every 500 ms; RSS counts "
        "the pages owners share (interpreter, libraries, a zygote's heap) once per owner, PSS "
        "splits them; `maxrss` is each receipt's `owner.maxrss_kib`)",
        "",
    ]
    rows = []
    for name, r in runs.items():
        m, lat = r.get("memory"), r.get("latency")
        if m is None or lat is None:
            continue
        owner, zygote, jour = m["peak"]["owner"], m["peak"]["zygote"], m["peak"]["journal"]
        mx = lat["owner_maxrss_kib"]
        at_peak = m["peak_at_s"].get("owners_at_rss_peak", 0)
        rows.append(
            [
                name,
                owner["count"],
                _mib(owner["rss"]),
                _mib(owner["pss"]),
                fmt(owner["rss"] / at_peak / MIB, 1) if at_peak else "-",
                _pss_per_owner(m.get("owners_pss_at_most")),
                f"{zygote['count']} / {_mib(zygote['rss'])} / {_mib(zygote['pss'])}",
                _mib(jour["rss"]),
                " / ".join(fmt(mx.get(q, float("nan")) / 1024, 1) for q in ("p50", "p90", "max")),
            ]
        )
    parts.append(
        md_table(
            [
                "variant",
                "owners alive (peak)",
                "sum RSS (MiB)",
                "sum PSS (MiB)",
                "RSS per owner at peak (MiB)",
                "PSS per owner: owners / sum / each (MiB), fullest PSS sample",
                "zygotes: n / RSS / PSS (MiB)",
                "journal RSS (MiB)",
                "receipt maxrss p50 / p90 / max (MiB)",
            ],
            rows,
        )
    )
    sampled = [
        f"{name} {m['samples']} samples, interval (ms) p50 / p99 / max "
        + " / ".join(fmt(m["interval_ms"].get(q), 0) for q in ("p50", "p99", "max"))
        for name, r in runs.items()
        if (m := r.get("memory")) and "interval_ms" in m
    ]
    if sampled:
        parts += ["", "Sampler (its own process): " + "; ".join(sampled) + "."]
    slack = [
        f"{name} {fmt(lease['min_slack_s'])} s (lease {data['params']['lease_s']:g} s)"
        for name, r in runs.items()
        if (lease := r.get("memory", {}).get("lease")) and lease.get("min_slack_s") is not None
    ]
    if slack:
        parts += [
            "",
            "Smallest lease slack seen over the live sessions (every 500 ms; at 0 the next "
            "admission would declare that session unknown and freeze the task): "
            + "; ".join(slack)
            + ".",
        ]
    problems = [(n, r["counts"]["problems"]) for n, r in runs.items() if r.get("counts")]
    problems += [(n, r["errors"]) for n, r in runs.items() if r.get("errors")]
    for name, found in problems:
        if found:
            parts += ["", f"{name}: first problems: " + "; ".join(f"`{x}`" for x in found[:5])]
    return "\n".join(parts)
