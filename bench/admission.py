"""admission: how long `Runtime.exec` takes to return for `true`, against a bare posix_spawn.

`Runtime.exec` returns once the owner has claimed the session and spawned the command (state
'running', or already further). Measured per run, interleaved in the same loop: a bare
`os.posix_spawn` of the same command (+ waitpid), settled exec-to-return and exec-to-receipt
with each owner launcher settled offers ('fresh': a new `python -I -S` per session, the default;
'warm': a pre-imported zygote forks the owner), a bare `python -I -S -c pass` with the same
interpreter, `python -I -S` importing the owner with the owner's sys.path, and a raw cgroup join.
The receipt's wall-clock timings split exec-to-return into phases; `-X importtime` says which
imports the fresh owner pays for.
"""

from __future__ import annotations

import contextlib
import json
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
)

FULL = {"runs": 200, "importtime_runs": 5, "per_boundary_runs": 40}
QUICK = {"runs": 30, "importtime_runs": 2, "per_boundary_runs": 6}
KINDS = ("cgroup2", "pidns", "subreaper")
OWNER_IMPORT = "import sys, json; sys.path[:0] = json.loads(sys.argv[1]); import settled.owner.main"


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


def _settled_once(rig: Any, boundary: str = "auto") -> dict[str, Any]:
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
    return {
        "state_at_return": admission.state,
        "boundary": receipt["death"]["boundary"],
        "exec_return_s": returned - started,
        "exec_to_receipt_s": received - started,
        "phases_s": {
            "admit (validate, boundary probe, store insert)": t["admitted_at"] - wall0,
            "owner launch + claim (fresh: interpreter + imports; fork, open store, CAS)": t[
                "claimed_at"
            ]
            - t["admitted_at"],
            "boundary setup + fork/exec of the command": t["spawned_at"] - t["claimed_at"],
            "record launch, readiness report, status read": (wall0 + returned - started)
            - t["spawned_at"],
            "exec returned -> receipt written (settled_at)": t["settled_at"]
            - (wall0 + returned - started),
            "settled_at -> Runtime.wait returned": (wall0 + received - started) - t["settled_at"],
        },
        "owner_maxrss_kib": receipt["owner"]["maxrss_kib"],
    }


def _cgroup_join_ms(hierarchy: str, tag: str) -> float:
    """A fresh child writes its pid into a new cgroup's cgroup.procs: ms the write took.

    The owner's cgroup2 boundary does exactly this between fork and exec (prepare_child).
    """
    path = os.path.join(hierarchy, f"settled-bench-raw-{os.getpid()}-{tag}")
    os.mkdir(path)
    try:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                t0 = time.perf_counter()
                with open(os.path.join(path, "cgroup.procs"), "w") as handle:
                    handle.write("0")
                os.write(write_end, str(time.perf_counter() - t0).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        os.waitpid(pid, 0)
        text = os.read(read_end, 64)
        os.close(read_end)
        if not text:
            raise RuntimeError(f"the child could not join {path}")
        return float(text) * 1e3
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


def _importtime(owner_path_json: str, runs: int) -> list[dict[str, Any]]:
    """Median self/cumulative microseconds per module over `runs` runs of -X importtime."""
    samples: dict[str, list[tuple[int, int]]] = {}
    depth: dict[str, int] = {}
    for _ in range(runs):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-I", "-S", "-c", OWNER_IMPORT, owner_path_json],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        for line in proc.stderr.splitlines():
            if not line.startswith("import time:") or "self [us]" in line:
                continue
            head, cumulative, name = line.split("|", 2)
            module = name.strip()
            depth[module] = (len(name) - len(name.lstrip()) - 1) // 2
            samples.setdefault(module, []).append((int(head.split(":", 1)[1]), int(cumulative)))
    rows = [
        {
            "module": module,
            "depth": depth[module],
            "self_ms": median([s for s, _ in values]) / 1000,
            "cumulative_ms": median([c for _, c in values]) / 1000,
        }
        for module, values in samples.items()
    ]
    rows.sort(key=lambda r: r["self_ms"], reverse=True)
    return rows


def run(quick: bool) -> tuple[dict[str, Any], str]:
    from settled.boundary import availability
    from settled.boundary.cgroup2 import find_hierarchy
    from settled.owner.launcher import owner_path

    p = QUICK if quick else FULL
    true_path = shutil.which("true")
    if true_path is None:
        raise RuntimeError("no `true` on PATH")
    exe = sys.executable
    path_json = json.dumps(owner_path())
    launchers = [name for name in ("fresh", "warm") if name in runtime_launchers()]
    reasons = availability()
    kinds = [k for k in KINDS if reasons.get(k) is None]
    hierarchy = find_hierarchy() if reasons.get("cgroup2") is None else None
    data: dict[str, Any] = {
        "benchmark": "admission",
        "quick": quick,
        "machine": machine(),
        "params": {
            **p,
            "command": [true_path],
            "interpreter": exe,
            "owner_path": path_json,
            "launchers": launchers,
        },
        "availability": reasons,
    }
    spawn, spawn_wait, py_pass, py_owner = [], [], [], []
    settled: dict[str, list[dict[str, Any]]] = {name: [] for name in launchers}
    first: dict[str, dict[str, Any]] = {}
    join_isolated: list[float] = []
    join_burst: list[float] = []
    per_kind = {name: {k: [] for k in kinds} for name in launchers}
    with contextlib.ExitStack() as stack:
        rigs = {
            name: stack.enter_context(
                settled_rig(f"admission-{name}", None if name == "fresh" else name)
            )
            for name in launchers
        }
        for name in launchers:  # untimed warm-up; for 'warm' this starts the zygote
            first[name] = _settled_once(rigs[name])
        for i in range(p["runs"]):
            s, w = _spawn_wait(true_path, ["true"])
            spawn.append(s)
            spawn_wait.append(w)
            for name in launchers:
                settled[name].append(_settled_once(rigs[name]))
            py_pass.append(_spawn_wait(exe, [exe, "-I", "-S", "-c", "pass"])[1])
            py_owner.append(_spawn_wait(exe, [exe, "-I", "-S", "-c", OWNER_IMPORT, path_json])[1])
            if hierarchy is not None:
                join_isolated.append(_cgroup_join_ms(hierarchy, f"{i}"))
                if i % 10 == 0:  # back to back: the second join finds the lock's fast path
                    join_burst += [_cgroup_join_ms(hierarchy, f"{i}-b{j}") for j in range(4)][1:]
            if (i + 1) % 50 == 0 or i + 1 == p["runs"]:
                medians = ", ".join(
                    f"{name} {median([r['exec_return_s'] for r in settled[name]]) * 1e3:.1f} ms"
                    for name in launchers
                )
                log(
                    f"admission {i + 1}/{p['runs']}: exec return p50 {medians}; posix_spawn "
                    f"p50 {median(spawn) * 1e3:.2f} ms"
                )
        for _ in range(p["per_boundary_runs"]):
            for name in launchers:
                for kind in kinds:
                    per_kind[name][kind].append(_settled_once(rigs[name], kind))
        log(f"admission per boundary: {p['per_boundary_runs']} runs each of {kinds} x {launchers}")
    imports = _importtime(path_json, p["importtime_runs"])
    ms = 1e3
    dists = {
        "posix_spawn(true) returned": distribution([v * ms for v in spawn]),
        "posix_spawn(true) + waitpid": distribution([v * ms for v in spawn_wait]),
    }
    for name in launchers:
        dists[f"settled exec -> returned ({name} owner)"] = distribution(
            [r["exec_return_s"] * ms for r in settled[name]]
        )
        dists[f"settled exec -> receipt ({name} owner)"] = distribution(
            [r["exec_to_receipt_s"] * ms for r in settled[name]]
        )
    dists["python -I -S -c pass (spawn + wait)"] = distribution([v * ms for v in py_pass])
    dists["python -I -S import settled.owner.main (spawn + wait)"] = distribution(
        [v * ms for v in py_owner]
    )
    phase_names = list(settled["fresh"][0]["phases_s"])
    phases = {
        name: {
            phase: distribution([r["phases_s"][phase] * ms for r in settled[name]])
            for phase in phase_names
        }
        for name in launchers
    }
    spawn_phase = "boundary setup + fork/exec of the command"
    data["per_boundary_ms"] = {
        name: {
            kind: {
                "exec_return": distribution([r["exec_return_s"] * ms for r in runs]),
                "boundary_and_spawn": distribution([r["phases_s"][spawn_phase] * ms for r in runs]),
            }
            for kind, runs in per_kind[name].items()
        }
        for name in launchers
    }
    data["cgroup_join_ms"] = {
        "isolated": distribution(join_isolated),
        "back_to_back": distribution(join_burst),
    }
    states: dict[str, dict[str, int]] = {}
    for name in launchers:
        states[name] = {}
        for r in settled[name]:
            states[name][r["state_at_return"]] = states[name].get(r["state_at_return"], 0) + 1
    base = dists["posix_spawn(true) + waitpid"]["p50"]
    data["distributions_ms"] = dists
    data["phases_ms"] = phases
    data["state_at_return"] = states
    data["first_exec_ms"] = {name: r["exec_return_s"] * ms for name, r in first.items()}
    data["imports"] = imports
    data["summary"] = {
        **{
            f"exec_return_p50_over_spawn_wait_p50_{name}": dists[
                f"settled exec -> returned ({name} owner)"
            ]["p50"]
            / base
            for name in launchers
        },
        "owner_imports_p50_ms": dists["python -I -S import settled.owner.main (spawn + wait)"][
            "p50"
        ]
        - dists["python -I -S -c pass (spawn + wait)"]["p50"],
        "boundary": settled["fresh"][0]["boundary"],
    }
    data["runs"] = {
        "posix_spawn_s": spawn,
        "posix_spawn_wait_s": spawn_wait,
        "python_pass_s": py_pass,
        "python_owner_import_s": py_owner,
        "settled": {name: _columns(runs) for name, runs in settled.items()},
        "first_exec": first,
        "per_boundary": {
            name: {kind: _columns(runs) for kind, runs in kinds_runs.items()}
            for name, kinds_runs in per_kind.items()
        },
        "cgroup_join_isolated_ms": join_isolated,
        "cgroup_join_back_to_back_ms": join_burst,
    }
    return data, render(data)


def render(data: dict[str, Any]) -> str:
    d, ph, s = data["distributions_ms"], data["phases_ms"], data["summary"]
    launchers = data["params"]["launchers"]
    base = d["posix_spawn(true) + waitpid"]["p50"]
    rows = [
        [
            name,
            v["n"],
            fmt(v["p50"]),
            fmt(v["p90"]),
            fmt(v["p99"]),
            fmt(v["max"]),
            fmt(v["p50"] / base, 1),
        ]
        for name, v in d.items()
    ]
    phase_rows = [
        [phase] + [fmt(ph[name][phase][q]) for name in launchers for q in ("p50", "p90", "max")]
        for phase in ph["fresh"]
    ]
    phase_headers = ["phase (ms)"] + [
        f"{name} {q}" for name in launchers for q in ("p50", "p90", "max")
    ]
    kinds = list(data["per_boundary_ms"]["fresh"])
    kind_rows = [
        [kind]
        + [
            fmt(data["per_boundary_ms"][name][kind][what]["p50"])
            for name in launchers
            for what in ("exec_return", "boundary_and_spawn")
        ]
        for kind in kinds
    ]
    kind_headers = ["boundary"] + [
        f"{name} {what} p50" for name in launchers for what in ("exec -> returned", "setup + spawn")
    ]
    join = data["cgroup_join_ms"]
    join_rows = [
        [name, v["n"], fmt(v.get("p50")), fmt(v.get("p90")), fmt(v.get("max"))]
        for name, v in (
            ("fresh child joins a new cgroup, isolated (one per loop turn)", join["isolated"]),
            ("the same, 2nd-4th of 4 back to back", join["back_to_back"]),
        )
    ]
    top = data["imports"][:15]
    import_rows = [
        [("· " * r["depth"]) + r["module"], fmt(r["self_ms"]), fmt(r["cumulative_ms"])] for r in top
    ]
    roots = [r for r in data["imports"] if r["depth"] == 0]
    roots.sort(key=lambda r: r["cumulative_ms"], reverse=True)
    root_text = ", ".join(f"`{r['module']}` {fmt(r['cumulative_ms'], 1)} ms" for r in roots[:4])
    states = "; ".join(
        f"{name}: "
        + ", ".join(f"{k} {v}" for k, v in sorted(data["state_at_return"][name].items()))
        for name in launchers
    )
    first = ", ".join(f"{name} {fmt(v, 1)} ms" for name, v in data["first_exec_ms"].items())
    n = d["posix_spawn(true) + waitpid"]["n"]
    return "\n\n".join(
        [
            header("admission", data),
            f"`Runtime.exec(task, argv=['true'])` (boundary `{s['boundary']}`) with each owner "
            f"launcher (`fresh`: a new `python -I -S` per session, the default; `warm`: "
            f"`Runtime(launcher='warm')`, a pre-imported zygote forks the owner) against a bare "
            f"`os.posix_spawn` of the same `true`, interleaved in one loop, {n} runs each. Times "
            f"in ms; the last column is p50 over the p50 of posix_spawn + waitpid. State when exec "
            f"returned: {states}. The first, untimed exec of each Runtime took: {first}.",
            md_table(["measurement (ms)", "n", "p50", "p90", "p99", "max", "p50 / spawn"], rows),
            "Where exec-to-receipt goes (from the receipt's wall-clock `timings`; the phases add "
            "up to exec-to-receipt; the first four to exec-to-return):",
            md_table(phase_headers, phase_rows),
            f"The same `true` per boundary ({data['params']['per_boundary_runs']} runs each, "
            "interleaved): exec-to-return and its boundary setup + fork/exec phase, p50 in ms:",
            md_table(kind_headers, kind_rows),
            "What joining a cgroup costs (the cgroup2 boundary's child writes its pid into "
            "`cgroup.procs` before exec): a raw fork + write in this process, in ms. Moving a "
            "process between cgroups takes the cgroup threadgroup rwsem for writing, which waits "
            "for an RCU grace period unless the lock was taken moments ago (or the hierarchy is "
            "mounted with `favordynmods`); `clone3(CLONE_INTO_CGROUP)` avoids the migration.",
            md_table(["join", "n", "p50", "p90", "max"], join_rows),
            f"The fresh owner's imports alone cost about {fmt(s['owner_imports_p50_ms'], 1)} ms "
            f"at p50 (import run minus bare interpreter). `-X importtime` of the owner's imports "
            f"(median of {data['params']['importtime_runs']} runs), top modules by self time; "
            f"top-level cumulative: {root_text}.",
            md_table(["module (· = nesting)", "self ms", "cumulative ms"], import_rows),
        ]
    )
