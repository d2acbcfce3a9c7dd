"""`settled soak`: real crashes (SIGKILL at named fault points) of real owners, CLI processes and
servers, with the invariants checked after each, run through the CLI as CI runs it.

A soak that passes must also end everything it started; a planted violation (a relaunched
command, a log cut below its durable cursor) must be caught, named with the seed and the point,
and replayed by the command it prints.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from settled.faults import ALL_POINTS
from settled.soak.plan import FAMILIES, INVARIANTS, POINTS, Attempt
from settled.soak.servers import missing_reason, weed_binary

SOAK = [sys.executable, "-m", "settled.cli", "soak"]
FAULT_LOOPS = int(os.environ.get("SETTLED_FAULT_LOOPS") or 2)  # per kind, for --faults store


def soak(
    *args: str, plant: str | None = None, timeout: float = 600
) -> tuple[int, dict[str, Any], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
    if plant:
        env["SETTLED_SOAK_PLANT"] = plant
    done = subprocess.run([*SOAK, *args, "--json"], env=env, capture_output=True, timeout=timeout)
    report = json.loads(done.stdout) if done.stdout.strip() else {}
    return done.returncode, report, done.stderr.decode(errors="replace")


def marked_by(pid: int) -> list[int]:
    """Processes whose environment carries the mark of the soak whose pid is `pid`."""
    needle = f"SETTLED_SOAK_MARK=settled-soak-{pid}-".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ:
            found.append(int(entry))
    return found


def assert_ended_everything(report: dict[str, Any]) -> None:
    ended = report["ended"]
    assert ended["processes_left"] == 0 and ended["cgroups_left"] == [], ended
    assert ended["scratch_left"] is False, ended


def test_each_attempt_is_drawn_from_the_seed_alone() -> None:
    assert set(POINTS) == set(ALL_POINTS), "the soak reaches every fault point there is"
    first = [(a.point, a.work().shell) for a in (Attempt(7, n, POINTS) for n in range(50))]
    again = [(a.point, a.work().shell) for a in (Attempt(7, n, POINTS) for n in range(50))]
    other = [Attempt(8, n, POINTS).point for n in range(50)]
    assert first == again and [p for p, _ in first] != other
    assert {Attempt(7, n, POINTS).family for n in range(200)} == set(FAMILIES)
    alone = Attempt(7, 3, (Attempt(7, 3, POINTS).point,))  # a replay with --points
    assert alone.work().shell == first[3][1], "the same parameters as in the whole run"


@pytest.mark.timeout(600)
def test_a_short_soak_crashes_every_family_holds_every_invariant_and_ends_everything() -> None:
    code, report, stderr = soak("--crashes", "30", "--seed", "20261")
    assert code == 0, stderr
    assert "seed 20261" in stderr, "the seed is printed"
    assert report["seed"] == 20261 and report["crashes"] == 30 and report["violations"] == []
    assert sum(c["crashes"] for c in report["points"].values()) == 30
    assert report["attempts"] == 30 + sum(c["not_reached"] for c in report["points"].values())
    crashed = {p.partition(".")[0] for p, c in report["points"].items() if c["crashes"]}
    assert crashed == set(FAMILIES), crashed
    assert report["seconds"] > 0 and report["crashes_per_second"] > 0
    assert report["invariants"] == list(INVARIANTS.values())
    assert_ended_everything(report)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("plant", "invariant"),
    [("relaunch", "no duplicate launch"), ("truncate", "no lost durable byte")],
)
def test_a_planted_violation_is_caught_named_and_replayed(plant: str, invariant: str) -> None:
    point = "owner.before_receipt"
    code, report, stderr = soak("--crashes", "3", "--seed", "5", "--points", point, plant=plant)
    assert code == 3, stderr
    [violation] = report["violations"]
    assert violation["invariant"] == invariant and violation["point"] == point, violation
    assert f'VIOLATION of "{invariant}"' in stderr and "seed 5" in stderr, stderr
    assert point in stderr and report["reproduce"] in stderr
    assert_ended_everything(report)
    replay = report["reproduce"].split()[2:]  # settled soak ...
    assert (
        replay[:2] == ["--seed", "5"] and f"--start {violation['attempt']}" in report["reproduce"]
    )
    code, again, _ = soak(*replay, plant=plant)
    assert code == 3 and again["violations"][0]["invariant"] == invariant
    assert again["violations"][0]["attempt"] == violation["attempt"]
    assert_ended_everything(again)


@pytest.mark.parametrize(
    "args",
    [
        ("--crashes", "0"),
        ("--points", "owner.nowhere"),
        ("--lanes", "0"),
        ("--home", "/tmp/x"),
        ("--faults", "disk"),
        ("--faults", "store", "--faults-per-kind", "0"),
    ],
)
def test_bad_input_is_refused_with_exit_2_before_anything_runs(args: tuple[str, ...]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
    done = subprocess.run([*SOAK, *args], env=env, capture_output=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert b"settled soak: seed" not in done.stderr, "nothing ran"


@pytest.mark.timeout(300)
def test_an_interrupted_soak_ends_everything_it_started() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
    process = subprocess.Popen(
        [*SOAK, "--crashes", "100000", "--seed", "3", "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        give_up = time.monotonic() + 120
        while len(marked_by(process.pid)) < 4:  # lanes, owners, a server: it is under way
            assert process.poll() is None and time.monotonic() < give_up
            time.sleep(0.1)
        time.sleep(2)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, err
    report = json.loads(out)
    assert report["interrupted"] is True and report["violations"] == []
    assert_ended_everything(report)
    assert marked_by(process.pid) == [], "no process of the run is left"


def _running_under(directory: str) -> list[int]:
    """Processes whose command line names `directory` (a server's data directory)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if directory.encode() in cmdline:
            found.append(int(entry))
    return found


@pytest.mark.timeout(900)
@pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
def test_store_faults_restart_kill_and_stop_the_servers_and_every_invariant_holds() -> None:
    """`--faults store`: a PostgreSQL (and S3, weed being installed) of the soak's own,
    restarted, killed and stopped FAULT_LOOPS times per kind among the crashes: no lost exit
    status, no false complete, no duplicate launch, every close converging by itself; the
    servers are ended with everything else."""
    per_kind = FAULT_LOOPS
    code, report, stderr = soak(
        "--faults", "store", "--faults-per-kind", str(per_kind), "--crashes", "4", "--seed", "39"
    )
    assert code == 0, stderr
    kinds = {"pg_restart", "pg_kill", "pg_stop"} | ({"s3_stop"} if weed_binary() else set())
    assert report["faults"]["per_kind"] == dict.fromkeys(kinds, per_kind), report["faults"]
    assert report["faults"]["done"] == report["faults"]["asked"] == per_kind * len(kinds)
    assert report["violations"] == [] and report["crashes"] == 4
    assert "no lost exit status" in report["invariants"]
    assert "--faults store --faults-per-kind" in report["rerun"]
    assert_ended_everything(report)
    assert report["ended"]["servers_left"] == []
    for directory in (report["servers"]["postgresql_dir"], report["servers"]["weed_dir"]):
        if directory:
            assert _running_under(directory) == [], f"a server of {directory} still runs"
            assert not os.path.exists(directory)


def test_store_faults_where_postgresql_is_missing_fail_in_one_line_with_exit_1() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
    env["SETTLED_PG_BIN"] = "/nonexistent/bin"
    done = subprocess.run(
        [*SOAK, "--faults", "store", "--crashes", "1"], env=env, capture_output=True, timeout=60
    )
    assert done.returncode == 1, done.stderr
    [line] = done.stderr.decode().splitlines()
    assert "no PostgreSQL binaries" in line and "/nonexistent/bin" in line, line


@pytest.mark.timeout(300)
@pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
def test_an_interrupted_store_soak_ends_the_servers_it_started() -> None:
    """Ctrl-C among the crashes and faults: exit 130, and its PostgreSQL and S3 are ended (a
    stopped one continued first) and their directories removed."""
    pattern = ("/tmp/settled-soak-pg-*", "/tmp/settled-soak-weed-*")
    before = {path for p in pattern for path in glob.glob(p)}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SETTLED_")}
    process = subprocess.Popen(
        [*SOAK, "--faults", "store", "--faults-per-kind", "1000", "--crashes", "100000",
         "--seed", "7", "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        give_up = time.monotonic() + 120
        while len(marked_by(process.pid)) < 4:  # servers up, lanes and owners under way
            assert process.poll() is None and time.monotonic() < give_up
            time.sleep(0.1)
        time.sleep(8)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, err
    report = json.loads(out)
    assert report["interrupted"] is True and report["violations"] == []
    assert_ended_everything(report)
    assert report["ended"]["servers_left"] == []
    made = {path for p in pattern for path in glob.glob(p)} - before
    assert made == set(), f"left behind: {made}"
    for directory in (report["servers"]["postgresql_dir"], report["servers"]["weed_dir"]):
        if directory:
            assert _running_under(directory) == [], f"a server of {directory} still runs"


@pytest.mark.timeout(600)
@pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
def test_a_lost_exit_status_planted_in_a_fault_round_is_caught_named_and_rerun() -> None:
    code, report, stderr = soak(
        "--faults", "store", "--faults-per-kind", "1", "--crashes", "1", "--seed", "5",
        plant="owner_lost",
    )  # fmt: skip
    assert code == 3, stderr
    [violation] = report["violations"]
    assert violation["invariant"] == "no lost exit status", violation
    assert violation["fault"]["kind"] in report["faults"]["per_kind"], violation
    assert 'VIOLATION of "no lost exit status" at server fault' in stderr and "seed 5" in stderr
    assert report["rerun"] in stderr and "--faults store" in report["rerun"]
    assert_ended_everything(report)
    assert report["ended"]["servers_left"] == []
