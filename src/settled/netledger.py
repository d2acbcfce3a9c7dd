"""A session's network ledger: what left the sandbox through settled's proxy, and how it ended.

Owns the ledger's one file format, the fold of its events into entries, the rule that decides
each entry's end, and the words a receipt, `explain` and `status` say of it. Pure but for
`read_events`, which reads the file.

Who writes it: the proxy (netproxy/daemon.py), a process settled owns, never the command; one
JSON object per line in `<home>/sessions/<s>/network.jsonl`, which the command's view never
holds. Events: `open` (a connection accepted and allowed: its destination, the address
connected to, for plain HTTP the method and authority), `refused` (with why), `end` (bytes each
way, how it ended as the proxy saw it: `closed`, `reset`, `failed`, or `aborted` by the seal,
and the monotonic time),
`sealed` (the session's owner asked for its ledger; `killed_at`: when it began to kill).

The rule (`entries`). An entry whose end the proxy saw before its session began to be killed
ended as seen (`closed`, `reset`, `failed`). One still open when the ledger was sealed, or that
ended once the kill had begun, is `unknown`: its command was killed mid-way (or the proxy was
lost), and whether its effect happened is the remote's to know, not settled's. A refused one is
`refused`: nothing was sent.

Must never: call an entry closed that the proxy did not see end before the kill, or drop an
event it cannot parse (a line that is not an event is counted, `damaged`, and said).
"""

from __future__ import annotations

import json

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

LEDGER_NAME = "network.jsonl"
ENDS = ("closed", "reset", "failed", "refused", "unknown")
RECEIPT_ENTRIES = 64  # a receipt lists at most this many; the rest are in the ledger file
SUMMARY_GROUPS = 6


def read_events(path: str) -> tuple[list[dict[str, Any]], int]:
    """(events, damaged lines) of the ledger at `path`; ([], 0) when there is none."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return [], 0
    events, damaged = [], 0
    for line in data.split(b"\n"):
        if not line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            damaged += 1
            continue
        if isinstance(event, dict) and isinstance(event.get("e"), str):
            events.append(event)
        else:
            damaged += 1
    return events, damaged


def killed_at(events: list[dict[str, Any]]) -> float | None:
    """When the session began to be killed, as its owner said when it sealed the ledger."""
    for event in events:
        if event["e"] == "sealed" and event.get("killed_at") is not None:
            return float(event["killed_at"])
    return None


def entries(events: list[dict[str, Any]], kill: float | None) -> list[dict[str, Any]]:
    """The ledger's entries in the order their connections began, each with its `end`.
    `kill`: when the session began to be killed (CLOCK_MONOTONIC), None if it was not."""
    found: dict[int, dict[str, Any]] = {}
    for event in events:
        kind, number = event["e"], event.get("id")
        if kind in ("open", "refused") and isinstance(number, int):
            entry = {k: v for k, v in event.items() if k not in ("e", "mono")}
            entry.update(sent=0, received=0, end="refused" if kind == "refused" else "unknown")
            found[number] = entry
        elif kind == "end" and number in found and found[number]["end"] == "unknown":
            entry = found[number]
            entry.update(sent=event.get("sent", 0), received=event.get("received", 0))
            entry["ended_at"] = event.get("at")
            ended_before_kill = kill is None or float(event.get("mono", kill)) < kill
            how = event.get("how", "closed")
            entry["end"] = how if ended_before_kill and how != "aborted" else "unknown"
            if event.get("why"):
                entry["why"] = event["why"]
            if how == "aborted":
                entry["why"] = "still open when its session ended: the proxy aborted it"
            elif not ended_before_kill:
                entry["why"] = "it ended once its session was being killed"
    for entry in found.values():
        if entry["end"] == "unknown" and "why" not in entry:
            entry["why"] = "still open when its session ended"
    return [found[n] for n in sorted(found)]


def facts(listed: list[dict[str, Any]], damaged: int, digest: str) -> dict[str, Any]:
    """The receipt's `network.ledger` of `entries`: count, ends, bytes, the summary line, the
    entries (at most RECEIPT_ENTRIES; `digest` is that of them all, refolded from the file)."""
    ends = {end: sum(1 for e in listed if e["end"] == end) for end in ENDS}
    out: dict[str, Any] = {
        "count": len(listed),
        "ends": {end: n for end, n in ends.items() if n},
        "sent": sum(int(e["sent"]) for e in listed),
        "received": sum(int(e["received"]) for e in listed),
        "summary": summary(listed),
        "digest": digest,
        "limit_hit": any(e.get("limit") for e in listed),
        "entries": listed[:RECEIPT_ENTRIES],
    }
    if len(listed) > RECEIPT_ENTRIES:
        out["entries_omitted"] = len(listed) - RECEIPT_ENTRIES
    if damaged:
        out["damaged_lines"] = damaged
    return out


def unrecorded(events: list[dict[str, Any]]) -> int:
    """Connections refused, unrecorded, once the session's ledger was full (the seal says)."""
    return sum(int(e.get("unrecorded") or 0) for e in events if e["e"] == "sealed")


def summary(listed: list[dict[str, Any]]) -> str:
    """One line: "3 connections to pypi.org:443, all closed; 1 refused to 169.254.169.254:80;
    1 unknown to api.example.com:443"; "no connection" for none."""
    if not listed:
        return "no connection"
    groups: dict[tuple[str, str], int] = {}
    for entry in listed:
        where = f"{_host(entry['host'])}:{entry['port']}" if entry["host"] else "no destination"
        key = (entry["end"], where)
        groups[key] = groups.get(key, 0) + 1
    ordered = sorted(groups.items(), key=lambda item: (ENDS.index(item[0][0]), -item[1]))
    words = [_group(end, where, n) for (end, where), n in ordered[:SUMMARY_GROUPS]]
    if len(ordered) > SUMMARY_GROUPS:
        rest = sum(n for _, n in ordered[SUMMARY_GROUPS:])
        words.append(f"{rest} more to {len(ordered) - SUMMARY_GROUPS} other destinations")
    return "; ".join(words)


def _group(end: str, where: str, n: int) -> str:
    if end == "closed":
        return f"{n} connection{'s' if n > 1 else ''} to {where}, {'all ' if n > 1 else ''}closed"
    return f"{n} {end} to {where}"


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def brief(ledger: dict[str, Any] | None) -> str | None:
    """The summary a receipt's ledger carries, for `status` and `explain`."""
    if not ledger:
        return None
    return str(ledger.get("summary") or "no connection")
