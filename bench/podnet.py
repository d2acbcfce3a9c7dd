"""podnet: what joining the task's network namespace (`--network none`) costs an admission,
against the same admission in the host's network (`--network host`), both in the task's pod.

Interleaved in one loop, on one Runtime with the fresh launcher, the same `true` admitted with
`network="none"` (the init opens the pod's network namespace with its others and setns's it
with IPC and UTS, before the view) and with `network="host"` (the pod's other namespaces only).
Figures per run: exec to return (the command runs), exec to the receipt, and the owner's
`spawn_s` (where the join is paid). Also, outside the loop: the init's joins alone, with and
without the network namespace (each in a forked child, as the init is single-threaded), and
what a pod's first process pays to make the namespace (unshare(CLONE_NEWNET) and the loopback
brought up), paid once per task. Ratios and differences are between variants of one run.
"""

from __future__ import annotations

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
VARIANTS = ("none", "host")


def _once(rig: Any, variant: str) -> dict[str, float]:
    figures, receipt = timed_admission(rig, argv=["true"], network=variant)
    assert receipt["isolation"]["network"]["mode"] == variant, receipt["isolation"]
    return figures


def _join_costs(home: str, task: str, runs: int) -> dict[str, Any]:
    """The init's joins (open_namespaces, join_before_view, join_after_view) with the network
    namespace and without, interleaved."""
    from settled.boundary import podns

    pod = podns.ensure(home, task)
    podns.key_filter()  # made once per owner process, before it forks its init
    costs: dict[str, list[float]] = {v: [] for v in VARIANTS}

    def joins(network: str) -> None:
        joining = podns.open_namespaces({**pod, "network": network})
        podns.join_before_view(joining)
        podns.join_after_view(joining)

    for index in range(runs):
        for variant in VARIANTS if index % 2 == 0 else VARIANTS[::-1]:
            costs[variant].append(timed_in_child(lambda v=variant: joins(v)))
    return {v: distribution(c) for v, c in costs.items()}


def _make_costs(makes: int) -> dict[str, Any]:
    """What the pod's first process pays for its network namespace: unshare and loopback up."""
    from settled.boundary import linux, podnet

    def make() -> None:
        linux.unshare(linux.CLONE_NEWNET)
        podnet.loopback_up()

    return distribution([timed_in_child(make) for _ in range(makes)])


def run(quick: bool) -> tuple[dict[str, Any], str]:
    sizes = QUICK if quick else FULL
    data: dict[str, Any] = {"machine": machine(), "sizes": sizes}
    with settled_rig("podnet", launcher="fresh") as rig:
        records, summary = interleaved(VARIANTS, sizes["runs"], lambda v: _once(rig, v))
        data["joins"] = _join_costs(rig.runtime.home, rig.task, sizes["runs"])
        data["make_ms"] = _make_costs(sizes["makes"])
    data["runs"], data["summary"] = records, summary
    none, host = summary["none"], summary["host"]
    joins = data["joins"]
    log(
        f"exec->running p50 {none['return_ms']['p50']:.2f} ms with --network none vs "
        f"{host['return_ms']['p50']:.2f} ms host; spawn p50 {none['spawn_ms']['p50']:.2f} vs "
        f"{host['spawn_ms']['p50']:.2f} ms; the init's joins p50 {joins['none']['p50']:.3f} vs "
        f"{joins['host']['p50']:.3f} ms; making the namespace p50 {data['make_ms']['p50']:.2f} ms"
    )
    return data, render(data)


def render(data: dict[str, Any]) -> str:
    rows = comparison_rows(data["summary"]["none"], data["summary"]["host"])
    joins, made = data["joins"], data["make_ms"]
    return (
        header("podnet: admission joining the task's network namespace, and not", data)
        + "\n\n"
        + md_table(["figure (fresh owner)", "none ms", "host ms", "added ms", "ratio"], rows)
        + "\n\nIn the init, the joins alone (open the pod's namespaces in the pods namespace, "
        "join IPC, UTS and, for none, the network; the user namespace, the keyring, the key "
        f"filter): p50 {fmt(joins['none']['p50'], 3)} ms with the network namespace "
        f"(p99 {fmt(joins['none']['p99'], 3)}), {fmt(joins['host']['p50'], 3)} ms without "
        f"(p99 {fmt(joins['host']['p99'], 3)}). Making the namespace in the pod's first "
        f"process (unshare, loopback up; once per task): p50 {fmt(made['p50'])} ms "
        f"(p99 {fmt(made['p99'])}).\n\n"
        "Both variants run in the task's pod, on the same Runtime, interleaved; `none` joins "
        "its network namespace, `host` stays in the host's.\n"
    )
