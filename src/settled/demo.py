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

from settled.errors import AdmissionSealed
from settled.render import close_text, receipt_text
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
    return 0 if unproven == 0 else 3
