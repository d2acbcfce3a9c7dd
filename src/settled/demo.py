"""`settled demo`: the seed's probes, run on the embedded default, each ending in a receipt.

A 4 MiB line with no newline (the line reader's failure), a silent command with a 1 s timeout (the
deadline that never fired), a command that leaves a `setsid` descendant holding its stdout (the
pipe that never closed), a retried admission (identity outlives transport) and a command that
cannot start. Everything it prints is read back from the store.
"""

from __future__ import annotations

import time

from settled.render import receipt_text
from settled.runtime import Runtime

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
]


def run_demo(rt: Runtime) -> int:
    task = rt.new_task()
    print(f"task {task.task}, workspace {task.workspace}, home {rt.home}\n")
    unproven = 0
    for title, params in PROBES:
        started = time.monotonic()
        admission = rt.exec(task.task, **params)  # type: ignore[arg-type]
        view = rt.wait(admission.session)
        took = time.monotonic() - started
        print(f"== {title}  ({took:.2f} s from exec to receipt)")
        receipt = view["receipt"]
        print(receipt_text(receipt))
        if receipt["output"]["stdout"]["cursor"] > 256:
            print("  model view (200 bytes):")
            print("    " + rt.view(admission.session, "stdout", 200).replace("\n", "\n    "))
        unproven += 0 if receipt["death"]["proven"] else 1
        print()
    retry = rt.exec(task.task, **PROBES[0][1])  # type: ignore[arg-type]
    print(
        f"== retrying the first admission with the same key: session {retry.session}, "
        f"reused={str(retry.reused).lower()}, state {retry.state} (nothing launched twice)"
    )
    return 0 if unproven == 0 else 3
