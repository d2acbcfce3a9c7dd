"""The essay's review checklist as experiments: the questions, the commands, and the runner.

Owns the catalogue (`QUESTIONS`, in the order the report prints them), the commands every adapter
runs for them (the same bytes for every runtime, so the answers compare), the `Outcome` an adapter
returns (holds, fails or not applicable, in words, with evidence) and `run_questions`, which
times each experiment in a scratch directory of its own and turns an experiment that raised
into a failed answer naming the error.
Must never: decide an answer (adapters experiment; this only times and records), let one
experiment's error hide the others, or call a runtime that could not show a thing "holds".
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HOLDS, FAILS, NOT_APPLICABLE = "holds", "fails", "not applicable"

LINE_BYTES = 4 << 20  # a 4 MiB line without newline
LONG_LINE = f"head -c {LINE_BYTES} /dev/zero | tr '\\0' x"
BINARY_BYTES = 64 << 10
BINARY = (
    f"head -c {BINARY_BYTES} /dev/urandom > random.bin && sha256sum random.bin > random.sha256"
    " && cat random.bin"
)
LAUNCH = "echo launched >> launches.txt; echo launched"
SILENT = "sleep 30"
SILENT_TIMEOUT_S = 1.0
GRACE_S = 1.0  # settled's TERM-to-KILL grace in these experiments
ON_TIME_SLACK_S = 1.5  # a loaded 2-CPU machine: a stop this late past the deadline is on time
HOLDER = "setsid sleep 60 & echo parent exits"
HOLDER_TIMEOUT_S = 4.0  # how long a caller that waits for EOF waits here
KILLED_SLEEP = "sleep 30"
KILLED = f"echo launched >> launches.txt; echo launched; {KILLED_SLEEP}"
LATE_WRITE = "sleep 0.2; printf %s {token} > late.txt"
DONE = "echo done"


@dataclass(frozen=True)
class Question:
    """One line of the checklist: `asks` as the issue words it, `does` what the probe does."""

    id: str
    asks: str
    does: str


QUESTIONS: tuple[Question, ...] = (
    Question(
        "retry",
        "retry after a lost response: one launch?",
        "admit a command that appends to launches.txt, lose the answer, retry the same call; "
        "count the lines",
    ),
    Question(
        "long_line",
        "a 4 MiB line without newline: bit for bit?",
        f"`{LONG_LINE}`; compare what the caller gets with the 4,194,304 bytes written",
    ),
    Question(
        "binary",
        "64 KiB of random binary: bit for bit?",
        "write 64 KiB of /dev/urandom to a file and cat it; compare the output with the file's "
        "sha256",
    ),
    Question(
        "silent",
        "a silent command with a 1 s timeout: stopped on time?",
        f"`{SILENT}` with a {SILENT_TIMEOUT_S:g} s timeout; when did the call return, and does "
        "anything of the command still run?",
    ),
    Question(
        "holder",
        "a setsid descendant holding the pipe: dead after the call, and who proved it?",
        f"`{HOLDER}`; does the call return, is the descendant alive after it, what proves it?",
    ),
    Question(
        "owner_killed",
        "the owner killed mid-run: Unknown, never relaunched?",
        "SIGKILL whatever supervises a running command; what does status say, does a retry "
        "launch it again, who settles it?",
    ),
    Question(
        "late_write",
        "a file written a moment before exit: in the checkpoint?",
        "the command's last act writes late.txt; is that file, with those bytes, in the "
        "checkpoint?",
    ),
    Question(
        "fenced",
        "a write from a fenced generation: refused?",
        "after close fences the task's generation, write with the old one and exec again",
    ),
    Question(
        "receipt",
        "which receipt allowed success?",
        "run `echo done`, finish, and ask the runtime what allowed success",
    ),
)
QUESTION_IDS = tuple(q.id for q in QUESTIONS)


@dataclass(frozen=True)
class Outcome:
    """What an experiment showed: a verdict, the answer in one line, and the evidence."""

    verdict: str
    answer: str
    evidence: dict[str, Any] = field(default_factory=dict)


def holds(answer: str, **evidence: Any) -> Outcome:
    return Outcome(HOLDS, answer, evidence)


def fails(answer: str, **evidence: Any) -> Outcome:
    return Outcome(FAILS, answer, evidence)


def not_applicable(why: str, **evidence: Any) -> Outcome:
    return Outcome(NOT_APPLICABLE, why, evidence)


def judged(ok: bool, answer: str, **evidence: Any) -> Outcome:
    """Holds when every condition of the experiment held, else fails, in the same words."""
    return Outcome(HOLDS if ok else FAILS, answer, evidence)


@dataclass(frozen=True)
class Answer:
    question: Question
    outcome: Outcome
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "question": self.question.id,
            "asks": self.question.asks,
            "verdict": self.outcome.verdict,
            "answer": self.outcome.answer,
            "evidence": self.outcome.evidence,
            "seconds": round(self.seconds, 3),
        }


Experiment = Callable[[str], Outcome]  # given a scratch directory of its own


def experiments_of(adapter: object) -> dict[str, Experiment]:
    """An adapter's experiments, one per question id: each is its method of the same name, so
    a question added to the catalogue is an experiment every adapter must then have."""
    return {qid: getattr(adapter, qid) for qid in QUESTION_IDS}


def run_questions(
    experiments: dict[str, Experiment],
    only: tuple[str, ...] = QUESTION_IDS,
    progress: Callable[[Question], None] | None = None,
) -> list[Answer]:
    """Every question of `only`, in the catalogue's order, each timed in its own scratch
    directory (removed after). An experiment that raises fails, naming the error."""
    answers = []
    for question in QUESTIONS:
        if question.id not in only:
            continue
        if progress is not None:
            progress(question)
        # Named before it is made: an interrupt (SIGTERM unwinds) landing inside the mkdir or
        # right after it still finds the name, and removes what exists of it.
        scratch = os.path.join(
            tempfile.gettempdir(), f"settled-probe-{question.id}-{secrets.token_hex(6)}"
        )
        started = time.monotonic()
        try:
            os.mkdir(scratch, 0o700)
            outcome = experiments[question.id](scratch)
        except Exception as exc:  # the experiment broke: no answer holds without one
            outcome = fails(
                f"the experiment raised {type(exc).__name__}: {exc}", error=type(exc).__name__
            )
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        answers.append(Answer(question, outcome, time.monotonic() - started))
    return answers


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def first_difference(got: bytes, want: bytes) -> int | None:
    """The first byte offset where `got` and `want` differ (their common length when one is
    a prefix of the other); None when they are equal."""
    if got == want:
        return None
    low, high = 0, min(len(got), len(want))  # the longest common prefix, by halving
    while low < high:
        middle = (low + high + 1) // 2
        if got[:middle] == want[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def count(data: bytes, word: bytes = b"launched") -> int:
    return sum(1 for line in data.splitlines() if line.strip() == word)
