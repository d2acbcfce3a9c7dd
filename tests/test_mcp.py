"""The MCP tools as an agent harness uses them: the SDK's own stdio client spawns
`python -m settled.mcp_server --home DIR` (inheriting the environment, so the test marker reaches
the server, its warm launcher and every owner) and calls the tools over JSON-RPC.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import time
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import ESCAPEE, proc_files
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.types import CallToolResult, TextContent

from settled.environment import base_environment, path_in_view
from settled.log.view import window_view
from settled.mcp_server import MARKER, MAX_WAIT_S, TOOL_NAMES

FOUR_MIB = 4 * 1024 * 1024
DIGITS = f"''.join(str(i % 10) for i in range({FOUR_MIB})) + chr(10)"
DIGITS_LINE = f'python3 -c "import sys; sys.stdout.write({DIGITS})"'  # one 4 MiB line


def _live(marker: str, needle: bytes) -> list[int]:
    """Pids of live processes carrying this test's marker whose command line has `needle`."""
    found = []
    for pid, (cmdline, environ, stat) in proc_files("cmdline", "environ", "stat"):
        zombie = stat.rsplit(b")", 1)[1].split()[0] == b"Z"
        if marker.encode() in environ and needle in cmdline and not zombie:
            found.append(pid)
    return found


@asynccontextmanager
async def mcp_session(tmp_path: Path) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "settled.mcp_server", "--home", str(tmp_path / "home")],
        env=dict(os.environ),  # the marker travels with it: conftest can end what it starts
    )
    with open(tmp_path / "mcp-server.stderr", "w") as errlog:
        async with (
            stdio_client(params, errlog=errlog) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session


def run_with_server(tmp_path: Path, body: Callable[[ClientSession], Awaitable[None]]) -> None:
    """Run `body` against a fresh MCP server, then check the server process has exited."""

    async def main() -> None:
        async with mcp_session(tmp_path) as session:
            await body(session)

    anyio.run(main)
    marker = os.environ["TEST_SESSION_MARKER"]
    deadline = time.monotonic() + 10
    while _live(marker, b"settled.mcp_server") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live(marker, b"settled.mcp_server") == [], "the MCP server outlived its stdin"


async def call(client: ClientSession, tool: str, /, **arguments: Any) -> CallToolResult:
    result = await client.call_tool(tool, arguments)
    assert isinstance(result, CallToolResult)
    return result


def text_of(result: CallToolResult) -> str:
    block = result.content[0]
    assert isinstance(block, TextContent)
    return block.text


def data_of(result: CallToolResult) -> dict[str, Any]:
    assert not result.is_error, text_of(result)
    assert isinstance(result.structured_content, dict)
    return result.structured_content


async def new_task(session: ClientSession, tmp_path: Path) -> str:
    workspace = tmp_path / "workspace"
    workspace.mkdir(exist_ok=True)
    task: str = data_of(await call(session, "new_task", workspace=str(workspace)))["task"]
    return task


@pytest.mark.timeout(60)
def test_lists_every_tool_with_a_description_for_a_model(tmp_path: Path) -> None:
    async def body(session: ClientSession) -> None:
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
        assert set(tools) == set(TOOL_NAMES)
        for tool in tools.values():
            assert tool.description and len(tool.description) > 80, tool.name
        assert set(tools["start"].input_schema["required"]) == {"task", "command"}

    run_with_server(tmp_path, body)


@pytest.mark.timeout(120)
def test_run_read_a_4_mib_line_from_a_cursor_wait_and_finish_complete(tmp_path: Path) -> None:
    async def body(session: ClientSession) -> None:
        task = await new_task(session, tmp_path)
        admitted = data_of(await call(session, "start", task=task, command=DIGITS_LINE))
        assert admitted["key"].startswith("k_") and admitted["reused"] is False
        again = data_of(
            await call(session, "start", task=task, command=DIGITS_LINE, key=admitted["key"])
        )
        assert again["session"] == admitted["session"] and again["reused"] is True

        done = data_of(await call(session, "wait", session=admitted["session"], timeout=60))
        assert done["settled"] and done["exit"]["code"] == 0 and done["death_proven"]
        assert done["stdout_cursor"] == FOUR_MIB + 1

        await reads_the_line_within_budgets(session, admitted["session"])

        finished = data_of(await call(session, "finish", task=task, final="printed the line"))
        assert finished["complete"] is True and finished["failed"] == []
        assert finished["all_commands_succeeded"] is True and finished["manifest"]

    run_with_server(tmp_path, body)


async def reads_the_line_within_budgets(session: ClientSession, sid: str) -> None:
    first = data_of(await call(session, "read_output", session=sid, cursor=0, budget=4096))
    assert len(first["text"].encode()) <= 4096
    assert first["next_cursor"] == FOUR_MIB + 1 and first["final"] is True
    a, b = first["omitted"]
    assert 0 < a < b < FOUR_MIB + 1
    assert first["text"].startswith("0123456789"[:10])
    assert f"cursor={a}" in first["text"]  # the marker says how to read what it left out

    middle = data_of(await call(session, "read_output", session=sid, cursor=a, budget=64))
    assert middle["cursor"] == a and middle["next_cursor"] == FOUR_MIB + 1
    expected = "".join(str(i % 10) for i in range(a, a + 8))
    whole = data_of(await call(session, "read_output", session=sid, cursor=b - 20, budget=4096))
    assert whole["omitted"] is None and whole["final"] is True
    assert whole["text"] == "".join(str(i % 10) for i in range(b - 20, FOUR_MIB)) + "\n"
    tail = data_of(await call(session, "read_output", session=sid, cursor=a, budget=1 << 20))
    assert tail["text"].startswith(expected)

    end = data_of(await call(session, "read_output", session=sid, cursor=FOUR_MIB + 1))
    assert end["text"] == "" and end["final"] is True


@pytest.mark.timeout(90)
def test_a_blocked_finish_names_the_authority_and_obligation(tmp_path: Path, marker: str) -> None:
    from conftest import kill_marked

    async def body(session: ClientSession) -> None:
        task = await new_task(session, tmp_path)
        escapee = ESCAPEE
        sid = data_of(await call(session, "start", task=task, command=escapee, boundary="pgroup"))[
            "session"
        ]
        waited = data_of(await call(session, "wait", session=sid, timeout=30))
        assert waited["state"] == "unknown" and waited["death_proven"] is False
        assert waited["settled"] is False and waited["still_running"] is False
        result = await call(session, "finish", task=task, deadline=5)
        blocked = data_of(result)
        assert blocked["complete"] is False
        assert blocked["blocked_on"]["authority"] == "recovery"
        assert blocked["blocked_on"]["session"] == sid
        assert text_of(result).startswith("NOT complete") and sid in text_of(result)

    try:
        run_with_server(tmp_path, body)
    finally:
        # the process group could not end the setsid escapee, and the receipt claims nothing;
        # the session's own pids cgroup (a resource wall) may have ended it at the owner's end
        kill_marked(marker, b"sleep")


@pytest.mark.timeout(60)
def test_wait_returns_by_its_timeout_and_signal_stops_the_command(tmp_path: Path) -> None:
    async def body(session: ClientSession) -> None:
        task = await new_task(session, tmp_path)
        sid = data_of(await call(session, "start", task=task, command=["sleep", "300"]))["session"]
        started = time.monotonic()
        still = data_of(await call(session, "wait", session=sid, timeout=0.5))
        assert time.monotonic() - started < 5
        assert still["settled"] is False and still["still_running"] is True
        assert still["state"] == "running"

        data_of(await call(session, "signal", session=sid, signal="KILL"))
        done = data_of(await call(session, "wait", session=sid, timeout=30))
        assert done["settled"] and done["exit"] and done["exit"]["reason"] == "cancelled", done

    run_with_server(tmp_path, body)


@pytest.mark.timeout(60)
def test_errors_are_tool_errors_that_name_the_value(tmp_path: Path) -> None:
    async def body(session: ClientSession) -> None:
        unknown = await call(session, "read_output", session="s_nope")
        assert unknown.is_error and "s_nope" in text_of(unknown)
        task = await new_task(session, tmp_path)
        sid = data_of(await call(session, "start", task=task, command="printf abc"))["session"]
        data_of(await call(session, "wait", session=sid, timeout=30))
        beyond = await call(session, "read_output", session=sid, cursor=99)
        assert beyond.is_error and "99" in text_of(beyond) and "3 bytes" in text_of(beyond)
        no_task = await call(session, "start", task="t_missing", command="true")
        assert no_task.is_error and "t_missing" in text_of(no_task)
        other = await call(session, "start", task=task, command="printf other", key=None)
        data_of(other)
        conflict = await call(
            session, "run", task=task, command="printf else", key=data_of(other)["key"]
        )
        assert conflict.is_error and "KeyConflict" in text_of(conflict)

    run_with_server(tmp_path, body)


@pytest.mark.timeout(30)
def test_the_window_view_keeps_budget_utf8_and_the_exact_omitted_range() -> None:
    data = ("aé€😀" * 5000).encode()  # 1-, 2-, 3- and 4-byte characters
    start, end = 1001, len(data) - 999
    window = data[start:end]
    for budget in (0, 10, 150, 200, 257, 1000, 4096, len(window) * 2):
        view = window_view(
            window[:budget],
            window[-budget:] if budget else b"",
            start,
            end,
            budget,
            "stdout",
            "s_x",
            marker=MARKER,
        )
        assert len(view.text.encode()) <= budget
        assert "\ufffd" not in view.text  # every cut is on a character boundary
        if view.omitted is None:
            assert view.text == window.decode("utf-8", "replace")
            continue
        a, b = view.omitted
        assert start <= a <= b <= end
        if f"omitted stdout bytes {a}..{b}" in view.text:
            head, _, rest = view.text.partition("\n[settled: omitted")
            assert head.encode() == data[start:a]  # the head is exactly bytes [start, a)
            assert rest.split("]\n", 1)[1].encode() == data[b:end]  # and the tail [b, end)


@pytest.mark.timeout(120)
def test_run_waits_and_returns_the_exit_code_and_both_streams(tmp_path: Path) -> None:
    async def body(session: ClientSession) -> None:
        task = await new_task(session, tmp_path)
        script = "printf 'to out'; printf 'to err' >&2; exit 5"
        done = data_of(await call(session, "run", task=task, command=script, key="step-1"))
        assert done["exit_code"] == 5 and done["death_proven"] and not done["still_running"]
        assert done["output"]["stdout"]["text"] == "to out"
        assert done["output"]["stderr"]["text"] == "to err"
        again = data_of(await call(session, "run", task=task, command=script, key="step-1"))
        assert again["session"] == done["session"] and again["reused"] is True
        late = data_of(await call(session, "run", task=task, command="sleep 30", timeout=0.5))
        assert late["exit_code"] == 124
        slow = data_of(await call(session, "run", task=task, command="sleep 3", wait=0.2))
        assert slow["still_running"] is True
        await call(session, "wait", session=slow["session"], timeout=30)

    run_with_server(tmp_path, body)


@pytest.mark.timeout(90)
def test_a_tasks_walls_are_tool_arguments_and_a_hog_is_named_oom(tmp_path: Path) -> None:
    async def body(session: ClientSession) -> None:
        workspace = tmp_path / "workspace"
        workspace.mkdir()
        made = data_of(
            await call(
                session, "new_task", workspace=str(workspace), memory="64M", pids=64,
                network="none",
            )
        )  # fmt: skip
        assert made["defaults"]["memory"] == 64 << 20 and made["defaults"]["pids"] == 64
        assert made["defaults"]["network"] == "none"
        task = made["task"]
        hog = data_of(await call(session, "run", task=task, command=["tail", "/dev/zero"]))
        assert hog["exit"]["reason"] == "oom" and hog["exit_code"] == 137 and hog["death_proven"]
        assert hog["resources"]["memory"]["limit"] == 64 << 20
        assert hog["resources"]["memory"]["source"] == "task"
        own = data_of(
            await call(session, "run", task=task, command="true", memory="128M", cpus=0.5)
        )
        assert own["exit_code"] == 0 and own["resources"]["memory"]["limit"] == 128 << 20
        assert own["resources"]["memory"]["source"] == "explicit"
        assert own["resources"]["pids"]["limit"] == 64
        too_small = await call(session, "start", task=task, command="true", memory="4k")
        assert too_small.is_error and "memory" in text_of(too_small)
        assert "4k" in text_of(too_small)

    run_with_server(tmp_path, body)


@pytest.mark.timeout(60)
def test_the_server_reports_the_package_version(tmp_path: Path) -> None:
    from importlib.metadata import version

    async def main() -> str:
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "settled.mcp_server", "--home", str(tmp_path / "home")],
            env=dict(os.environ),
        )
        with open(tmp_path / "mcp-server.stderr", "w") as errlog:
            async with (
                stdio_client(params, errlog=errlog) as (read, write),
                ClientSession(read, write) as session,
            ):
                init = await session.initialize()
                return str(init.server_info.version)

    assert anyio.run(main) == version("settled")


def test_an_answer_holding_a_lone_surrogate_is_sent_as_utf8() -> None:
    """A file name's byte that is not UTF-8 reaches the model as `\\xNN` (printable.py's
    escape), in the text and the data; the SDK's strict UTF-8 JSON refused the raw surrogate."""
    from settled.mcp_server import _answer

    answer = _answer("wrote caf\udce9.txt\nnext line", {"paths": ["caf\udce9.txt", "é"]})
    sent = answer.model_dump_json()  # what the stdio transport writes
    assert "caf\\\\xe9.txt\\nnext line" in sent
    assert answer.structured_content == {"paths": ["caf\\xe9.txt", "é"]}


@pytest.mark.timeout(90)
def test_env_reaches_the_command_and_is_part_of_its_identity(tmp_path: Path) -> None:
    async def body(session: ClientSession) -> None:
        task = await new_task(session, tmp_path)
        shown = data_of(
            await call(
                session, "run", task=task, command='printf "%s" "$GREETING"', key="greet",
                env={"GREETING": "hello from env"},
            )
        )  # fmt: skip
        assert shown["exit_code"] == 0
        assert shown["output"]["stdout"]["text"] == "hello from env"
        same = data_of(
            await call(
                session, "run", task=task, command='printf "%s" "$GREETING"', key="greet",
                env={"GREETING": "hello from env"},
            )
        )  # fmt: skip
        assert same["reused"] is True and same["session"] == shown["session"]
        other = await call(
            session, "start", task=task, command='printf "%s" "$GREETING"', key="greet",
            env={"GREETING": "another value"},
        )  # fmt: skip
        assert other.is_error and "KeyConflict" in text_of(other)
        bad = await call(session, "start", task=task, command="true", env={"A=B": "x"})
        assert bad.is_error and "A=B" in text_of(bad)
        path = data_of(await call(session, "run", task=task, command='printf "%s" "$PATH"'))
        workspace = [str(tmp_path / "workspace")]
        theirs = path_in_view(os.environ["PATH"], base_environment()["HOME"], workspace)
        assert path["output"]["stdout"]["text"] == theirs  # its client's, as settled run's
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}
        for name in ("run", "start"):
            assert tools[name].input_schema["properties"]["env"]["description"]

    run_with_server(tmp_path, body)


@pytest.mark.timeout(120)
def test_finish_answers_with_the_short_explain(tmp_path: Path) -> None:
    async def body(session: ClientSession) -> None:
        task = await new_task(session, tmp_path)
        for command in ("true", "exit 3", "no-such-command-here"):
            await call(session, "run", task=task, command=command)
        result = await call(session, "finish", task=task, final="done")
        assert data_of(result)["complete"] is True
        text = text_of(result)
        verdict, *lines = text.splitlines()[1:]
        assert text.startswith("complete.\n")
        assert verdict.startswith(f"task {task} is COMPLETE (not success: 2 of 3 command(s)")
        assert [line[2:16].strip() for line in lines] == ["exit 0", "exit 3", "exit 127"]
        assert [line[17:].split("  (")[0] for line in lines] == [
            "true", "exit 3", "no-such-command-here",
        ]  # fmt: skip
        assert "cgroup.events" not in text and "PID namespace" not in text

    run_with_server(tmp_path, body)


DOC = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"


def _client_snippets() -> dict[str, tuple[str, list[str]]]:
    """Each MCP client's snippet in docs/integrations.md, parsed as its client reads it: the
    command and args it starts."""
    section = DOC.read_text().split("\n## MCP\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    found: dict[str, tuple[str, list[str]]] = {}
    for n, (kind, text) in enumerate(blocks):
        if kind == "json":
            entry = json.loads(text)["mcpServers"]["settled"]
            assert entry.get("type", "stdio") == "stdio"
            found[f"json-{n}"] = (entry["command"], list(entry["args"]))
        elif kind == "toml":
            entry = tomllib.loads(text)["mcp_servers"]["settled"]
            assert entry["tool_timeout_sec"] > MAX_WAIT_S
            found[f"toml-{n}"] = (entry["command"], list(entry["args"]))
        elif kind == "sh":
            words = shlex.split(text)
            assert (
                words[:3] == ["claude", "mcp", "add"] and "settled" in words[3 : words.index("--")]
            )
            command, *args = words[words.index("--") + 1 :]
            found[f"sh-{n}"] = (command, args)
    return found


@pytest.mark.timeout(120)
def test_each_client_snippet_in_the_docs_starts_the_real_mcp_server(tmp_path: Path) -> None:
    snippets = _client_snippets()
    assert sorted(name.split("-")[0] for name in snippets) == ["json", "json", "sh", "toml"]

    async def tools_of(command: str, args: list[str], home: Path) -> set[str]:
        # `settled` is this checkout's entry point, `python -m settled` (PATH may hold another)
        assert command == "settled" and args[0] == "mcp", (command, args)
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "settled", *args],
            env={**os.environ, "SETTLED_HOME": str(home)},
        )
        with open(home.parent / f"{home.name}.stderr", "w") as errlog:
            async with (
                stdio_client(params, errlog=errlog) as (read, write),
                ClientSession(read, write) as session,
            ):
                await session.initialize()
                listed = (await session.list_tools()).tools
                assert (
                    "env" in next(t for t in listed if t.name == "run").input_schema["properties"]
                )
                return {tool.name for tool in listed}

    for name, (command, args) in snippets.items():
        assert anyio.run(tools_of, command, args, tmp_path / name) == set(TOOL_NAMES), name
    marker = os.environ["TEST_SESSION_MARKER"]
    deadline = time.monotonic() + 10
    while _live(marker, b"settled\0mcp") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live(marker, b"settled\0mcp") == [], "an MCP server outlived its stdin"
