"""`settled probe`: the essay's checklist as experiments, against settled (a fresh home and a real
`settled serve`), a plain `subprocess.run` and SWE-ReX's local runtime.

Each test runs the real experiments and checks the answers against the evidence they carry:
settled holds on every question; the baselines fail what they really fail, and say so with
pids, byte counts and digests. Every process a probe starts carries its marker and is ended by
the probe (`left_running` must be empty); conftest's autouse fixture ends anything else
carrying the test's marker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import proc_files
from test_cli import SETTLED
from test_client import TOKEN, Server

from settled.boundary import inspect as boundary_inspect
from settled.probe import QUESTION_IDS, probe
from settled.probe import host as probe_host
from settled.probe.host import Sweep
from settled.probe.questions import FAILS, HOLDS, NOT_APPLICABLE, run_questions
from settled.probe.report import Report, table
from settled.probe.settled_adapter import SettledAdapter
from settled.probe.settled_local import LocalBackend


def answers(report: Report, runtime: int = 0) -> dict[str, dict[str, Any]]:
    return {a["question"]: a for a in report.to_json()["runtimes"][runtime]["answers"]}


def verdicts(report: Report, runtime: int = 0) -> dict[str, str]:
    return {k: v["verdict"] for k, v in answers(report, runtime).items()}


def processes_naming(text: str) -> list[int]:
    needle = text.encode()
    return [pid for pid, (cmdline,) in proc_files("cmdline") if needle in cmdline]


@pytest.mark.timeout(240)
def test_settled_on_a_fresh_home_holds_on_every_question_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SETTLED_HOME", str(tmp_path / "the-users-home"))
    report = probe(["settled"])
    found = answers(report)
    assert verdicts(report) == dict.fromkeys(QUESTION_IDS, HOLDS), json.dumps(found, indent=1)
    assert report.holds and report.exit_code == 0
    runtime = report.to_json()["runtimes"][0]
    assert runtime["name"] == "settled" and runtime["version"].startswith("settled ")
    assert runtime["left_running"] == [] and runtime["cleanup_error"] is None
    evidence = {k: v["evidence"] for k, v in found.items()}
    assert evidence["retry"]["launches"] == 1 and evidence["retry"]["reused"] is True
    assert evidence["long_line"]["received"] == 4 << 20
    assert evidence["long_line"]["recomputed"] == evidence["long_line"]["receipt_digest"]
    assert evidence["binary"]["received_sha256"] == evidence["binary"]["written_sha256"]
    assert evidence["silent"]["exit"]["reason"] == "timeout"
    # caught before or after setsid exec'd the sleep: named either way
    assert evidence["holder"]["stragglers"][0]["cmdline"].endswith("sleep 60")
    killed = evidence["owner_killed"]
    assert killed["status_after_the_kill"] == "unknown" and killed["launches"] == 1
    assert killed["retry"]["reused"] is True and killed["death"]["source"] == "recovery"
    assert killed["retry_after_recovery"]["reused"] is True
    assert killed["other_exec"].startswith("AdmissionFrozen")
    assert evidence["late_write"]["restored"] == evidence["late_write"]["written"]
    assert evidence["fenced"]["stale_write"].startswith("StaleWrite")
    assert evidence["fenced"]["exec_after_close"].startswith("AdmissionSealed")
    assert (
        evidence["receipt"]["allowed_by"]["process_receipts"][0]["digest"]
        == (evidence["receipt"]["process_receipt"])
    )
    home = runtime["where"].removeprefix("a fresh home ")
    assert home.startswith("/") and not os.path.exists(home), "the probe's home is removed"
    assert processes_naming(home) == [], "no owner or journal of the probe's home still runs"
    assert not (tmp_path / "the-users-home").exists(), "the user's home is never opened"


@pytest.mark.timeout(180)
def test_every_task_the_settled_probe_makes_is_closed_and_its_cgroups_are_gone() -> None:
    adapter = SettledAdapter(Sweep(), LocalBackend())
    backend = adapter.backend
    assert isinstance(backend, LocalBackend)
    rt = backend.rt
    try:
        run_questions(adapter.experiments(), ("retry", "silent", "owner_killed"))
        assert len(adapter.tasks) == 3
        for task in adapter.tasks:
            view = rt.task_status(task)
            assert view["state"] == "complete", view
            assert all(row["state"] == "settled" for row in view["sessions"]), view
            cgroup = boundary_inspect.cgroup_path_of(task, "")
            assert cgroup is None or not os.path.exists(cgroup), f"{cgroup} is left"
    finally:
        adapter.close()
    assert not os.path.exists(rt.home)


@pytest.mark.timeout(240)
def test_settled_serve_through_its_url_holds_where_applicable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = Server(tmp_path)
    server.start()
    try:
        monkeypatch.setenv("SETTLED_TOKEN", TOKEN)
        report = probe([server.url])
    finally:
        server.stop()
    found = answers(report)
    assert verdicts(report) == dict.fromkeys(QUESTION_IDS, HOLDS), json.dumps(found, indent=1)
    runtime = report.to_json()["runtimes"][0]
    assert runtime["where"] == f"the service at {server.url}" and runtime["left_running"] == []
    assert runtime["version"].startswith("settled 0.")  # the service's, from its OpenAPI info
    assert found["retry"]["evidence"]["how_lost"].startswith("the first POST reached the store")
    assert found["owner_killed"]["evidence"]["status_after_the_kill"] == "unknown"
    assert "bytes not read" in found["late_write"]["answer"]  # no restore over HTTP: said so
    assert found["fenced"]["evidence"]["stale_write_tried"] is False
    assert found["fenced"]["evidence"]["exec_after_close"].startswith("AdmissionSealed")


@pytest.mark.timeout(120)
def test_killing_the_owner_of_a_service_on_another_machine_is_not_applicable_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = Server(tmp_path)
    server.start()
    try:
        monkeypatch.setenv("SETTLED_TOKEN", TOKEN)
        monkeypatch.setattr(probe_host, "boot_id", lambda: "another-machine")
        report = probe([server.url], only=("owner_killed",))
    finally:
        server.stop()
    [answer] = answers(report).values()
    assert answer["verdict"] == NOT_APPLICABLE
    assert "needs its host" in answer["answer"] and "another machine" in answer["answer"]
    assert report.exit_code == 0 and report.to_json()["runtimes"][0]["left_running"] == []


@pytest.mark.timeout(180)
def test_subprocess_fails_what_it_really_fails_with_the_evidence() -> None:
    report = probe(["subprocess"])
    found = answers(report)
    assert report.exit_code == 3 and not report.holds
    assert report.to_json()["runtimes"][0]["left_running"] == []
    retry = found["retry"]
    assert retry["verdict"] == FAILS and retry["evidence"]["launches"] == 2
    binary = found["binary"]["evidence"]
    assert found["binary"]["verdict"] == FAILS and binary["replaced"] > 0
    assert binary["received_digest"] != binary["written_digest"]
    long_line = found["long_line"]  # subprocess.run reads a long line whole: it holds
    assert long_line["verdict"] == HOLDS and long_line["evidence"]["received"] == 4 << 20
    silent = found["silent"]
    assert silent["evidence"]["timed_out"] is True
    ran_on = silent["evidence"]["running_after_the_call"]
    assert silent["verdict"] == (FAILS if ran_on else HOLDS)  # what /bin/sh really did
    holder = found["holder"]
    assert holder["verdict"] == FAILS and holder["evidence"]["timed_out"] is True
    assert [p["cmdline"] for p in holder["evidence"]["running_after_the_call"]] == ["sleep 60"]
    killed = found["owner_killed"]
    assert killed["verdict"] == FAILS and killed["evidence"]["launches"] == 2
    assert any(p["cmdline"] == "sleep 30" for p in killed["evidence"]["running_after_the_kill"])
    assert found["late_write"]["verdict"] == NOT_APPLICABLE
    assert found["late_write"]["evidence"]["on_disk"] is True
    assert found["fenced"]["verdict"] == NOT_APPLICABLE
    assert found["receipt"]["verdict"] == FAILS and found["receipt"]["evidence"]["receipt"] is None


@pytest.mark.timeout(240)
def test_swerex_local_runtime_is_reported_as_it_really_behaves() -> None:
    pytest.importorskip("swerex")
    report = probe(["swerex"])
    found = answers(report)
    runtime = report.to_json()["runtimes"][0]
    assert runtime["version"].startswith("swe-rex ") and runtime["left_running"] == []
    assert found["retry"]["verdict"] == FAILS and found["retry"]["evidence"]["launches"] == 2
    binary = found["binary"]["evidence"]
    assert found["binary"]["verdict"] == FAILS and binary["received"] != binary["written"]
    long_line = found["long_line"]
    same = long_line["evidence"]["received_digest"] == long_line["evidence"]["written_digest"]
    assert long_line["verdict"] == (HOLDS if same else FAILS)
    silent = found["silent"]
    assert silent["evidence"]["timed_out"] is True
    ran_on = silent["evidence"]["running_after_the_call"]
    assert silent["verdict"] == (FAILS if ran_on else HOLDS)
    holder = found["holder"]
    assert holder["verdict"] == FAILS and holder["evidence"]["proof"] is None
    killed = found["owner_killed"]
    assert killed["verdict"] == FAILS and killed["evidence"]["launches"] == 2
    assert found["late_write"]["verdict"] == NOT_APPLICABLE
    assert found["fenced"]["verdict"] == NOT_APPLICABLE
    assert found["receipt"]["verdict"] == FAILS


@pytest.mark.timeout(120)
def test_the_command_prints_one_json_object_and_exits_3_when_an_answer_fails(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [*SETTLED, "probe", "--runtime", "subprocess", "--runtime", "settled",
         "--only", "retry", "--only", "receipt", "--json"],
        capture_output=True, timeout=100, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    report = json.loads(done.stdout)
    assert report["holds"] is False and report["machine"]["cpus"]
    plain, ours = report["runtimes"]
    assert (plain["name"], ours["name"]) == ("subprocess", "settled")
    for runtime in (plain, ours):
        assert runtime["version"] and runtime["how"] and runtime["left_running"] == []
        assert [a["question"] for a in runtime["answers"]] == ["retry", "receipt"]
        for answer in runtime["answers"]:
            assert set(answer) == {"question", "asks", "verdict", "answer", "evidence", "seconds"}
    assert [a["verdict"] for a in plain["answers"]] == [FAILS, FAILS]
    assert [a["verdict"] for a in ours["answers"]] == [HOLDS, HOLDS]


@pytest.mark.timeout(120)
def test_the_command_exits_0_when_every_answer_holds_and_prints_the_table(tmp_path: Path) -> None:
    done = subprocess.run(
        [*SETTLED, "probe", "--only", "retry", "--only", "fenced"],
        capture_output=True, timeout=100, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout.decode()
    assert "every applicable answer holds: 2 hold, 0 fail" in out
    assert "probing settled" in done.stderr.decode()  # progress on stderr, the answers on stdout


@pytest.mark.parametrize(
    ("runtime", "named"),
    [
        ("nope", "'nope' is not one of settled, subprocess, swerex"),
        ("http://127.0.0.1:1", "no settled service answers at http://127.0.0.1:1"),
    ],
)
def test_an_unknown_runtime_or_an_unreachable_url_is_one_line_and_exit_2(
    tmp_path: Path, runtime: str, named: str
) -> None:
    done = subprocess.run(
        [*SETTLED, "probe", "--runtime", runtime], capture_output=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 2 and done.stdout == b""
    [line] = done.stderr.decode().splitlines()
    assert named in line


def test_the_table_has_a_row_per_question_and_a_column_per_runtime_headed_by_its_version() -> None:
    report = probe(["subprocess"], only=("retry", "fenced"))
    lines = table(report).splitlines()
    assert lines[0].startswith("| question | Python ") and "subprocess |" in lines[0]
    assert len(lines) == 2 + len(QUESTION_IDS)
    assert "**fails**: 2 launches" in lines[2] and "not asked" in lines[3]
    assert "n/a: subprocess has no task" in lines[-2]


@pytest.mark.timeout(120)
def test_a_terminated_probe_still_ends_every_command_it_started(tmp_path: Path) -> None:
    probing = subprocess.Popen(
        [*SETTLED, "probe", "--runtime", "subprocess"], cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # where its scratch directories go
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert probing.stderr is not None
    for line in probing.stderr:  # SIGTERM while the setsid descendant holds the pipe
        if b"a setsid descendant" in line:
            break
    probing.send_signal(signal.SIGTERM)
    assert probing.wait(timeout=60) == 130
    mark = f"PROBE_MARK=settled-probe-{probing.pid}-".encode()
    assert [pid for pid, (env,) in proc_files("environ") if mark in env] == []
    assert list(tmp_path.glob("settled-probe-*")) == [], "its scratch directories are removed"
