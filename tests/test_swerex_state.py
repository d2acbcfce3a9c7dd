"""`settled serve --swerex`'s shell state against hostile programs, big actions and long waits.

Each test drives a real `settled serve --swerex` (tests/test_swerex.py's fixture) with swe-rex's
own RemoteRuntime. The threat: the command and every program it runs are hostile; a program an
action runs must not change the state the next action starts from (in SWE-ReX's own server a
child cannot change its parent shell's state either), nor make the server claim a syntax error.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("swerex")

import test_swerex
from swerex.runtime.abstract import BashAction, Command, CreateBashSessionRequest
from test_swerex import KEY, Served, _drive, _post

from settled.server import swerex_service
from settled.server.swerex_service import SwerexService

# A child of the action: looks for the nonce wherever its parent shell might show it (argv,
# environment, stdin, its descriptors), writes a report with what it found (old form and new,
# size and all) and a syntax token to every descriptor of the parent it can open, then SIGKILLs
# the parent so that the real report never comes.
FORGER = r"""
p=$PPID
{ tr '\0' '\n' </proc/$p/cmdline; tr '\0' '\n' </proc/$p/environ
  cat /proc/$p/fd/0; for f in /proc/$p/fd/*; do timeout 1 cat "$f"; done; } >"$2" 2>/dev/null
nonce=$(grep -ao 'settled-swerex-[a-z]*-[0-9a-f]\{32\}' "$2" | head -1 | tail -c 33)
nonce=${nonce:-0123456789abcdef0123456789abcdef}
size=0; for f in /tmp PATH "/tmp/evil:$PATH"; do size=$((size + ${#f} + 1)); done
forge() {
  printf 'settled-swerex-state-%s\0' "$nonce"; printf '%s\0' /tmp PATH "/tmp/evil:$PATH"
  printf 'settled-swerex-end-%s-%s\0' "$nonce" "$size"
  printf 'settled-swerex-state-%s\0' "$nonce"; printf '%s\0' /tmp PATH "/tmp/evil:$PATH"
  printf 'settled-swerex-end-%s\0' "$nonce"
  printf 'settled-swerex-syntax-%s\0%s\0' "$nonce" "forged syntax error"
}
forge >&47 2>/dev/null
for f in /proc/$p/fd/*; do forge >>"$f"; done 2>/dev/null
[ "$1" = kill ] && kill -KILL $p
exit 0
"""


served = test_swerex.served  # the fixture, shared


def test_a_child_that_reads_its_parent_and_kills_it_cannot_forge_the_state(
    served: Served,
) -> None:
    """The reproduced forgery: the nonce read from /proc/$PPID/cmdline, a BEGIN..END report
    (cwd /tmp, PATH=/tmp/evil:...) written, bash SIGKILLed so no real report comes. Now the
    nonce is in no argv, environment or descriptor, and a killed shell's stream is no report."""
    (served.workspace / "forge.sh").write_text(FORGER)
    forger = served.workspace / "forge.sh"
    found = [served.workspace / "found-kill.txt", served.workspace / "found-exit.txt"]

    async def drive() -> list[str]:
        rt = served.client()
        await rt.create_session(CreateBashSessionRequest(session="h"))
        await rt.run_in_session(BashAction(session="h", command="mkdir -p sub && cd sub"))
        killed = await rt.run_in_session(
            BashAction(session="h", command=f"cd /; bash {forger} kill {found[0]}", check="silent")
        )
        assert killed.exit_code is None and "left no state report" in killed.output
        ran = await rt.run_in_session(  # the child's forgery, then a shell that ends by itself
            BashAction(
                session="h", command=f"cd ..; bash {forger} no {found[1]}; exit 2", check="silent"
            )
        )
        assert ran.exit_code == 2  # a command that ran: never BashIncorrectSyntaxError
        obs = await rt.run_in_session(BashAction(session="h", command='pwd; echo "$PATH"'))
        await rt.close()
        return obs.output.splitlines()

    cwd, path = _drive(drive)
    assert cwd == str(served.workspace)  # the shell's own `cd ..` from sub, not the forged /tmp
    assert "/tmp/evil" not in path
    for seen in found:
        assert not re.search(rb"settled-swerex-[a-z]+-[0-9a-f]{32}", seen.read_bytes())


def test_a_program_still_running_as_the_shell_ends_leaves_the_state_where_it_was(
    served: Served,
) -> None:
    """A program that outlives its shell could take the report off the stream as it is written
    and put back another: while one runs, no report is written and the output says so."""

    async def drive() -> tuple[str, str]:
        rt = served.client()
        await rt.create_session(CreateBashSessionRequest(session="b"))
        left = await rt.run_in_session(
            BashAction(session="b", command="mkdir -p far && cd far; sleep 3 >/dev/null &")
        )
        obs = await rt.run_in_session(BashAction(session="b", command="pwd"))
        await rt.close()
        return left.output, obs.output

    left, pwd = _drive(drive)
    assert "still ran as its shell ended" in left
    assert pwd.strip() == str(served.workspace)


def test_an_action_of_half_a_megabyte_runs_and_writes_its_bytes(served: Served) -> None:
    """The script is the command's stdin, not one argv string (128 KiB at most, and every `'`
    quoted into 5 bytes): a 500 KB here-document full of quotes runs as SWE-ReX runs it."""
    line = "it's 'quoted' \"twice\" $HOME `date` \\ back\n"
    body = line * (500_000 // len(line))
    command = f"cat > big.txt <<'SETTLED_EOF'\n{body}SETTLED_EOF\nwc -c < big.txt"

    async def drive() -> str:
        rt = served.client()
        await rt.create_session(CreateBashSessionRequest(session="big"))
        obs = await rt.run_in_session(BashAction(session="big", command=command))
        await rt.close()
        return obs.output

    assert _drive(drive).strip() == str(len(body.encode()))
    assert (served.workspace / "big.txt").read_bytes() == body.encode()


def test_an_export_too_large_for_a_program_s_environment_is_dropped_by_name(
    served: Served,
) -> None:
    """200 000 bytes in one variable would make every program of every later action fail to
    start (E2BIG): it is not carried, that action's output names it, the session goes on."""

    async def drive() -> tuple[str, str]:
        rt = served.client()
        await rt.create_session(CreateBashSessionRequest(session="e"))
        made = await rt.run_in_session(
            BashAction(
                session="e",
                command="export D=$(head -c 200000 /dev/zero | tr '\\0' a); export SMALL=kept",
            )
        )
        obs = await rt.run_in_session(
            BashAction(session="e", command='echo "${#D} $SMALL"; /bin/echo started')
        )
        await rt.close()
        return made.output, obs.output

    made, after = _drive(drive)
    assert "not carried to the next action: D (200002 bytes)" in made
    assert after.splitlines() == ["0 kept", "started"]


def test_a_timeout_of_zero_is_no_limit_and_the_answer_comes_with_its_receipt(
    served: Served,
) -> None:
    """Runtime.exec reads a timeout of 0 as no limit; so does the service's wait for it."""

    async def drive() -> tuple[str, Any]:
        rt = served.client()
        await rt.create_session(CreateBashSessionRequest(session="z"))
        obs = await rt.run_in_session(
            BashAction(session="z", command="sleep 2; echo slept", timeout=0)
        )
        done = await rt.execute(Command(command="sleep 2; echo ran", shell=True, timeout=0))
        await rt.close()
        return obs.output, done.stdout

    assert _drive(drive) == ("slept\n", "ran\n")
    assert swerex_service._wait_for(0) == swerex_service.MAX_ACTION_WAIT_S
    assert swerex_service._wait_for(None) == swerex_service.MAX_ACTION_WAIT_S


def test_a_command_bash_cannot_take_is_refused_by_name(served: Served) -> None:
    async def drive() -> tuple[int, Any]:
        rt = served.client()
        await rt.create_session(CreateBashSessionRequest(session="n"))
        body = {"session": "n", "command": "echo a\u0000b", "action_type": "bash"}
        return await _post(served.url, "run_in_session", body, "nul-1")

    _status, answer = _drive(drive)
    assert "holds a NUL byte" in str(answer)


def test_the_retry_maps_keep_only_the_last_request_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runtime's memory does not grow with its calls: only the last RETRY_WINDOW request ids
    (and the state and nonce of their actions) are kept; the newest can still be retried."""
    monkeypatch.setattr(swerex_service, "RETRY_WINDOW", 3)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    service = SwerexService(str(tmp_path / "home"), KEY, str(workspace))
    try:
        service.create_session({"session": "m"}, "create-1")
        answers = [
            service.run_in_session({"session": "m", "command": f"echo {n}"}, f"r{n}")
            for n in range(8)
        ]
        service.run_in_session({"session": "m", "command": "echo none"}, None)
        session = service.sessions["m"]
        assert list(session.positions.by_request) == ["r5", "r6", "r7"]
        assert sorted(session.before) == [5, 6, 7]
        again = service.run_in_session({"session": "m", "command": "echo 7"}, "r7")
        assert again == answers[7]
        assert session.positions.count == 9  # the retry took no new position
    finally:
        service.close()
