"""`settled soak`: the process that runs the lanes, counts their crashes and ends everything.

Owns: the run's scratch directory (a fresh home and the workspaces, removed at the end), its
mark (every process of the run carries it), the standing server every lane's retried request
goes to, the lanes (`python -m settled.soak.lane`, each in a session of its own), handing out
attempt numbers so that exactly N crashes happen (an attempt whose point was not reached does
not count, and the next number is handed out), the tally per point, and the end: lanes stopped,
every open task destroyed (its sandbox is the evidence for its sessions), the marked processes
ended, every task's cgroup checked gone, the scratch removed; after a violation or Ctrl-C too.
With `--faults store`, the servers the home is bound to (`servers.Servers`, started before
anything else and ended after everything else: resumed first, so a close finds them up) and the
rounds of server faults between the crashes (`outages.Outages`).

Must never: use the caller's home, run past the first violation, or claim a crash it did not
see.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

from settled.runtime import Runtime
from settled.soak import procs
from settled.soak.outages import Outages, RoundFailed
from settled.soak.servers import Servers, ServersFailed

ATTEMPT_S = 300.0  # one attempt that takes longer than this is a stuck lane
FINISH_S = 180.0
PROGRESS_S = 10.0
CALLERS_CHOICES = (
    "SETTLED_HOME",
    "SETTLED_STORE",
    "SETTLED_OBJECTS",
    "SETTLED_SANDBOX",
    "SETTLED_FAULT",
    "SETTLED_LAUNCHER",
)


class SoakFailed(RuntimeError):
    """The soak itself could not go on (a lane failed or stopped answering): not a verdict."""


class LaneProcess:
    def __init__(self, index: int, config: dict[str, Any], env: dict[str, str]) -> None:
        self.index = index
        self.process = subprocess.Popen(
            [sys.executable, "-m", "settled.soak.lane", json.dumps({**config, "lane": index})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.stdin: IO[bytes] = self.process.stdin
        self.stdout: IO[bytes] = self.process.stdout
        self.busy: int | None = None
        self.since = time.monotonic()

    def send(self, message: dict[str, Any]) -> None:
        self.stdin.write(json.dumps(message).encode() + b"\n")
        self.stdin.flush()
        self.since = time.monotonic()

    def answer(self) -> dict[str, Any]:
        line = self.stdout.readline()
        if not line:
            raise SoakFailed(f"lane {self.index} exited ({self.process.wait()}) mid-attempt")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        for pipe in (self.stdin, self.stdout):
            with contextlib.suppress(OSError):
                pipe.close()


class Tally:
    """Crashes and attempts per point, the first violation, and the clock."""

    def __init__(self, points: tuple[str, ...]) -> None:
        self.per_point: dict[str, dict[str, Any]] = {
            p: {"crashes": 0, "not_reached": 0, "seconds": 0.0} for p in points
        }  # seconds: summed over its attempts, each a lane's whole cycle and checks
        self.crashes = self.attempts = 0
        self.violation: dict[str, Any] | None = None
        self.started = time.monotonic()

    def add(self, answer: dict[str, Any]) -> None:
        self.attempts += 1
        counts = self.per_point[answer["point"]]
        counts["seconds"] = round(counts["seconds"] + float(answer.get("seconds", 0.0)), 4)
        if answer.get("crashed"):
            self.crashes += 1
            counts["crashes"] += 1
        elif "crashed" in answer:
            counts["not_reached"] += 1
        if "violation" in answer and self.violation is None:
            self.violation = {
                **answer["violation"],
                "crash": self.crashes + 1,
                "attempt": answer.get("attempt"),
                "point": answer.get("point"),
            }

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started


class Run:
    """One soak: `run()` returns the tally; `close()` ends everything it started."""

    def __init__(
        self,
        crashes: int,
        seed: int,
        lanes: int,
        start: int,
        points: tuple[str, ...],
        faults: tuple[str, ...] = (),
        per_kind: int = 0,
    ):
        self.target, self.seed, self.start, self.points = crashes, seed, start, points
        self.faults, self.per_kind = faults, per_kind
        self.servers = Servers()
        self.outages: Outages | None = None
        self.said_faults = time.monotonic()
        self.scratch = tempfile.mkdtemp(prefix="settled-soak-")
        self.home = os.path.join(self.scratch, "home")
        self.mark = f"settled-soak-{os.getpid()}-{secrets.token_hex(6)}"
        self.token = secrets.token_hex(24)
        for name in CALLERS_CHOICES:  # the embedded default in the run's own home, unarmed
            os.environ.pop(name, None)
        os.environ[procs.MARK_ENV] = self.mark  # the Runtime that cleans up, and what it starts
        self.env = dict(os.environ)
        self.standing: procs.Server | None = None
        self.lanes: list[LaneProcess] = []
        self.lane_count = lanes
        self.tally = Tally(points)
        self.ended: dict[str, Any] = {}

    def run(self) -> Tally:
        if self.faults:
            self._start_servers()
        try:
            self.standing = procs.Server(
                self.home, self.token, os.path.join(self.scratch, "serve-standing.log")
            )
        except RuntimeError as exc:
            raise SoakFailed(f"the standing server did not start: {exc}") from exc
        config = {
            "home": self.home,
            "scratch": self.scratch,
            "seed": self.seed,
            "points": list(self.points),
            "server": self.standing.url,
            "token": self.token,
            "mark": self.mark,
        }
        self.lanes = [LaneProcess(i, config, self.env) for i in range(self.lane_count)]
        self._attempts()
        self._rounds_left()
        if self.tally.violation is None:
            self._finish()
        return self.tally

    def _start_servers(self) -> None:
        """The store (and objects) the home is bound to: in this process's environment, so
        every lane, server, CLI process and owner of the run reaches them."""
        try:
            self.servers.start(with_objects=True)
        except ServersFailed as exc:
            raise SoakFailed(f"the servers did not start: {exc}") from exc
        os.environ.update(self.servers.env())
        self.env = dict(os.environ)
        self.outages = Outages(self.servers, self.seed, self.per_kind, self.target)

    def _round_due(self) -> bool:
        return self.outages is not None and self.outages.due(self.tally.crashes)

    def _round(self) -> None:
        assert self.outages is not None
        try:
            violation = self.outages.run_round(self.lanes)
        except RoundFailed as exc:
            raise SoakFailed(str(exc)) from exc
        if violation is not None and self.tally.violation is None:
            self.tally.violation = violation
        if time.monotonic() - self.said_faults > PROGRESS_S:
            self.said_faults = time.monotonic()
            done = self.outages.report()
            _say(f"{done['done']}/{done['asked']} server faults, {self.tally.seconds:.0f} s")

    def _rounds_left(self) -> None:
        while self.outages is not None and self.outages.remaining and not self.tally.violation:
            self._round()

    def _attempts(self) -> None:
        selector = selectors.DefaultSelector()
        for lane in self.lanes:
            selector.register(lane.stdout, selectors.EVENT_READ, lane)
        number, cap = self.start, self.start + 3 * self.target + 20
        said = time.monotonic()
        while self.tally.violation is None:
            busy = [lane for lane in self.lanes if lane.busy is not None]
            pausing = self._round_due()  # no attempt while a server fault waits to strike
            if pausing and not busy:
                self._round()
                continue
            for lane in self.lanes:
                # in flight may all crash: hand out no more than could make up the count
                wanted = self.tally.crashes + len(busy) < self.target
                if lane.busy is None and wanted and number < cap and not pausing:
                    lane.busy = number
                    lane.send({"attempt": number})
                    busy.append(lane)
                    number += 1
            if not busy:
                break
            for key, _ in selector.select(timeout=5.0):
                self._answered(key.data)
            self._check_stuck(busy)
            if time.monotonic() - said > PROGRESS_S:
                said = time.monotonic()
                _say(f"{self.tally.crashes}/{self.target} crashes, {self.tally.seconds:.0f} s")
        if self.tally.crashes < self.target and self.tally.violation is None:
            raise SoakFailed(
                f"{number - self.start} attempts gave only {self.tally.crashes} crashes: "
                "the points were not reached"
            )

    def _answered(self, lane: LaneProcess) -> None:
        answer = lane.answer()
        lane.busy = None
        if "error" in answer:
            raise SoakFailed(
                f"lane {lane.index}, attempt {answer.get('attempt')} at "
                f"{answer.get('point')}:\n{answer['error']}"
            )
        self.tally.add(answer)

    def _check_stuck(self, busy: list[LaneProcess]) -> None:
        for lane in busy:
            if lane.busy is not None and time.monotonic() - lane.since > ATTEMPT_S:
                raise SoakFailed(
                    f"lane {lane.index} has been at attempt {lane.busy} for more "
                    f"than {ATTEMPT_S:.0f} s"
                )

    def _finish(self) -> None:
        """Each lane closes its last task as a caller would, and checks that close too."""
        for lane in self.lanes:
            lane.send({"finish": True})
        for lane in self.lanes:
            answer = _bounded(lane, FINISH_S)
            if "error" in answer:
                raise SoakFailed(f"lane {lane.index} at its final close:\n{answer['error']}")
            if "violation" in answer and self.tally.violation is None:
                self.tally.violation = {
                    **answer["violation"],
                    "crash": None,
                    "attempt": None,
                    "point": "final close",
                }

    def close(self) -> dict[str, Any]:
        """End everything the run started; what was found and ended is returned."""
        for lane in self.lanes:
            lane.stop()
        with contextlib.suppress(Exception):
            self.servers.resume()  # a fault cut short by Ctrl-C: the store must answer below
        ended: dict[str, Any] = {"destroyed_tasks": 0, "cgroups_left": []}
        with contextlib.suppress(Exception), Runtime(self.home) as rt:
            ended.update(_destroy_open_tasks(rt))
            rt.release_pods()  # its home is removed whole: no mount may stay
        if self.standing is not None:
            self.standing.stop()
        swept = procs.sweep(self.mark)
        for name in self.servers.env() if self.outages else ():
            os.environ.pop(name, None)  # what bound the run's home, no longer served
        ended["servers_left"] = self.servers.stop()
        ended["processes_terminated"] = len(swept["terminated"])
        ended["processes_killed"] = len(swept["killed"])
        ended["processes_left"] = len(procs.marked(self.mark))
        shutil.rmtree(self.scratch, ignore_errors=True)
        ended["scratch_left"] = os.path.exists(self.scratch)
        os.environ.pop(procs.MARK_ENV, None)
        self.ended = ended
        return ended


def _bounded(lane: LaneProcess, seconds: float) -> dict[str, Any]:
    selector = selectors.DefaultSelector()
    selector.register(lane.stdout, selectors.EVENT_READ)
    if not selector.select(timeout=seconds):
        raise SoakFailed(f"lane {lane.index} did not finish within {seconds:.0f} s")
    return lane.answer()


def _destroy_open_tasks(rt: Runtime) -> dict[str, Any]:
    """Every task still open is destroyed (its cgroup killed: evidence for its sessions), what
    is still unknown recovered; then no task's cgroup may remain."""
    tasks = rt.list_tasks(limit=1_000_000)
    destroyed = 0
    for row in tasks:
        if row["state"] in ("open", "frozen") or row["live"]:
            with contextlib.suppress(Exception):
                rt.destroy_task(row["task"])
                destroyed += 1
    with contextlib.suppress(Exception):
        rt.recover()
    left = []
    for row in tasks:
        cgroup = (rt.task_record(row["task"]).sandbox or {}).get("cgroup")
        if cgroup and os.path.exists(cgroup):
            left.append(cgroup)
    return {"destroyed_tasks": destroyed, "cgroups_left": left}


def _say(message: str) -> None:
    print(f"settled soak: {message}", file=sys.stderr, flush=True)


def interrupt_on_term() -> Any:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so the run's `close` ends what it started."""

    def raise_interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    return {sig: signal.signal(sig, raise_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
