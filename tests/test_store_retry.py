"""The owner's store retry policy (owner/store_retry.py): pure, handed numbers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from settled.errors import StaleWrite, StoreUnreachable
from settled.owner.store_retry import (
    CAP_DELAY_S,
    DEFAULT_PATIENCE_S,
    FIRST_DELAY_S,
    PATIENCE_ENV,
    gives_up,
    next_delay,
    patience_s,
    receipt_recorded,
    settling_outcome,
    with_retries,
)


@pytest.mark.parametrize(
    ("attempt", "delay"),
    [(0, 0.05), (1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (6, 1.0), (500, 1.0)],
)
def test_the_pause_doubles_from_the_first_to_the_cap(attempt: int, delay: float) -> None:
    assert next_delay(attempt) == pytest.approx(delay)
    assert FIRST_DELAY_S <= next_delay(attempt) <= CAP_DELAY_S


@pytest.mark.parametrize(
    ("waited", "delay", "patience", "stop"),
    [
        (0.0, 0.05, 300.0, False),
        (299.0, 1.0, 300.0, False),  # a retry that starts within the patience is made
        (299.5, 1.0, 300.0, True),  # one that would start past it is not
        (0.0, 0.05, 0.0, True),  # no patience: one attempt
        (1.2, 0.4, 1.5, True),
    ],
)
def test_a_retry_is_made_only_if_it_starts_within_the_patience(
    waited: float, delay: float, patience: float, stop: bool
) -> None:
    assert gives_up(waited, delay, patience) is stop


def test_the_patience_is_an_environment_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PATIENCE_ENV, raising=False)
    assert patience_s() == DEFAULT_PATIENCE_S
    monkeypatch.setenv(PATIENCE_ENV, "2.5")
    assert patience_s() == 2.5


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.pauses: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def test_an_outage_shorter_than_the_patience_is_waited_out() -> None:
    clock, between = _Clock(), []
    answers: list[object] = [StoreUnreachable("db", "down")] * 4 + ["done"]

    def call() -> object:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    result = with_retries(
        call, 10.0, between=lambda: between.append(clock.now), clock=lambda: clock.now,
        sleep=clock.sleep,
    )  # fmt: skip
    assert result == ("done", 4)
    assert clock.pauses == pytest.approx([0.05, 0.1, 0.2, 0.4])
    assert len(between) == 4  # a lease renewal asked before each pause


def test_an_outage_past_the_patience_raises_the_last_unreachable() -> None:
    clock = _Clock()

    def call() -> None:
        raise StoreUnreachable("db", f"down at {clock.now:.2f}")

    with pytest.raises(StoreUnreachable, match="down at"):
        with_retries(call, 3.0, clock=lambda: clock.now, sleep=clock.sleep)
    assert sum(clock.pauses) <= 3.0
    assert clock.pauses[-1] == CAP_DELAY_S


def test_a_refused_write_is_an_answer_never_retried() -> None:
    calls = []

    def call() -> None:
        calls.append(1)
        raise StaleWrite("fenced")

    with pytest.raises(StaleWrite):
        with_retries(call, 60.0, sleep=lambda _s: None)
    assert calls == [1]


def _found(state: str, generation: int, digest: str | None = None) -> Any:
    """The facts the read-backs look at (a SessionRecord's state, generation and receipt)."""
    return SimpleNamespace(
        state=state, generation=generation, receipt=None if digest is None else {"digest": digest}
    )


@pytest.mark.parametrize(
    ("found", "recorded"),
    [
        (_found("settled", 1, "sha256:mine"), True),  # the first attempt committed, answer lost
        (_found("unknown", 1, "sha256:mine"), True),  # its own "lose" receipt, likewise
        (_found("settled", 2, "sha256:mine"), False),  # another generation: fenced
        (_found("settled", 1, "sha256:other"), False),  # another receipt at its generation
        (_found("settled", 2, "sha256:recovery"), False),  # recovery's receipt stands
        (_found("running", 1), False),
        (_found("unknown", 2), False),  # taken over, no receipt yet
    ],
)
def test_a_stale_receipt_write_is_this_owners_only_with_its_digest_at_its_generation(
    found: Any, recorded: bool
) -> None:
    assert receipt_recorded(found, 1, "sha256:mine") is recorded


@pytest.mark.parametrize(
    ("found", "outcome"),
    [
        (_found("settling", 1), "done"),  # an earlier attempt committed
        (_found("settled", 1, "sha256:mine"), "done"),  # its receipt came first
        (_found("unknown", 1), "wait"),  # cut off past its lease: the next renewal revives it
        (_found("running", 1), "wait"),  # revived meanwhile: asked again
        (_found("unknown", 2), "fenced"),  # recovery took it over
        (_found("settled", 2, "sha256:recovery"), "fenced"),
    ],
)
def test_a_stale_settling_write_is_done_waits_or_is_fenced(found: Any, outcome: str) -> None:
    assert settling_outcome(found, 1) == outcome
