"""`settled demo`: the essay's checklist run on the embedded default, each answer with its receipts.

The experiments are `settled probe`'s (settled.probe): every question is asked of settled on the
demo's own Runtime and home, and each answer is printed with the process receipts of the
sessions it made (read back from the store). Then what the checklist does not ask: a command
that cannot start and a running service, closed with a command that wrote the workspace (the
close stops the service, checkpoints, fences), with `explain`. It ends with the comparison
table: the same experiments on a plain `subprocess.run`, measured just now, beside settled's.
What it prints of a command (its output's model view, paths, words) is escaped as in every
human view (`printable`).
Must never: run an experiment of its own that the probe also runs (one copy of each).
"""

from __future__ import annotations

import time

from settled.errors import EXIT_BLOCKED, EXIT_OK
from settled.printable import printable
from settled.probe.host import Sweep, machine
from settled.probe.plain import PlainAdapter
from settled.probe.questions import HOLDS, Answer, run_questions
from settled.probe.report import Report, RuntimeReport, table
from settled.probe.settled_adapter import SettledAdapter
from settled.probe.settled_local import LocalBackend
from settled.render import close_text, explain_brief, receipt_text
from settled.runtime import Runtime

VIEW_BYTES = 200  # the model view of the 4 MiB line, as an agent would be shown it


def run_demo(rt: Runtime) -> int:
    print(f"home {printable(str(rt.home))}\n")
    sweep = Sweep()
    try:
        ours = SettledAdapter(sweep, LocalBackend(rt))
        started = time.monotonic()
        answers = run_questions(ours.experiments())
        settled = RuntimeReport(ours.describe(), answers, time.monotonic() - started)
        for answer in answers:
            _show(rt, answer, ours.sessions.get(answer.question.id, []))
        closed = _close_story(rt)
        print("\n== the essay's checklist: a plain subprocess, then settled (both measured now)\n")
        plain = PlainAdapter(sweep)
        started = time.monotonic()
        baseline = RuntimeReport(
            plain.describe(), run_questions(plain.experiments()), time.monotonic() - started
        )
        print(table(Report(machine(), [baseline, settled])))
    finally:
        settled_left = sweep.end()
    held = all(a.outcome.verdict == HOLDS for a in answers)
    return EXIT_OK if held and closed and not settled_left else EXIT_BLOCKED


def _show(rt: Runtime, answer: Answer, sessions: list[str]) -> None:
    """A question, settled's answer, and the receipt of every session it made."""
    print(f"== {answer.question.asks}  ({answer.seconds:.2f} s)")
    print(f"   {answer.outcome.verdict}: {answer.outcome.answer}")
    for session in dict.fromkeys(sessions):  # a retry names its session twice
        print(receipt_text(rt.wait(session, 60)["receipt"]))
        if answer.question.id == "long_line":
            print(f"  model view ({VIEW_BYTES} bytes):")
            lines = rt.view(session, "stdout", VIEW_BYTES).split("\n")
            print("\n".join(f"    {printable(line)}" for line in lines))
    print()


def _close_story(rt: Runtime) -> bool:
    """A command that cannot start, one that writes the workspace, a running service; then
    the close join: it stops the service, scans, checkpoints, reads back and fences."""
    task = rt.new_task()
    missing = rt.exec(task.task, argv=["./no-such-program"], key="demo-not-found")
    print("== a command that cannot start")
    print(receipt_text(rt.wait(missing.session, 60)["receipt"]))
    writer = rt.exec(
        task.task,
        shell="mkdir -p src && echo 'print(42)' > src/main.py && ln -sf /etc/hostname host-link",
        key="demo-workspace-writer",
    )
    rt.wait(writer.session, 60)
    service = rt.exec(task.task, shell="sleep 600", service=True, key="demo-dev-server")
    print(f"\n== a service is running ({service.session}); closing the task\n")
    result = rt.close_task(task.task, final="The demo ran every probe.", deadline=30)
    if not result.complete or result.receipt is None:
        print(f"close is blocked: {printable(str(result.blocked_on))}")
        return False
    print(close_text(result.receipt))
    more = (
        f"(every session's evidence: settled explain {task.task} --verbose,\n"
        " in a home the demo kept: settled demo --keep-home)"
    )
    print("\n== explain\n" + explain_brief(rt.explain(task.task), more))
    return True
