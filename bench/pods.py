"""pods: what joining a task's pod costs an admission, against the same admission without one.

Interleaved in one loop, on one Runtime with the fresh launcher (the launcher is this process,
so `SETTLED_PODS=off` set here between admissions reaches it), the same `true` admitted with
the task's pod (the default: the launcher finds the pod from its record; the init opens the
pod's namespaces inside the pods namespace, joins IPC and UTS, then the user namespace and the
keyring, and installs the key filter) and without one. Figures per run: exec to return (the
command runs), exec to the receipt, and the owner's `spawn_s` (where the joins are paid). Also,
outside the loop: `podns.ensure` finding a pod (every admission pays it) and making one (a
task's first session pays it). Ratios and differences are between the two variants of one run.
"""

from __future__ import annotations

import os
import time
from typing import Any

from common import distribution, fmt, header, log, machine, md_table, settled_rig

FULL = {"runs": 200, "makes": 30}
QUICK = {"runs": 20, "makes": 5}
VARIANTS = ("pod", "none")
PODS_ENV = "SETTLED_PODS"


def _once(rig: Any, variant: str) -> dict[str, float]:
    if variant == "none":
        os.environ[PODS_ENV] = "off"
    else:
        os.environ.pop(PODS_ENV, None)
    try:
        started = time.perf_counter()
        admission = rig.exec(argv=["true"])
        returned = time.perf_counter()
        view = rig.runtime.wait(admission.session, timeout=60.0)
        settled = time.perf_counter()
    finally:
        os.environ.pop(PODS_ENV, None)
    receipt = view["receipt"]
    assert receipt["death"]["proven"], receipt["death"]
    assert (receipt["isolation"]["pod"] is not None) == (variant == "pod"), receipt["isolation"]
    rig.forget_logs(admission.session)
    return {
        "return_ms": (returned - started) * 1000,
        "receipt_ms": (settled - started) * 1000,
        "spawn_ms": float(receipt["timings"]["spawn_s"]) * 1000,
    }


def _join_costs(home: str, task: str, runs: int) -> dict[str, Any]:
    """The init's joins alone (open_namespaces, join_before_view, join_after_view), timed in a
    forked child each (single-threaded, as the init is), without the fork."""
    from settled.boundary import podns

    pod = podns.ensure(home, task)
    podns.key_filter()  # made once per owner process, before it forks its init
    costs = []
    for _ in range(runs):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                started = time.perf_counter()
                joining = podns.open_namespaces(pod)
                podns.join_before_view(joining)
                podns.join_after_view(joining)
                os.write(write_end, b"%f" % ((time.perf_counter() - started) * 1000))
            finally:
                os._exit(0)
        os.close(write_end)
        costs.append(float(os.read(read_end, 64)))
        os.close(read_end)
        os.waitpid(pid, 0)
    return distribution(costs)


def _ensure_costs(rig: Any, makes: int) -> dict[str, Any]:
    from settled.boundary import podns

    home, found, made = rig.runtime.home, [], []
    for index in range(makes):
        task = f"t_bench{index:011d}"
        started = time.perf_counter()
        assert podns.ensure(home, task)["state"] == "created"
        made.append((time.perf_counter() - started) * 1000)
        for _ in range(10):
            started = time.perf_counter()
            assert podns.ensure(home, task)["state"] == "found"
            found.append((time.perf_counter() - started) * 1000)
        podns.release(home, task)
    return {"found_ms": distribution(found), "made_ms": distribution(made)}


def run(quick: bool) -> tuple[dict[str, Any], str]:
    sizes = QUICK if quick else FULL
    data: dict[str, Any] = {"machine": machine(), "sizes": sizes}
    records: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with settled_rig("pods", launcher="fresh") as rig:
        for variant in VARIANTS:  # warm-up: the pod made, the journal, the page cache
            _once(rig, variant)
        for index in range(sizes["runs"]):
            order = VARIANTS if index % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                records[variant].append(_once(rig, variant))
        data["ensure"] = _ensure_costs(rig, sizes["makes"])
        data["joins"] = _join_costs(rig.runtime.home, rig.task, sizes["runs"])
    summary = {
        variant: {
            key: distribution([r[key] for r in rows])
            for key in ("return_ms", "receipt_ms", "spawn_ms")
        }
        for variant, rows in records.items()
    }
    data["runs"], data["summary"] = records, summary
    pod, none = summary["pod"], summary["none"]
    log(
        f"exec->running p50 {pod['return_ms']['p50']:.2f} ms with the pod vs "
        f"{none['return_ms']['p50']:.2f} ms without; spawn p50 {pod['spawn_ms']['p50']:.2f} vs "
        f"{none['spawn_ms']['p50']:.2f} ms; ensure found p50 "
        f"{data['ensure']['found_ms']['p50']:.3f} ms, made p50 "
        f"{data['ensure']['made_ms']['p50']:.2f}"
        f" ms; the init's joins p50 {data['joins']['p50']:.3f} ms"
    )
    return data, render(data)


def render(data: dict[str, Any]) -> str:
    pod, none = data["summary"]["pod"], data["summary"]["none"]
    rows = []
    for key, label in (
        ("spawn_ms", "owner spawn (fork to exec)"),
        ("return_ms", "exec to running (return)"),
        ("receipt_ms", "exec to receipt"),
    ):
        for q in ("p50", "p99"):
            rows.append(
                [
                    f"{label} {q}",
                    fmt(pod[key][q]),
                    fmt(none[key][q]),
                    fmt(pod[key][q] - none[key][q]),
                    fmt(pod[key][q] / none[key][q]),
                ]
            )
    ensure = data["ensure"]
    return (
        header("pods: admission with and without the task's pod", data)
        + "\n\n"
        + md_table(["figure (fresh owner)", "pod ms", "no pod ms", "added ms", "ratio"], rows)
        + "\n\n`podns.ensure` in the launcher: finding a pod p50 "
        f"{fmt(ensure['found_ms']['p50'], 3)} ms (p99 {fmt(ensure['found_ms']['p99'], 3)}), "
        f"making one (a task's first session) p50 {fmt(ensure['made_ms']['p50'])} ms "
        f"(p99 {fmt(ensure['made_ms']['p99'])}). In the init, the joins alone (open the pod's "
        "namespaces in the pods namespace, join IPC and UTS, the user namespace, the keyring, "
        f"the key filter): p50 {fmt(data['joins']['p50'], 3)} ms "
        f"(p99 {fmt(data['joins']['p99'], 3)}).\n\n"
        "Pod: the default. No pod: `SETTLED_PODS=off` in the launcher (this process), same "
        "isolation otherwise, same Runtime, runs interleaved.\n"
    )
