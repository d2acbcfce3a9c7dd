"""mini-swe-agent's real agent loop (DefaultAgent, its DeterministicModel) over settled: the
observations are the commands' output and exit codes, a timeout surfaces like its own local
environment's, a replayed run (same task key) reruns no step, close() checkpoints, and
the command gets the caller's environment as LocalEnvironment gives it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("minisweagent", reason="mini-swe-agent not installed (extra: mini-swe-agent)")

from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output
from test_client import TOKEN, Server

from settled.errors import KeyConflict
from settled.integrations.mini_swe_agent import SettledEnvironment

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


def _run(env: SettledEnvironment) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    model = DeterministicModel(outputs=SCRIPT)
    agent = DefaultAgent(model, env, system_template="sys", instance_template="{{task}}")
    return agent.run("count"), agent.messages


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
        replay = _environment(tmp_path)
        try:
            again, _ = _run(replay)
            assert again["submission"] == "run\n"
            assert replay.last is not None and replay.last.reused
        finally:
            replay.backend.release()
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
        replay = _environment(tmp_path, url=server.url, token=TOKEN, task_key="run-svc")
        again, _ = _run(replay)
        replay.backend.release()
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
        replay = _environment(tmp_path, task_key="run-diverge")
        try:
            with pytest.raises(KeyConflict):  # step 0 was another command: no receipt is reused
                replay.execute({"command": "echo b"})
        finally:
            replay.backend.release()
    finally:
        first.close()


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
    env = _environment(tmp_path, task_key="run-env", token="secret")
    try:
        output = env.execute({"command": PROBE})
        record = env.serialize()
    finally:
        env.close()
    assert output["output"] == f"{os.path.join(bindir, 'python3')}\n{sys.prefix}\nseen withheld\n"
    assert "token" not in record["info"]["config"]["environment"]
