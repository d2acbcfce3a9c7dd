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

from common import (
    comparison_rows,
    distribution,
    fmt,
    header,
    interleaved,
    log,
    machine,
    md_table,
    settled_rig,
    timed_admission,
    timed_in_child,
)

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
        figures, receipt = timed_admission(rig, argv=["true"])
    finally:
        os.environ.pop(PODS_ENV, None)
    assert (receipt["isolation"]["pod"] is not None) == (variant == "pod"), receipt["isolation"]
    return figures


def _join_costs(home: str, task: str, runs: int) -> dict[str, Any]:
    """The init's joins alone (open_namespaces, join_before_view, join_after_view), timed in a
    forked child each (single-threaded, as the init is), without the fork."""
    from settled.boundary import podns

    pod = podns.ensure(home, task)
    podns.key_filter()  # made once per owner process, before it forks its init

    def joins() -> None:
        joining = podns.open_namespaces(pod)
        podns.join_before_view(joining)
        podns.join_after_view(joining)

    return distribution([timed_in_child(joins) for _ in range(runs)])


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
    with settled_rig("pods", launcher="fresh") as rig:
        records, summary = interleaved(VARIANTS, sizes["runs"], lambda v: _once(rig, v))
        data["ensure"] = _ensure_costs(rig, sizes["makes"])
        data["joins"] = _join_costs(rig.runtime.home, rig.task, sizes["runs"])
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
    rows = comparison_rows(data["summary"]["pod"], data["summary"]["none"])
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
