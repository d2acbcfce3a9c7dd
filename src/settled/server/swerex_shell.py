"""One SWE-ReX bash action as the whole script settled runs, and the shell state it leaves.

Owns: writing the script of an action (the state the previous action left, the action, a
report of the state it leaves) and reading that report back. Pure: no I/O, no process.

SWE-ReX's own server keeps one long-lived bash per session; settled runs each action as a fresh
bash whose script is written out in full, so the state an action starts from is part of its
command digest (the script is the command's stdin) and nothing rides in the hidden memory of a
shell. The argv is the fixed ``BOOT`` (read the whole script from stdin into a variable, set
stdin to /dev/null, eval it): nothing of one action is in any process's argv or environment.
The script:

1. saves the session's stderr stream on descriptor ``REPORT_FD``, then sends its own stderr to
   stdout (SWE-ReX answers one merged output): the action's output is the session's stdout;
2. re-creates the state: ``export NAME='value'`` for each exported variable and ``cd`` to the
   working directory, every value quoted here by ``shlex.quote``, never text of the command's
   evaluated; a directory that is gone is said on stdout and the action starts in the
   workspace instead (a session is never left unable to run);
3. checks the action's syntax first with ``bash -n``, inside the session as SWE-ReX checks it
   before it runs anything: a syntax error is reported (below) and nothing of the action runs;
   then runs the action through ``eval`` of its quoted text with ``REPORT_FD`` closed (its
   programs never inherit it; bash keeps a close-on-exec copy, found again by the report's
   inode when the action exits from inside a function or by a signal);
4. on EXIT, when the shell is the only process of its PID namespace but init (nobody else can
   hold, read or write the stream as the report is written), writes the report on
   ``REPORT_FD``: ``BEGIN\\0cwd\\0name\\0value\\0...END-<size>\\0`` with both tokens carrying
   a nonce the server draws per action (128 random bits) and ``size`` the bytes between them.
   While other processes of the action still run, no report is written and the output says so.
   A syntax error is ``SYNTAX\\0bash's words\\0`` there.

Why a program of the action cannot forge the report: the nonce exists only in the script, which
is in no argv, no environment and no descriptor once the action runs (the stdin is a sealed
memfd bash has read and closed); what a program writes on the stream (through /proc/PPID/fd)
without the nonce is never read as a report, and bytes it slips into the real report change its
size. A report counts only when the shell exited as one that ran its EXIT trap (a code, or a
signal bash traps; never SIGKILL), a syntax error only with bash's exit code 2 of the check.
What remains: a process allowed to ptrace the shell (same user, no Yama restriction) can read
its memory, as it could change the state of SWE-ReX's own long-lived shell directly; and a
process of another session of the task (outside this PID namespace) handed the stream's
descriptor by a program of the action (over a socket) could read the report as it is written.
Names are checked here (shell identifiers, none of bash's own per-shell variables) and values
are data: nothing of the report is evaluated.

Shell functions, aliases, options and unexported variables do not carry to the next action;
neither does the state of an action that replaces the EXIT trap, ``exec``s another program or
leaves processes running (no report: the next action starts where this one started).
"""

from __future__ import annotations

import re
import secrets
import shlex
from dataclasses import dataclass

REPORT_FD = 47  # the session's stderr stream, kept for the report (stderr itself is merged)
NONCE_BYTES = 16
MAX_EXPORT_BYTES = (128 << 10) - 1  # NAME=value, one string of a program's environment
MAX_EXPORTS_BYTES = 512 << 10  # all carried NAME=value: room left for argv under ARG_MAX
SYNTAX_EXIT = 2

BOOT = (  # the argv's script: the action's whole script is on stdin, never in argv
    "IFS= builtin read -r -d '' __settled_swerex_script; exec 0</dev/null; "
    'builtin eval -- "$__settled_swerex_script"'
)

# bash's own per-shell variables: read-only or remade by every shell, never carried
_NOT_CARRIED = re.compile(
    r"(BASHOPTS|SHELLOPTS|BASH_[A-Za-z0-9_]*|BASHPID|EUID|UID|PPID|GROUPS|OLDPWD|PWD|SHLVL|_)"
)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# The report's bash. __settled_swerex_where: the report stream's "mnt_id ino" (its fdinfo).
_REPORTER = r"""__settled_swerex_inode() {
  local __k __v __m= __i=
  while IFS=$'\t' builtin read -r __k __v; do
    case $__k in mnt_id:) __m=$__v ;; ino:) __i=$__v ;; esac
  done 2>/dev/null <"/proc/self/fdinfo/$1"
  [[ -n $__i ]] && builtin printf '%s %s' "$__m" "$__i"
}
__settled_swerex_bytes() {
  local LC_ALL=C __f; __settled_swerex_size=0
  for __f in "$@"; do (( __settled_swerex_size += ${#__f} + 1 )); done
}
__settled_swerex_state() {
  builtin set +euf; builtin shopt -u failglob nullglob
  local IFS=$' \t\n' __n __p __fd={fd} __fields=()
  if ! { builtin true >&{fd}; } 2>/dev/null; then
    __fd=
    for __p in /proc/self/fd/*; do
      __p=${__p##*/}
      if (( __p >= 10 )) && [[ -n $__settled_swerex_where &&
          $(__settled_swerex_inode "$__p") == "$__settled_swerex_where" ]]; then
        __fd=$__p; break
      fi
    done
    [[ -n $__fd ]] || builtin return
  fi
  if (( PPID == 1 )); then
    for __p in /proc/[1-9]*; do
      __p=${__p#/proc/}
      if [[ $__p != 1 && $__p != "$$" ]]; then
        builtin printf '\n[settled: %s]\n' 2>/dev/null \
          "processes of this action still ran as its shell ended: its state is not carried"
        builtin return
      fi
    done
  fi
  builtin set -f
  __fields=("$PWD")
  for __n in $(builtin compgen -e); do __fields+=("$__n" "${!__n}"); done
  __settled_swerex_bytes "${__fields[@]}"
  builtin printf '%s\0' {begin} "${__fields[@]}" >&$__fd 2>/dev/null
  builtin printf '%s-%s\0' {end} "$__settled_swerex_size" >&$__fd 2>/dev/null
}
"""


@dataclass(frozen=True)
class ShellState:
    """Where the next action starts: its working directory and exported variables."""

    cwd: str
    exports: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Report:
    """The state an action left, and the exported variables too large to carry (name, bytes)."""

    state: ShellState
    dropped: tuple[tuple[str, int], ...] = ()


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def _tokens(nonce: str) -> tuple[str, str]:
    return f"settled-swerex-state-{nonce}", f"settled-swerex-end-{nonce}"


def _syntax_token(nonce: str) -> str:
    return f"settled-swerex-syntax-{nonce}"


def script(state: ShellState, command: str, nonce: str, fallback_cwd: str) -> bytes:
    """The whole script of one action, given to ``BOOT`` on stdin (see the module's docstring)."""
    begin, end = _tokens(nonce)
    exports = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in state.exports)
    gone = shlex.quote(
        f"settled: the working directory {state.cwd} is gone; this action starts in "
        f"{fallback_cwd}\n"
    )
    reporter = (
        _REPORTER.replace("{fd}", str(REPORT_FD)).replace("{begin}", begin).replace("{end}", end)
    )
    text = (
        "builtin unset __settled_swerex_script\n"
        f"exec {REPORT_FD}>&2 2>&1\n"
        + reporter
        + f"__settled_swerex_where=$(__settled_swerex_inode {REPORT_FD})\n"
        + exports
        + f"builtin cd -- {shlex.quote(state.cwd)} 2>/dev/null || "
        f"{{ builtin printf '%s' {gone}; builtin cd -- {shlex.quote(fallback_cwd)} || exit 1; }}\n"
        + "builtin trap __settled_swerex_state EXIT\n"
        + f"__settled_swerex_command={shlex.quote(command)}\n"
        + "if ! __settled_swerex_syntax=$(builtin printf '%s\\n' \"$__settled_swerex_command\" "
        "| (exec -a bash /bin/bash -n) 2>&1); then\n"
        f"  builtin printf '%s\\0%s\\0' {_syntax_token(nonce)} \"$__settled_swerex_syntax\" "
        f">&{REPORT_FD}\n"
        f"  builtin exit {SYNTAX_EXIT}\n"
        "fi\n"
        f'builtin eval -- "$__settled_swerex_command" {REPORT_FD}>&-\n'
    )
    return text.encode("utf-8", "surrogateescape")


def ran_its_trap(exit_facts: dict[str, object]) -> bool:
    """Whether a shell that ended so ran its EXIT trap: an exit code, or a signal bash traps
    (SIGKILL and SIGSTOP never are: a report in such a stream was written by someone else)."""
    if exit_facts.get("code") is not None:
        return True
    return exit_facts.get("signal") in (
        "TERM",
        "HUP",
        "INT",
        "QUIT",
        "PIPE",
        "ALRM",
        "USR1",
        "USR2",
    )


def read_syntax_error(stream: bytes, nonce: str, exit_facts: dict[str, object]) -> str | None:
    """What bash said of the action's syntax, when the check refused it (nothing ran)."""
    if exit_facts.get("code") != SYNTAX_EXIT:
        return None
    token = _syntax_token(nonce).encode() + b"\0"
    at = stream.rfind(token)
    if at < 0:
        return None
    said = stream[at + len(token) :].split(b"\0", 1)
    return said[0].decode(errors="backslashreplace") if len(said) == 2 else None


def read_report(stream: bytes, nonce: str, exit_facts: dict[str, object]) -> Report | None:
    """The state the action's report names, or None when there is no whole, untouched report
    (the action replaced the EXIT trap, exec'd, left processes running or was killed)."""
    if not ran_its_trap(exit_facts):
        return None
    begin_token, end_token = _tokens(nonce)
    begin, end = begin_token.encode() + b"\0", end_token.encode() + b"-"
    stop = stream.rfind(end)
    at = stream.rfind(begin, 0, max(stop, 0))
    if stop < 0 or at < 0:
        return None
    size = re.match(rb"([0-9]{1,12})\0", stream[stop + len(end) :])
    payload = stream[at + len(begin) : stop]
    if size is None or int(size.group(1)) != len(payload) or not payload.endswith(b"\0"):
        return None  # bytes slipped in between the tokens: not the shell's own report
    fields = payload.split(b"\0")[:-1]  # each field ends with its NUL
    if len(fields) % 2 != 1:
        return None
    cwd = _text(fields[0])
    if cwd is None or not cwd.startswith("/"):
        return None
    kept, dropped = _fitting(_carried(fields[1:]))
    return Report(ShellState(cwd, tuple(kept)), tuple(dropped))


def report_note(report: Report | None) -> str:
    """What the output says when the state is not carried whole."""
    if report is None:
        return (
            "\n[settled: this action left no state report (it replaced the EXIT trap, exec'd "
            "another program, left processes running or was killed); the next one starts "
            "where it started]\n"
        )
    if not report.dropped:
        return ""
    named = ", ".join(f"{name} ({size} bytes)" for name, size in report.dropped)
    return (
        f"\n[settled: exported variables not carried to the next action: {named}; a program's "
        f"environment takes NAME=value of at most {MAX_EXPORT_BYTES} bytes each and settled "
        f"carries at most {MAX_EXPORTS_BYTES} bytes of them]\n"
    )


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


def _fitting(
    pairs: list[tuple[str, str]],
) -> tuple[list[tuple[str, str]], list[tuple[str, int]]]:
    """The pairs every program of the next action can still be started with: a NAME=value
    past one exec string, then the largest ones past the total, are dropped (and named)."""
    sizes = {name: len(f"{name}={value}".encode()) for name, value in pairs}
    dropped = {name for name, size in sizes.items() if size > MAX_EXPORT_BYTES}
    total = sum(size + 1 for name, size in sizes.items() if name not in dropped)
    for name in sorted(sizes, key=lambda n: sizes[n], reverse=True):
        if total <= MAX_EXPORTS_BYTES:
            break
        if name not in dropped:
            dropped.add(name)
            total -= sizes[name] + 1
    kept = [(name, value) for name, value in pairs if name not in dropped]
    return kept, [(name, sizes[name]) for name, _value in pairs if name in dropped]


def _text(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
