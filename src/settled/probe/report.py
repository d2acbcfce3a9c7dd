"""What a probe run found, kept and shown: per runtime, every answer with its evidence and time.

Owns the report's shape (`to_json`: one object with the machine, and per runtime its name,
version, how and where, each question's verdict, answer, evidence and seconds, and anything
the final sweep had to end), its exit code, and its two renderings: the per-question text and
the comparison table (Markdown, one column per runtime, headed by its version) that the
README shows.
Must never: hide an answer that did not hold, or print a verdict the experiment did not return.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field
from typing import Any

from settled.errors import EXIT_BLOCKED, EXIT_OK
from settled.probe.questions import FAILS, HOLDS, NOT_APPLICABLE, QUESTIONS, Answer

EVIDENCE_VALUE_CHARS = 120


@dataclass
class RuntimeReport:
    """One runtime's answers, and what of it the final sweep found still running."""

    runtime: dict[str, str]
    answers: list[Answer]
    seconds: float
    left_running: list[dict[str, object]] = field(default_factory=list)
    cleanup_error: str | None = None

    @property
    def holds(self) -> bool:
        """Every applicable answer holds and nothing of the runtime outlived the probe."""
        return (
            all(a.outcome.verdict != FAILS for a in self.answers)
            and not self.left_running
            and self.cleanup_error is None
        )

    def to_json(self) -> dict[str, Any]:
        return {
            **self.runtime,
            "holds": self.holds,
            "answers": [a.to_json() for a in self.answers],
            "left_running": self.left_running,
            "cleanup_error": self.cleanup_error,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class Report:
    machine: dict[str, object]
    runtimes: list[RuntimeReport]

    @property
    def holds(self) -> bool:
        return all(r.holds for r in self.runtimes)

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.holds else EXIT_BLOCKED

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "holds": self.holds,
            "runtimes": [r.to_json() for r in self.runtimes],
        }


def header(runtime: dict[str, str], machine: dict[str, object]) -> str:
    return (
        f"settled probe: {runtime['version']} ({runtime['where']}), on {machine['host']} "
        f"{machine['os']} {machine['arch']}, {machine['cpus']} CPUs, Python {machine['python']}"
        f"\n  driven as: {runtime['how']}"
    )


def answer_text(answer: Answer) -> str:
    """A question's verdict, time, answer and evidence, wrapped to 100 columns."""
    outcome = answer.outcome
    lines = [f"{outcome.verdict.upper():>14}  {answer.seconds:6.2f} s  {answer.question.asks}"]
    lines += _wrap(outcome.answer, " " * 26, " " * 26)
    if outcome.evidence:
        facts = "; ".join(f"{k}={_short(v)}" for k, v in outcome.evidence.items())
        lines += _wrap("evidence: " + facts, " " * 26, " " * 28)
    return "\n".join(lines)


def _wrap(text: str, first: str, rest: str) -> list[str]:
    """Wrapped at 100 columns without breaking a digest or a path in two."""
    return textwrap.wrap(
        text, 100, initial_indent=first, subsequent_indent=rest,
        break_long_words=False, break_on_hyphens=False,
    )  # fmt: skip


def _short(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= EVIDENCE_VALUE_CHARS else text[: EVIDENCE_VALUE_CHARS - 1] + "…"


def runtime_text(report: RuntimeReport, machine: dict[str, object]) -> str:
    lines = [header(report.runtime, machine), ""]
    lines += [answer_text(a) for a in report.answers]
    held = sum(1 for a in report.answers if a.outcome.verdict == HOLDS)
    failed = sum(1 for a in report.answers if a.outcome.verdict == FAILS)
    skipped = sum(1 for a in report.answers if a.outcome.verdict == NOT_APPLICABLE)
    lines.append("")
    if report.left_running:
        lines.append(f"left running after the probe, ended by it: {report.left_running}")
    if report.cleanup_error:
        lines.append(f"cleanup failed: {report.cleanup_error}")
    verdict = "every applicable answer holds" if report.holds else "NOT every answer holds"
    lines.append(
        f"{verdict}: {held} hold, {failed} fail, {skipped} not applicable, "
        f"in {report.seconds:.1f} s"
    )
    return "\n".join(lines)


def table(report: Report) -> str:
    """The comparison table: a row per question, a column per runtime, as Markdown."""
    versions = [r.runtime["version"] for r in report.runtimes]
    head = ["question"] + [
        f"{r.runtime['version']} ({r.runtime['where']})" if versions.count(v) > 1 else v
        for r, v in zip(report.runtimes, versions, strict=True)
    ]
    rows = [head, ["---"] * len(head)]
    for question in QUESTIONS:
        row = [question.asks]
        for runtime in report.runtimes:
            found = [a for a in runtime.answers if a.question.id == question.id]
            row.append(_cell(found[0]) if found else "not asked")
        rows.append(row)
    return "\n".join("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |"
                     for row in rows)  # fmt: skip


def _cell(answer: Answer) -> str:
    verdict = answer.outcome.verdict
    mark = {HOLDS: "holds", FAILS: "**fails**", NOT_APPLICABLE: "n/a"}[verdict]
    return f"{mark}: {answer.outcome.answer} ({answer.seconds:.2f} s)"


def text(report: Report) -> str:
    parts = [runtime_text(r, report.machine) for r in report.runtimes]
    if len(report.runtimes) > 1:
        parts.append(table(report))
    return "\n\n".join(parts)
