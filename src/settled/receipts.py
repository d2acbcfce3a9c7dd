"""Receipts: canonical, versioned JSON facts, each sealed with a digest over its canonical bytes.

Owns the shape of the process receipt (DESIGN.md) and the decoding of a wait status into
`exit {code | signal, reason}`, and the one answer to where a settled stream's sealed copy is
(`sealed_copy`) and whether a seal may be recorded (`seal_refusal`). Pure: the owner gathers the
facts, this only arranges them.
"""

from __future__ import annotations

import os
import time

from settled.canonical import digest_of
from settled.errors import ReceiptTampered

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

PROCESS_RECEIPT_VERSION = "settled.receipt.process/v1"
SHELL_CONVENTIONS = {
    126: "126 is /bin/sh's code for a command found but not executable",
    127: "127 is /bin/sh's code for a command not found",
}


def exit_fact(
    wait_status: int | None, reason: str, *, shell: bool, elapsed_s: float | None
) -> dict[str, Any]:
    fact: dict[str, Any] = {"code": None, "signal": None, "reason": reason}
    if wait_status is not None:
        if os.WIFEXITED(wait_status):
            fact["code"] = os.WEXITSTATUS(wait_status)
            if shell and fact["code"] in SHELL_CONVENTIONS:
                fact["note"] = SHELL_CONVENTIONS[fact["code"]]
        elif os.WIFSIGNALED(wait_status):
            import signal  # the owner's, at its end: readers of receipts never need it

            fact["signal"] = signal.Signals(os.WTERMSIG(wait_status)).name.removeprefix("SIG")
    if elapsed_s is not None:
        fact["elapsed_s"] = round(elapsed_s, 6)
    return fact


def not_started_fact(stage: str, error: str) -> dict[str, Any]:
    return {"code": None, "signal": None, "reason": "not_started", "stage": stage, "error": error}


def seal(receipt: dict[str, Any]) -> dict[str, Any]:
    """Add issued_at and the digest over every other field's canonical bytes."""
    body = {k: v for k, v in receipt.items() if k != "digest"}
    body.setdefault("issued_at", round(time.time(), 6))
    return {**body, "digest": digest_of(body)}


def verify(receipt: dict[str, Any]) -> bool:
    body = {k: v for k, v in receipt.items() if k != "digest"}
    return receipt.get("digest") == digest_of(body)


def checked(receipt: Any, what: str) -> dict[str, Any]:
    """The receipt, once its digest over its canonical bytes holds; ReceiptTampered otherwise.
    Every read that decides anything goes through here (the store calls it on every load)."""
    if not isinstance(receipt, dict):
        raise ReceiptTampered(what, None, f"not a receipt object: {type(receipt).__name__}")
    body = {k: v for k, v in receipt.items() if k != "digest"}
    try:
        actual = digest_of(body)
    except (TypeError, ValueError) as exc:
        raise ReceiptTampered(what, receipt.get("digest"), f"unencodable ({exc})") from None
    if receipt.get("digest") != actual:
        raise ReceiptTampered(what, receipt.get("digest"), actual)
    return receipt


def process_receipt(
    *,
    session: str,
    task: str,
    key: str,
    command_digest: str,
    generation: int,
    death: dict[str, Any],
    exit: dict[str, Any],
    output: dict[str, Any],
    stragglers: list[dict[str, Any]],
    terminal_mutation: dict[str, Any],
    owner: dict[str, Any],
    timings: dict[str, float],
    isolation: dict[str, Any] | None = None,
    resources: dict[str, Any] | None = None,
    network: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`resources`: the command's limits and what the kernel counted (boundary/walls.py);
    absent for a command that never started. `network`: under `--network proxy`, its ledger
    (netledger.py: what left the sandbox, and how each connection ended)."""
    extra = {"resources": resources} if resources is not None else {}
    if network is not None:
        extra["network"] = network
    return seal(
        {
            "kind": "process",
            "v": PROCESS_RECEIPT_VERSION,
            "authority": "session-owner",
            "session": session,
            "task": task,
            "key": key,
            "command_digest": command_digest,
            "generation": generation,
            "death": death,
            "exit": exit,
            "output": output,
            "stragglers": stragglers,
            "terminal_mutation": terminal_mutation,
            "isolation": isolation,
            "owner": owner,
            "timings": timings,
            **extra,
        }
    )


# -- sealed logs: where a settled stream's copy in the object store is -------------------------
STREAMS: Final = ("stdout", "stderr")


def sealed_copy(
    receipt: dict[str, Any] | None, recorded: dict[str, Any], stream: str
) -> dict[str, Any] | None:
    """Where the sealed copy of `stream` is (a fact naming its manifest and chunks), or None:
    the seal recorded apart (`Store.record_seal`, `recorded` by stream), else the one an older
    receipt carried in `output.<stream>.sealed`. Every reader of a sealed log asks this."""
    fact = recorded.get(stream)
    if isinstance(fact, dict) and "chunks" in fact:
        return fact
    inline = ((receipt or {}).get("output", {}).get(stream) or {}).get("sealed")
    if isinstance(inline, dict) and "chunks" in inline:
        return inline
    return None


def seal_failure(receipt: dict[str, Any] | None, stream: str) -> str | None:
    """Why an older receipt's seal of `stream` failed, as the receipt names it."""
    inline = ((receipt or {}).get("output", {}).get(stream) or {}).get("sealed")
    return str(inline["error"]) if isinstance(inline, dict) and "error" in inline else None


def seal_refusal(
    session: str, stream: str, state: str, receipt: dict[str, Any] | None, fact: dict[str, Any]
) -> str | None:
    """Why a seal of `stream` may not be recorded (None: it may): only a settled session's,
    and only one whose length and digest are its receipt's cursor and digest for the stream,
    so no log (hostile or changed) can make a sealed copy that disagrees with the receipt."""
    if stream not in STREAMS:
        return f"a seal names stream stdout or stderr, not {stream!r}"
    if state != "settled" or receipt is None:
        return f"session {session} is {state}: only a settled session's logs are sealed"
    output = receipt.get("output", {}).get(stream) or {}
    if fact.get("length") != output.get("cursor") or fact.get("digest") != output.get("digest"):
        return (
            f"the seal offered for the {stream} of session {session} names "
            f"{fact.get('length')} bytes with digest {fact.get('digest')}, its receipt "
            f"{output.get('cursor')} bytes with digest {output.get('digest')}"
        )
    if fact.get("chunks") is None or (fact["chunks"] and not fact.get("manifest")):
        return f"the seal offered for the {stream} of session {session} names no manifest"
    if (fact["chunks"] == 0) != (fact.get("length") == 0):  # an empty seal is of no byte only
        return (
            f"the seal offered for the {stream} of session {session} names {fact['chunks']} "
            f"chunks for {fact.get('length')} bytes"
        )
    return None
