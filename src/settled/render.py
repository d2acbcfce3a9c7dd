"""Human-readable renderings of receipts and status for the terminal (the JSON is the truth).

Every public rendering escapes its whole input once (`printable.printable_tree`) before it
formats it: a receipt or a view carries the command's argv, key, paths and words, and none of
them may reach a person's terminal as control characters, bidi controls or escape sequences.
Must never: escape twice (a private `_..._text` formats what its public caller escaped) or
change the JSON a verb prints beside the text.
"""

from __future__ import annotations

from settled.printable import printable_tree

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
    lines.append(f"  digest    {receipt['digest']}")
    return "\n".join(lines)


def blocked_text(task: str, blocked: dict[str, Any]) -> str:
    task, blocked = printable_tree(task), printable_tree(blocked)
    return (
        f"task {task} is NOT complete: blocked on {blocked['authority']}, "
        f"which owes {blocked['obligation']}"
    )
