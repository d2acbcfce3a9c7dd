"""Human-readable renderings of receipts and status for the terminal (the JSON is the truth).

Every public rendering escapes its whole input once (`printable.printable_tree`) before it
formats it: a receipt or a view carries the command's argv, key, paths and words, and none of
them may reach a person's terminal as control characters, bidi controls or escape sequences.
Must never: escape twice (a private `_..._text` formats what its public caller escaped) or
change the JSON a verb prints beside the text.
"""

from __future__ import annotations

from settled.printable import printable, printable_tree
from settled.states import did_not_succeed, is_live

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def _exit_line(exit_fact: dict[str, Any]) -> str:
    reason = exit_fact.get("reason")
    if reason == "not_started":
        return f"never started ({exit_fact.get('stage')}): {exit_fact.get('error')}"
    if exit_fact.get("signal"):
        how = f"killed by SIG{exit_fact['signal']}"
    else:
        how = f"exit code {exit_fact.get('code')}"
    text = f"{how} ({reason})"
    if "elapsed_s" in exit_fact:
        text += f" after {exit_fact['elapsed_s']:.3f} s"
    if exit_fact.get("note"):
        text += f"; {exit_fact['note']}"
    return text


def _stream_line(name: str, fact: dict[str, Any]) -> str:
    text = f"{fact['cursor']} bytes, {fact['digest'][:23]}…"
    if fact.get("not_stored"):
        text += f" ({fact['not_stored']} bytes past the {fact['cap']}-byte cap drained, not stored)"
    if fact.get("dropped") or fact.get("complete") is False:
        text += (
            f" INCOMPLETE: {fact.get('dropped')} bytes drained but not stored"
            f" ({fact.get('dropped_reason')})"
        )
    return f"  {name:<8}{text}"


def receipt_text(receipt: dict[str, Any]) -> str:
    return _receipt_text(printable_tree(receipt))


def _receipt_text(receipt: dict[str, Any]) -> str:
    death = receipt["death"]
    output = receipt["output"]
    proof = (
        death["evidence"]
        if death.get("proven")
        else "NOT PROVEN: "
        + str(death.get("observed", {}).get("why_not_evidence", "no evidence observed"))
    )
    lines = [
        f"process receipt {receipt['session']} (task {receipt['task']}, key {receipt['key']})",
        f"  exit    {_exit_line(receipt['exit'])}",
        f"  death   [{death.get('boundary')}, {death.get('source')}] {proof}",
        _stream_line("stdout", output["stdout"]),
        _stream_line("stderr", output["stderr"]),
        f"  drain   {output['drain']}",
    ]
    isolation = receipt.get("isolation") or {}
    if isolation.get("missing"):
        for name, why in isolation["missing"].items():
            lines.append(f"  missing {name}: {why}")
    elif isolation:
        lines.append(
            f"  isolated uid {isolation.get('uid')}: home hidden, own /proc "
            f"({isolation.get('proc')}), /sys {isolation.get('sys')}, cgroup "
            f"{isolation.get('cgroup')}, no_new_privs"
        )
    for straggler in receipt.get("stragglers", []):
        lines.append(
            f"  straggler pid {straggler['pid']} `{straggler['cmdline']}` "
            f"stopped by {straggler['stopped_by']}"
        )
    owner = receipt["owner"]
    if owner.get("role") == "recovery":
        lost = owner.get("lost_owner") or {}
        lines.append(f"  owner   lost (pid {lost.get('pid')}); settled by recovery {owner['pid']}")
    elif owner.get("role") == "launcher":
        lines.append(f"  owner   none was claimed; settled by its launcher {owner['pid']}")
    else:
        lines.append(
            f"  owner   pid {owner['pid']}, peak RSS {owner['maxrss_kib'] / 1024:.1f} MiB, "
            f"cpu {owner['cpu_s']:.3f} s"
        )
    lines.append(f"  digest  {receipt['digest']}")
    return "\n".join(lines)


def status_text(view: dict[str, Any]) -> str:
    return _status_text(printable_tree(view))


def _status_text(view: dict[str, Any]) -> str:
    if "sessions" in view:
        lines = [f"task {view['task']} [{view['state']}] workspace {view['workspace']}"]
        for s in view["sessions"]:
            exit_fact = s.get("exit")
            tail = f" — {_exit_line(exit_fact)}" if exit_fact else ""
            command = f" `{s['command']}`" if s.get("command") else ""
            lines.append(f"  {s['session']} key {s['key']}{command}: {s['state']}{tail}")
        return "\n".join(lines)
    lines = [f"session {view['session']} [{view['state']}] boundary {view['boundary']}"]
    if view.get("command"):
        lines.append(f"  command: {view['command']}")
    if view.get("why"):
        lines.append(f"  why: {view['why']}")
    if view.get("reason"):
        lines.append(f"  reason: {view['reason']}")
    if "receipt" in view:
        lines.append(_receipt_text(view["receipt"]))
    return "\n".join(lines)


def close_text(receipt: dict[str, Any]) -> str:
    return _close_text(printable_tree(receipt))


def _close_text(receipt: dict[str, Any]) -> str:
    checkpoint = receipt["checkpoint"]
    commands = receipt["outcome"]["commands"]
    lines = [
        f"close receipt for task {receipt['task']}: COMPLETE",
        f"  sealed    {len(receipt['sessions'])} session(s), each with a process receipt",
        f"  checkpoint {checkpoint['manifest']} ({checkpoint['entries']} entries), "
        f"watermark {checkpoint['watermark']}, read back: {checkpoint['read_back']['verified']}",
        f"  fence     generation {receipt['fence']['fenced_generation']} -> "
        f"{receipt['fence']['generation']}",
    ]
    for group, sessions in commands.items():
        if sessions:
            lines.append(f"  {group.replace('_', ' ')}: {', '.join(sessions)}")
    if not receipt["outcome"]["all_commands_succeeded"]:
        lines.append("  note      complete is not success: some commands did not succeed")
    for loss in receipt["outcome"].get("output_incomplete", []):
        lines.append(
            f"  output    {loss['session']} {loss['stream']} INCOMPLETE: stored "
            f"{loss['stored']} bytes, {loss['dropped']} drained but not stored ({loss['reason']})"
        )
    for unsealed in receipt["outcome"].get("output_unsealed", []):
        lines.append(
            f"  output    {unsealed['session']} {unsealed['stream']} NOT SEALED into the object "
            f"store: {unsealed['why']}"
        )
    lines.append(f"  digest    {receipt['digest']}")
    return "\n".join(lines)


def blocked_text(task: str, blocked: dict[str, Any]) -> str:
    task, blocked = printable_tree(task), printable_tree(blocked)
    return (
        f"task {task} is NOT complete: blocked on {blocked['authority']}, "
        f"which owes {blocked['obligation']}"
    )


COMMAND_WIDTH = 48  # characters of a command a line of `explain` shows (escapes counted)
SESSION_LINES = 40  # sessions `explain` lists one a line; the rest are counted


def explain_brief(view: dict[str, Any], more: str = "") -> str:
    """`settled explain` for a person: the verdict on one line, then one line per session
    (how it ended, its command, what proved it stopped), then `more` (where the details are).
    The full words are `view["words"]`."""
    shown = printable_tree(view)
    raw_sessions = view.get("sessions") or []
    lines = [_verdict(shown)]
    for raw, session in zip(raw_sessions[:SESSION_LINES], shown["sessions"], strict=False):
        lines.append(_session_line(session, shortened(str(raw.get("command") or ""))))
    if len(raw_sessions) > SESSION_LINES:
        lines.append(f"  … and {len(raw_sessions) - SESSION_LINES} more session(s)")
    if more:
        lines.append(more)
    return "\n".join(lines)


def shortened(command: str, width: int = COMMAND_WIDTH) -> str:
    """`command` escaped (`printable`, a character at a time, so no escape is cut in two) and
    cut to about `width` characters with an ellipsis."""
    out: list[str] = []
    used = 0
    for char in command:
        shown = printable(char)
        if used + len(shown) > width - 1:
            out.append("…")
            break
        out.append(shown)
        used += len(shown)
    return "".join(out)


def _verdict(view: dict[str, Any]) -> str:
    task = view["task"]
    if view["complete"]:
        outcome = _outcome_words(view.get("commands") or {})
        notes = ""
        if view.get("output_incomplete"):
            notes += f"; output INCOMPLETE in {len(view['output_incomplete'])} stream(s)"
        if view.get("output_unsealed"):
            notes += (
                f"; {len(view['output_unsealed'])} stream(s) NOT SEALED into the object store "
                "(readable only on their host)"
            )
        if view.get("ignored"):
            notes += "; paths matching its ignore rules are not checkpointed"
        if (view.get("workspace") or {}).get("shared_with"):
            notes += "; its workspace was shared with other task(s)"
        return (
            f"task {task} is COMPLETE ({outcome}): every command proven stopped, workspace "
            f"checkpointed and read back{notes}."
        )
    if view.get("state") == "frozen":
        return (
            f"task {task} is frozen ({view.get('frozen')}): it admits nothing and is not "
            "complete; recovery settles what its host's sandbox provider can prove."
        )
    if view.get("state") == "open":
        live = sum(1 for s in view.get("sessions") or [] if is_live(s["state"]))
        running = f", {live} of them still running" if live else ""
        count = len(view.get("sessions") or [])
        return (
            f"task {task} is open ({count} session(s){running}): not complete until it is closed."
        )
    blocked = view.get("blocked_on") or {}
    owed = f"{blocked.get('authority')} owes {blocked.get('obligation')}"
    if view.get("blocked"):
        return f"task {task} is NOT complete: blocked, {owed}."
    return f"task {task} is NOT complete yet: its close is under way; next, {owed}."


def _outcome_words(commands: dict[str, list[Any]]) -> str:
    total = sum(len(v) for v in commands.values())
    failed = did_not_succeed(commands)
    if failed:
        return f"not success: {failed} of {total} command(s) did not succeed"
    return f"all {total} command(s) succeeded" if total else "no command ran"


def _session_line(session: dict[str, Any], command: str) -> str:
    named = command or "(no command)"
    return f"  {_ending(session):<14} {named}  ({_proof(session)}; {session['session']})"


def _ending(session: dict[str, Any]) -> str:
    """How it ended, in a word or two; a live or unknown session says its state instead."""
    exit_fact = session.get("exit")
    if is_live(session["state"]) or not exit_fact:
        return str(session["state"])
    reason = exit_fact.get("reason")
    if reason == "not_started":
        return "never started"
    if reason in ("timeout", "cancelled", "oom"):
        return {"timeout": "timed out", "cancelled": "cancelled", "oom": "out of memory"}[reason]
    if exit_fact.get("signal"):
        return f"SIG{exit_fact['signal']}"
    return f"exit {exit_fact.get('code')}"


def _proof(session: dict[str, Any]) -> str:
    """What proved it can no longer run, named in a few words."""
    if session.get("proven"):
        source = session.get("source")
        by = f", by {source}" if source and source != "owner" else ""
        return f"death proven: {session.get('boundary')}{by}"
    if is_live(session["state"]):
        return "no death evidence yet"
    return "NO death evidence: recover it or destroy its sandbox"
