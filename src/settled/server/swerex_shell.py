"""One SWE-ReX bash action as the whole script settled runs, and the shell state it leaves.

Owns: writing the script of an action (the state the previous action left, the action, a
report of the state it leaves) and reading that report back. Pure: no I/O, no process.

SWE-ReX's own server keeps one long-lived bash per session; settled runs each action as a fresh
``bash -c`` whose script is written out in full, so the state an action starts from is part of
its command digest and nothing rides in the hidden memory of a shell. The script:

1. saves the action's stderr on descriptor ``REPORT_FD``, then sends its own stderr to stdout
   (SWE-ReX answers one merged output): the action's output is the session's stdout, alone;
2. re-creates the state: ``export NAME='value'`` for each exported variable and ``cd`` to the
   working directory, every value quoted here by ``shlex.quote``, never text of the command's
   evaluated; a directory that is gone is said on stdout and the action starts in the
   workspace instead (a session is never left unable to run);
3. checks the action's syntax first with ``bash -n``, inside the session as SWE-ReX checks it
   before it runs anything: a syntax error is reported (below) and nothing of the action runs;
   then runs the action through ``eval`` of its quoted text, so the action cannot swallow the
   lines around it (an unterminated here-document, a trailing backslash);
4. on EXIT, writes the report on ``REPORT_FD``, so into the session's *stderr* stream:
   ``BEGIN\\0cwd\\0name\\0value\\0...END\\0`` with both tokens carrying a nonce the server
   draws per action (128 random bits); a syntax error is ``SYNTAX\\0bash's words\\0`` there.

Why the report cannot be cut or forged by output: it is not in the output at all. The output
can be any size, capped or cut anywhere, and the report (a few KiB on its own stream) is
untouched; text the action prints, a file it cats, anything planted earlier, lands on stdout and
cannot name the nonce, which exists only in this action's script. The action itself can write
a report (it can read its own script), but it could equally `cd` or `export`: its own next
state is all it can change, never a receipt. Names are checked here (shell identifiers, none of
bash's own per-shell variables) and values are data: nothing of the report is evaluated.

Shell functions, aliases, options and unexported variables do not carry to the next action;
neither does the state of an action that replaces the EXIT trap or ``exec``s another program
(no report: the next action starts where this one started, and the output says so).
"""

from __future__ import annotations

import re
import secrets
import shlex
from dataclasses import dataclass

REPORT_FD = 47  # the action's stderr stream, kept for the report (stderr itself is merged)
NONCE_BYTES = 16

# bash's own per-shell variables: read-only or remade by every shell, never carried
_NOT_CARRIED = re.compile(
    r"(BASHOPTS|SHELLOPTS|BASH_[A-Za-z0-9_]*|BASHPID|EUID|UID|PPID|GROUPS|OLDPWD|PWD|SHLVL|_)"
)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

_REPORTER = (
    "__settled_swerex_state() {{\n"
    "  builtin set +eu -f; local IFS=$' \\t\\n' __n\n"
    "  builtin printf '%s\\0%s\\0' {begin} \"$PWD\"\n"
    "  for __n in $(builtin compgen -e); do\n"
    '    builtin printf \'%s\\0%s\\0\' "$__n" "${{!__n}}"\n'
    "  done\n"
    "  builtin printf '%s\\0' {end}\n"
    "}} >&{fd} 2>/dev/null\n"
)


@dataclass(frozen=True)
class ShellState:
    """Where the next action starts: its working directory and exported variables."""

    cwd: str
    exports: tuple[tuple[str, str], ...] = ()


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def _tokens(nonce: str) -> tuple[str, str]:
    return f"settled-swerex-state-{nonce}", f"settled-swerex-end-{nonce}"


def _syntax_token(nonce: str) -> str:
    return f"settled-swerex-syntax-{nonce}"


def script(state: ShellState, command: str, nonce: str, fallback_cwd: str) -> str:
    """The whole script of one action (see the module's docstring)."""
    begin, end = _tokens(nonce)
    exports = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in state.exports)
    gone = shlex.quote(
        f"settled: the working directory {state.cwd} is gone; this action starts in "
        f"{fallback_cwd}\n"
    )
    return (
        f"exec {REPORT_FD}>&2 2>&1\n"
        + _REPORTER.format(begin=begin, end=end, fd=REPORT_FD)
        + exports
        + f"builtin cd -- {shlex.quote(state.cwd)} 2>/dev/null || "
        f"{{ builtin printf '%s' {gone}; builtin cd -- {shlex.quote(fallback_cwd)} || exit 1; }}\n"
        + "trap __settled_swerex_state EXIT\n"
        + f"__settled_swerex_command={shlex.quote(command)}\n"
        + "if ! __settled_swerex_syntax=$(builtin printf '%s\\n' \"$__settled_swerex_command\" "
        "| (exec -a bash /bin/bash -n) 2>&1); then\n"
        f"  builtin printf '%s\\0%s\\0' {_syntax_token(nonce)} \"$__settled_swerex_syntax\" "
        f">&{REPORT_FD}\n"
        "  exit 2\n"
        "fi\n"
        'eval -- "$__settled_swerex_command"\n'
    )


def read_syntax_error(stream: bytes, nonce: str) -> str | None:
    """What bash said of the action's syntax, when the check refused it (nothing ran)."""
    token = _syntax_token(nonce).encode() + b"\0"
    at = stream.rfind(token)
    if at < 0:
        return None
    said = stream[at + len(token) :].split(b"\0", 1)
    return said[0].decode(errors="backslashreplace") if len(said) == 2 else None


def read_report(stream: bytes, nonce: str) -> ShellState | None:
    """The state the action's report names, or None when there is no whole report (the action
    replaced the EXIT trap, exec'd, or was killed before it could write one)."""
    begin, end = (token.encode() + b"\0" for token in _tokens(nonce))
    at = stream.rfind(begin)
    if at < 0:
        return None
    stop = stream.find(end, at)
    if stop < 0:
        return None
    fields = stream[at + len(begin) : stop].split(b"\0")[:-1]  # each field ends with its NUL
    if len(fields) % 2 != 1:
        return None
    cwd = _text(fields[0])
    if cwd is None or not cwd.startswith("/"):
        return None
    return ShellState(cwd, tuple(_carried(fields[1:])))


def _carried(fields: list[bytes]) -> list[tuple[str, str]]:
    """The (name, value) pairs to carry: shell names only, none of bash's own, UTF-8 text only
    (a variable whose value is not UTF-8 cannot be written into the next script's text)."""
    pairs = []
    for raw_name, raw_value in zip(fields[0::2], fields[1::2], strict=True):
        name, value = _text(raw_name), _text(raw_value)
        if name is None or value is None:
            continue
        if _NAME.fullmatch(name) and not _NOT_CARRIED.fullmatch(name):
            pairs.append((name, value))
    return pairs


def _text(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
