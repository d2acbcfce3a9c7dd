"""The MCP server of settled: the library Runtime as agent tools, over stdio (official `mcp` SDK).

Owns: the tool surface a model sees — `new_task`, `run`, `start`, `read_output`, `wait`,
`signal`, `finish` — their descriptions (written for a model), the translation of each answer
into a short text the model reads plus structured content a harness can parse, and the
translation of settled's typed errors into tool errors whose message names the offending
value. It runs over `Runtime` directly (home from `--home` or SETTLED_HOME); no HTTP is involved.

Must never: decide anything the runtime decides (state, receipts and completion are reported as
computed); block a tool call past the timeout the model gave; show the model more than its byte
budget of output, or a cut inside a UTF-8 character, or an omitted range other than the bytes
not shown; relabel an unknown session as failed; keep a process alive after stdin closes (the
warm launcher it owns ends with it; sessions belong to their owners and outlive it by design).

Longer than most modules: each tool's signature, with every argument's description inline, is
the model's documentation, and they read best together.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sqlite3
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal, ParamSpec, TypeVar

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, TextContent
from pydantic import Field

from settled import grammar
from settled.environment import caller_policy
from settled.errors import CursorOutOfRange, NotSettled, SettledError
from settled.exitcodes import command_exit_code
from settled.printable import surrogates_escaped
from settled.render import explain_brief
from settled.requests import ExecRequest, TaskRequest
from settled.runtime import Runtime, open_launcher

if TYPE_CHECKING:
    from settled.runtime import Launcher


DEFAULT_BUDGET = 16 * 1024
MAX_BUDGET = grammar.MAX_BUDGET
MAX_WAIT_S = 600.0
DEFAULT_FINISH_DEADLINE_S = 60.0

INSTRUCTIONS = """\
settled runs your shell commands and tells you, with proof, when the work is done.
Start with new_task(workspace) once, then run(task, command) for each command: it waits for the
end and returns the exit code and output. For a long command use start(task, command), which
returns at once with a session id while the command keeps running on its own; read_output(session,
cursor) shows output (never more than `budget` bytes, the omitted range named) and wait(session,
timeout) gets the exit. If a run or start call fails or times out, call it again with the SAME
key: it returns the same session and never runs the command twice. When you are done,
call finish(task, final) — it answers complete only when every command is proven stopped and the
workspace is checkpointed; otherwise it names exactly what still blocks it."""

P = ParamSpec("P")
R = TypeVar("R")


# -- one Runtime per worker thread ------------------------------------------------------------


class Runtimes:
    """The SDK runs each sync tool in a worker thread and a Runtime serves one thread (its
    SQLite connection), so each thread gets its own; all share one warm launcher (a long-lived
    server is what it is for), unless SETTLED_LAUNCHER=fresh asks for a fresh owner each time."""

    def __init__(self, home: str | None) -> None:
        self.home = home
        fresh = os.environ.get("SETTLED_LAUNCHER") == "fresh"
        self.launcher: Launcher = open_launcher("fresh" if fresh else "warm")
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[Runtime] = []

    def get(self) -> Runtime:
        runtime: Runtime | None = getattr(self._local, "runtime", None)
        if runtime is None:
            runtime = Runtime(self.home, shared_launcher=self.launcher)
            self._local.runtime = runtime
            with self._lock:
                self._all.append(runtime)
        return runtime

    def close(self) -> None:
        """End the warm launcher; each store closes with its thread (or this process)."""
        with self._lock:
            for runtime in self._all:
                # a connection of another thread is released when this process exits
                with contextlib.suppress(sqlite3.ProgrammingError):
                    runtime.close()
            self._all.clear()
        self.launcher.close()


# -- answers ----------------------------------------------------------------------------------


def _answer(text: str, data: dict[str, Any]) -> CallToolResult:
    """The model's text and the harness's data; a lone surrogate (a byte of a file name that
    is not UTF-8) escaped in both, as the SDK writes strict UTF-8 JSON."""
    return CallToolResult(
        content=[TextContent(type="text", text=surrogates_escaped(text))],
        structured_content=surrogates_escaped(data),
    )


def _tool_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """settled's typed errors (and bad cursors) become tool errors the model can act on."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except SettledError as exc:
            raise ToolError(surrogates_escaped(f"{exc.kind}: {exc}")) from exc
        except CursorOutOfRange as exc:
            raise ToolError(surrogates_escaped(f"CursorOutOfRange: {exc}")) from exc
        except ValueError as exc:
            raise ToolError(surrogates_escaped(f"BadInput: {exc}")) from exc

    return wrapper


def _exit_words(exit_fact: dict[str, Any]) -> str:
    if exit_fact.get("reason") == "not_started":
        return f"never started: {exit_fact.get('error')}"
    how = f"signal {exit_fact['signal']}" if exit_fact.get("signal") else "code"
    value = "" if exit_fact.get("signal") else f" {exit_fact.get('code')}"
    return f"exit {how}{value} ({exit_fact.get('reason')})"


def receipt_summary(view: dict[str, Any]) -> dict[str, Any]:
    """What a model needs of a process receipt: how it ended, whether death is proven, where
    each stream ends, the limits it ran under."""
    receipt = view.get("receipt") or {}
    death, output = receipt.get("death", {}), receipt.get("output", {})
    return {
        "session": view["session"],
        "state": view["state"],
        "exit": receipt.get("exit"),
        "death_proven": bool(death.get("proven")),
        "evidence": death.get("evidence"),
        "stdout_cursor": output.get("stdout", {}).get("cursor"),
        "stderr_cursor": output.get("stderr", {}).get("cursor"),
        "drain": output.get("drain"),
        "stragglers": [s.get("cmdline") for s in receipt.get("stragglers", [])],
        "why": view.get("why"),
        "receipt_digest": receipt.get("digest"),
        "resources": receipt.get("resources"),  # the limits applied, and any one hit
    }


def _summary_text(summary: dict[str, Any]) -> str:
    if summary["state"] == "unknown":
        return (
            f"session {summary['session']} is UNKNOWN (not failed): {summary['why']}. "
            "finish will name it as what blocks completion."
        )
    exit_fact = summary["exit"] or {}
    text = f"session {summary['session']} settled: {_exit_words(exit_fact)}"
    text += f"; stdout {summary['stdout_cursor']} bytes, stderr {summary['stderr_cursor']} bytes"
    if summary["stragglers"]:
        text += f"; stragglers stopped: {', '.join(map(str, summary['stragglers']))}"
    return text + "."


# -- the model view of a cursor window ---------------------------------------------------------

# How the MCP view names what it left out: the read_output call that reads it.
MARKER = (
    "\n[settled: omitted {stream} bytes {a}..{b} ({n} bytes); read them with "
    "read_output(session={session!r}, stream={stream!r}, cursor={a})]\n"
)


# -- the tools --------------------------------------------------------------------------------

SessionId = Annotated[str, Field(description="A session id returned by run, e.g. 's_...'.")]
TaskId = Annotated[str, Field(description="A task id returned by new_task, e.g. 't_...'.")]


Command = Annotated[
    str | list[str], Field(description="A shell string (run by /bin/sh -c) or an argv list.")
]
CommandTimeout = Annotated[
    float | None,
    Field(
        description="Seconds before settled stops the command (TERM, then KILL); 0 or none: "
        "no limit.",
        ge=0,
        le=grammar.MAX_TIMEOUT_S,
        strict=True,
        allow_inf_nan=False,
    ),
]
Cwd = Annotated[str, Field(description="Directory relative to the workspace.")]
Env = Annotated[
    dict[str, str] | None,
    Field(
        description="Environment variables for the command, NAME -> VALUE, like "
        '{"CI": "1"}; they are part of the command\'s identity, so a retry with the same key '
        "must pass the same ones. Omit for none beyond settled's defaults.",
        max_length=grammar.MAX_ENV_ITEMS,
    ),
]
MemoryLimit = Annotated[
    str | None,
    Field(
        description="Most memory the command's processes may use together, like 512M or 2G; "
        "past it the kernel kills them and the exit says oom. Omit for the task's default."
    ),
]
PidsLimit = Annotated[
    int | None,
    Field(
        description="Most processes and threads the command may have at once (a fork past "
        "it fails). Omit for the task's default.",
        ge=1,
        le=grammar.MAX_PIDS,
        strict=True,
    ),
]
CpusLimit = Annotated[
    float | None,
    Field(
        description="CPU time the command may use, as a number of CPUs like 0.5 or 2. Omit "
        "for the task's default (no quota).",
        ge=grammar.MIN_CPUS,
        le=grammar.MAX_CPUS,
        allow_inf_nan=False,
    ),
]


def _callers_path() -> list[str]:
    """The names a command takes from this server's environment, which is its MCP client's
    (the client starts `settled mcp`): its PATH, as `settled run` gives (environment.py's
    policy); an `env` with PATH wins."""
    return caller_policy((), False, False, os.environ)


def _memory(text: str | None) -> int | None:
    """A memory limit as a model writes it (512M, 2G, bytes), in bytes."""
    return None if text is None else grammar.parse_memory("memory", text)


class Tools:
    """The tool functions; each docstring is what the model reads."""

    def __init__(self, runtimes: Runtimes) -> None:
        self.runtimes = runtimes

    def new_task(
        self,
        workspace: Annotated[str, Field(description="Absolute path of an existing directory.")],
        shared_workspace: Annotated[
            bool,
            Field(
                description="Allow a workspace that overlaps another open task's; both "
                "tasks' close receipts then name each other."
            ),
        ] = False,
        memory: MemoryLimit = None,
        pids: PidsLimit = None,
        cpus: CpusLimit = None,
        network: Annotated[
            Literal["proxy", "none", "host"] | None,
            Field(
                description="The commands' network: 'proxy' (the default) goes out only "
                "through settled's HTTP(S) proxy, which records every connection; 'none' "
                "gives them only a loopback of the task's own; 'host' the host's, unrecorded."
            ),
        ] = None,
        allow_hosts: Annotated[
            list[str] | None,
            Field(
                description="Where the proxy lets the commands go: host names, host:port, "
                "*.domain or addresses (pypi.org, *.pythonhosted.org:443). Omit for the "
                "public internet; a host service only when named exactly."
            ),
        ] = None,
    ) -> CallToolResult:
        """Create a task over a workspace directory. Every command you run belongs to a task,
        and finish(task) later proves the task complete. memory, pids, cpus and network are
        the defaults of its commands (a command's own limits replace them). Returns the task
        id. (Paths beyond the workspace are granted by whoever runs settled, never here.)"""
        record = self.runtimes.get().create_task(
            TaskRequest(
                workspace=workspace,
                shared_workspace=shared_workspace,
                memory=_memory(memory),
                pids=pids,
                cpus=cpus,
                network=network,
                allow_hosts=allow_hosts or (),
            )
        )
        data = record.to_json()
        return _answer(f"task {record.task} over {record.workspace} ({record.state})", data)

    def start(
        self,
        task: TaskId,
        command: Command,
        key: Annotated[
            str | None,
            Field(
                description="Idempotency key. Omit for a new command (one is made and "
                "returned); pass the same key again to retry without running twice."
            ),
        ] = None,
        timeout: CommandTimeout = None,
        service: Annotated[
            bool, Field(description="A long-running service, stopped when the task finishes.")
        ] = False,
        cwd: Cwd = ".",
        env: Env = None,
        boundary: Annotated[
            Literal["auto", "cgroup2+pidns", "cgroup2", "pidns", "subreaper", "pgroup"],
            Field(description="How the process tree is contained; keep 'auto'."),
        ] = "auto",
        memory: MemoryLimit = None,
        pids: PidsLimit = None,
        cpus: CpusLimit = None,
    ) -> CallToolResult:
        """Start a command and return at once with its session id (use run to start and wait in
        one call). It runs on its own, with a deadline kept by settled even if it prints nothing.
        Calling start again with the same key returns the same session (reused=true) and never
        starts the command twice."""
        shell, argv = (command, None) if isinstance(command, str) else (None, command)
        admission = self.runtimes.get().admit(
            task,
            ExecRequest(
                argv=argv,
                shell=shell,
                key=key,
                timeout=timeout,
                service=service,
                cwd=cwd,
                env=env,
                inherit=_callers_path(),
                boundary=boundary,
                memory=_memory(memory),
                pids=pids,
                cpus=cpus,
            ),
        )
        data = admission.to_json()
        text = (
            f"session {admission.session} (key {admission.key}) is {admission.state}"
            f"{'; reused: this key already named this command' if admission.reused else ''}. "
            f"Next: read_output(session={admission.session!r}) or wait(session=...)."
        )
        return _answer(text, data)

    def run(
        self,
        task: TaskId,
        command: Command,
        key: Annotated[
            str | None,
            Field(
                description="Idempotency key. Omit for a new command; pass the same key again "
                "to retry: you get the same session and its result, never a second run."
            ),
        ] = None,
        timeout: CommandTimeout = None,
        wait: Annotated[
            float,
            Field(
                description="Most seconds this call waits for the end; past it the command "
                "goes on and you get its session to wait on.",
                ge=0,
                le=MAX_WAIT_S,
                strict=True,
                allow_inf_nan=False,
            ),
        ] = 120.0,
        cwd: Cwd = ".",
        env: Env = None,
        budget: Annotated[
            int,
            Field(
                description="Most bytes of output text to return, shared by stdout and stderr.",
                ge=0,
                le=MAX_BUDGET,
                strict=True,
            ),
        ] = DEFAULT_BUDGET,
        memory: MemoryLimit = None,
        pids: PidsLimit = None,
        cpus: CpusLimit = None,
    ) -> CallToolResult:
        """Run a command and wait for it: returns its exit code (as a shell reports it: 124 on
        timeout, 127 if it never started, 128+N for signal N, 117 if the outcome is unknown),
        the head and tail of stdout and stderr within `budget` bytes with their cursors, and
        whether its whole process tree is proven stopped."""
        rt = self.runtimes.get()
        shell, argv = (command, None) if isinstance(command, str) else (None, command)
        admission = rt.admit(
            task,
            ExecRequest(
                argv=argv,
                shell=shell,
                key=key,
                timeout=timeout,
                cwd=cwd,
                env=env,
                inherit=_callers_path(),
                memory=_memory(memory),
                pids=pids,
                cpus=cpus,
            ),
        )
        try:
            view = rt.wait(admission.session, wait)
        except NotSettled:
            data = {"session": admission.session, "key": admission.key, "still_running": True}
            text = (
                f"session {admission.session} is still running after {wait} s; it goes on. "
                f"Next: wait(session={admission.session!r}) or read_output."
            )
            return _answer(text, data)
        outputs = {}
        for stream in ("stdout", "stderr"):
            window, final = rt.window(admission.session, stream, 0, budget // 2, marker=MARKER)
            outputs[stream] = {"text": window.text, "next_cursor": window.end, "final": final}
        code = command_exit_code(view.get("receipt"))
        summary = receipt_summary(view)
        data = {
            **summary,
            "key": admission.key,
            "reused": admission.reused,
            "exit_code": code,
            "output": outputs,
            "still_running": False,
        }
        text = f"exit code {code}. {_summary_text(summary)}"
        for stream, out in outputs.items():
            if out["text"]:
                text += f"\n--- {stream} ---\n{out['text']}"
        return _answer(text, data)

    def read_output(
        self,
        session: SessionId,
        stream: Annotated[Literal["stdout", "stderr"], Field(description="Which stream.")] = (
            "stdout"
        ),
        cursor: Annotated[
            int,
            Field(
                description="Byte offset to read from: 0, or next_cursor of a previous read.",
                ge=0,
                le=grammar.MAX_CURSOR,
                strict=True,
            ),
        ] = 0,
        budget: Annotated[
            int,
            Field(description="Most bytes of text to return.", ge=0, le=MAX_BUDGET, strict=True),
        ] = DEFAULT_BUDGET,
    ) -> CallToolResult:
        """Read a command's output from a byte cursor, as text of at most `budget` bytes. If
        more is stored, you see its head and tail with a marker naming the omitted byte range
        (read it with cursor=its start). next_cursor is where to continue; final=true means the
        stream is complete and nothing more will come."""
        rt = self.runtimes.get()
        window, final = rt.window(session, stream, cursor, budget, marker=MARKER)
        data = {
            "session": session,
            "stream": stream,
            "cursor": window.start,
            "next_cursor": window.end,
            "final": final,
            "omitted": list(window.omitted) if window.omitted else None,
            "text": window.text,
        }
        status = "final" if final else "still running; more may come"
        note = f"\n[settled: {stream} bytes {window.start}..{window.end}, {status}; "
        note += f"next_cursor={window.end}]"
        return _answer(window.text + note, data)

    def wait(
        self,
        session: SessionId,
        timeout: Annotated[
            float,
            Field(
                description="Most seconds to wait.",
                ge=0,
                le=MAX_WAIT_S,
                strict=True,
                allow_inf_nan=False,
            ),
        ] = 30.0,
    ) -> CallToolResult:
        """Wait up to `timeout` seconds for a command to end; returns its exit and whether its
        death is proven, or says it is still running (it goes on; call wait again)."""
        rt = self.runtimes.get()
        try:
            view = rt.wait(session, timeout)
            if view["state"] == "unknown":  # confirm with a fresh look: a projection racing
                view = rt.session_status(session)  # the owner's exit shows unknown an instant
        except NotSettled:
            view = rt.session_status(session)
            data = {"session": session, "state": view["state"], "settled": False}
            text = f"session {session} is still {view['state']} after {timeout} s; it goes on."
            return _answer(text, {**data, "still_running": True})
        summary = receipt_summary(view)
        done = {"settled": view["state"] == "settled", "still_running": False}
        return _answer(_summary_text(summary), {**summary, **done})

    def signal(
        self,
        session: SessionId,
        signal: Annotated[
            Literal["TERM", "KILL", "INT"], Field(description="The signal you want sent.")
        ] = "TERM",
    ) -> CallToolResult:
        """Stop a running command. settled's owner sends TERM to its whole process tree, waits
        the grace period, then KILLs what is left, and writes the receipt; use wait to see it.
        (Any of TERM, KILL, INT asks for that stop; the name is recorded as the reason.)"""
        view = self.runtimes.get().cancel(session, f"{signal} requested by an MCP client")
        data = {"session": session, "state": view["state"], "requested": signal}
        return _answer(f"stop requested for session {session} (now {view['state']})", data)

    def finish(
        self,
        task: TaskId,
        final: Annotated[
            str | None, Field(description="Your final answer, stored with the proof.")
        ] = None,
        deadline: Annotated[
            float,
            Field(
                description="Seconds to let running commands end before they are stopped.",
                ge=0,
                le=MAX_WAIT_S,
                strict=True,
                allow_inf_nan=False,
            ),
        ] = DEFAULT_FINISH_DEADLINE_S,
    ) -> CallToolResult:
        """Close the task: no new command may start; running ones get `deadline` seconds, then
        are stopped; the workspace is checkpointed. Answers complete with the proof and which
        commands failed, or not complete with exactly what still blocks it (an authority and
        its obligation). Calling finish again resumes; it never re-runs a command."""
        rt = self.runtimes.get()
        result = rt.close_task(task, final, deadline)
        explained = rt.explain(task)
        if not result.complete:
            blocked = result.blocked_on or {}
            data = {"task": task, "complete": False, "blocked_on": blocked}
            return _answer(f"NOT complete.\n{explain_brief(explained)}", data)
        receipt = result.receipt or {}
        commands = receipt.get("outcome", {}).get("commands", {})
        failed = [*commands.get("failed", []), *commands.get("timed_out", [])]
        failed += commands.get("not_started", [])
        data = {
            "task": task,
            "complete": True,
            "all_commands_succeeded": receipt.get("outcome", {}).get("all_commands_succeeded"),
            "commands": commands,
            "failed": failed,
            "manifest": receipt.get("checkpoint", {}).get("manifest"),
            "receipt_digest": receipt.get("digest"),
        }
        return _answer(f"complete.\n{explain_brief(explained)}", data)


TOOL_NAMES = ("new_task", "run", "start", "read_output", "wait", "signal", "finish")


def build_server(runtimes: Runtimes) -> MCPServer[Any]:
    server: MCPServer[Any] = MCPServer(
        name="settled", version=package_version(), instructions=INSTRUCTIONS
    )
    tools = Tools(runtimes)
    for name in TOOL_NAMES:
        server.add_tool(_tool_errors(getattr(tools, name)), name=name)
    return server


def package_version() -> str:
    """The package's version, which the server reports at initialization."""
    from settled import __version__

    return __version__


def run_stdio(home: str | None) -> int:
    """Serve the tools over stdin/stdout until stdin closes; 0 on a clean end."""
    from settled import oomguard

    runtimes = Runtimes(home)
    oomguard.protect_self()  # never the kernel's choice under memory pressure, where it can
    try:
        build_server(runtimes).run("stdio")
    finally:
        runtimes.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="settled mcp", description="settled's MCP tools (stdio)")
    parser.add_argument(
        "--home",
        help="settled home (default SETTLED_HOME, else the per-user default of `settled --help`)",
    )
    return run_stdio(parser.parse_args(argv).home)


if __name__ == "__main__":
    sys.exit(main())
