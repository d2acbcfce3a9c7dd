"""isolation: what a session's isolation costs at admission, against the same session without it.

Interleaved in one loop, one Runtime per launcher, the same `true` admitted with
`--isolation auto` (the default: private mount, cgroup and PID namespaces, the allow-list view
built from an empty root and pivot_root with the task's pod directories, /proc, /sys, /dev
replaced or read-only, a shrunk bounding set, no_new_privs) and with `--isolation none`, on the
default boundary. Three figures per run:
exec to return (the admission a caller waits for), exec to the process receipt, and the owner's
own `spawn_s` (fork, boundary, view, privileges, exec until it is known to have succeeded),
which is where isolation is paid. Ratios and differences are taken between the two variants
of the same run; nothing is compared across runs.
"""

from __future__ import annotations

from typing import Any

from common import (
    comparison_rows,
    header,
    interleaved,
    log,
    machine,
    md_table,
    settled_rig,
    timed_admission,
)

FULL = {"runs": 200}
QUICK = {"runs": 20}
VARIANTS = ("auto", "none")


def _once(rig: Any, isolation: str) -> dict[str, float]:
    figures, receipt = timed_admission(rig, argv=["true"], isolation=isolation)
    if isolation == "auto":
        assert receipt["isolation"]["home_hidden"], receipt["isolation"]
    return figures


def run(quick: bool) -> tuple[dict[str, Any], str]:
    sizes = QUICK if quick else FULL
    data: dict[str, Any] = {"machine": machine(), "sizes": sizes, "launchers": {}}
    for launcher in ("warm", "fresh"):
        with settled_rig(f"isolation-{launcher}", launcher=launcher) as rig:
            records, summary = interleaved(VARIANTS, sizes["runs"], lambda v: _once(rig, v))
        data["launchers"][launcher] = {"runs": records, "summary": summary}
        auto, none = summary["auto"], summary["none"]
        log(
            f"{launcher}: exec->return p50 {auto['return_ms']['p50']:.2f} ms isolated vs "
            f"{none['return_ms']['p50']:.2f} ms; spawn p50 {auto['spawn_ms']['p50']:.2f} vs "
            f"{none['spawn_ms']['p50']:.2f} ms"
        )
    return data, render(data)


def render(data: dict[str, Any]) -> str:
    rows = [
        [launcher, *row]
        for launcher, result in data["launchers"].items()
        for row in comparison_rows(result["summary"]["auto"], result["summary"]["none"])
    ]
    return (
        header("isolation: admission with and without it", data)
        + "\n\n"
        + md_table(
            ["launcher", "figure", "isolated ms", "not isolated ms", "added ms", "ratio"], rows
        )
        + "\n\nIsolated: `--isolation auto` (the default). Not isolated: `--isolation none`, "
        "same boundary (cgroup2+pidns where available), same Runtime, runs interleaved.\n"
    )
