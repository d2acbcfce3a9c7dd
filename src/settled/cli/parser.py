"""The `settled` command line's grammar: every verb, its arguments, their types and help.

Owns the parser (built once per process, or one verb at a time: `parse`, `prebuild`), the
types that check each argument with settled.grammar, and the help text (every default, an
example and the exit codes). Long because it is one table of every verb's arguments, not
because it decides anything: what a verb does is cli/verbs.py's; what a value may be is
settled.grammar's.

Must never: run a verb, open a Runtime, or read the home.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable

from settled import __version__, grammar
from settled.cli.reads import LS_LIMIT, cmd_ls, cmd_ps, cmd_status
from settled.errors import BadInput, SettledError, exit_code_lines
from settled.exitcodes import RUN_EXIT_CODES
from settled.identity import BOUNDARY_POLICIES, ISOLATION_POLICIES, NETWORK_POLICIES

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn


# -- the grammar of each argument (settled.grammar): a BadValue propagates out of parse_args
# (argparse catches only ValueError and TypeError), so it reaches the user naming the option.


class UsageError(BadInput):
    """What argparse itself refuses (an unknown option, a missing argument): exit 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are a typed BadInput (exit 2, JSON with --json) instead
    of a SystemExit from deep inside parse_args."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _seconds(field: str, hi: float) -> Callable[[str], float]:
    return lambda text: grammar.parse_seconds(field, text, hi)


def _integer(field: str, lo: int, hi: int) -> Callable[[str], int]:
    return lambda text: grammar.parse_int(field, text, lo, hi)


def _memory(field: str) -> Callable[[str], int]:
    return lambda text: grammar.parse_memory(field, text)


def _cpus(field: str) -> Callable[[str], float]:
    return lambda text: grammar.parse_cpus(field, text)


def _text(field: str, max_bytes: int, min_bytes: int = 0) -> Callable[[str], str]:
    return lambda text: grammar.check_text(field, text, max_bytes, min_bytes)


def _path(field: str) -> Callable[[str], str]:
    return lambda text: grammar.check_path(field, text)


def _key(field: str) -> Callable[[str], str]:
    return lambda text: grammar.check_key(field, text)


def _id(field: str) -> Callable[[str], str]:
    return lambda text: grammar.check_id(field, text)


class Help(argparse.RawDescriptionHelpFormatter):
    """Examples kept as written, and every option's default shown where it has one worth
    reading (a help that words its own default keeps its words).

    It finds the terminal's width itself: argparse's own way imports shutil (and with it bz2 and
    lzma) at every add_argument, a tenth of what `settled status` costs besides Python."""

    def __init__(
        self,
        prog: str,
        indent_increment: int = 2,
        max_help_position: int = 24,
        width: int | None = None,
    ) -> None:
        super().__init__(prog, indent_increment, max_help_position, width or _columns() - 2)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "(default" in text or default in (None, False, [], argparse.SUPPRESS):
            return text
        if action.option_strings or action.nargs in ("?", "*"):
            return f"{text} (default: {default})"
        return text


def _columns() -> int:
    """The terminal's width as shutil.get_terminal_size reports it (COLUMNS, else the
    terminal of stdout, else 80)."""
    with contextlib.suppress(ValueError):
        if int(os.environ.get("COLUMNS", "0")) > 0:
            return int(os.environ["COLUMNS"])
    try:
        return os.get_terminal_size(1).columns or 80
    except (ValueError, OSError):
        return 80


def _verb(
    sub: Any, name: str, common: argparse.ArgumentParser, what: str, example: str,
    epilog: str | None = None,
) -> argparse.ArgumentParser:  # fmt: skip
    """A verb whose --help says what it does, every default, an example and its exit codes."""
    tail = epilog or "exit codes: see `settled --help`"
    parser: argparse.ArgumentParser = sub.add_parser(
        name, parents=[common], help=what, description=what, formatter_class=Help,
        epilog=f"example:\n  {example}\n\n{tail}",
    )  # fmt: skip
    return parser


def _exec_options(ex: argparse.ArgumentParser) -> None:
    """What identifies a command (all of it in the command digest) and how it runs."""
    ex.add_argument("--task", type=_id("--task"), required=True, help="the task to run in")
    ex.add_argument(
        "--key", type=_key("--key"),
        help="invocation key: a retry with the same key and command returns the same session "
        "(default: a new key)",
    )  # fmt: skip
    ex.add_argument(
        "--timeout", type=_seconds("--timeout", grammar.MAX_TIMEOUT_S), metavar="SECONDS",
        help="settled stops the command after this long: TERM, grace, KILL; 0 is no limit, as "
        "for timeout(1) (default: none)",
    )  # fmt: skip
    ex.add_argument(
        "--grace", type=_seconds("--grace", grammar.MAX_GRACE_S), metavar="SECONDS",
        help="seconds between TERM and KILL (default: 5)",
    )  # fmt: skip
    ex.add_argument(
        "--cwd", type=_text("--cwd", grammar.MAX_PATH_BYTES), default=".",
        help="directory inside the workspace",
    )  # fmt: skip
    ex.add_argument(
        "--env", type=_text("--env", grammar.MAX_ARG_BYTES), action="append", default=[],
        metavar="K=V", help="a variable for the command (repeatable; wins over the rest)",
    )  # fmt: skip
    ex.add_argument(
        "--env-file", type=_path("--env-file"), action="append", default=[], metavar="FILE",
        help="NAME=VALUE lines (# comments, `export `, quotes); a malformed line is refused",
    )  # fmt: skip
    ex.add_argument(
        "--inherit", type=_text("--inherit", grammar.MAX_ARG_BYTES, 1), action="append",
        default=[], metavar="NAME",
        help="pass this variable of your environment (repeatable; SETTLED_INHERIT lists "
        "standing ones). The command gets your PATH, its HOME, LANG and what you pass",
    )  # fmt: skip
    ex.add_argument(
        "--clean-env", action="store_true",
        help="give the command the standard PATH, not yours (then only HOME, LANG and what "
        "you pass)",
    )  # fmt: skip
    ex.add_argument(
        "--inherit-env", action="store_true",
        help="pass all of your environment but settled's own variables, the home's "
        "credentials and any named like a secret (*_API_KEY, *_TOKEN, ...; named in the "
        "receipt's isolation.env_removed; --inherit NAME passes one)",
    )  # fmt: skip
    ex.add_argument(
        "--stdin", type=_path("--stdin"), metavar="FILE|-",
        help="bytes for the command's stdin, stored and in the digest (default: empty)",
    )  # fmt: skip
    ex.add_argument(
        "--service", action="store_true",
        help="a long-running service: close stops it instead of waiting for it",
    )  # fmt: skip
    ex.add_argument(
        "--boundary", default="auto", choices=list(BOUNDARY_POLICIES),
        help="what proves the process tree dead (auto: the strongest this machine has)",
    )  # fmt: skip
    ex.add_argument(
        "--isolation", default="auto", choices=list(ISOLATION_POLICIES),
        help="auto: every protection this machine gives, the receipt names any missing; "
        "strict: refuse unless all are available; none: the command sees everything",
    )  # fmt: skip
    ex.add_argument(
        "--user", type=_text("--user", grammar.MAX_USER_BYTES, 1), metavar="UID[:GID]",
        help="run as this user (default: the task's)",
    )  # fmt: skip
    _wall_options(ex, "the command")
    ex.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARG...]")


def _wall_options(parser: argparse.ArgumentParser, whose: str) -> None:
    """The grants and limits of a command's walls: an exec's own, or a task's defaults."""
    parser.add_argument(
        "--writable", type=_path("--writable"), action="append", default=[], metavar="DIR",
        help=f"a host directory {whose} may write (repeatable). Nothing of the host exists "
        "for a command but the system's directories (read-only), its workspace, its task's "
        "own /tmp, /var/tmp, /dev/shm and HOME, and what is granted",
    )  # fmt: skip
    parser.add_argument(
        "--readable", type=_path("--readable"), action="append", default=[], metavar="DIR",
        help=f"a host directory {whose} may read (repeatable), e.g. a toolchain outside /usr",
    )  # fmt: skip
    parser.add_argument(
        "--memory", type=_memory("--memory"), metavar="BYTES",
        help=f"memory limit of {whose} (512M, 2G, bytes): past it the kernel kills inside "
        "the session only, and the receipt says oom",
    )  # fmt: skip
    parser.add_argument(
        "--pids", type=_integer("--pids", 1, grammar.MAX_PIDS), metavar="N",
        help=f"processes and threads {whose} may have at once",
    )  # fmt: skip
    parser.add_argument(
        "--cpus", type=_cpus("--cpus"), metavar="F",
        help=f"CPUs' worth of time {whose} may use (0.5, 2)",
    )  # fmt: skip
    parser.add_argument(
        "--network", choices=list(NETWORK_POLICIES),
        help=f"proxy (the default): {whose} runs in its task's own network namespace, whose "
        "one way out is settled's HTTP(S) proxy (HTTP_PROXY and the like are set), recording "
        "every connection in the session's ledger; none: only the task's own loopback; host: "
        "the host's network, unrecorded (named in the receipt)",
    )  # fmt: skip
    parser.add_argument(
        "--allow-host", action="append", metavar="PATTERN",
        help=f"where the proxy lets {whose} go (repeatable): pypi.org, pypi.org:443, "
        "*.pythonhosted.org, 10.0.0.7:5432, [fd00::7]:80. Without one, the public internet; "
        "a host service (loopback, private, link-local, the host's own addresses) only when "
        "named exactly",
    )  # fmt: skip


def _interrupt_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cancel-on-interrupt", action="store_true",
        help="Ctrl-C cancels the command (TERM, grace, KILL) and waits for its receipt, "
        "instead of detaching",
    )  # fmt: skip


class _Dropped(Parser):
    """Where the verbs not asked for are built: it keeps nothing, so building them is free."""

    def add_argument(self, *args: Any, **kwargs: Any) -> Any:
        return None

    def set_defaults(self, **kwargs: Any) -> None:
        return None


_DROPPED = _Dropped(add_help=False)


class _OneVerb:
    """Stands in for the subparsers while the parser is built for the one verb the command line
    names (`verb`; None: every verb): only its parser is made and attached, the others are
    dropped (building all of them, each with the common options copied in, was most of what a
    parse cost)."""

    def __init__(self, sub: Any, verb: str | None) -> None:
        self.sub, self.verb = sub, verb

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        if self.verb is None or name == self.verb:
            parser: argparse.ArgumentParser = self.sub.add_parser(name, **kwargs)
            return parser
        return _DROPPED


# the common options that take a value
_VALUE_OPTIONS = ("--home", "--store", "--objects", "--password-file")


def _named_verb(argv: list[str]) -> str | None:
    """The verb the command line names (the first word that is no option or option value);
    None when a help before it asks for the whole parser's list of verbs."""
    words = iter(argv)
    for word in words:
        if word in ("--", "-h", "--help"):
            return None
        if word in _VALUE_OPTIONS:
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse with the named verb's parser alone; anything it refuses (or a word that is no
    verb) is parsed again by the whole parser, so every error reads as the whole one words it."""
    verb = _named_verb(argv)
    if verb is not None:
        with contextlib.suppress(SettledError):
            parser, built = _built(verb)
            if built:
                return parser.parse_args(argv)
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The whole parser: every verb (for `settled --help` and for errors)."""
    return _built(None)[0]


_BUILT: dict[str | None, tuple[argparse.ArgumentParser, bool]] = {}


def prebuild(verbs: tuple[str, ...]) -> None:
    """Build these verbs' parsers now: a warm process (cli/worker.py) builds them once, and
    each call it serves parses with them (argparse and gettext cost ~2 ms a parser)."""
    for verb in verbs:
        _built(verb)


def _built(only: str | None) -> tuple[argparse.ArgumentParser, bool]:
    """`_build(only)`, once per process: parsing leaves a parser as it was."""
    if only not in _BUILT:
        _BUILT[only] = _build(only)
    return _BUILT[only]


def _build(only: str | None) -> tuple[argparse.ArgumentParser, bool]:
    """The parser, with every verb or only `only`; and whether `only` (if given) is a verb."""
    from settled.cli.running import cmd_attach, cmd_exec, cmd_run  # imported after this one
    from settled.cli.verbs import (  # the handlers: verbs.py imports this module first
        cmd_cancel,
        cmd_checkpoint,
        cmd_close,
        cmd_demo,
        cmd_explain,
        cmd_hosts,
        cmd_logs,
        cmd_probe,
        cmd_recover,
        cmd_restore,
        cmd_task_destroy,
        cmd_task_new,
        cmd_verify,
        cmd_wait,
    )

    common = Parser(add_help=False, formatter_class=Help)
    common.add_argument(
        "--home",
        type=_path("--home"),
        default=argparse.SUPPRESS,
        help="settled home (SETTLED_HOME; default $XDG_STATE_HOME/settled, else "
        "~/.local/state/settled, /var/lib/settled for root)",
    )
    common.add_argument(
        "--store",
        default=argparse.SUPPRESS,
        metavar="URL",
        help="authority store, recorded in the home at its first open: sqlite:///PATH "
        "(default: the home's settled.db) or postgresql://USER@HOST:PORT/DB (SETTLED_STORE); "
        "a password in it is used, never recorded",
    )
    common.add_argument(
        "--password-file",
        default=argparse.SUPPRESS,
        metavar="FILE",
        help="the PostgreSQL store's password, on the first line of a file only its owner may "
        "read (chmod 600); its path is recorded, never the password (SETTLED_STORE_PASSWORD_FILE;"
        " else PGPASSWORD, PGPASSFILE or ~/.pgpass)",
    )
    common.add_argument(
        "--objects",
        default=argparse.SUPPRESS,
        metavar="URL",
        help="object store for checkpoints and sealed logs: file:///PATH (default: the "
        "home's objects/) or s3://BUCKET/PREFIX, with AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_REGION (SETTLED_OBJECTS)",
    )
    common.add_argument(  # SUPPRESS: a subcommand's default would undo `settled --json VERB`
        "--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON object"
    )
    common.add_argument(
        "-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
        help="print only the id a script needs (task, session), or nothing",
    )  # fmt: skip
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS,
        help="on an error, print its traceback after the one line",
    )  # fmt: skip
    parser = Parser(
        prog="settled",
        parents=[common],
        description=__doc__,
        epilog="exit codes:\n"
        + "\n".join(exit_code_lines())
        + "\n  `settled run` and `attach` exit with the command's own code instead: "
        "124 timeout, 117 unknown, 127 never started, 128+N signal N (see `settled run --help`)",
        formatter_class=Help,
    )
    parser.add_argument("-V", "--version", action="version", version=f"settled {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True)
    sub = _OneVerb(verbs, only)

    tasks = sub.add_parser("task", help="tasks")
    dropped = tasks is _DROPPED  # then its verbs are dropped too
    task = _OneVerb(None if dropped else tasks.add_subparsers(dest="task_verb", required=True),
                    "" if dropped else None)  # fmt: skip
    new = _verb(
        task,
        "new",
        common,
        "create a task",
        "settled task new --workspace ~/proj --ignore .venv/ -q",
    )
    new.add_argument(
        "--workspace", type=_path("--workspace"), metavar="DIR",
        help="the directory the task's commands work in and its checkpoints capture; it must "
        "not overlap another open task's (default: a new empty directory settled makes for it)",
    )  # fmt: skip
    new.add_argument(
        "--key", type=_key("--key"),
        help="task key: `task new` again with the same key (and workspace) returns the same "
        "task, so a retry after a lost answer makes no second one (default: a new key)",
    )  # fmt: skip
    new.add_argument(
        "--user",
        type=_text("--user", grammar.MAX_USER_BYTES, 1),
        metavar="UID[:GID]",
        help="run the task's commands as this user (or NAME)",
    )
    new.add_argument(
        "--shared-workspace",
        action="store_true",
        help="allow a workspace that overlaps another open task's; both close receipts say so",
    )
    new.add_argument(
        "--ignore", type=_text("--ignore", grammar.MAX_ARG_BYTES, 1), action="append",
        default=[], metavar="PATTERN",
        help="a gitignore-syntax pattern the checkpoints leave out, after the workspace's "
        ".settledignore (repeatable). Both are bound now, recorded in every manifest, and a "
        "command editing .settledignore later changes nothing",
    )  # fmt: skip
    _wall_options(new, "every command of the task (an exec adds its own grants and may "
                  "replace a limit)")  # fmt: skip
    new.set_defaults(handler=cmd_task_new)
    destroy = _verb(
        task, "destroy", common, "destroy the task's sandbox", "settled task destroy t_0123"
    )
    destroy.add_argument("task", type=_id("task"))
    destroy.set_defaults(handler=cmd_task_destroy)

    ex = _verb(
        sub,
        "exec",
        common,
        "admit a command and return at once (or --wait for its receipt)",
        "settled exec --task t_0123 --key build-1 --timeout 600 -- make -j2",
    )
    _exec_options(ex)
    ex.add_argument("--wait", action="store_true", help="wait for the process receipt")
    ex.set_defaults(handler=cmd_exec)

    run = _verb(
        sub,
        "run",
        common,
        "admit a command, stream its stdout and stderr live, exit with its code",
        "settled run --task t_0123 --timeout 60 -- pytest -q\n"
        "  Ctrl-C detaches (the command runs on) and prints the `settled attach` that goes on",
        epilog="exit codes of run (the command's, as a shell reports them):\n"
        + "\n".join(f"  {code:>3}  {meaning}" for code, meaning in RUN_EXIT_CODES.items())
        + "\n  and settled's own: 2 usage, 4 key conflict or sealed admission, 130 detached,"
        "\n  141 stdout closed. When the code is settled's and not the command's (124, 127,"
        "\n  117, a cancel, the memory limit), one line on stderr says why and what to do",
    )
    _exec_options(run)
    _interrupt_option(run)
    run.set_defaults(handler=cmd_run)

    attach = _verb(
        sub,
        "attach",
        common,
        "stream a session's output from its cursors until it settles",
        "settled attach s_0123 --from 1048576 --stderr-from 0",
        epilog="exit codes: as `settled run`",
    )
    attach.add_argument("session", type=_id("session"))
    attach.add_argument(
        "--from", dest="start", type=_integer("--from", 0, grammar.MAX_CURSOR), default=0,
        metavar="BYTES", help="stdout cursor to start at",
    )  # fmt: skip
    attach.add_argument(
        "--stderr-from", dest="stderr_start", type=_integer("--stderr-from", 0, grammar.MAX_CURSOR),
        default=0, metavar="BYTES", help="stderr cursor to start at",
    )  # fmt: skip
    _interrupt_option(attach)
    attach.set_defaults(handler=cmd_attach)

    ls = _verb(sub, "ls", common, "the tasks of this home, newest first", "settled ls --limit 10")
    ls.add_argument(
        "--limit", type=_integer("--limit", *LS_LIMIT[:2]), default=LS_LIMIT[2],
        help="at most this many",
    )  # fmt: skip
    ls.set_defaults(handler=cmd_ls)

    ps = _verb(sub, "ps", common, "the sessions of a task", "settled ps t_0123")
    ps.add_argument("task", type=_id("task"))
    ps.set_defaults(handler=cmd_ps)

    wait = _verb(
        sub, "wait", common, "wait for a process receipt", "settled wait s_0123 --timeout 60 --json"
    )
    wait.add_argument("session", type=_id("session"))
    wait.add_argument("--timeout", type=_seconds("--timeout", grammar.MAX_WAIT_S))
    wait.set_defaults(handler=cmd_wait)

    logs = _verb(
        sub,
        "logs",
        common,
        "read output bytes from a cursor",
        "settled logs s_0123 --stream stderr --from 4096 --follow",
    )
    logs.add_argument("session", type=_id("session"))
    logs.add_argument(
        "--stream", default="merged", choices=["merged", "stdout", "stderr"],
        help="merged: both streams in the order the owner stored their bytes",
    )  # fmt: skip
    logs.add_argument(
        "--from", dest="start", type=_integer("--from", 0, grammar.MAX_CURSOR), default=0,
        metavar="BYTES", help="cursor to start at (into the merged view with --stream merged)",
    )  # fmt: skip
    logs.add_argument("--follow", action="store_true")
    logs.add_argument(
        "--timeout",
        type=_seconds("--timeout", grammar.MAX_WAIT_S),
        help="with --follow: give up after S seconds",
    )
    logs.add_argument(
        "--view",
        type=_integer("--view", 0, grammar.MAX_BUDGET),
        metavar="BYTES",
        help="model view",
    )
    logs.set_defaults(handler=cmd_logs)

    status = _verb(
        sub, "status", common, "computed status of a session/task", "settled status s_0123 --json"
    )
    status.add_argument("target", type=_id("target"), metavar="SESSION|TASK")
    status.set_defaults(handler=cmd_status)

    cancel = _verb(
        sub,
        "cancel",
        common,
        "TERM, grace, KILL a session",
        "settled cancel s_0123 --reason 'took too long'",
    )
    cancel.add_argument("session", type=_id("session"))
    cancel.add_argument(
        "--reason", type=_text("--reason", grammar.MAX_REASON_BYTES), default="cancel requested"
    )
    cancel.set_defaults(handler=cmd_cancel)

    close = _verb(
        sub,
        "close",
        common,
        "the close join: prove completion",
        "settled close t_0123 --final 'tests pass' --deadline 60",
    )
    close.add_argument("task", type=_id("task"), nargs="?")
    close.add_argument(
        "--final",
        type=_text("--final", grammar.MAX_FINAL_BYTES),
        help="the model's final response, stored as pending",
    )
    close.add_argument(
        "--deadline",
        type=_seconds("--deadline", grammar.MAX_DEADLINE_S),
        help="seconds to wait for the task's running commands; then those still running are "
        "cancelled (default: 600). On a terminal, what it waits for is printed every few "
        "seconds; Ctrl-C stops waiting (exit 130) and `settled close TASK` again finishes it",
    )
    close.add_argument("--list-fault-points", action="store_true")
    close.set_defaults(handler=cmd_close)

    checkpoint = _verb(
        sub, "checkpoint", common, "checkpoint an open task", "settled checkpoint t_0123 --json"
    )
    checkpoint.add_argument("task", type=_id("task"))
    checkpoint.add_argument("--full", action="store_true", help="ignore the journal; scan all")
    checkpoint.set_defaults(handler=cmd_checkpoint)

    recover = _verb(
        sub, "recover", common, "settle sessions whose owner died", "settled recover --task t_0123"
    )
    recover.add_argument("--task", type=_id("--task"), help="only this task")
    recover.add_argument(
        "--host",
        type=_id("--host"),
        help="declare this other host gone for good: freeze its tasks, mark its unsettled "
        "sessions unknown (never relaunched), settle those its sandbox provider proves dead",
    )
    recover.set_defaults(handler=cmd_recover)

    hosts = _verb(sub, "hosts", common, "the hosts of this store", "settled hosts --json")
    hosts.set_defaults(handler=cmd_hosts)

    explain = _verb(
        sub,
        "explain",
        common,
        "whether a task is complete and why: a verdict, a line per session",
        "settled explain t_0123 --verbose",
    )
    explain.add_argument("task", type=_id("task"))
    explain.add_argument(
        "--verbose", "-v", action="store_true",
        help="the full words: every session's kernel evidence, protections and network",
    )  # fmt: skip
    explain.set_defaults(handler=cmd_explain)

    restore = _verb(
        sub, "restore", common, "rebuild a checkpoint", "settled restore t_0123 /tmp/restored"
    )
    restore.add_argument("target", type=_target, metavar="TASK|MANIFEST")
    restore.add_argument("dest", type=_path("dest"))
    restore.add_argument(
        "--same-owner",
        action="store_true",
        help="give every entry its recorded owner and keep its set-id bits (root only)",
    )
    restore.set_defaults(handler=cmd_restore)

    verify = _verb(
        sub, "verify", common, "check every object a checkpoint reaches",
        "settled verify t_0123 --read-data",
    )  # fmt: skip
    verify.add_argument("target", type=_target, metavar="TASK|MANIFEST")
    verify.add_argument(
        "--read-data", action="store_true", help="re-hash every blob, not only its presence"
    )
    verify.set_defaults(handler=cmd_verify)

    _verb(
        sub,
        "mcp",
        common,
        "the MCP tools over stdio, for agent harnesses",
        "settled mcp --home ~/.local/state/settled",
    )

    srv = _verb(
        sub,
        "serve",
        common,
        "the HTTP service (bearer tokens) and its page of the four clocks at /ui",
        "SETTLED_TOKEN=$(openssl rand -hex 16) settled serve --port 8765",
    )
    srv.add_argument("--host", type=_text("--host", 255, 1), default="127.0.0.1")
    srv.add_argument("--port", type=_integer("--port", 0, grammar.MAX_PORT), default=8765)
    srv.add_argument(
        "--tokens", type=_path("--tokens"), metavar="FILE", help="JSON file of task-scoped tokens"
    )
    srv.add_argument(
        "--swerex", action="store_true",
        help="answer SWE-ReX's remote runtime protocol instead (SWE-agent's RemoteRuntime), "
        "always keyed by X-API-Key: from --api-key-file or SETTLED_SWEREX_API_KEY (never argv); "
        "with neither, a new key is written to a 0600 file in the home's run directory and its "
        "path printed",
    )  # fmt: skip
    srv.add_argument(
        "--api-key-file", type=_path("--api-key-file"), metavar="FILE",
        help="with --swerex: the file holding the key; a FILE that does not exist yet gets a new "
        "key (0600), kept for the next start (default: SETTLED_SWEREX_API_KEY, else a new key)",
    )  # fmt: skip
    srv.add_argument(
        "--swerex-workspace", type=_path("--swerex-workspace"), metavar="DIR",
        help="with --swerex: the directory of the one task that each SWE-ReX runtime's "
        "sessions and commands share (default: a new one per runtime)",
    )  # fmt: skip

    probe = _verb(
        sub,
        "probe",
        common,
        "the essay's review checklist, run as experiments against a runtime",
        "settled probe --runtime subprocess --runtime swerex --runtime settled",
        epilog="exit codes of probe:\n"
        "    0  every answer holds, or is not applicable and says why\n"
        "    2  bad input: an unknown runtime or question, a URL that does not answer,\n"
        "       a runtime not installed here (nothing was run)\n"
        "    3  at least one answer fails, or something the probe started outlived it",
    )
    probe.add_argument(
        "--runtime", action="append", metavar="NAME|URL",
        help="settled (on a fresh temporary home, never yours), subprocess (subprocess.run "
        "with a timeout), swerex (SWE-ReX's local runtime), or http(s)://HOST:PORT of a settled "
        "service (token from SETTLED_TOKEN); repeat it for a table comparing them "
        "(default: settled)",
    )  # fmt: skip
    probe.add_argument(
        "--only", action="append", metavar="QUESTION",
        help="ask only this question (repeatable): retry, long_line, binary, silent, holder, "
        "owner_killed, late_write, fenced, receipt (default: all)",
    )  # fmt: skip
    probe.set_defaults(handler=cmd_probe)

    soak = _verb(
        sub, "soak", common,
        "crash settled at random fault points (owner, checkpoint, close, recovery, server) "
        "with sessions running, and check every invariant after each crash; in a temporary "
        "home of its own, removed after",
        "settled soak --crashes 1000 --seed 42 --json",
        epilog="exit codes of soak:\n"
        "    0  every invariant held\n"
        "    1  the soak itself could not run (a lane failed, the points were not reached,\n"
        "       a server --faults needs is missing, or it could not end what it started)\n"
        "    2  bad input (nothing was run)\n"
        "    3  a violation: the invariant, the seed, the crash, the point, and the command\n"
        "       that replays it\n"
        "  130  interrupted (everything it started is ended)",
    )  # fmt: skip
    soak.add_argument(
        "--crashes", type=_integer("--crashes", 1, 1_000_000), default=100,
        help="how many crashes (an attempt whose point is not reached does not count)",
    )  # fmt: skip
    soak.add_argument(
        "--seed", type=_integer("--seed", 0, grammar.MAX_CURSOR), default=None,
        help="what draws each attempt's point (default: a random seed, printed)",
    )  # fmt: skip
    soak.add_argument(
        "--lanes", type=_integer("--lanes", 1, 16), default=3,
        help="crash cycles run side by side, each on tasks of its own",
    )  # fmt: skip
    soak.add_argument(
        "--start", type=_integer("--start", 0, grammar.MAX_CURSOR), default=0,
        help="the first attempt's number (replay attempt N alone: --start N --crashes 1)",
    )  # fmt: skip
    soak.add_argument(
        "--points", type=_text("--points", 65536, 1), metavar="P,...",
        help="only these fault points (default: all of `settled close --list-fault-points`)",
    )  # fmt: skip
    soak.add_argument(
        "--faults", type=_text("--faults", 256, 1), metavar="store",
        help="server faults too: `store` binds the home to a PostgreSQL (and, if weed is "
        "installed, an S3) the soak starts, and restarts it (-m fast), kills and restarts it, "
        "and stops it (SIGSTOP, shorter than the lease; S3 too) while sessions run "
        "(default: none)",
    )  # fmt: skip
    soak.add_argument(
        "--faults-per-kind", type=_integer("--faults-per-kind", 1, 10_000), default=5,
        help="with --faults: how many faults of each kind, spread over the crashes",
    )  # fmt: skip
    soak.set_defaults(handler=None)

    demo = _verb(sub, "demo", common, "the main job on the embedded default", "settled demo")
    demo.add_argument(
        "--keep-home", action="store_true",
        help="keep the fresh home the demo made (default: removed when it ends)",
    )  # fmt: skip
    demo.set_defaults(handler=cmd_demo)
    return parser, only is None or only in verbs.choices


def _target(text: str) -> str:
    return grammar.check_text("target", text, grammar.MAX_KEY_BYTES, 1)
