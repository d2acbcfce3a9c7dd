"""admission: how long `Runtime.exec` takes to return for `true`, against a bare posix_spawn.

`Runtime.exec` returns once the command runs inside its boundary (state 'running', or already
further). Measured per run, interleaved in the same loop: a bare `os.posix_spawn` of the same
command (+ waitpid), settled exec-to-return and exec-to-receipt with each way settled starts an
owner ('fresh': a new `python -I -S` per session, the default, its command cloned into its
cgroup; 'fresh-fork': the same with SETTLED_SPAWN=fork, the fork-and-join path a kernel without
clone3(CLONE_INTO_CGROUP) takes; 'warm': a pre-imported zygote forks the owner), a bare
`python -I -S -c pass` with the same interpreter, `python -I -S` loading the owner's launch path
(everything it imports before its command runs), and a raw cgroup placement (a fresh child
writing cgroup.procs, against clone3 into the cgroup). The receipt's wall-clock timings split
exec-to-return into its critical path; `-X importtime` says what a fresh owner imports before
its command runs, and what loads while it runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from common import (
    distribution,
    end_process,
    fmt,
    header,
    log,
    machine,
    md_table,
    median,
    runtime_launchers,
    settled_rig,
    source_revision,
)

FULL = {"runs": 200, "importtime_runs": 7, "per_boundary_runs": 40}
QUICK = {"runs": 30, "importtime_runs": 3, "per_boundary_runs": 6}
KINDS = ("cgroup2+pidns", "cgroup2", "pidns", "subreaper")
SPAWN_ENV = "SETTLED_SPAWN"
# name -> (launcher, SETTLED_SPAWN): how each series starts its owners and their commands
SERIES = {"fresh": ("fresh", None), "fresh-fork": ("fresh", "fork"), "warm": ("warm", None)}
LAUNCH_PATH = (
    "import sys; sys.path += sys.argv[1:]; import settled.owner.main; "
    "import settled.owner.launch; settled.owner.launch.Ahead().close()"
)
SESSION_PATH = "import sys; sys.path += sys.argv[1:]; import settled.owner.session"
PLACE = """
import os, sys, time
from settled.boundary import spawn
cgroup, via = sys.argv[1], sys.argv[2]
if via == "fork":
    os.environ["SETTLED_SPAWN"] = "fork"
t0 = time.perf_counter()
pid, pidfd, placed = spawn.fork_into(cgroup, new_pid_namespace=False)
if pid == 0:
    if not placed:
        spawn.join_cgroup(cgroup)
    os._exit(0)
os.waitpid(pid, 0)
print((time.perf_counter() - t0) * 1e3)
"""
# The critical path of exec-to-return, from the receipt's timings (they add up to it):
PHASES = (
    "admit (validate, store insert)",
    "admit commit, journal, owner spawned",
    "owner: interpreter to its pid (warm: zygote fork)",
    "owner: launch path loaded, orders in (claim made meanwhile)",
    "owner: last words, boundary setup",
    "command start (clone3 or fork, isolation, exec)",
    "running report, pid record, status read",
)
AFTER = (
    "exec returned -> owner's session loaded (supervised_at)",
    "-> receipt written (settled_at)",
    "settled_at -> Runtime.wait returned",
)


def _spawn_wait(path: str, argv: list[str]) -> tuple[float, float]:
    """(spawn returned, child reaped) in seconds after the call, for one posix_spawn."""
    started = time.perf_counter()
    pid = os.posix_spawn(path, argv, os.environ)
    spawned = time.perf_counter()
    _, status = os.waitpid(pid, 0)
    reaped = time.perf_counter()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{argv} exited with status {status}")
    return spawned - started, reaped - started


@contextlib.contextmanager
def _spawn_env(value: str | None) -> Any:
    """Owners read SETTLED_SPAWN from the caller's environment at their launch."""
    before = os.environ.get(SPAWN_ENV)
    if value is None:
        os.environ.pop(SPAWN_ENV, None)
    else:
        os.environ[SPAWN_ENV] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SPAWN_ENV, None)
        else:
            os.environ[SPAWN_ENV] = before


def _settled_once(rig: Any, spawn: str | None, boundary: str = "auto") -> dict[str, Any]:
    with _spawn_env(spawn):
        wall0 = time.time()
        started = time.perf_counter()
        admission = rig.exec(argv=["true"], boundary=boundary)
        returned = time.perf_counter()
    view = rig.runtime.wait(admission.session, timeout=60.0)
    received = time.perf_counter()
    receipt = view["receipt"]
    if receipt["exit"].get("code") != 0 or not receipt["death"]["proven"]:
        raise RuntimeError(f"session {admission.session}: {receipt['exit']} {receipt['death']}")
    t = receipt["timings"]
    end_process(receipt["owner"]["pid"], "session owner")
    returned_at, received_at = wall0 + returned - started, wall0 + received - started
    started_cmd = t["spawned_at"] + t["spawn_s"]
    steps = [wall0, t["admitted_at"], t["launched_at"], t["owner_at"], t["orders_at"]]
    steps += [t["spawned_at"], started_cmd, returned_at]
    return {
        "state_at_return": admission.state,
        "boundary": receipt["death"]["boundary"],
        "spawn": receipt["owner"].get("spawn"),
        "calls": receipt["owner"].get("calls"),
        "exec_return_s": returned - started,
        "exec_to_receipt_s": received - started,
        "phases_s": {
            **{name: b - a for name, a, b in zip(PHASES, steps[:-1], steps[1:], strict=True)},
            AFTER[0]: t["supervised_at"] - returned_at,
            AFTER[1]: t["settled_at"] - t["supervised_at"],
            AFTER[2]: received_at - t["settled_at"],
        },
        "claim_s": t["claimed_at"] - t["launched_at"],  # fresh: overlaps the interpreter
        "spawn_s": t["spawn_s"],
        "owner_maxrss_kib": receipt["owner"]["maxrss_kib"],
    }


def _raw_cgroup(hierarchy: str, tag: str, via: str, path_env: dict[str, str]) -> float:
    """A new cgroup, a child started in it (clone3) or joining it (fork, then cgroup.procs),
    in a helper process with no other thread: ms from the call to the child reaped."""
    path = os.path.join(hierarchy, f"settled-bench-raw-{os.getpid()}-{tag}")
    os.mkdir(path)
    try:
        out = subprocess.run(
            [sys.executable, "-c", PLACE, path, via],
            env=path_env, capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return float(out.stdout)
    finally:
        give_up = time.monotonic() + 5.0
        while os.path.isdir(path):
            try:
                os.rmdir(path)
            except OSError:
                if time.monotonic() > give_up:
                    log(f"warning: could not remove raw cgroup {path}")
                    break
                time.sleep(0.001)


def _columns(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-run records as columns (one list per field, phases by name): a much smaller file."""
    if not records:
        return {}
    out: dict[str, Any] = {k: [r[k] for r in records] for k in records[0] if k != "phases_s"}
    out["phases_s"] = {ph: [r["phases_s"][ph] for r in records] for ph in records[0]["phases_s"]}
    return out


def _importtime(code: str, roots: list[str], runs: int) -> dict[str, Any]:
    """Median self/cumulative microseconds per module over `runs` runs of -X importtime, and
    the modules the interpreter had loaded before `code` ran (left out of the totals)."""
    samples: dict[str, list[tuple[int, int]]] = {}
    depth: dict[str, int] = {}
    for _ in range(runs):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-I", "-S", "-c", code, *roots],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        for line in proc.stderr.splitlines():
            if not line.startswith("import time:") or "self [us]" in line:
                continue
            head, cumulative, name = line.split("|", 2)
            module = name.strip()
            depth[module] = (len(name) - len(name.lstrip()) - 1) // 2
            samples.setdefault(module, []).append((int(head.split(":", 1)[1]), int(cumulative)))
    startup = set(
        subprocess.run(
            [sys.executable, "-I", "-S", "-c", "import sys; print(' '.join(sys.modules))"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout.split()
    )  # fmt: skip
    rows = [
        {
            "module": module,
            "depth": depth[module],
            "self_ms": median([s for s, _ in values]) / 1000,
            "cumulative_ms": median([c for _, c in values]) / 1000,
        }
        for module, values in samples.items()
        if module not in startup
    ]
    rows.sort(key=lambda r: r["self_ms"], reverse=True)
    return {"total_self_ms": sum(r["self_ms"] for r in rows), "modules": rows}


def run(quick: bool) -> tuple[dict[str, Any], str]:
    from settled.boundary import availability, linux
    from settled.boundary.cgroup2 import find_hierarchy
    from settled.owner.launcher import owner_path

    p = QUICK if quick else FULL
    true_path = shutil.which("true")
    if true_path is None:
        raise RuntimeError("no `true` on PATH")
    exe = sys.executable
    roots = owner_path()
    path_env = {**os.environ, "PYTHONPATH": os.pathsep.join(roots)}
    offered = runtime_launchers()
    series = {name: spec for name, spec in SERIES.items() if spec[0] in offered}
    reasons = availability()
    kinds = [k for k in KINDS if reasons.get(k) is None]
    hierarchy = find_hierarchy() if reasons.get("cgroup2") is None else None
    clone3 = linux.clone3_missing()
    data: dict[str, Any] = {
        "benchmark": "admission",
        "quick": quick,
        "machine": machine(),
        "revision": source_revision(),
        "params": {
            **p,
            "command": [true_path],
            "interpreter": exe,
            "owner_path": roots,
            "series": {k: list(v) for k, v in series.items()},
            "linux_calls": linux.BINDING,
            "clone3_missing": clone3,
        },
        "availability": reasons,
    }
    spawn, spawn_wait, py_pass, py_launch = [], [], [], []
    settled: dict[str, list[dict[str, Any]]] = {name: [] for name in series}
    first: dict[str, dict[str, Any]] = {}
    raw: dict[str, list[float]] = {"fork": [], "clone3": []}
    per_kind: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {k: [] for k in kinds} for name in series
    }
    code = LAUNCH_PATH
    with contextlib.ExitStack() as stack:
        rigs = {
            name: stack.enter_context(
                settled_rig(f"admission-{name}", None if launcher == "fresh" else launcher)
            )
            for name, (launcher, _spawn) in series.items()
        }
        for name, (_launcher, via) in series.items():  # untimed warm-up; 'warm' starts its zygote
            first[name] = _settled_once(rigs[name], via)
        for i in range(p["runs"]):
            s, w = _spawn_wait(true_path, ["true"])
            spawn.append(s)
            spawn_wait.append(w)
            for name, (_launcher, via) in series.items():
                settled[name].append(_settled_once(rigs[name], via))
            py_pass.append(_spawn_wait(exe, [exe, "-I", "-S", "-c", "pass"])[1])
            py_launch.append(_spawn_wait(exe, [exe, "-I", "-S", "-c", code, *roots])[1])
            if hierarchy is not None:
                for via in ("fork", "clone3") if clone3 is None else ("fork",):
                    raw[via].append(_raw_cgroup(hierarchy, f"{i}-{via}", via, path_env))
            if (i + 1) % 50 == 0 or i + 1 == p["runs"]:
                medians = ", ".join(
                    f"{name} {median([r['exec_return_s'] for r in runs]) * 1e3:.1f} ms"
                    for name, runs in settled.items()
                )
                log(
                    f"admission {i + 1}/{p['runs']}: exec return p50 {medians}; posix_spawn "
                    f"p50 {median(spawn) * 1e3:.2f} ms"
                )
        for _ in range(p["per_boundary_runs"]):
            for name, (_launcher, via) in series.items():
                for kind in kinds:
                    per_kind[name][kind].append(_settled_once(rigs[name], via, kind))
        log(f"admission per boundary: {p['per_boundary_runs']} runs each of {kinds} x {series}")
    launch_imports = _importtime(LAUNCH_PATH, roots, p["importtime_runs"])
    session_imports = _importtime(SESSION_PATH, roots, p["importtime_runs"])
    ms = 1e3
    dists = {
        "posix_spawn(true) returned": distribution([v * ms for v in spawn]),
        "posix_spawn(true) + waitpid": distribution([v * ms for v in spawn_wait]),
    }
    for name, runs in settled.items():
        dists[f"settled exec -> returned ({name})"] = distribution(
            [r["exec_return_s"] * ms for r in runs]
        )
        dists[f"settled exec -> receipt ({name})"] = distribution(
            [r["exec_to_receipt_s"] * ms for r in runs]
        )
    dists["python -I -S -c pass (spawn + wait)"] = distribution([v * ms for v in py_pass])
    dists["python -I -S loading the owner's launch path (spawn + wait)"] = distribution(
        [v * ms for v in py_launch]
    )
    data["distributions_ms"] = dists
    data["phases_ms"] = {
        name: {
            phase: distribution([r["phases_s"][phase] * ms for r in runs])
            for phase in (*PHASES, *AFTER)
        }
        for name, runs in settled.items()
    }
    data["claim_ms"] = {
        name: distribution([r["claim_s"] * ms for r in runs]) for name, runs in settled.items()
    }
    data["per_boundary_ms"] = {
        name: {
            kind: {
                "exec_return": distribution([r["exec_return_s"] * ms for r in runs]),
                "command_start": distribution([r["spawn_s"] * ms for r in runs]),
            }
            for kind, runs in kinds_runs.items()
        }
        for name, kinds_runs in per_kind.items()
    }
    data["raw_cgroup_ms"] = {via: distribution(values) for via, values in raw.items()}
    data["state_at_return"] = {
        name: {s: [r["state_at_return"] for r in runs].count(s) for s in ("running", "settling")}
        for name, runs in settled.items()
    }
    data["first_exec_ms"] = {name: r["exec_return_s"] * ms for name, r in first.items()}
    data["imports"] = {"launch_path": launch_imports, "session": session_imports}
    base = dists["posix_spawn(true) + waitpid"]["p50"]
    fresh = dists.get("settled exec -> returned (fresh)", {"p50": float("nan")})
    data["summary"] = {
        **{
            f"exec_return_p50_over_spawn_wait_p50_{name}": dists[
                f"settled exec -> returned ({name})"
            ]["p50"]
            / base
            for name in settled
        },
        "fresh_exec_return_p50_ms": fresh["p50"],
        "fresh_over_python_pass_p50": fresh["p50"]
        / dists["python -I -S -c pass (spawn + wait)"]["p50"],
        "target_ms": 20.0,
        "target_met": fresh["p50"] <= 20.0,
        "launch_path_imports_ms": launch_imports["total_self_ms"],
        "session_imports_ms": session_imports["total_self_ms"],
        "boundary": settled[next(iter(settled))][0]["boundary"],
        "spawn": {name: runs[0]["spawn"] for name, runs in settled.items()},
        "linux_calls": linux.BINDING,
    }
    data["runs"] = {
        "posix_spawn_s": spawn,
        "posix_spawn_wait_s": spawn_wait,
        "python_pass_s": py_pass,
        "python_launch_path_s": py_launch,
        "settled": {name: _columns(runs) for name, runs in settled.items()},
        "first_exec": first,
        "per_boundary": {
            name: {kind: _columns(runs) for kind, runs in kinds_runs.items()}
            for name, kinds_runs in per_kind.items()
        },
        "raw_cgroup_ms": raw,
    }
    return data, render(data)


def _import_rows(block: dict[str, Any], top: int) -> list[list[str]]:
    return [
        [("· " * r["depth"]) + r["module"], fmt(r["self_ms"]), fmt(r["cumulative_ms"])]
        for r in block["modules"][:top]
    ]


def render(data: dict[str, Any]) -> str:
    d, ph, s = data["distributions_ms"], data["phases_ms"], data["summary"]
    names = list(ph)
    base = d["posix_spawn(true) + waitpid"]["p50"]
    rows = [
        [name, v["n"], fmt(v["p50"]), fmt(v["p90"]), fmt(v["p99"]), fmt(v["max"]),
         fmt(v["p50"] / base, 1)]
        for name, v in d.items()
    ]  # fmt: skip
    phase_rows = [
        [phase] + [fmt(ph[name][phase][q]) for name in names for q in ("p50", "p90")]
        for phase in ph[names[0]]
    ]
    phase_rows.append(
        ["(claim: prepare, CAS, fsync; from the owner's spawn)"]
        + [fmt(data["claim_ms"][name][q]) for name in names for q in ("p50", "p90")]
    )
    phase_headers = ["phase (ms)"] + [f"{name} {q}" for name in names for q in ("p50", "p90")]
    kinds = list(data["per_boundary_ms"][names[0]])
    kind_rows = [
        [kind]
        + [
            fmt(data["per_boundary_ms"][name][kind][what]["p50"])
            for name in names
            for what in ("exec_return", "command_start")
        ]
        for kind in kinds
    ]
    kind_headers = ["boundary"] + [
        f"{name} {what} p50" for name in names for what in ("exec -> returned", "command start")
    ]
    raw = data["raw_cgroup_ms"]
    raw_rows = [
        [what, v["n"], fmt(v.get("p50")), fmt(v.get("p90")), fmt(v.get("max"))]
        for what, v in (
            ("fork, then the child writes cgroup.procs", raw["fork"]),
            ("clone3(CLONE_INTO_CGROUP)", raw["clone3"]),
        )
    ]
    states = "; ".join(
        f"{name}: " + ", ".join(f"{k} {v}" for k, v in data["state_at_return"][name].items())
        for name in names
    )
    first = ", ".join(f"{name} {fmt(v, 1)} ms" for name, v in data["first_exec_ms"].items())
    launch, session = data["imports"]["launch_path"], data["imports"]["session"]
    foundation = [
        r
        for r in launch["modules"]
        if r["module"].startswith("settled.")
        and r["module"].split(".")[1] in ("errors", "faults", "helper_process", "records", "home")
    ]
    foundation_text = ", ".join(f"`{r['module']}` {fmt(r['self_ms'])} ms" for r in foundation)
    met = "met" if s["target_met"] else "**missed**"
    n = d["posix_spawn(true) + waitpid"]["n"]
    return "\n\n".join(
        [
            header("admission", data),
            f"`Runtime.exec(task, argv=['true'])` (boundary `{s['boundary']}`, Linux calls "
            f"through the `{s['linux_calls']}` binding) with each way settled starts an owner "
            "(`fresh`: a new `python -I -S` per session, the default, its command cloned into "
            "its cgroup; `fresh-fork`: the same with SETTLED_SPAWN=fork, the path of a kernel "
            "without clone3(CLONE_INTO_CGROUP); `warm`: `Runtime(launcher='warm')`, a "
            "pre-imported zygote forks the owner) against a bare `os.posix_spawn` of the same "
            f"`true`, interleaved in one loop, {n} runs each. Times in ms; the last column is "
            f"p50 over the p50 of posix_spawn + waitpid. State when exec returned: {states}. "
            f"The first, untimed exec of each Runtime took: {first}. Target (issue 15, goal 3): "
            f"fresh exec -> returned p50 <= 20 ms: {fmt(s['fresh_exec_return_p50_ms'])} ms, "
            f"{met}; that is {fmt(s['fresh_over_python_pass_p50'], 2)} x the bare "
            f"`python -I -S -c pass` of the same loop "
            f"({fmt(d['python -I -S -c pass (spawn + wait)']['p50'])} ms, the floor of any "
            "fresh owner, and what the machine's other load does to it).",
            md_table(["measurement (ms)", "n", "p50", "p90", "p99", "max", "p50 / spawn"], rows),
            "Where exec-to-return goes, from the receipt's wall-clock `timings`: the first "
            "seven phases add up to exec -> returned (its critical path); the claim runs beside "
            "the owner's interpreter (fresh) or after its pid (warm), and is shown apart; the "
            "last three run after exec returned.",
            md_table(phase_headers, phase_rows),
            f"The same `true` per boundary ({data['params']['per_boundary_runs']} runs each, "
            "interleaved): exec -> returned and the command's start (clone3 or fork, boundary "
            "placement, isolation, exec) p50 in ms:",
            md_table(kind_headers, kind_rows),
            "Placing a child in a new cgroup, raw (a helper process with one thread, one per "
            "loop turn): a migration takes the cgroup threadgroup rwsem for writing, which "
            "waits for an RCU grace period unless it was taken moments ago; clone3 starts the "
            "child inside, with no migration.",
            md_table(["placement", "n", "p50", "p90", "max"], raw_rows),
            f"A fresh owner's imports before its command runs (`-X importtime`, median of "
            f"{data['params']['importtime_runs']} runs, the interpreter's own start-up modules "
            f"left out): {fmt(launch['total_self_ms'], 1)} ms in all. Of the foundation: "
            f"{foundation_text or 'none'}. Top modules by self time:",
            md_table(
                ["module (· = nesting)", "self ms", "cumulative ms"], _import_rows(launch, 12)
            ),
            f"What the owner loads while its command runs (`settled.owner.session`: the store, "
            f"records, identity, logs, lease, supervision, receipts): "
            f"{fmt(session['total_self_ms'], 1)} ms; off the admission path, but each fresh "
            "owner's CPU before it drains, and the foundation's to slim. Top modules:",
            md_table(
                ["module (· = nesting)", "self ms", "cumulative ms"], _import_rows(session, 15)
            ),
        ]
    )
