"""Profiles behind the benchmarks' pages: python bench/profiling.py NAME [--out DIR].

Each writes its raw data (traces, samples, timelines) into `--out` (default
`$TMPDIR/settled-profile-NAME`, outside the repository: raw profiles are regenerated, never
committed) and prints its summary; the pages in bench/results/ quote what was found, with the
commit it was measured at.

- `exec-trace`: one fresh `Runtime.exec(argv=["true"])` under `strace -f -tt`, turned into the
  timeline of its steps (caller, owner, PID namespace init, command). strace inflates every
  time 2-3x: read the order and the overlap, not the totals. (admission.md)
- `owner-drain`: one owner draining `head -c 2G /dev/zero` under py-spy (per thread, needs
  `pip install py-spy`) and `perf record -g` at once. (drain.md)
- `owner-cpu`: N sessions through the home's zygote under `perf record -a -g`, each sample
  attributed to its process's role (owner, init, zygote, journal, caller, the command). (load.md)
- `cli-overhead`: wall time and top-level imports (`-X importtime`) of `settled exec` and
  `settled wait` around a 64 MiB drain, 5 runs. (drain.md)
- `importtime`: `-X importtime` of `settled logs --follow` and `settled run`, 7 runs; with
  `--tree SRC`, that source tree instead of the installed one. (drain.md)

Every run makes its settled home under /tmp and removes it; nothing is asserted.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
TRACED = "execve,clone3,clone,write,openat,fsync,fdatasync,mount,unshare,read,mkdir,pipe2"


# -- exec-trace -----------------------------------------------------------------------------


def exec_trace(out: str, _args: argparse.Namespace) -> None:
    trace = os.path.join(out, "strace.txt")
    command = [sys.executable, os.path.abspath(__file__), "one-exec"]
    subprocess.run(["strace", "-f", "-tt", "-e", f"trace={TRACED}", "-o", trace, *command],
                   check=True, timeout=300)  # fmt: skip
    with open(trace) as handle:
        lines = handle.read().splitlines()
    begin = next(i for i, line in enumerate(lines) if "MARKER_BEGIN" in line)
    end = next(i for i, line in enumerate(lines) if "MARKER_END" in line)
    text = "\n".join(timeline(lines[begin : end + 1]))
    with open(os.path.join(out, "one_exec_timeline.txt"), "w") as handle:
        handle.write(text + "\n")
    print(text)


def one_exec() -> None:
    """Three untimed fresh execs, then one between two markers on stderr (for strace)."""
    from common import end_process, settled_rig

    with settled_rig("once", None) as rig:
        for _ in range(3):
            warm = rig.exec(argv=["true"])
            owner = rig.runtime.wait(warm.session, timeout=30)["receipt"]["owner"]["pid"]
            end_process(owner, "owner")
        os.write(2, b"MARKER_BEGIN\n")
        admission = rig.exec(argv=["true"])
        os.write(2, b"MARKER_END\n")
        receipt = rig.runtime.wait(admission.session, timeout=30)["receipt"]
        end_process(receipt["owner"]["pid"], "owner")


STAMP = re.compile(r"(\d+)\s+(\d+):(\d+):([\d.]+)")


def _stamp(line: str) -> tuple[int, float]:
    found = STAMP.match(line)
    assert found is not None, line
    return int(found[1]), int(found[2]) * 3600 + int(found[3]) * 60 + float(found[4])


def _roles(lines: list[str]) -> dict[int, str]:
    named: dict[int, str] = {}
    owner = None
    for line in lines:
        pid, _ = _stamp(line)
        body = line.split(None, 2)[2]
        if body.startswith("execve(") and "python" in body:
            owner = named[pid] = "owner"
        elif body.startswith("execve(") and "/true" in body:
            named[pid] = "command"
        elif owner and pid not in named and body.startswith("unshare(CLONE_NEWNS"):
            named[pid] = "init"
    return named


def _kept(body: str) -> bool:
    marks = ("execve(", "clone3(", "fdatasync", "fsync(", "unshare(", "MARKER")
    return (
        any(mark in body for mark in marks)
        or body.startswith('mount("proc"')
        or ("mkdir(" in body and "cgroup" in body)
        or ("write(" in body and ("owner_pid" in body or '"running"' in body))
        or ("read(" in body and ('"running"' in body or "owner_pid" in body))
        or ("openat" in body and ("last_words" in body or "stdout.log" in body))
    )


def timeline(lines: list[str]) -> list[str]:
    """The steps of one exec, in ms from its first line, each with the role of its process."""
    start = _stamp(lines[0])[1]
    named = _roles(lines)
    shown, imports = [], collections.defaultdict(list)
    for line in lines:
        pid, at = _stamp(line)
        body = line.split(None, 2)[2]
        role, ms = named.get(pid, "runtime"), (at - start) * 1e3
        if "openat" in body and ".pyc" in body:
            module = re.search(r"/([\w.]+)/__pycache__/([\w.]+)\.cpython", body)
            imports[role].append((ms, f"{module[1]}/{module[2]}" if module else "?"))
        elif _kept(body):
            shown.append(f"{ms:8.2f} ms  {role:8s} {body[:112]}")
    for role, items in imports.items():
        names = ", ".join(name for _, name in items)
        shown.append(f"{role}: {len(items)} .pyc files, {items[0][0]:.2f} to "
                     f"{items[-1][0]:.2f} ms: {names}")  # fmt: skip
    return shown


# -- owner-drain ----------------------------------------------------------------------------


def owner_drain(out: str, _args: argparse.Namespace) -> None:
    from common import end_process, settled_rig

    spy_bin = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    with settled_rig("drainprof") as rig:
        os.sync()
        admitted = rig.exec(argv=["sh", "-c", "sleep 0.5; head -c 2G /dev/zero"])
        pid = str(admitted.owner_pid)
        spy = subprocess.Popen(
            [spy_bin, "record", "--pid", pid, "--threads", "--nonblocking", "--rate", "500",
             "--format", "raw", "--output", os.path.join(out, "owner_pyspy.raw")],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        perf = subprocess.Popen(
            ["perf", "record", "-F", "999", "-g", "-p", pid,
             "-o", os.path.join(out, "owner.perf.data")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        receipt = rig.runtime.wait(admitted.session, timeout=600)["receipt"]
        spy.wait(timeout=60)
        perf.wait(timeout=60)
        print("owner cpu", receipt["owner"]["cpu_s"], "timings", receipt["timings"])
        end_process(receipt["owner"]["pid"], "owner")
        rig.forget_logs(admitted.session)
    print(f"perf report -i {out}/owner.perf.data --no-children --sort dso,sym -g none")


# -- owner-cpu ------------------------------------------------------------------------------

ROLE_COMMAND = "yes x | head -c 1048576; date +%s.%N >&2"
KERNEL_PATHS = ("exit_mmap", "copy_process", "exc_page_fault", "do_fsync", "__x64_sys_openat",
                "__x64_sys_mount", "__x64_sys_unshare", "__x64_sys_clone3", "__x64_sys_rmdir",
                "__x64_sys_mkdir", "schedule")  # fmt: skip
HZ = 4999


def owner_cpu(out: str, args: argparse.Namespace) -> None:
    data, facts = os.path.join(out, "roles.perf.data"), os.path.join(out, "roles.json")
    command = [sys.executable, os.path.abspath(__file__), "sessions", str(args.sessions), facts]
    subprocess.run(["perf", "record", "-a", "-g", "-F", str(HZ), "-o", data, "--", *command],
                   check=True, timeout=1800)  # fmt: skip
    print("\n".join(role_tables(data, facts)))


def sessions(n: int, facts_path: str) -> None:
    """N sessions through the home's zygote, each waited to its receipt; what the roles need."""
    from settled.runtime import Runtime

    root = tempfile.mkdtemp(prefix="owner-cpu-")
    workspace = os.path.join(root, "ws")
    os.mkdir(workspace)
    rt = Runtime(os.path.join(root, "home"), launcher="home")
    task = rt.new_task(workspace).task
    for _ in range(3):  # the zygote, its spare and the journal started
        rt.wait(rt.exec(task, shell=ROLE_COMMAND).session)
    time.sleep(0.5)
    started = time.monotonic()
    rows = [rt.wait(rt.exec(task, shell=ROLE_COMMAND).session) for _ in range(n)]
    ended = time.monotonic()
    with open(facts_path, "w") as handle:
        json.dump({"rows": rows, "daemons": _home_processes(root), "caller": os.getpid(),
                   "window": [started, ended]}, handle)  # fmt: skip
    print(f"{(ended - started) / n * 1e3:.1f} ms a session, wall")
    rt.close_task(task)
    rt.close()
    shutil.rmtree(root, ignore_errors=True)


def _home_processes(root: str) -> dict[int, str]:
    """The home's zygote (and its spare) and journal daemon: their command lines name it."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                line = handle.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if root in line:
            found[int(pid)] = line
    return found


def role_tables(data: str, facts_path: str) -> list[str]:
    with open(facts_path) as handle:
        facts = json.load(handle)
    rows, (t0, t1) = facts["rows"], facts["window"]
    owners = {r["owner"]["pid"] for r in rows}
    inits = {r["receipt"]["death"]["observed"]["init_pid"] for r in rows}
    daemons = {int(p): ("zygote" if "home_launcher" in c else "journal" if "journal" in c
                        else "spare owner") for p, c in facts["daemons"].items()}  # fmt: skip

    def role_of(comm: str, pid: int) -> str:
        if pid in owners:
            return "owner"
        if pid in inits:
            return "init"
        if pid == facts["caller"]:
            return "caller"
        return daemons.get(pid) or ("idle" if comm == "swapper" else comm)

    roles: collections.Counter[str] = collections.Counter()
    paths: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for comm, pid, at, stack in _samples(data):
        if t0 <= at <= t1:
            role = role_of(comm, pid)
            roles[role] += 1
            paths[role][next((m for m in KERNEL_PATHS if m in stack), "other")] += 1
    per_session = HZ * len(rows) / 1e3
    lines = ["| role | ms CPU a session |", "|---|---|"]
    lines += [f"| {role} | {count / per_session:.2f} |" for role, count in roles.most_common(14)]
    for role in ("owner", "init"):
        lines += ["", f"| {role}: kernel path on the stack | ms a session |", "|---|---|"]
        lines += [f"| {p} | {count / per_session:.2f} |" for p, count in paths[role].most_common()]
    return lines


def _samples(data: str) -> list[tuple[str, int, float, list[str]]]:
    text = subprocess.run(["perf", "script", "-i", data, "-F", "comm,pid,time,ip,sym"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    samples, head, stack = [], None, []
    for line in [*text.splitlines(), ""]:
        if not line.strip():
            if head is not None:
                samples.append((*head, stack))
            head, stack = None, []
        elif not line.startswith(("\t", " ")):
            parts = line.split()
            head = (parts[0], int(parts[1]), float(parts[2].rstrip(":")))
        else:
            parts = line.split()
            stack.append(parts[1].split("+")[0] if len(parts) > 1 else "?")
    return samples


# -- cli-overhead and importtime ------------------------------------------------------------


class _Cli:
    """`python -m settled` in a home of its own under /tmp, bytecode written as installed."""

    def __init__(self, tree: str | None = None) -> None:
        self.root = tempfile.mkdtemp(prefix="settled-profile-cli-")
        self.workspace = os.path.join(self.root, "ws")
        os.mkdir(self.workspace)
        self.env = {**os.environ, "SETTLED_HOME": os.path.join(self.root, "home")}
        self.env.pop("PYTHONDONTWRITEBYTECODE", None)
        if tree is not None:
            self.env["PYTHONPATH"] = tree
            self.env["PYTHONPYCACHEPREFIX"] = os.path.join(self.root, "pycache")

    def __call__(self, *args: str, importtime: bool = False) -> subprocess.CompletedProcess[bytes]:
        argv = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "settled"]
        return subprocess.run([*argv, *args], env=self.env, capture_output=True, timeout=120)

    def new_task(self) -> str:
        made = self("task", "new", "--workspace", self.workspace, "--json")
        return str(json.loads(made.stdout)["task"])

    def close(self, task: str) -> None:
        self("close", task, "--json")
        shutil.rmtree(self.root, ignore_errors=True)


IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)")


def top_level_imports(stderr: bytes) -> dict[str, float]:
    """Each top-level module's cumulative import time in ms, from `-X importtime`."""
    found = {}
    for line in stderr.decode().splitlines():
        m = IMPORT_LINE.match(line)
        if m and m[3] == "":
            found[m[4]] = int(m[2]) / 1000
    return found


def cli_overhead(out: str, _args: argparse.Namespace) -> None:
    cli = _Cli()
    task = cli.new_task()
    walls: dict[str, list[float]] = {"exec": [], "wait": []}
    imports: dict[str, list[float]] = {"exec": [], "wait": []}
    top: dict[str, dict[str, float]] = {}
    for _ in range(5):
        argv = {"exec": ["exec", "--task", task, "--json", "--", "head", "-c", "64M", "/dev/zero"]}
        for verb in ("exec", "wait"):
            started = time.perf_counter()
            done = cli(*argv[verb], importtime=True)
            walls[verb].append(time.perf_counter() - started)
            top[verb] = top_level_imports(done.stderr)
            imports[verb].append(sum(top[verb].values()))
            if verb == "exec":
                argv["wait"] = ["wait", json.loads(done.stdout)["session"], "--json"]
    lines = []
    for verb in ("exec", "wait"):
        largest = sorted(top[verb].items(), key=lambda x: -x[1])[:6]
        lines.append(
            f"{verb}: wall median {statistics.median(walls[verb]) * 1e3:.0f} ms, top-level "
            f"imports median {statistics.median(imports[verb]):.0f} ms; largest: "
            + ", ".join(f"{m} {t:.1f}" for m, t in largest)
        )
    cli.close(task)
    _report(out, "cli_overhead.txt", lines)


def importtime(out: str, args: argparse.Namespace) -> None:
    cli = _Cli(args.tree)
    task = cli.new_task()
    totals: dict[str, list[float]] = {"logs --follow": [], "run": []}
    for _ in range(7):
        admitted = cli("exec", "--task", task, "--json", "--", "sh", "-c", "sleep 0.4; echo hi")
        session = json.loads(admitted.stdout)["session"]
        follow = cli("logs", session, "--stream", "stdout", "--follow", importtime=True)
        totals["logs --follow"].append(sum(top_level_imports(follow.stderr).values()))
        ran = cli("run", "--task", task, "--", "sleep", "0.3", importtime=True)
        totals["run"].append(sum(top_level_imports(ran.stderr).values()))
    cli.close(task)
    medians = {verb: round(statistics.median(ms), 1) for verb, ms in totals.items()}
    _report(out, "importtime.txt", [f"top-level imports, median of 7 (ms): {medians}"])


def _report(out: str, name: str, lines: list[str]) -> None:
    with open(os.path.join(out, name), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))


PROFILES: dict[str, Callable[[str, argparse.Namespace], None]] = {
    "exec-trace": exec_trace,
    "owner-drain": owner_drain,
    "owner-cpu": owner_cpu,
    "cli-overhead": cli_overhead,
    "importtime": importtime,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["one-exec"]:  # the traced process of exec-trace
        one_exec()
        return 0
    if argv[:1] == ["sessions"]:  # the sampled process of owner-cpu
        sessions(int(argv[1]), argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=list(PROFILES))
    parser.add_argument(
        "--out", help="where the raw data goes (default $TMPDIR/settled-profile-NAME)"
    )
    parser.add_argument("--sessions", type=int, default=100, help="owner-cpu: how many")
    parser.add_argument("--tree", help="importtime: a source tree (its src/) to run instead")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(tempfile.gettempdir(), f"settled-profile-{args.name}")
    os.makedirs(out, exist_ok=True)
    PROFILES[args.name](out, args)
    print(f"raw data in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
