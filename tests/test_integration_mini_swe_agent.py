"""mini-swe-agent's real agent loop (DefaultAgent, its DeterministicModel) over settled: the
observations are the commands' output and exit codes, a timeout surfaces like its own local
environment's, a replayed run (same task key) reruns no step, the run's end closes the task
(its submit, or the interpreter's exit) with the receipt in the trajectory's info, and the
command gets the caller's environment as LocalEnvironment gives it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("minisweagent", reason="mini-swe-agent not installed (extra: mini-swe-agent)")

from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output
from test_client import TOKEN, Server

from settled.errors import KeyConflict
from settled.integrations._steps import interpreter_grants
from settled.integrations.mini_swe_agent import SettledEnvironment
from settled.runtime import Runtime

pytestmark = pytest.mark.timeout(180)

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat count"
SCRIPT = [
    make_output("append", [{"command": "echo run >> count; echo out; echo err >&2"}]),
    make_output("fail", [{"command": "exit 7"}]),
    make_output("submit", [{"command": SUBMIT}]),
]


def _environment(tmp_path: Path, **extra: Any) -> SettledEnvironment:
    config = {
        "environment_class": "settled.integrations.mini_swe_agent.SettledEnvironment",
        "workspace": str(tmp_path / "ws"),
        "home": str(tmp_path / "home"),
        "task_key": "run-1",
        **extra,
    }
    env = get_environment(config)  # resolved by mini-swe-agent's own dotted-path lookup
    assert isinstance(env, SettledEnvironment)
    return env


def _run(
    env: SettledEnvironment, script: list[dict[str, Any]] = SCRIPT, **agent: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    model = DeterministicModel(outputs=script)
    loop = DefaultAgent(model, env, system_template="sys", instance_template="{{task}}", **agent)
    return loop.run("count"), loop.messages


def _closed_receipt(home: Path, task: str) -> dict[str, Any]:
    """The task's close receipt, read only once its status says the close already proved it
    complete (a close_task on an open task would close it here, proving nothing)."""
    with Runtime(str(home)) as runtime:
        assert runtime.task_status(task)["complete"] is True
        closed = runtime.close_task(task)  # complete: the same receipt, read back
    assert closed.receipt is not None
    return closed.receipt


def test_agent_loop_sees_output_and_codes_and_a_replay_reruns_nothing(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    env = _environment(tmp_path)
    try:
        result, messages = _run(env)
        observations = [m["content"] for m in messages if m["role"] == "user"][1:]
        assert "<returncode>0</returncode>" in observations[0]
        assert "out\nerr\n" in observations[0]
        assert "<returncode>7</returncode>" in observations[1]
        assert result["exit_status"] == "Submitted" and result["submission"] == "run\n"
        # a restarted harness replays the same task: every step gets its first session back
        with _environment(tmp_path) as replay:
            again, _ = _run(replay)
            assert again["submission"] == "run\n"
            assert replay.last is not None and replay.last.reused
        assert (tmp_path / "ws" / "count").read_text() == "run\n"  # ran once, not twice
    finally:
        receipt = env.close()
    assert receipt["kind"] == "close" and receipt["checkpoint"]["digest"].startswith("sha256:")
    assert env.close() == receipt  # a repeated close is the same receipt


def test_a_timeout_surfaces_like_the_local_environment(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    env = _environment(tmp_path, task_key="run-timeout", timeout=1)
    try:
        output = env.execute({"command": "echo started; sleep 30"})
    finally:
        env.close()
    assert output["returncode"] == -1
    assert output["extra"]["exception_type"] == "TimeoutExpired"
    assert "timed out after 1 seconds" in output["exception_info"]
    assert output["output"] == "started\n"
    assert env.last is not None and env.last.receipt["exit"]["reason"] == "timeout"


def test_through_a_service_the_steps_and_the_replay_are_the_same(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    server = Server(tmp_path)
    server.start()
    try:
        env = _environment(tmp_path, url=server.url, token=TOKEN, task_key="run-svc")
        result, _ = _run(env)
        with _environment(tmp_path, url=server.url, token=TOKEN, task_key="run-svc") as replay:
            again, _ = _run(replay)
        receipt = env.close()
    finally:
        server.stop()
    assert result["submission"] == again["submission"] == "run\n"
    assert replay.last is not None and replay.last.reused
    assert (tmp_path / "ws" / "count").read_text() == "run\n"
    assert receipt["checkpoint"]["digest"].startswith("sha256:")


def test_a_replay_that_diverges_is_refused_not_answered_with_the_old_output(
    tmp_path: Path,
) -> None:
    (tmp_path / "ws").mkdir()
    first = _environment(tmp_path, task_key="run-diverge")
    try:
        assert first.execute({"command": "echo a"})["output"] == "a\n"
        # step 0 was another command: no receipt is reused
        with _environment(tmp_path, task_key="run-diverge") as replay, pytest.raises(KeyConflict):
            replay.execute({"command": "echo b"})
    finally:
        first.close()


SUBMIT_PROBE = [
    make_output("probe", [{"command": "echo probe > probed"}]),
    make_output("submit", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo done"}]),
]
PROBE = (
    "command -v python3; python3 -c 'import sys; print(sys.prefix)'; "
    'echo "$MINI_PROBE ${SETTLED_PROBE:-withheld}"'
)


def test_the_command_gets_the_callers_environment_and_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LocalEnvironment's rule: python3 through the caller's PATH is the caller's interpreter,
    a caller's variable is seen, settled's own are withheld; the token is not serialized."""
    (tmp_path / "ws").mkdir()
    bindir = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("MINI_PROBE", "seen")
    monkeypatch.setenv("SETTLED_PROBE", "leaked")
    script = [make_output("probe", [{"command": PROBE}]), SUBMIT_PROBE[-1]]
    with _environment(tmp_path, task_key="run-env", token="secret") as env:
        _, messages = _run(env, script)  # mini's own loop
        record = env.serialize()
    observed = [m["content"] for m in messages if m["role"] == "user"][1]
    assert f"{os.path.join(bindir, 'python3')}\n{sys.prefix}\nseen withheld\n" in observed
    assert "token" not in record["info"]["config"]["environment"]


def test_the_run_closes_its_task_and_its_trajectory_carries_the_close(tmp_path: Path) -> None:
    """mini never calls close: the submitting step closes the task, and the agent's own save
    writes the trajectory with the task id and the close's digests in its info."""
    (tmp_path / "ws").mkdir()
    trajectory = tmp_path / "run.traj.json"
    env = _environment(tmp_path, task_key="run-close")
    try:
        result, _ = _run(env, SUBMIT_PROBE, output_path=trajectory)
        assert result["exit_status"] == "Submitted"
        receipt = _closed_receipt(tmp_path / "home", env.task)  # closed without close()
        info = json.loads(trajectory.read_text())["info"]
    finally:
        assert env.close() == receipt  # releases; the receipt is the one the run made
    settled = info["settled"]
    assert settled["task"] == env.task and settled["closed"] is True
    assert settled["close_receipt"] == receipt["digest"]
    assert settled["checkpoint"] == receipt["checkpoint"]["digest"]
    assert [t["task"] for t in settled["tasks"]] == [env.task]
    assert receipt["checkpoint"]["digest"].startswith("sha256:")


def test_a_second_run_after_a_submit_is_a_new_closed_task(tmp_path: Path) -> None:
    """The interactive agent goes on after a submit when the user types a new task: the next
    step opens the next task (key .1), and info lists both, each with its close."""
    (tmp_path / "ws").mkdir()
    with _environment(tmp_path, task_key="run-twice") as env:
        first, _ = _run(env, SUBMIT_PROBE)
        first_task = env.task
        second, _ = _run(env, SUBMIT_PROBE)
        tasks = env.serialize()["info"]["settled"]["tasks"]
    assert first["exit_status"] == second["exit_status"] == "Submitted"
    assert [t["task_key"] for t in tasks] == ["run-twice", "run-twice.1"]
    assert tasks[0]["task"] == first_task != tasks[1]["task"]
    for entry in tasks:
        receipt = _closed_receipt(tmp_path / "home", entry["task"])
        assert entry["close_receipt"] == receipt["digest"]


def test_a_run_that_ends_without_a_submit_is_closed_when_its_process_exits(
    tmp_path: Path,
) -> None:
    """A step limit ends the run with no submit: the environment's atexit hook closes the task
    as the real interpreter exits (nothing here calls close)."""
    (tmp_path / "ws").mkdir()
    program = textwrap.dedent(
        f"""
        from minisweagent.agents.default import DefaultAgent
        from minisweagent.environments import get_environment
        from minisweagent.models.test_models import DeterministicModel, make_output
        env = get_environment({{
            "environment_class": "settled.integrations.mini_swe_agent.SettledEnvironment",
            "workspace": {str(tmp_path / "ws")!r}, "home": {str(tmp_path / "home")!r},
            "task_key": "run-limit",
        }})
        model = DeterministicModel(outputs=[make_output("a", [{{"command": "echo a >> f"}}])] * 3)
        agent = DefaultAgent(model, env, system_template="s", instance_template="t", step_limit=1)
        print(agent.run("t")["exit_status"], env.task, env.serialize()["info"]["settled"]["closed"])
        """
    )
    quiet = {"MSWEA_SILENT_STARTUP": "1", "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "mini")}
    done = subprocess.run(
        [sys.executable, "-c", program],
        env={**os.environ, **quiet, "PYTHONPATH": str(Path(__file__).parents[1] / "src")},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    status, task, closed_before_exit = done.stdout.split()
    assert (status, closed_before_exit) == ("LimitsExceeded", "False")
    assert _closed_receipt(tmp_path / "home", task)["kind"] == "close"
    assert (tmp_path / "ws" / "f").read_text() == "a\n"


def test_the_interpreter_grant_leaves_what_the_view_already_shows(tmp_path: Path) -> None:
    """The grant is the interpreter's directories, read-only; one inside the workspace (a venv
    in the repo) stays the workspace's, writable, and the system's are in every view."""
    prefix = os.path.realpath(sys.prefix)
    assert prefix in interpreter_grants(str(tmp_path))
    assert prefix not in interpreter_grants(os.path.dirname(prefix))  # the workspace holds it
    assert not [p for p in interpreter_grants(str(tmp_path)) if p.startswith("/usr/")]


def test_the_exit_close_runs_no_file_the_workspace_holds(tmp_path: Path) -> None:
    """The exit-time close is a fresh interpreter: -I -S (no .pth file runs), settled and the
    site-packages on its path by hand, and refused when any of them, or the interpreter, lies
    in the workspace, whose files the task's commands could have replaced."""
    from settled.integrations._steps import LocalSteps, exit_close_command, exit_close_roots

    command = exit_close_command("t_0123456789abcdef")
    assert command[1:4] == ["-I", "-S", "-c"] and command[-3:-1] == ["--json", "--deadline"]
    assert command[6 : 6 + int(command[5])] == exit_close_roots()
    venv_in_repo = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    steps = LocalSteps(str(tmp_path / "home"))
    with pytest.raises(RuntimeError, match="is inside its workspace, which its commands could"):
        steps.close_at_exit("t_0123456789abcdef", workspace=venv_in_repo)
    steps.release()
