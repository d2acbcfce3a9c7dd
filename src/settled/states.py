"""The session and task state machines: every transition the store may perform, in one table.

Theory of operation (after h11's _state.py): the store is the only writer of state, and it writes
a new state only through `next_session_state`, under a compare-and-set on the current state and
generation. Nothing here does I/O; everything that changes what a transition means lives here.

    admitted --claim--> running --exit|deadline|cancel--> settling --receipt--> settled
    admitted --receipt--> settled          (cancelled or unstartable before it ran)
    admitted --unclaimed--> settled        (no owner was claimed: never started; a claim
                                            made since refuses it, the generation unchanged)
    running  --receipt--> settled          (the owner may settle in one step)
    admitted|running|settling --lose--> unknown --recover--> settled
    unknown --receipt--> settled           (the owner's late receipt: nobody took over)
    unknown --revive--> running            (the owner's heartbeat: nobody took over)

`exit` (code, signal, timeout, cancel) is part of the receipt, never a state.

Unknown says "no one has shown the owner alive lately", not "the owner is dead": an owner cut
off from the store (an outage longer than its lease) comes back at its own generation. Its
heartbeat then revives the session and its receipt settles it, each only while the session is
unknown at that generation and carries no receipt (store/sql.py). Recovery's `take_over` is a
compare-and-set on the same (unknown, generation) that moves the generation on, so exactly one
of the two wins: after a take-over every write of the old owner is StaleWrite, and after a
revival or a late receipt the take-over is (docs/DESIGN.md "recovery", the fence).
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final

ADMITTED: Final = "admitted"
RUNNING: Final = "running"
SETTLING: Final = "settling"
SETTLED: Final = "settled"
UNKNOWN: Final = "unknown"

SESSION_STATES: Final = (ADMITTED, RUNNING, SETTLING, SETTLED, UNKNOWN)
LIVE_STATES: Final = frozenset({ADMITTED, RUNNING, SETTLING})


def is_live(state: str) -> bool:
    """The one "is this session still its owner's" predicate: every layer asks this."""
    return state in LIVE_STATES


SESSION_TRANSITIONS: Final[dict[tuple[str, str], str]] = {
    (ADMITTED, "claim"): RUNNING,
    (RUNNING, "settle_begin"): SETTLING,
    (ADMITTED, "receipt"): SETTLED,
    (ADMITTED, "unclaimed"): SETTLED,  # never started: only while no owner is claimed
    (RUNNING, "receipt"): SETTLED,
    (SETTLING, "receipt"): SETTLED,
    (ADMITTED, "lose"): UNKNOWN,
    (RUNNING, "lose"): UNKNOWN,
    (SETTLING, "lose"): UNKNOWN,
    (UNKNOWN, "recover"): SETTLED,
    (UNKNOWN, "receipt"): SETTLED,
    (UNKNOWN, "revive"): RUNNING,
}

# The events of a session's own owner that an unknown session takes back at the same generation
# (only with no receipt recorded: an owner that settled it unproven ("lose") said its last word).
OWNER_RETURNS: Final = frozenset({"receipt", "revive"})

TASK_OPEN: Final = "open"
TASK_SEALED: Final = "sealed"
TASK_CLOSING: Final = "closing"
TASK_COMPLETE: Final = "complete"

TASK_TRANSITIONS: Final[dict[tuple[str, str], str]] = {
    (TASK_OPEN, "seal"): TASK_SEALED,
    (TASK_SEALED, "close_begin"): TASK_CLOSING,
    (TASK_CLOSING, "complete"): TASK_COMPLETE,
}


class IllegalTransition(ValueError):
    pass


def next_session_state(state: str, event: str) -> str:
    try:
        return SESSION_TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"session in state {state!r} cannot take event {event!r}") from None


def states_accepting(event: str) -> tuple[str, ...]:
    """The states from which `event` is legal: the 'expected' side of the compare-and-set."""
    return tuple(sorted(s for (s, e) in SESSION_TRANSITIONS if e == event))


def next_task_state(state: str, event: str) -> str:
    try:
        return TASK_TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"task in state {state!r} cannot take event {event!r}") from None


# The groups of a task's command outcomes (close/decide.py's `command_outcomes`) that are not a
# failure; every other group (failed, timed out, cancelled, never started, unknown) is.
NOT_FAILURES: Final = frozenset({"succeeded", "services_stopped", "running"})


def did_not_succeed(outcomes: dict[str, list[str]]) -> int:
    """How many commands did not succeed: the one rule of the close receipt's
    `all_commands_succeeded` and of explain's verdict ("complete is not success")."""
    return sum(len(v) for k, v in outcomes.items() if k not in NOT_FAILURES)
