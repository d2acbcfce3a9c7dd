"""The close deadline as one scope, pure: recorded once, kept by every resume, one bound after.

The close that records ``final_pending`` records its deadline there as a wall-clock time
(join.py), and every close of the task, the first or a resume in another process, keeps it
(`close_deadline`), unless a resume asks for a sooner one: a deadline is only ever shortened.
Monotonic time cannot be recorded for another process: CLOCK_MONOTONIC counts from an
unspecified point of each boot, so a value written before a crash and a reboot means nothing
after it. The wall clock is read once per wait to say how much of the deadline is left, and that
is kept within [0, the deadline's length] (`seconds_left`), so a clock stepped back cannot
stretch the close past its whole deadline counted anew from then, and one stepped forward only
cancels sooner; the waits themselves run on the monotonic clock. Past the deadline, every
session still live is waited for under one bound (`settle_bound`), not one after another.

Must never: read a clock, the store or a session; it imports records only (decisions layer).
"""

from __future__ import annotations

from settled.records import Frozen

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class Deadline(Frozen):
    """The close's one deadline: the wall-clock time it passes, its length, and where it came
    from ("recorded" with final_pending, or this close's own for a final_pending recorded
    before the deadline was: counted from now, as every close did then)."""

    __slots__ = ("at", "seconds", "source")
    at: float
    seconds: float
    source: str

    def __init__(self, at: float, seconds: float, source: str) -> None:
        self._fill(locals())

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "s": self.seconds, "source": self.source}


def close_deadline(
    pending: dict[str, Any], given_s: float | None, now: float, default_s: float
) -> Deadline:
    """The deadline a close keeps. The one its final_pending fact recorded when the close began
    holds across every resume; a resume given a deadline of its own (`given_s`, None when the
    caller named none) may bring it sooner, never later: `settled close T --deadline 0` after an
    interrupted close cancels now. A fact an older version recorded without a deadline gets
    `given_s` (else `default_s`) counted from `now`, as every close did then."""
    at, seconds = pending.get("deadline_at"), pending.get("deadline_s")
    if isinstance(at, int | float) and isinstance(seconds, int | float):
        if given_s is not None and now + given_s < at:
            return Deadline(now + given_s, given_s, "this close (sooner than the recorded one)")
        return Deadline(float(at), float(seconds), "recorded")
    chosen = float(default_s if given_s is None else given_s)
    return Deadline(now + chosen, chosen, "this close (final_pending recorded none)")


def seconds_left(deadline: Deadline, now: float) -> float:
    """How long the close may still wait for its required commands, by the wall clock `now`,
    within [0, the deadline's length]: a clock stepped back never makes a close wait longer
    than its whole deadline from now; one stepped forward only brings the cancel sooner."""
    return min(max(0.0, deadline.at - now), deadline.seconds)


def settle_bound(graces: list[float], cancel_settle_s: float) -> float:
    """The one bound the close waits, from its cancel, for every session still live to settle:
    the longest `cancel_settle_s + grace` among them, not their sum (they stop together)."""
    return max((cancel_settle_s + grace for grace in graces), default=0.0)
