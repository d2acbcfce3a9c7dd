"""settled.soak: `settled soak --crashes N --seed S [--json]` crashes settled at random fault
points, with concurrent sessions running, and checks every invariant after each crash. With
`--faults store [--faults-per-kind K]` its home is bound to a PostgreSQL (and, when `weed` is
installed, an S3) of its own, which it restarts, kills and stops K times per kind between the
crashes while sessions run (`outages.py`, `servers.py`).

Owns: the verb's whole run (`run_soak`): checking its input, the run (`driver.Run`: lanes of
crash cycles on a fresh home of its own), its verdict and exit code, and the report: the seed,
the crashes per point, the time, and for a violation the invariant, the crash, the point and
the command that replays it. Exit 0 when every invariant held, 3 on a violation (named), 2 on
bad input, 1 when the soak itself could not run (a lane failed, the points were not reached, a
server it needs is not installed or could not be faulted, or something it started could not be
ended), 130 on Ctrl-C.

Must never: use the caller's home (the run has a temporary one), leave a process, cgroup or
directory of the run behind (also after a violation or Ctrl-C), or call a run that stopped
early a success.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Any

from settled.errors import EXIT_BLOCKED, EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, BadInput
from settled.soak.plan import FAULT_FAMILIES, INVARIANTS, POINTS

DEFAULT_LANES = 3
DEFAULT_PER_KIND = 5
MAX_PER_KIND = 10_000
ENDING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
MAX_CRASHES = 1_000_000
MAX_LANES = 16


def parse_points(text: str | None) -> tuple[str, ...]:
    """`--points a,b`: a subset of the soak's points (default all of them)."""
    if not text:
        return POINTS
    asked = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [p for p in asked if p not in POINTS]
    if unknown or not asked:
        raise BadInput(
            f"--points {text!r}: unknown point(s) {unknown}; the points are {', '.join(POINTS)}"
        )
    return asked


def parse_faults(text: str | None) -> tuple[str, ...]:
    """`--faults store`: the server fault families (default none: crashes only)."""
    if not text:
        return ()
    asked = tuple(dict.fromkeys(f.strip() for f in text.split(",") if f.strip()))
    unknown = [f for f in asked if f not in FAULT_FAMILIES]
    if unknown or not asked:
        raise BadInput(f"--faults {text!r}: the families are {', '.join(FAULT_FAMILIES)}")
    return asked


def check(crashes: int, lanes: int, start: int, per_kind: int = DEFAULT_PER_KIND) -> None:
    if not 1 <= per_kind <= MAX_PER_KIND:
        raise BadInput(f"--faults-per-kind {per_kind}: between 1 and {MAX_PER_KIND}")
    if not 1 <= crashes <= MAX_CRASHES:
        raise BadInput(f"--crashes {crashes}: between 1 and {MAX_CRASHES}")
    if not 1 <= lanes <= MAX_LANES:
        raise BadInput(f"--lanes {lanes}: between 1 and {MAX_LANES}")
    if start < 0:
        raise BadInput(f"--start {start}: an attempt number, 0 or more")


def run_soak(
    crashes: int,
    seed: int,
    *,
    lanes: int = DEFAULT_LANES,
    start: int = 0,
    points: tuple[str, ...] = POINTS,
    as_json: bool = False,
    faults: tuple[str, ...] = (),
    per_kind: int = DEFAULT_PER_KIND,
) -> int:
    """The whole `settled soak`; returns its exit code."""
    from settled.soak.driver import Run, SoakFailed, interrupt_on_term
    from settled.soak.servers import missing_reason

    check(crashes, lanes, start, per_kind)
    missing = missing_reason() if faults else None
    if missing is not None:
        _say(f"--faults store cannot run here: {missing}")
        return EXIT_FAILURE
    _say(f"seed {seed}: {crashes} crashes at {len(points)} fault points, {lanes} lanes")
    run = Run(crashes, seed, lanes, start, points, faults, per_kind)
    before = interrupt_on_term()
    outcome: dict[str, Any] = {}
    try:
        run.run()
    except KeyboardInterrupt:
        outcome["interrupted"] = True
    except SoakFailed as exc:
        outcome["failure"] = str(exc)
    finally:  # a second Ctrl-C must not stop the run from ending what it started
        quiet = {sig: signal.signal(sig, signal.SIG_IGN) for sig in ENDING_SIGNALS}
        try:
            ended = run.close()
        finally:
            for sig, handler in {**quiet, **before}.items():
                signal.signal(sig, handler)
    report = _report(run, outcome, ended, lanes)
    _print(report, as_json)
    return _code(report)


def _report(run: Any, outcome: dict[str, Any], ended: dict[str, Any], lanes: int) -> dict[str, Any]:
    tally = run.tally
    seconds = round(tally.seconds, 2)
    report: dict[str, Any] = {
        "seed": run.seed,
        "crashes": tally.crashes,
        "asked": run.target,
        "attempts": tally.attempts,
        "start": run.start,
        "lanes": lanes,
        "points": tally.per_point,
        "violations": [tally.violation] if tally.violation else [],
        "seconds": seconds,
        "crashes_per_second": round(tally.crashes / seconds, 3) if seconds else None,
        "invariants": list(INVARIANTS.values()),
        "ended": ended,
        **outcome,
    }
    whole = f"settled soak --seed {run.seed} --crashes {run.target} --lanes {lanes}"
    if tuple(run.points) != POINTS:
        whole += f" --points {','.join(run.points)}"
    if run.faults:
        whole += f" --faults {','.join(run.faults)} --faults-per-kind {run.per_kind}"
        report["faults"] = run.outages.report() if run.outages else {"asked": None, "done": 0}
        report["servers"] = run.servers.describe()
    report["rerun"] = whole
    violation = tally.violation
    if violation and violation.get("attempt") is not None:
        report["reproduce"] = (
            f"settled soak --seed {run.seed} --crashes 1 --lanes 1 "
            f"--start {violation['attempt']} --points {violation['point']}"
        )
        if run.faults:  # the same backends; one round of each fault follows the crash
            report["reproduce"] += f" --faults {','.join(run.faults)} --faults-per-kind 1"
    return report


def _code(report: dict[str, Any]) -> int:
    if report["violations"]:
        return EXIT_BLOCKED
    if report.get("interrupted"):
        return EXIT_INTERRUPTED
    ended = report["ended"]
    if report.get("failure") or ended.get("processes_left") or ended.get("cgroups_left"):
        return EXIT_FAILURE
    faults = report.get("faults")
    if ended.get("servers_left") or (faults and faults["done"] != faults["asked"]):
        return EXIT_FAILURE
    return EXIT_OK if report["crashes"] >= report["asked"] else EXIT_FAILURE


def _print(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, sort_keys=True))
    else:
        print(text(report))
    for line in _stderr_lines(report):
        _say(line)


def _stderr_lines(report: dict[str, Any]) -> list[str]:
    lines = [f"seed {report['seed']}: {report['crashes']} crashes in {report['seconds']} s"]
    for violation in report["violations"]:
        lines.append(
            f'VIOLATION of "{violation["invariant"]}" at {_where(violation)}, seed '
            f"{report['seed']}): {violation['detail']}"
        )
        if "reproduce" in report:
            lines.append(f"reproduce: {report['reproduce']}")
        lines.append(f"the whole run: {report['rerun']}")
    if report.get("failure"):
        lines.append(f"the soak could not go on: {report['failure']}")
        lines.append(f"the whole run: {report['rerun']}")
    ended = report["ended"]
    if ended.get("processes_left") or ended.get("cgroups_left") or ended.get("servers_left"):
        lines.append(f"could not end everything: {ended}")
    return lines


def _where(violation: dict[str, Any]) -> str:
    fault = violation.get("fault")
    if fault is not None:  # a server fault's round: its number, kind and hold
        return f"server fault {fault['number']} ({fault['kind']}, {fault['hold_s']} s"
    return f"crash {violation['crash']} (attempt {violation['attempt']}, point {violation['point']}"


def text(report: dict[str, Any]) -> str:
    rows = [f"{'point':<32} {'crashes':>8} {'not reached':>12} {'s/attempt':>10}"]
    for point, counts in report["points"].items():
        tried = counts["crashes"] + counts["not_reached"]
        each = f"{counts['seconds'] / tried:.2f}" if tried else "-"
        rows.append(f"{point:<32} {counts['crashes']:>8} {counts['not_reached']:>12} {each:>10}")
    if "faults" in report:
        for kind, done in report["faults"].get("per_kind", {}).items():
            rows.append(f"{'fault ' + kind:<32} {done:>8}")
    rate = report["crashes_per_second"]
    rows.append(
        f"{report['crashes']} crashes in {report['seconds']} s ({rate}/s), seed "
        f"{report['seed']}, {report['lanes']} lanes, {report['attempts']} attempts"
    )
    faults = report.get("faults") or {}
    if (
        not report["violations"]
        and report["crashes"] >= report["asked"]
        and (faults.get("done") == faults.get("asked"))
    ):
        rows.append("every invariant held: " + "; ".join(report["invariants"]))
    return "\n".join(rows)


def _say(message: str) -> None:
    print(f"settled soak: {message}", file=sys.stderr, flush=True)
