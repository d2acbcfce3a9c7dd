"""What one session owner costs the machine: embedded home against a home bound to PostgreSQL + S3.

A user's `settled run --task T --json -- CMD` (whole CLI processes; the home's warm launcher
forks the owners, as a user gets) for N sessions of `true` and N of a command writing 1 MiB,
interleaved between a default home (SQLite + local objects) and one bound to a real
PostgreSQL and SeaweedFS (the test servers, tests/pg.py and tests/s3.py). Each owner is
measured over its whole life, to its exit, whatever it does after its receipt (a seal after
it included): this process is a child subreaper (PR_SET_CHILD_SUBREAPER), so every detached
owner the home's zygote forks is re-parented to it. Its own CPU is the kernel's exact
sum_exec_runtime of each of its threads, read from taskstats as each exits
(bench/taskstats.py); a thread reaps it with `wait4`, whose rusage adds what the owner reaped
itself (its placer, and its command's init with the command, the same on both backends) and
whose `ru_maxrss` is its peak resident set. The owner's pid is the receipt's. Peak RSS is the
kernel's count: it includes the pages an owner shares copy-on-write with its zygote (what the
zygote imported, once for every owner).

    .venv/bin/python bench/run.py owner_cost [--quick]

SETTLED_BENCH_BASE=/path/to/checkout measures that checkout's `src` instead of this one's (to
measure main before a change).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

from common import distribution, fmt, header, log, machine, md_table, scratch, source_revision
from taskstats import TaskExits

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS_DIR = os.path.join(REPO, "tests")
sys.path.insert(0, TESTS_DIR)

import s3 as weed_server  # noqa: E402  (tests/s3.py: the SeaweedFS launcher)

PR_SET_CHILD_SUBREAPER = 36
COMMANDS = {"true": ["true"], "write 1 MiB": ["head", "-c", "1048576", "/dev/urandom"]}
BACKENDS = ("sqlite+local", "postgresql+s3")
TARGET = 3.0  # the remote owner within 3x the embedded one (issue 39, item 5)
RUN_TIMEOUT_S = 120.0
PAUSE_S = 0.1


def _source_root() -> str:
    return os.path.join(os.environ.get("SETTLED_BENCH_BASE") or REPO, "src")


class Exits:
    """Every child of this (subreaper) process, measured at its exit: pid -> facts."""

    def __init__(self) -> None:
        self.seen: dict[int, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="owner-exits", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid == 0:
                time.sleep(0.002)  # none exited (or none yet: a spawn is coming)
                continue
            with self._cond:
                self.seen[pid] = {
                    "cpu_s": usage.ru_utime + usage.ru_stime,
                    "maxrss_kib": usage.ru_maxrss,
                    "status": status,
                }
                self._cond.notify_all()

    def await_pid(self, pid: int, timeout: float) -> dict[str, Any]:
        give_up = time.monotonic() + timeout
        with self._cond:
            while pid not in self.seen:
                left = give_up - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"process {pid} did not exit within {timeout} s")
                self._cond.wait(left)
            return self.seen.pop(pid)


@contextlib.contextmanager
def _subreaper() -> Iterator[None]:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def _settled(env: dict[str, str], exits: Exits, *argv: str) -> tuple[bytes, dict[str, Any]]:
    """One whole `python -m settled ARGV` process: its stdout and its own exit facts."""
    return _spawn(env, exits, ["-m", "settled", *argv])


def _spawn(env: dict[str, str], exits: Exits, argv: list[str]) -> tuple[bytes, dict[str, Any]]:
    """`python ARGV`, spawned here (its exit is the reaper thread's to collect)."""
    out = os.path.join(env["SETTLED_HOME"], f"out-{secrets.token_hex(4)}")
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        pid = os.posix_spawn(
            sys.executable,
            [sys.executable, *argv],
            env,
            file_actions=[(os.POSIX_SPAWN_DUP2, fd, 1)],
        )
    finally:
        os.close(fd)
    facts = exits.await_pid(pid, RUN_TIMEOUT_S)
    with open(out, "rb") as handle:
        data = handle.read()
    os.unlink(out)
    return data, facts


def _environments(root: str, weed: Any, cluster: Any) -> dict[str, dict[str, str]]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SETTLED_", "AWS_", "PG")) and k != "PYTHONDONTWRITEBYTECODE"
    }
    base["PYTHONPATH"] = _source_root()
    import pg  # tests/pg.py

    schema = pg.schema_for_directory(os.path.join(root, "pg"))
    return {
        "sqlite+local": {**base, "SETTLED_HOME": os.path.join(root, "home-embedded")},
        "postgresql+s3": {
            **base,
            "SETTLED_HOME": os.path.join(root, "home-remote"),
            "SETTLED_STORE": f"{cluster.url()}?options=-csearch_path%3D{schema}",
            "SETTLED_OBJECTS": f"s3://{weed_server.VERSIONED_BUCKET}/owner-cost",
            **weed.env(),
        },
    }


def _recorded_seal(env: dict[str, str], exits: Exits, session: str) -> dict[str, Any] | None:
    """The seal of stdout the owner recorded after its receipt (`status`'s `sealed`), read once
    the owner has exited; None for an embedded home (nothing to seal) or a seal that failed."""
    out, _facts = _settled(env, exits, "status", session, "--json")
    sealed: dict[str, Any] | None = (json.loads(out).get("sealed") or {}).get("stdout")
    return sealed


def _one(
    env: dict[str, str], exits: Exits, tasks: TaskExits | None, task: str, command: list[str]
) -> dict[str, Any]:
    out, facts = _settled(env, exits, "run", "--task", task, "--json", "--", *command)
    receipt = json.loads(out)
    if receipt["exit"]["code"] != 0:
        raise RuntimeError(f"{command} failed: {receipt['exit']}")
    pid = int(receipt["owner"]["pid"])
    owner = exits.await_pid(pid, RUN_TIMEOUT_S)
    sealed = _recorded_seal(env, exits, receipt["session"])  # the owner sealed after its receipt
    return {
        "cpu_s": owner["cpu_s"],
        "own_cpu_s": tasks.own_cpu_s(pid) if tasks is not None else None,
        "maxrss_kib": owner["maxrss_kib"],
        "receipt_cpu_s": receipt["owner"]["cpu_s"],
        "cli_cpu_s": facts["cpu_s"],
        "sealed": sealed is not None,
        "seal_s": (sealed or {}).get("seal_s"),
    }


def run(quick: bool) -> tuple[dict[str, Any], str]:
    rounds = 6 if quick else 30
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        b: {c: [] for c in COMMANDS} for b in BACKENDS
    }
    with ExitStack() as stack:
        root = stack.enter_context(scratch("owner-cost"))
        import pg  # tests/pg.py

        weed = weed_server.start(os.path.join(root, "weed"))
        stack.callback(weed.stop)
        weed_server.make_buckets(weed)
        cluster = pg.start_cluster()
        stack.callback(cluster.stop)
        envs = _environments(root, weed, cluster)
        stack.enter_context(_subreaper())
        task_exits = TaskExits.open()  # before any owner: it reads every exit from now on
        if task_exits is not None:
            stack.callback(task_exits.close)
        exits = Exits()
        exits.start()
        stack.callback(exits.stop)
        tasks = {}
        for name, env in envs.items():
            os.makedirs(env["SETTLED_HOME"])
            workspace = os.path.join(root, f"w-{name}")
            os.makedirs(workspace)
            out, _ = _settled(env, exits, "task", "new", "--workspace", workspace, "-q")
            tasks[name] = out.decode().strip()
            stack.callback(_stop_launcher, env, exits)
        for name in BACKENDS:  # the first call starts the home's zygote: not measured
            _one(envs[name], exits, task_exits, tasks[name], ["true"])
        for index in range(rounds):
            for command, argv in COMMANDS.items():
                for name in BACKENDS:
                    runs[name][command].append(
                        _one(envs[name], exits, task_exits, tasks[name], argv)
                    )
                    time.sleep(PAUSE_S)  # an agent's next call: the zygote's spare is ready
            if index % 10 == 9:
                log(f"owner_cost: {index + 1}/{rounds} rounds")
        overruns = task_exits.overruns if task_exits is not None else None
    data = {
        "machine": machine(),
        "revision": _revision(),
        "source": _source_root(),
        "quick": quick,
        "rounds": rounds,
        "taskstats_overruns": overruns,
        "runs": runs,
        "summary": _summary(runs),
    }
    return data, render(data)


def _revision() -> str:
    """The commit of the source measured (SETTLED_BENCH_BASE's checkout, else this one)."""
    base = os.environ.get("SETTLED_BENCH_BASE")
    if not base:
        return source_revision()
    done = subprocess.run(["git", "-C", base, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, timeout=10)  # fmt: skip
    return done.stdout.strip() or "?"


def plot(out: str, data: dict[str, Any]) -> str:
    """owner_cost.svg: the CDF of each owner's own CPU (taskstats) and peak RSS, per command
    and backend."""
    from plots import SERIES, cdf, median, pyplot, save

    plt = pyplot()
    if plt is None:
        from plots import SKIPPED

        return SKIPPED
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), layout="constrained")
    for ax, key, scale, unit in (
        (axes[0], "own_cpu_s", 1e3, "owner's own CPU over its whole life, ms (taskstats)"),
        (axes[1], "maxrss_kib", 1 / 1024, "owner peak RSS, MiB (shared pages counted)"),
    ):
        series = iter(SERIES)
        for command in COMMANDS:
            for name in BACKENDS:
                values = [r[key] * scale for r in data["runs"][name][command] if r[key]]
                label = f"{command}, {name} (p50 {median(values):.1f})"
                cdf(ax, values, label, color=next(series), lw=2)
        ax.set_xlabel(unit)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_ylabel("fraction of owners <= x")
    return save(plt, fig, out, "owner_cost", "owner_cost: CDF of owner CPU and peak RSS")


def _stop_launcher(env: dict[str, str], exits: Exits) -> None:
    """End the home's zygote (the first `run` started it), in a process of the measured source."""
    code = (
        "import sys; from settled.home import run_dir; from settled.owner import home_launcher; "
        "home_launcher.stop(run_dir(sys.argv[1]))"
    )
    _spawn(env, exits, ["-c", code, env["SETTLED_HOME"]])
    tidy = (
        "import sys; from common import _release_pods, _stop_journals; "
        "from settled.netproxy import lifecycle; "
        "_stop_journals(sys.argv[1]); lifecycle.stop(sys.argv[1]); _release_pods(sys.argv[1])"
    )
    _spawn({**env, "PYTHONPATH": f"{_source_root()}:{os.path.dirname(__file__)}"}, exits,
           ["-c", tidy, env["SETTLED_HOME"]])  # fmt: skip


MEASURES = ("own_cpu_s", "receipt_cpu_s", "cpu_s", "maxrss_kib")
JUDGED = ("own_cpu_s", "maxrss_kib")  # the owner's own, over its whole life
COLUMNS = [
    "command", "backends", "owner's own CPU, whole life, p50 ms", "to its receipt p50 ms",
    "with what it reaped p50 ms", "peak RSS p50 MiB", "sealed",
]  # fmt: skip


def _summary(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for command in COMMANDS:
        rows = {}
        for name in BACKENDS:
            rows[name] = {
                key: distribution([r[key] for r in runs[name][command] if r[key] is not None])
                for key in MEASURES
            }
            rows[name]["sealed"] = sum(r["sealed"] for r in runs[name][command])
        base, remote = rows["sqlite+local"], rows["postgresql+s3"]
        rows["ratio"] = {
            key: remote[key]["p50"] / base[key]["p50"] if base[key].get("n") else None
            for key in MEASURES
        }
        summary[command] = rows
    return summary


def render(data: dict[str, Any]) -> str:
    table = []
    for command, rows in data["summary"].items():
        for name in BACKENDS:
            row = rows[name]
            table.append([
                f"`{command}`", name,
                *(fmt(row[k].get("p50", float("nan")) * 1000, 1) for k in MEASURES[:3]),
                fmt(row["maxrss_kib"]["p50"] / 1024, 1), str(row["sealed"]),
            ])  # fmt: skip
        ratio = rows["ratio"]
        judged = [ratio[k] for k in JUDGED if ratio[k] is not None]
        verdict = "met" if judged and max(judged) <= TARGET else "**missed**"
        table.append([f"`{command}`", "**ratio**", *(f"{fmt(ratio[k])}x" for k in MEASURES),
                      verdict])  # fmt: skip
    return "\n\n".join([
        header("What one session owner costs: embedded against PostgreSQL + S3", data),
        f"{data['rounds']} rounds, interleaved; each round runs `settled run --task T --json -- "
        "CMD` once per command and backend (whole CLI processes, a call every 0.1 s; owners "
        "forked by the home's warm launcher; the first call of each home, which starts it, is "
        "not counted). This process is the owners' subreaper, so each owner is measured at "
        "its exit, whatever it did after its receipt. `own CPU, whole life` is the kernel's "
        "exact sum_exec_runtime of every thread of the owner process, read from taskstats as "
        "each exits (bench/taskstats.py; its children, the placer and the command's init, are "
        "their own processes and not counted): the figure judged. Beside it, the receipt's "
        "`owner.cpu_s` (getrusage read as the receipt is built: what the owner does after it "
        "is missed) and wait4's rusage at the owner's exit (which adds what the owner reaped: "
        "its placer and its command's init with the command, the same work on both "
        "backends). Peak RSS is wait4's ru_maxrss and counts the pages an owner shares "
        "copy-on-write with its zygote (for the remote home, what the zygote imported once "
        f"for every owner). Target: the remote owner within {TARGET:g}x of the embedded one "
        "in its own CPU and its peak RSS (issue 39, item 5). Source measured: "
        f"`{data['source']}`; taskstats overruns (exits the kernel dropped): "
        f"{data.get('taskstats_overruns')}.",
        md_table(COLUMNS, table),
    ])  # fmt: skip


if __name__ == "__main__":
    print(run("--quick" in sys.argv)[1])
