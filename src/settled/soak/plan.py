"""The soak's plan and its words: the fault point of each attempt, drawn from the seed, and the
invariants a violation names.

Owns: the seeded choice of attempt n's point and parameters (`Attempt(seed, n, points)`), the
families the points fall in, the commands a cycle runs and the bytes they must leave, the
seeded order and parameters of the server faults (`fault_kinds`, `Fault`), and `Violation`.

Must never: depend on time, on the lane that runs an attempt or on what ran before it: attempt
n of seed s is the same point with the same parameters in every run, so `settled soak --seed s
--start n --crashes 1` replays it alone in a fresh home.
"""

from __future__ import annotations

import random
from typing import Any

from settled.runtime import ALL_POINTS

FAMILIES = ("owner", "checkpoint", "close", "recovery", "server")
INVARIANTS = {
    "false_success": "no false success",
    "duplicate_launch": "no duplicate launch",
    "lost_byte": "no lost durable byte",
    "relaunch": "no relaunch of an unknown session",
    "close_converges": "every retried close converges",
    "converges": "every crash converges",  # a retry or recovery that raises or never settles
    "lost_exit": "no lost exit status",  # a command that ended as the store came back
}
FAULT_FAMILIES = ("store",)  # `--faults`: what the run's servers suffer between the crashes
STORE_FAULTS = ("pg_restart", "pg_kill", "pg_stop")  # the cluster: graceful, killed, stopped
OBJECT_FAULTS = ("s3_stop",)  # the S3 server stopped as sessions end (when weed is installed)
ROUND_COMMANDS = 3  # commands each lane runs through one fault
LAUNCHES = ".launches"  # each command appends its logical key here first: one line per launch
OUTPUT_DIR = "out"  # each command that ends writes out/<key>: the close's checkpoint must hold it
TICK = b"tick"
TICKER_PAUSE_S = 0.1
STEP_LINES = 32  # a paced command sleeps its step after each this many lines


class Violation(Exception):
    """An invariant that did not hold: which one and the facts that broke it."""

    def __init__(self, invariant: str, detail: str) -> None:
        assert invariant in INVARIANTS, invariant
        super().__init__(f"{INVARIANTS[invariant]}: {detail}")
        self.invariant, self.detail = invariant, detail

    def to_json(self) -> dict[str, Any]:
        return {"invariant": INVARIANTS[self.invariant], "detail": self.detail}


def family(point: str) -> str:
    return point.partition(".")[0]


POINTS = tuple(p for p in ALL_POINTS if family(p) in FAMILIES)  # a cycle reaches each of them


class Attempt:
    """Attempt `number` of a run: its point, and an RNG for its parameters alone."""

    def __init__(self, seed: int, number: int, points: tuple[str, ...]) -> None:
        self.seed, self.number = seed, number
        self.point = random.Random(f"settled-soak:{seed}:{number}:point").choice(points)
        # its own stream: a replay limited to this point (--points) draws the same parameters
        self.rng = random.Random(f"settled-soak:{seed}:{number}")
        self.family = family(self.point)
        self.key = f"a{number}"  # the logical key: settled's key and the launch marker's line

    def work(self) -> Work:
        """The command this attempt runs (its size and pace drawn for it)."""
        lines = self.rng.choice((1, 8, 64, 400))
        pause = self.rng.choice((0.0, 0.0, 0.05, 0.2))
        return Work(self.key, lines, pause)


class Work:
    """A command whose every byte is known in advance: it appends its key to LAUNCHES, prints
    `lines` numbered lines (pausing `pause` s halfway, and `step` s every STEP_LINES lines),
    then writes out/<key>."""

    def __init__(self, key: str, lines: int, pause: float, step: float = 0.0) -> None:
        self.key, self.lines, self.pause, self.step = key, lines, pause, step

    @property
    def shell(self) -> str:
        half = self.lines // 2
        each = f"[ $((i % {STEP_LINES})) -eq 0 ] && sleep {self.step}; " if self.step else ""
        loop = "while [ $i -lt {end} ]; do printf '{key}.%04d\\n' $i; " + each + "i=$((i+1)); done"
        return (
            f"echo {self.key} >> {LAUNCHES}; i=0; {loop.format(end=half, key=self.key)}; "
            f"sleep {self.pause}; {loop.format(end=self.lines, key=self.key)}; "
            f"echo {self.key} > {OUTPUT_DIR}/{self.key}"
        )

    @property
    def stdout(self) -> bytes:
        return b"".join(b"%s.%04d\n" % (self.key.encode(), i) for i in range(self.lines))

    @property
    def file(self) -> tuple[str, bytes]:
        return f"{OUTPUT_DIR}/{self.key}", f"{self.key}\n".encode()


def ticker(key: str) -> str:
    """A service that prints TICK every TICKER_PAUSE_S until the close stops it."""
    tick = TICK.decode()
    return f"echo {key} >> {LAUNCHES}; while :; do printf {tick}; sleep {TICKER_PAUSE_S}; done"


def ticker_bytes(length: int) -> bytes:
    return (TICK * (length // len(TICK) + 1))[:length]


def fault_kinds(seed: int, per_kind: int, kinds: tuple[str, ...]) -> list[str]:
    """The run's faults in order: `per_kind` of each kind, shuffled by the seed."""
    order = [kind for kind in kinds for _ in range(per_kind)]
    random.Random(f"settled-soak:{seed}:faults").shuffle(order)
    return order


class Fault:
    """Round `number` of a run: its kind, when it strikes after the round's commands are
    launched (`delay_s`), and how long the server stays down or stopped (`hold_s`, shorter than
    the lease: a store back within it must lose no exit status)."""

    def __init__(self, seed: int, number: int, kind: str, lease_s: float) -> None:
        rng = random.Random(f"settled-soak:{seed}:fault:{number}")
        self.number, self.kind = number, kind
        self.delay_s = round(rng.uniform(0.0, 0.6), 3)
        longest = max(0.5, min(2.0, lease_s / 3))
        self.hold_s = round(rng.uniform(0.0 if kind == "pg_kill" else 0.5, longest), 3)

    def work(self, seed: int, lane: int) -> list[Work]:
        """The commands lane `lane` runs through it: each ends before, during or after it."""
        rng = random.Random(f"settled-soak:{seed}:fault:{self.number}:{lane}")
        return [
            Work(
                f"r{self.number}.{lane}.{i}",
                rng.choice((8, 64, 400)),
                round(rng.uniform(0.1, 2.0), 3),
            )
            for i in range(ROUND_COMMANDS)
        ]
