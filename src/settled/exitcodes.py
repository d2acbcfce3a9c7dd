"""The process exit codes of `settled run`: what a shell sees once the command has settled.

Owns one decision, as a table over the process receipt's `exit` and `death` facts (receipts.py):
which single number stands for the command's outcome. Pure: no I/O, no store. It must never turn
a receipt that does not prove an outcome into a code that claims one; anything it cannot prove
(an unproven death, a lost owner, a receipt whose digest does not hold, a shape it does not know)
is RUN_UNKNOWN, never 0 and never a guess at the command's code.

The conventions are the shell's and timeout(1)'s, so scripts written for them keep working:
the command's own code when it exited, 128 + N when signal N killed it, 124 when settled's
deadline stopped it, 127 when it never started.
"""

from __future__ import annotations

from settled.receipts import verify

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

RUN_TIMEOUT: Final = 124
"""The timeout fired and settled stopped the command (as timeout(1) reports it), whatever the
command did on TERM: its own code or signal stays in the receipt."""

RUN_CANNOT_START: Final = 127
"""The command never started (not found, no boundary, no isolation, no space): the receipt's
`exit.stage` and `exit.error` say why. /bin/sh uses 127 for a command not found."""

RUN_UNKNOWN: Final = 117
"""The outcome is unknown: the process tree was not proven dead, its owner was lost with the exit
status, or the receipt is not one this code can trust. Not failure and not success: run
`settled status SESSION` for why, and `settled recover` to settle it."""

RUN_SIGNAL_BASE: Final = 128
"""A command killed by signal N exits with RUN_SIGNAL_BASE + N, as a shell reports it."""

RUN_CANCELLED: Final = RUN_SIGNAL_BASE + 15  # SIGTERM on Linux
"""A cancelled command that never ran, or that exited 0 on the TERM cancel sent it: what a shell
reports for a command ended by TERM (a cancel never reads as success)."""

RUN_EXIT_CODES: Final[dict[str, str]] = {
    "0-116, 118-123, 125-126, 128-255": "the command's own exit code, or 128 + N when signal N "
    "killed it (143 also: cancelled before it ran, or it exited 0 on the cancel)",
    str(RUN_TIMEOUT): "the timeout fired and settled stopped the command (as timeout(1))",
    str(RUN_UNKNOWN): "outcome unknown: no proof the command's processes are gone, or the exit "
    "status was lost; see `settled status SESSION`",
    str(RUN_CANNOT_START): "the command never started (the receipt's exit.stage and exit.error "
    "say why)",
}
"""The table `settled run --help` lists (a command's own 117, 124 or 127 reads as settled's
meaning there: the receipt, printed by `--json`, is what tells them apart)."""


def command_exit_code(process_receipt: dict[str, Any] | None) -> int:
    """The exit code `settled run` ends with for this process receipt (None: the session has no
    receipt yet, as `wait` shows an unknown session, so RUN_UNKNOWN).

    The receipt is re-checked here (its digest over its canonical bytes) because the code is a
    claim about the command, and a receipt that came through a client or a file may have been
    altered on the way: a tampered or malformed one gives RUN_UNKNOWN.
    """
    if not isinstance(process_receipt, dict) or process_receipt.get("kind") != "process":
        return RUN_UNKNOWN
    if not verify(process_receipt):
        return RUN_UNKNOWN
    death = process_receipt.get("death")
    exit_fact = process_receipt.get("exit")
    if not isinstance(death, dict) or not isinstance(exit_fact, dict):
        return RUN_UNKNOWN
    if death.get("proven") is not True:
        return RUN_UNKNOWN  # an exit status without death evidence proves nothing settled
    decide = _BY_REASON.get(exit_fact.get("reason"))  # type: ignore[arg-type]
    return RUN_UNKNOWN if decide is None else decide(exit_fact)


def _waited(exit_fact: dict[str, Any]) -> int | None:
    """The code a shell would report for this wait status, or None when it shows none."""
    code = exit_fact.get("code")
    name = exit_fact.get("signal")
    if code is not None and name is not None:
        return None  # a wait status is one or the other, never both
    if code is not None:
        return code if type(code) is int and 0 <= code <= 255 else None
    if isinstance(name, str):
        import signal  # only here: its enums cost every `settled status` a third of a ms

        try:
            return RUN_SIGNAL_BASE + signal.Signals["SIG" + name].value
        except KeyError:
            return None
    return None


def _exited(exit_fact: dict[str, Any]) -> int:
    waited = _waited(exit_fact)
    return RUN_UNKNOWN if waited is None else waited


def _cancelled(exit_fact: dict[str, Any]) -> int:
    """The signal or the failing code the command ended with; RUN_CANCELLED when it never ran or
    exited 0 on TERM, so that `settled run ... && next` never proceeds past a cancel."""
    if exit_fact.get("code") is None and exit_fact.get("signal") is None:
        return RUN_CANCELLED
    waited = _exited(exit_fact)
    return RUN_CANCELLED if waited == 0 else waited


def _timeout(exit_fact: dict[str, Any]) -> int:
    return RUN_TIMEOUT


def _not_started(exit_fact: dict[str, Any]) -> int:
    return RUN_CANNOT_START


def _owner_lost(exit_fact: dict[str, Any]) -> int:
    return RUN_UNKNOWN


_BY_REASON: Final = {
    "exited": _exited,
    "oom": _exited,  # the memory controller's kill: the KILL it died of, 137, as a shell says
    "timeout": _timeout,
    "cancelled": _cancelled,
    "not_started": _not_started,
    "owner_lost": _owner_lost,
}
"""exit.reason -> the decision; the reasons are those the owner (owner/supervise.py, main.py)
and recovery write. A reason missing here is unknown, never the command's code."""
