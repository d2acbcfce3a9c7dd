"""`settled demo`: the seed's probes, run on the embedded default, each ending in a receipt.

A 4 MiB line with no newline (the line reader's failure), a silent command with a 1 s timeout (the
deadline that never fired), a command that leaves a `setsid` descendant holding its stdout (the
pipe that never closed), a retried admission (identity outlives transport) and a command that
cannot start; then a command that writes the workspace, a running service, and the close join
that stops the service, scans, checkpoints and fences, then a restore of the checkpoint.
Everything it prints is read back from the store.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from settled import baseline
from settled.errors import AdmissionSealed
from settled.render import close_text, receipt_text
from settled.runtime import Runtime

if TYPE_CHECKING:
    from settled.runtime import CloseResult


PROBES: list[tuple[str, dict[str, object]]] = [
    (
        "a 4 MiB single line, no newline",
        {"shell": "head -c 4194304 /dev/zero | tr '\\0' x", "key": "demo-4mib-line"},
    ),
    (
        "a silent command with a 1 s timeout",
        {"shell": "sleep 30", "timeout": 1.0, "grace": 1.0, "key": "demo-silent-timeout"},
    ),
    (
        "a command that leaves a setsid descendant holding its stdout",
        {
            "shell": "setsid sleep 300 & echo parent exits now",
            "grace": 1.0,
            "key": "demo-setsid-holder",
        },
    ),
    ("a command that cannot start", {"argv": ["./no-such-program"], "key": "demo-not-found"}),
    (
        "64 KiB of random binary",
        {
            "shell": "head -c 65536 /dev/urandom > random.bin && cat random.bin",
            "key": "demo-binary",
        },
    ),
]


def run_demo(rt: Runtime) -> int:
    task = rt.new_task()
    print(f"task {task.task}, workspace {task.workspace}, home {rt.home}\n")
    unproven = 0
    sessions: dict[str, str] = {}
    for title, params in PROBES:
        started = time.monotonic()
        admission = rt.exec(task.task, **params)  # type: ignore[arg-type]
        view = rt.wait(admission.session)
        took = time.monotonic() - started
        sessions[str(params["key"])] = admission.session
        print(f"== {title}  ({took:.2f} s from exec to receipt)")
        receipt = view["receipt"]
        print(receipt_text(receipt))
        if params["key"] == "demo-4mib-line":
            print("  model view (200 bytes):")
            print("    " + rt.view(admission.session, "stdout", 200).replace("\n", "\n    "))
        unproven += 0 if receipt["death"]["proven"] else 1
        print()
    retry = rt.exec(task.task, **PROBES[0][1])  # type: ignore[arg-type]
    print(
        f"== retrying the first admission with the same key: session {retry.session}, "
        f"reused={str(retry.reused).lower()}, state {retry.state} (nothing launched twice)\n"
    )
    writer = rt.exec(
        task.task,
        shell="mkdir -p src && echo 'print(42)' > src/main.py && ln -sf /etc/hostname host-link"
        " && printf late > written-just-before-exit.txt",
        key="demo-workspace-writer",
    )
    rt.wait(writer.session)
    service = rt.exec(task.task, shell="sleep 600", service=True, key="demo-dev-server")
    print(f"== a service is running ({service.session}); closing the task\n")
    result = rt.close_task(task.task, final="The demo ran every probe.", deadline=30)
    if not result.complete or result.receipt is None:
        print(f"close is blocked: {result.blocked_on}")
        return 3
    print(close_text(result.receipt))
    print("\n== explain\n" + rt.explain(task.task)["words"])
    destination = os.path.join(rt.home, f"restored-{task.task}")
    restored = rt.restore(task.task, destination)
    print(
        f"\n== restore: {restored.files} files, {restored.dirs} dirs, {restored.symlinks} "
        f"symlinks into {restored.dest}, every blob re-hashed"
    )
    sealed = "refused"
    try:
        rt.exec(task.task, shell="echo too late")
        sealed = "ADMITTED (a bug)"
    except AdmissionSealed:
        pass
    print(f"== exec after close: {sealed} (admission is sealed)")
    facts = _settled_facts(rt, sessions, retry.reused, task.workspace, restored.dest, result)
    print("\n== the essay's probes: a plain subprocess, then settled (both measured just now)\n")
    print(_table(baseline.run_all(), facts))
    return 0 if unproven == 0 else 3


def _settled_facts(
    rt: Runtime,
    sessions: dict[str, str],
    reused: bool,
    workspace: str,
    restored: str,
    result: CloseResult,
) -> dict[str, str]:
    """What settled's receipts say for each row, read back from the store."""

    def receipt(key: str) -> dict[str, Any]:
        return dict(rt.wait(sessions[key])["receipt"])

    output = receipt("demo-4mib-line")["output"]
    line = {"cursor": output["stdout"]["cursor"], "drain": output["drain"]}
    silent = receipt("demo-silent-timeout")
    holder = receipt("demo-setsid-holder")["death"]
    binary = rt.read(sessions["demo-binary"], "stdout", 0, 1 << 20)
    with open(os.path.join(restored, "random.bin"), "rb") as handle:
        same = binary == handle.read()
    late = os.path.exists(os.path.join(restored, "written-just-before-exit.txt"))
    close = result.receipt or {}
    return {
        "retry": f"1 launch: the same session (reused={str(reused).lower()})",
        "long_line": f"{line['cursor']} bytes at cursor {line['cursor']}, drain {line['drain']}",
        "binary": f"{len(binary)} bytes, {'bit for bit' if same else 'DIFFERENT (a bug)'}",
        "silent": f"{silent['exit']['reason']} after {_ran_for(silent):.2f} s by the owner's "
        "clock; tree proven dead",
        "holder": f"proven dead by {holder['boundary']}"
        if holder["proven"]
        else f"NOT proven dead ({holder['boundary']}): unknown, blocks close",
        "late_write": "in the checkpoint, restored" if late else "MISSING (a bug)",
        "receipt": f"close receipt {str(close.get('digest', '?'))[:19]}…; `explain` names each",
    }


def _ran_for(receipt: dict[str, Any]) -> float:
    timings = receipt["timings"]
    return float(timings["settled_at"]) - float(timings["spawned_at"])


ROWS = [
    ("retry after a lost response", "retry"),
    ("a 4 MiB line, no newline", "long_line"),
    ("64 KiB of random binary", "binary"),
    ("a silent command, 1 s timeout", "silent"),
    ("a setsid descendant holding stdout", "holder"),
    ("a file written just before exit", "late_write"),
    ("which receipt allowed success?", "receipt"),
]


def _table(plain: dict[str, baseline.Observed], facts: dict[str, str]) -> str:
    rows = [("probe", "plain subprocess", "settled")]
    for title, key in ROWS:
        seen = plain.get(key)
        rows.append((
            title,
            f"{seen.words} ({seen.seconds:.2f} s)" if seen else "an exit code, nothing more",
            facts[key],
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
             for row in rows]  # fmt: skip
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
