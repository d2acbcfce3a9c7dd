"""`settled probe`: the essay's review checklist, run as experiments against a runtime.

Owns the run: open every adapter `--runtime` names (so a bad name or an unreachable URL is
refused before anything runs), ask each every question (`questions.QUESTIONS`) in turn, close it,
sweep the machine for any process still carrying the run's marker (ended, and reported), and
return the `report.Report`. Adapters: `settled` (a Runtime on a fresh temporary home, never the
user's, or a service URL through `settled.client`), `subprocess` (plain `subprocess.run` with a
timeout) and `swerex` (SWE-ReX's local runtime, when installed).
Must never: report an answer an experiment did not give, leave a process, task, session or home
of its own behind, or open the user's home.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from settled.probe.adapter import RUNTIMES, Adapter, open_adapter
from settled.probe.host import Sweep, machine
from settled.probe.questions import QUESTION_IDS, Question, run_questions
from settled.probe.report import Report, RuntimeReport

__all__ = ["QUESTION_IDS", "RUNTIMES", "Report", "probe"]


def probe(
    runtimes: Sequence[str],
    only: Sequence[str] = QUESTION_IDS,
    progress: Callable[[str, Question], None] | None = None,
) -> Report:
    """Every question of `only` against every runtime named, in order. BadInput (nothing run)
    for an unknown runtime or question, an unreachable URL or a runtime not installed."""
    from settled.errors import BadInput

    unknown = sorted(set(only) - set(QUESTION_IDS))
    if unknown:
        raise BadInput(f"unknown question {unknown[0]!r}: one of {', '.join(QUESTION_IDS)}")
    sweep = Sweep()
    adapters: list[Adapter] = []
    try:
        for runtime in runtimes:
            adapters.append(open_adapter(runtime, sweep))
        reports = []
        while adapters:
            reports.append(_ask(adapters.pop(0), sweep, tuple(only), progress))
    finally:
        for adapter in adapters:  # interrupted: the ones never asked are closed too
            adapter.close()
    return Report(machine(), reports)


def _ask(
    adapter: Adapter,
    sweep: Sweep,
    only: tuple[str, ...],
    progress: Callable[[str, Question], None] | None,
) -> RuntimeReport:
    """One runtime's answers; then the adapter is closed and the machine swept."""
    started = time.monotonic()
    described = adapter.describe()
    error = None
    try:
        answers = run_questions(
            adapter.experiments(), only,
            None if progress is None else lambda q: progress(described["version"], q),
        )  # fmt: skip
    finally:
        try:
            adapter.close()
        except Exception as exc:  # reported: a cleanup that failed is an answer too
            error = f"{type(exc).__name__}: {exc}"
        left = [proc.to_json() for proc in sweep.end()]
    return RuntimeReport(described, answers, time.monotonic() - started, left, error)
