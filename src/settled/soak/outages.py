"""The server faults of `settled soak --faults store`, on the driver's side: when each round is
due among the crashes, and one round across every lane.

Owns: the run's rounds (`Outages`: the seeded order of kinds, `per_kind` of each, spread evenly
over the crashes so that rounds fall between them), one round (`run_round`: every lane launches
its commands, the fault strikes after its seeded delay and holds for its seeded time, every lane
checks), and the count of faults done per kind.

Must never: strike while a lane is mid-attempt (the driver hands out no attempt while a round is
due and runs it once every lane is idle; the lanes' services and the round's commands are what
runs through it), leave a server stopped or down after a round (`servers.resume` also runs when
the round fails), or count a fault that did not happen.
"""

from __future__ import annotations

import os
import selectors
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from settled.soak.plan import OBJECT_FAULTS, STORE_FAULTS, Fault, fault_kinds
from settled.soak.servers import Servers, ServersFailed

if TYPE_CHECKING:
    from settled.soak.driver import LaneProcess

ROUND_S = 300.0  # one lane's phase of a round that takes longer is a stuck lane
LEASE_ENV = "SETTLED_LEASE_S"  # the owners' lease (owner/lease.py's knob and default)
DEFAULT_LEASE_S = 15.0


class RoundFailed(RuntimeError):
    """A lane could not play its part, or a server could not be faulted: not a verdict."""


class Outages:
    def __init__(self, servers: Servers, seed: int, per_kind: int, crashes: int) -> None:
        self.servers, self.seed = servers, seed
        kinds = STORE_FAULTS + (OBJECT_FAULTS if servers.objects is not None else ())
        self.order = fault_kinds(seed, per_kind, kinds)
        self.done: dict[str, int] = dict.fromkeys(kinds, 0)
        self.seconds = 0.0  # summed over the rounds: launch, fault, checks and close
        self.crashes, self.next = crashes, 0
        self.lease_s = float(os.environ.get(LEASE_ENV) or DEFAULT_LEASE_S)

    @property
    def remaining(self) -> int:
        return len(self.order) - self.next

    def due(self, crashes: int) -> bool:
        """Round k is due once k+1 of len+1 equal shares of the crashes are done."""
        share = (self.next + 1) * self.crashes / (len(self.order) + 1)
        return self.remaining > 0 and crashes >= share

    def run_round(self, lanes: list[LaneProcess]) -> dict[str, Any] | None:
        """One fault across every lane; the first violation a lane found, if any."""
        fault = Fault(self.seed, self.next, self.order[self.next], self.lease_s)
        self.next += 1
        started = time.monotonic()
        try:
            return self._round(lanes, fault)
        finally:
            self.seconds += time.monotonic() - started

    def _round(self, lanes: list[LaneProcess], fault: Fault) -> dict[str, Any] | None:
        launched = _ask_all(lanes, lambda lane: {"launch": fault.number, "kind": fault.kind})
        found = _first_violation(launched)
        if found is None:
            time.sleep(fault.delay_s)
            self.strike(fault)
        checked = {} if found is not None else _ask_all(lanes, lambda lane: _check(lane, launched))
        found = found or _first_violation(checked)
        if found is not None:
            found.update({"crash": None, "attempt": None, "point": f"fault {fault.number}"})
            found["fault"] = {"number": fault.number, "kind": fault.kind, "hold_s": fault.hold_s}
        return found

    def strike(self, fault: Fault) -> None:
        cluster, objects = self.servers.cluster, self.servers.objects
        assert cluster is not None
        try:
            if fault.kind == "pg_restart":
                cluster.restart_fast()
            elif fault.kind == "pg_kill":
                cluster.kill_and_restart(fault.hold_s)
            elif fault.kind == "pg_stop":
                cluster.stall(fault.hold_s)
            elif fault.kind == "s3_stop" and objects is not None:
                objects.stall(fault.hold_s)
            else:
                raise RoundFailed(f"no server for fault {fault.kind}")
        except ServersFailed as exc:
            raise RoundFailed(f"fault {fault.number} ({fault.kind}): {exc}") from exc
        finally:
            self.servers.resume()
        self.done[fault.kind] += 1

    def report(self) -> dict[str, Any]:
        return {
            "per_kind": dict(self.done),
            "asked": len(self.order),
            "done": sum(self.done.values()),
            "seconds": round(self.seconds, 2),
        }


def _ask_all(
    lanes: list[LaneProcess], message: Callable[[LaneProcess], dict[str, Any]]
) -> dict[int, dict[str, Any]]:
    """The message to every lane at once, then every answer (bounded)."""
    for lane in lanes:
        lane.send(message(lane))
    answers: dict[int, dict[str, Any]] = {}
    selector = selectors.DefaultSelector()
    for lane in lanes:
        selector.register(lane.stdout, selectors.EVENT_READ, lane)
    give_up = time.monotonic() + ROUND_S
    while len(answers) < len(lanes):
        ready = selector.select(timeout=max(0.0, give_up - time.monotonic()))
        if not ready:
            raise RoundFailed(f"a lane did not answer a server fault's round in {ROUND_S:.0f} s")
        for key, _ in ready:
            lane = key.data
            answers[lane.index] = lane.answer()
            selector.unregister(lane.stdout)
    for index, answer in answers.items():
        if "error" in answer:
            raise RoundFailed(f"lane {index} in a server fault's round:\n{answer['error']}")
    return answers


def _check(lane: LaneProcess, launched: dict[int, dict[str, Any]]) -> dict[str, Any]:
    return {"check": True, "sessions": launched[lane.index]["sessions"]}


def _first_violation(answers: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    for index in sorted(answers):
        if "violation" in answers[index]:
            return {**answers[index]["violation"], "lane": index}
    return None
