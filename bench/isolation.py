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

import time
from typing import Any

from common import distribution, fmt, header, log, machine, md_table, settled_rig

FULL = {"runs": 200}
QUICK = {"runs": 20}
VARIANTS = ("auto", "none")


def _once(rig: Any, isolation: str) -> dict[str, float]:
    started = time.perf_counter()
    admission = rig.exec(argv=["true"], isolation=isolation)
    returned = time.perf_counter()
    view = rig.runtime.wait(admission.session, timeout=60.0)
    settled = time.perf_counter()
    receipt = view["receipt"]
    assert receipt["death"]["proven"], receipt["death"]
    if isolation == "auto":
        assert receipt["isolation"]["home_hidden"], receipt["isolation"]
    rig.forget_logs(admission.session)
    return {
        "return_ms": (returned - started) * 1000,
        "receipt_ms": (settled - started) * 1000,
        "spawn_ms": float(receipt["timings"]["spawn_s"]) * 1000,
    }


def run(quick: bool) -> tuple[dict[str, Any], str]:
    sizes = QUICK if quick else FULL
    data: dict[str, Any] = {"machine": machine(), "sizes": sizes, "launchers": {}}
    for launcher in ("warm", "fresh"):
        records: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
        with settled_rig(f"isolation-{launcher}", launcher=launcher) as rig:
            for variant in VARIANTS:  # warm-up: the zygote, the journal, the page cache
                _once(rig, variant)
            for index in range(sizes["runs"]):
                order = VARIANTS if index % 2 == 0 else VARIANTS[::-1]
                for variant in order:
                    records[variant].append(_once(rig, variant))
        summary = {
            variant: {
                key: distribution([r[key] for r in rows])
                for key in ("return_ms", "receipt_ms", "spawn_ms")
            }
            for variant, rows in records.items()
        }
        data["launchers"][launcher] = {"runs": records, "summary": summary}
        auto, none = summary["auto"], summary["none"]
        log(
            f"{launcher}: exec->return p50 {auto['return_ms']['p50']:.2f} ms isolated vs "
            f"{none['return_ms']['p50']:.2f} ms; spawn p50 {auto['spawn_ms']['p50']:.2f} vs "
            f"{none['spawn_ms']['p50']:.2f} ms"
        )
    return data, render(data)


def render(data: dict[str, Any]) -> str:
    rows = []
    for launcher, result in data["launchers"].items():
        auto, none = result["summary"]["auto"], result["summary"]["none"]
        for key, label in (
            ("spawn_ms", "owner spawn (fork to exec)"),
            ("return_ms", "exec to return"),
            ("receipt_ms", "exec to receipt"),
        ):
            for q in ("p50", "p99"):
                rows.append(
                    [
                        launcher,
                        f"{label} {q}",
                        fmt(auto[key][q]),
                        fmt(none[key][q]),
                        fmt(auto[key][q] - none[key][q]),
                        fmt(auto[key][q] / none[key][q]),
                    ]
                )
    return (
        header("isolation: admission with and without it", data)
        + "\n\n"
        + md_table(
            ["launcher", "figure", "isolated ms", "not isolated ms", "added ms", "ratio"], rows
        )
        + "\n\nIsolated: `--isolation auto` (the default). Not isolated: `--isolation none`, "
        "same boundary (cgroup2+pidns where available), same Runtime, runs interleaved.\n"
    )
