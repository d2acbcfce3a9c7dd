"""`settled explain` for a person: a one-line verdict, then one line per session named by its
command (escaped, shortened), how it ended and what proved it stopped; `--verbose` gives the
full words (every session's kernel evidence) and `--json` is the same data as before.

Driven as a user would: real `settled` processes over a real home and real commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from settled.printable import printable
from settled.render import shortened

SETTLED = [sys.executable, "-m", "settled.cli"]
HOSTILE = ["printf", "\x1b[2K\u202eevil\\"]  # erase the row, reverse it, a backslash
LONG = "echo " + "x" * 200


def _settled(home: Path, *args: str, code: int = 0) -> str:
    env = {**os.environ, "SETTLED_HOME": str(home)}  # the test's marker is in os.environ
    done = subprocess.run([*SETTLED, *args], capture_output=True, timeout=60, env=env)
    assert done.returncode == code, (args, done.returncode, done.stdout, done.stderr)
    return done.stdout.decode()


def _session_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("  ")]


@pytest.mark.timeout(180)
def test_explain_is_a_verdict_and_a_line_per_session_and_verbose_is_the_whole(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    (tmp_path / "ws").mkdir()
    task = _settled(home, "task", "new", "--workspace", str(tmp_path / "ws"), "-q").strip()
    run = ("run", "--task", task, "--")
    _settled(home, *run, "true")
    _settled(home, *run, "sh", "-c", "exit 3", code=3)
    _settled(home, *run, "no-such-command-here", code=127)
    _settled(home, *run, *HOSTILE)
    _settled(home, *run, "sh", "-c", LONG)
    running = _settled(home, "exec", "--task", task, "-q", "--", "sleep", "60").strip()

    opened = _settled(home, "explain", task, code=3)
    assert opened.splitlines()[0].startswith(f"task {task} is open (6 session(s), 1 of")
    [live] = [line for line in _session_lines(opened) if running in line]
    assert live.split()[0] == "running" and "no death evidence yet" in live
    assert "unknown" not in live.lower()
    words = _settled(home, "explain", task, "--verbose", code=3)
    assert "Commands: 3 succeeded, 2 failed, 1 running." in words and "unknown" not in words
    assert f"Session {running}: still running, no death evidence yet." in words
    _settled(home, "cancel", running)
    _settled(home, "close", task, "--deadline", "30")

    short = _settled(home, "explain", task)
    verbose = _settled(home, "explain", task, "--verbose")
    as_json: dict[str, Any] = json.loads(_settled(home, "--json", "explain", task))

    verdict, *rest = short.splitlines()
    assert verdict.startswith(f"task {task} is COMPLETE (not success: 3 of 6 command(s)")  # the
    # cancelled `sleep 60` did not succeed either
    lines = _session_lines(short)
    assert (
        len(lines) == 6
        and rest[-1] == f"(every session's evidence: settled explain {task} --verbose)"
    )
    ended = {line[17:].split("  (")[0]: line[2:16].strip() for line in lines}  # command: end
    assert ended["true"] == "exit 0" and ended["sh -c 'exit 3'"] == "exit 3"
    assert ended["no-such-command-here"] == "exit 127" and ended["sleep 60"] == "cancelled"
    for line in lines:
        assert "(death proven: " in line, line
    # the hostile argv is shown escaped (no ESC, no bidi override reaches the terminal)
    assert "\x1b" not in short and "\u202e" not in short
    assert "printf '\\x1b[2K\\u202eevil\\\\'" in short
    # a long command is cut, with an ellipsis; the evidence paragraph is not repeated
    assert "echo " + "x" * 30 in short and "x" * 100 not in short and "…" in short
    assert "cgroup.events" not in short and "PID namespace reaped" not in short
    assert len(short) < len(verbose) / 2 and max(map(len, lines)) < 120

    # --verbose is today's full text: every session's evidence; --json the same data as before
    assert verbose == printable(as_json["words"]) + "\n"
    assert verbose.count("Session s_") == 6
    assert "brief" not in as_json and as_json["complete"] is True
    assert {s["command"] for s in as_json["sessions"]} >= {"true", "sleep 60"}


def test_a_command_is_shortened_on_escape_boundaries() -> None:
    assert shortened("make test") == "make test"
    cut = shortened("\x1b" * 40, width=10)
    assert cut == "\\x1b\\x1b…"  # never half an escape
    assert shortened("a" * 100, width=10) == "a" * 9 + "…"
    assert shortened("é\u202e", width=60) == "é\\u202e"


def test_the_short_form_names_a_block_an_unknown_session_and_counts_the_rest() -> None:
    """The verdict of a blocked task is its authority and obligation; a session without death
    evidence is said to have none (never 'stopped'); past SESSION_LINES the rest are counted."""
    from settled.render import SESSION_LINES, explain_brief

    unknown = {"session": "s_u", "command": "sleep 9", "state": "unknown", "exit": None}
    unknown |= {"proven": False, "boundary": "pgroup", "source": None}
    never = {"session": "s_n", "command": "x", "state": "settled", "proven": True}
    never |= {"exit": {"reason": "not_started"}, "boundary": "cgroup2", "source": "owner"}
    many = [{**never, "session": f"s_{n}"} for n in range(SESSION_LINES + 5)]
    view = {
        "task": "t_1",
        "state": "closing",
        "complete": False,
        "blocked": True,
        "blocked_on": {"authority": "recovery", "obligation": "death evidence for session s_u"},
        "sessions": [unknown, *many],
    }
    text = explain_brief(view, more="(more)")
    lines = text.splitlines()
    assert (
        lines[0]
        == "task t_1 is NOT complete: blocked, recovery owes death evidence for session s_u."
    )
    said = "NO death evidence: recover it or destroy its sandbox"
    assert lines[1] == f"  unknown        sleep 9  ({said}; s_u)"
    assert lines[2] == "  never started  x  (death proven: cgroup2; s_0)"
    assert lines[-2] == "  … and 6 more session(s)" and lines[-1] == "(more)"
    assert len(lines) == 1 + SESSION_LINES + 2


@pytest.mark.timeout(180)
def test_a_cancelled_command_or_a_crashed_service_is_not_called_success(tmp_path: Path) -> None:
    """The verdict counts as the close receipt does (states.did_not_succeed): a command the
    close cancelled at its deadline and a service that crashed on its own did not succeed; a
    service the close stopped did."""
    home = tmp_path / "home"
    (tmp_path / "ws").mkdir()
    task = _settled(home, "task", "new", "--workspace", str(tmp_path / "ws"), "-q").strip()
    _settled(home, "run", "--task", task, "--", "true")
    _settled(home, "exec", "--task", task, "-q", "--", "sleep", "100")
    crashed = _settled(home, "exec", "--task", task, "-q", "--service", "--", "sh", "-c", "exit 3")
    _settled(home, "wait", crashed.strip())
    _settled(home, "exec", "--task", task, "-q", "--service", "--", "sleep", "100")
    closed = json.loads(_settled(home, "close", task, "--deadline", "1", "--json"))
    commands = closed["outcome"]["commands"]
    assert len(commands["cancelled"]) == 1 and len(commands["failed"]) == 1
    assert len(commands["services_stopped"]) == 1 and len(commands["succeeded"]) == 1
    assert closed["outcome"]["all_commands_succeeded"] is False
    verdict = _settled(home, "explain", task).splitlines()[0]
    assert f"task {task} is COMPLETE (not success: 2 of 4 command(s) did not succeed)" in verdict
