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

import os
import time
from typing import Any

from common import distribution, fmt, header, log, machine, md_table, settled_rig

FULL = {"runs": 200, "makes": 30}
QUICK = {"runs": 20, "makes": 5}
VARIANTS = ("none", "host")


def _once(rig: Any, variant: str) -> dict[str, float]:
    started = time.perf_counter()
    admission = rig.exec(argv=["true"], network=variant)
    returned = time.perf_counter()
    view = rig.runtime.wait(admission.session, timeout=60.0)
    settled = time.perf_counter()
    receipt = view["receipt"]
    assert receipt["death"]["proven"], receipt["death"]
    assert receipt["isolation"]["network"]["mode"] == variant, receipt["isolation"]
    rig.forget_logs(admission.session)
    return {
        "return_ms": (returned - started) * 1000,
        "receipt_ms": (settled - started) * 1000,
        "spawn_ms": float(receipt["timings"]["spawn_s"]) * 1000,
    }


def _in_child(work: Any) -> float:
    """`work()` timed in a forked child (single-threaded, as the init is), the fork excluded."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            started = time.perf_counter()
            work()
            os.write(write_end, b"%f" % ((time.perf_counter() - started) * 1000))
        finally:
            os._exit(0)
    os.close(write_end)
    answer = os.read(read_end, 64)
    os.close(read_end)
    os.waitpid(pid, 0)
    return float(answer)


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
            costs[variant].append(_in_child(lambda v=variant: joins(v)))
    return {v: distribution(c) for v, c in costs.items()}


def _make_costs(makes: int) -> dict[str, Any]:
    """What the pod's first process pays for its network namespace: unshare and loopback up."""
    from settled.boundary import linux, podnet

    def make() -> None:
        linux.unshare(linux.CLONE_NEWNET)
        podnet.loopback_up()

    return distribution([_in_child(make) for _ in range(makes)])


def run(quick: bool) -> tuple[dict[str, Any], str]:
    sizes = QUICK if quick else FULL
    data: dict[str, Any] = {"machine": machine(), "sizes": sizes}
    records: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with settled_rig("podnet", launcher="fresh") as rig:
        for variant in VARIANTS:  # warm-up: the pod made, the journal, the page cache
            _once(rig, variant)
        for index in range(sizes["runs"]):
            order = VARIANTS if index % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                records[variant].append(_once(rig, variant))
        data["joins"] = _join_costs(rig.runtime.home, rig.task, sizes["runs"])
        data["make_ms"] = _make_costs(sizes["makes"])
    summary = {
        variant: {
            key: distribution([r[key] for r in rows])
            for key in ("return_ms", "receipt_ms", "spawn_ms")
        }
        for variant, rows in records.items()
    }
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
    none, host = data["summary"]["none"], data["summary"]["host"]
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
                    fmt(none[key][q]),
                    fmt(host[key][q]),
                    fmt(none[key][q] - host[key][q]),
                    fmt(none[key][q] / host[key][q]),
                ]
            )
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
