"""admission: how long `Runtime.exec` takes to return for `true`, against a bare posix_spawn.

`Runtime.exec` returns once the owner has claimed the session and spawned the command (state
'running', or already 'settled'). Measured per run, interleaved in the same loop: a bare
`os.posix_spawn` of the same command (+ waitpid), settled exec-to-return and exec-to-receipt,
a bare `python -I -S -c pass` with the same interpreter, and `python -I -S` importing the owner
with the owner's sys.path. The receipt's wall-clock timings split exec-to-return into phases;
`-X importtime` says which imports the owner pays for.
"""

from __future__ import annotations

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
    settled_rig,
)

FULL = {"runs": 200, "importtime_runs": 5}
QUICK = {"runs": 30, "importtime_runs": 2}
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


def _settled_once(rig: Any) -> dict[str, Any]:
    wall0 = time.time()
    started = time.perf_counter()
    admission = rig.exec(argv=["true"])
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
            "owner launch + claim (interpreter, imports, fork, open store, CAS)": t["claimed_at"]
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
    p = QUICK if quick else FULL
    from settled.owner.launcher import owner_path

    true_path = shutil.which("true")
    if true_path is None:
        raise RuntimeError("no `true` on PATH")
    exe = sys.executable
    path_json = json.dumps(owner_path())
    data: dict[str, Any] = {
        "benchmark": "admission",
        "quick": quick,
        "machine": machine(),
        "params": {**p, "command": [true_path], "interpreter": exe, "owner_path": path_json},
    }
    spawn, spawn_wait, py_pass, py_owner, settled = [], [], [], [], []
    with settled_rig("admission") as rig:
        for i in range(p["runs"]):
            s, w = _spawn_wait(true_path, ["true"])
            spawn.append(s)
            spawn_wait.append(w)
            settled.append(_settled_once(rig))
            py_pass.append(_spawn_wait(exe, [exe, "-I", "-S", "-c", "pass"])[1])
            py_owner.append(_spawn_wait(exe, [exe, "-I", "-S", "-c", OWNER_IMPORT, path_json])[1])
            if (i + 1) % 50 == 0 or i + 1 == p["runs"]:
                log(
                    f"admission {i + 1}/{p['runs']}: exec return p50 "
                    f"{median([r['exec_return_s'] for r in settled]) * 1e3:.1f} ms, posix_spawn "
                    f"p50 {median(spawn) * 1e3:.2f} ms"
                )
    imports = _importtime(path_json, p["importtime_runs"])
    ms = 1e3
    dists = {
        "posix_spawn(true) returned": distribution([v * ms for v in spawn]),
        "posix_spawn(true) + waitpid": distribution([v * ms for v in spawn_wait]),
        "settled exec -> returned": distribution([r["exec_return_s"] * ms for r in settled]),
        "settled exec -> receipt (Runtime.wait)": distribution(
            [r["exec_to_receipt_s"] * ms for r in settled]
        ),
        "python -I -S -c pass (spawn + wait)": distribution([v * ms for v in py_pass]),
        "python -I -S import settled.owner.main (spawn + wait)": distribution(
            [v * ms for v in py_owner]
        ),
    }
    phase_names = list(settled[0]["phases_s"])
    phases = {
        name: distribution([r["phases_s"][name] * ms for r in settled]) for name in phase_names
    }
    states: dict[str, int] = {}
    for r in settled:
        states[r["state_at_return"]] = states.get(r["state_at_return"], 0) + 1
    base = dists["posix_spawn(true) + waitpid"]["p50"]
    data["distributions_ms"] = dists
    data["phases_ms"] = phases
    data["state_at_return"] = states
    data["imports"] = imports
    data["summary"] = {
        "exec_return_p50_over_spawn_wait_p50": dists["settled exec -> returned"]["p50"] / base,
        "exec_receipt_p50_over_spawn_wait_p50": dists["settled exec -> receipt (Runtime.wait)"][
            "p50"
        ]
        / base,
        "owner_imports_p50_ms": dists["python -I -S import settled.owner.main (spawn + wait)"][
            "p50"
        ]
        - dists["python -I -S -c pass (spawn + wait)"]["p50"],
        "boundary": settled[0]["boundary"],
    }
    data["runs"] = {
        "posix_spawn_s": spawn,
        "posix_spawn_wait_s": spawn_wait,
        "python_pass_s": py_pass,
        "python_owner_import_s": py_owner,
        "settled": settled,
    }
    return data, render(data)


def render(data: dict[str, Any]) -> str:
    d, ph, s = data["distributions_ms"], data["phases_ms"], data["summary"]
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
        [name, fmt(v["p50"]), fmt(v["p90"]), fmt(v["p99"]), fmt(v["max"])] for name, v in ph.items()
    ]
    top = data["imports"][:15]
    import_rows = [
        [("· " * r["depth"]) + r["module"], fmt(r["self_ms"]), fmt(r["cumulative_ms"])] for r in top
    ]
    roots = [r for r in data["imports"] if r["depth"] == 0]
    roots.sort(key=lambda r: r["cumulative_ms"], reverse=True)
    root_text = ", ".join(f"`{r['module']}` {fmt(r['cumulative_ms'], 1)} ms" for r in roots[:6])
    states = ", ".join(f"{k}: {v}" for k, v in sorted(data["state_at_return"].items()))
    return "\n\n".join(
        [
            header("admission", data),
            f"`Runtime.exec(task, argv=['true'])` (boundary `{s['boundary']}`) against a bare "
            f"`os.posix_spawn` of the same `true`, interleaved in one loop, "
            f"{d['settled exec -> returned']['n']} runs each. Times in ms; the last column is "
            f"p50 over the p50 of posix_spawn + waitpid. State when exec returned: {states}.",
            md_table(["measurement (ms)", "n", "p50", "p90", "p99", "max", "p50 / spawn"], rows),
            "Where exec-to-return goes (from the receipt's wall-clock `timings`; the phases add "
            "up to exec-to-receipt):",
            md_table(["phase (ms)", "p50", "p90", "p99", "max"], phase_rows),
            f"The owner's imports alone cost about {fmt(s['owner_imports_p50_ms'], 1)} ms at "
            f"p50 (import run minus bare interpreter). `-X importtime` of the owner's imports "
            f"(median of {data['params']['importtime_runs']} runs), top modules by self time; "
            f"top-level cumulative: {root_text}.",
            md_table(["module (· = nesting)", "self ms", "cumulative ms"], import_rows),
        ]
    )
