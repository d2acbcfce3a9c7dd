"""The close join as pure decisions over recorded facts: the one table of steps, complete(task),
and explain(task). Nothing here does I/O (after h11's _state.py); join.py performs the step this
module names and records its fact, so a crash anywhere leaves facts that this module reads again
to resume at the first unrecorded step. A step is never re-run once recorded, and no step ever
re-runs a command.

    complete(task) =
        admission_is_sealed
        AND every_session_has(death_proof, final_output_cursor, terminal_mutation)
        AND checkpoint_covers(final_scan_boundary)      -- >= every terminal mutation
        AND checkpoint_manifest_reads_back_exactly
        AND checkpoint_carries_runtime_fence

A stream whose owner drained bytes it could not store (disk full, I/O error, the home's reserve
reached) does not block completion: its final cursor is still a fact (the stored length), its
process is still proven dead, and the lost bytes can never come back, so blocking would make the
task impossible to complete. It is never called complete silently either: `output_losses`
names each such stream, `explain` words it, and the close receipt lists it in
`outcome.output_incomplete`. Likewise a stream whose seal into a remote object store failed
(its only copy is its host's log): the close retries the seal before it publishes, and its
receipt names each stream still unsealed in `outcome.output_unsealed` (`output_unsealed`).

Over 400 lines: the one table of steps and every decision the close and explain read from it
(completion, the outcomes, the losses, the words) stay together, so a step and its explanation
can never disagree.
"""

from __future__ import annotations

from settled.netledger import brief
from settled.receipts import sealed_copy
from settled.records import Frozen, SessionRecord, TaskRecord
from settled.states import SETTLED, UNKNOWN, is_live
from settled.status import command_words

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class Step(Frozen):
    __slots__ = ("authority", "name", "obligation")
    name: str
    authority: str
    obligation: str

    def __init__(self, name: str, authority: str, obligation: str) -> None:
        self._fill(locals())


# The join, in order (DESIGN.md, close). Each row is one recorded fact.
STEPS: tuple[Step, ...] = (
    Step("final_pending", "close", "store the final response as pending"),
    Step("sealed", "store", "seal admission so no new command can start"),
    Step(
        "sessions_settled",
        "session-owner",
        "settle every session: wait for required commands up to the deadline, then cancel "
        "them; stop services",
    ),
    Step("receipts", "session-owner", "a process receipt with death evidence for every session"),
    Step("final_scan", "workspace-service", "a final scan covering every terminal mutation"),
    Step(
        "checkpoint",
        "workspace-service",
        "publish blobs, write the manifest last and read it back by its exact id",
    ),
    Step("fenced", "store", "fence the runtime generation"),
    Step("outcome", "close", "publish the outcome"),
)


class CloseFacts(Frozen):
    """Everything the store recorded about one task's close, handed in by the driver.
    `seals`: the sealed copies recorded apart from the receipts, by session then stream."""

    __slots__ = ("seals", "sessions", "steps", "task")
    task: TaskRecord
    sessions: list[SessionRecord]
    steps: dict[str, dict[str, Any]]
    seals: dict[str, dict[str, Any]]

    def __init__(
        self,
        task: TaskRecord,
        sessions: list[SessionRecord],
        steps: dict[str, dict[str, Any]] | None = None,
        seals: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        steps = {} if steps is None else steps
        seals = {} if seals is None else seals
        self._fill(locals())


class Blocked(Frozen):
    __slots__ = ("authority", "obligation", "session")
    authority: str
    obligation: str
    session: str | None

    def __init__(self, authority: str, obligation: str, session: str | None = None) -> None:
        self._fill(locals())

    def to_json(self) -> dict[str, Any]:
        return {"authority": self.authority, "obligation": self.obligation, "session": self.session}


class Next(Frozen):
    __slots__ = ("step",)
    step: Step

    def __init__(self, step: Step) -> None:
        self._fill(locals())


class Done(Frozen):
    __slots__ = ()


Decision = Next | Blocked | Done


def _receipt_gap(session: SessionRecord) -> Blocked | None:
    """Why a session does not (yet) have a receipt that proves it can no longer run."""
    receipt = session.receipt
    if session.live:
        return Blocked(
            "session-owner",
            f"a process receipt for session {session.session} (still {session.state})",
            session.session,
        )
    if session.state == UNKNOWN or receipt is None or not receipt["death"].get("proven"):
        boundary = (receipt or {}).get("death", {}).get("boundary") or session.boundary
        return Blocked(
            "recovery",
            f"death evidence for session {session.session}: it is unknown (boundary "
            f"{boundary} gave none); recover it or destroy the task's sandbox",
            session.session,
        )
    return None


def next_decision(facts: CloseFacts) -> Decision:
    for step in STEPS:
        if step.name in facts.steps:
            continue
        if step.name == "receipts":
            for session in facts.sessions:
                gap = _receipt_gap(session)
                if gap is not None:
                    return gap
        return Next(step)
    return Done()


def terminal_mutations(sessions: list[SessionRecord]) -> list[int]:
    seqs = []
    for session in sessions:
        mutation = (session.receipt or {}).get("terminal_mutation") or {}
        if isinstance(mutation, dict) and mutation.get("seq") is not None:
            seqs.append(int(mutation["seq"]))
    return seqs


def latest_evidence_at(sessions: list[SessionRecord]) -> float:
    """Wall-clock time of the last death evidence: a scan that starts later covers every write."""
    times = [float((s.receipt or {}).get("timings", {}).get("settled_at", 0.0)) for s in sessions]
    return max(times, default=0.0)


def coverage_gaps(facts: CloseFacts) -> list[str]:
    """Every clause of complete(task) that does not hold, in words (empty: complete)."""
    gaps: list[str] = []
    if "sealed" not in facts.steps or facts.task.state == "open":
        gaps.append("admission is not sealed")
    for session in facts.sessions:
        gap = _receipt_gap(session)
        if gap is not None:
            gaps.append(gap.obligation)
            continue
        receipt = session.receipt or {}
        if "cursor" not in receipt.get("output", {}).get("stdout", {}):
            gaps.append(f"session {session.session} names no final output cursor")
        if "terminal_mutation" not in receipt:
            gaps.append(f"session {session.session} records no terminal mutation")
    checkpoint = facts.steps.get("checkpoint", {}).get("receipt")
    scan = facts.steps.get("final_scan")
    if checkpoint is None or scan is None:
        gaps.append("no checkpoint of the final scan")
    else:
        watermark = checkpoint.get("watermark")
        for seq in terminal_mutations(facts.sessions):
            if watermark is None or watermark < seq:
                gaps.append(f"checkpoint watermark {watermark} does not cover mutation {seq}")
        if float(scan.get("started_at", 0.0)) < latest_evidence_at(facts.sessions):
            gaps.append("the final scan started before the last session's death evidence")
        if not checkpoint.get("read_back", {}).get("verified"):
            gaps.append(f"manifest {checkpoint.get('manifest')} did not read back exactly")
        fence = facts.steps.get("fenced")
        if fence is None or fence.get("fenced_generation") != checkpoint.get("generation"):
            gaps.append("the checkpoint does not carry the runtime fence")
    return gaps


def complete(facts: CloseFacts) -> bool:
    return not coverage_gaps(facts) and "outcome" in facts.steps


def command_outcomes(sessions: list[SessionRecord], live: bool = False) -> dict[str, list[str]]:
    """Plainly which commands did what: complete is not the same as every command succeeding.
    With `live` (explain, before a close), a session its owner still acts for is `running`,
    not `unknown`; a close receipt's outcome has no such group (every session has settled)."""
    groups: dict[str, list[str]] = {
        "succeeded": [],
        "failed": [],
        "timed_out": [],
        "cancelled": [],
        "not_started": [],
        "services_stopped": [],
        "unknown": [],
    }
    if live:
        groups["running"] = []
    for session in sessions:
        exit_fact = (session.receipt or {}).get("exit", {})
        reason = exit_fact.get("reason")
        label = f"{session.session} ({session.key})"
        if live and session.live:
            groups["running"].append(label)
        elif session.state != SETTLED:
            groups["unknown"].append(label)
        elif session.spec.get("service") and _stopped_service(reason, exit_fact.get("code")):
            groups["services_stopped"].append(label)  # a service ends when the task closes
        elif reason == "timeout":
            groups["timed_out"].append(label)
        elif reason == "cancelled":
            groups["cancelled"].append(label)
        elif reason == "not_started":
            groups["not_started"].append(label)
        elif exit_fact.get("code") == 0:
            groups["succeeded"].append(label)
        else:
            groups["failed"].append(label)
    return groups


def _stopped_service(reason: str | None, code: int | None) -> bool:
    """A service stopped (by the close, or its deadline), or one that ended cleanly on its own;
    a service that exited with a non-zero code crashed: that is a failure, not a stop."""
    return reason in ("cancelled", "timeout") or (reason == "exited" and code == 0)


def output_losses(sessions: list[SessionRecord]) -> list[dict[str, Any]]:
    """Every stream whose receipt says bytes were drained but not stored, with how many and why.
    A recovered stream (its owner lost) says nothing of dropped bytes: its drain is incomplete,
    which the receipt already states."""
    losses = []
    for session in sessions:
        output = (session.receipt or {}).get("output", {})
        for stream in ("stdout", "stderr"):
            fact = output.get(stream) or {}
            if fact.get("dropped") or fact.get("complete") is False:
                losses.append(
                    {
                        "session": session.session,
                        "stream": stream,
                        "stored": fact.get("cursor"),
                        "dropped": fact.get("dropped"),
                        "reason": fact.get("dropped_reason"),
                    }
                )
    return losses


def output_unsealed(facts: CloseFacts) -> list[dict[str, Any]]:
    """The streams the close receipt named as not sealed into the object store (the home's
    objects are remote, so the log in the home is the only copy) that still have no sealed
    copy: a seal recorded since (an owner's late retry) drops one from the list."""
    outcome = (facts.steps.get("outcome", {}).get("receipt") or {}).get("outcome", {})
    receipts = {s.session: s.receipt for s in facts.sessions}
    return [
        named
        for named in outcome.get("output_unsealed") or []
        if sealed_copy(
            receipts.get(named["session"]), facts.seals.get(named["session"], {}), named["stream"]
        )
        is None
    ]


def _unsealed_words(unsealed: list[dict[str, Any]]) -> str:
    if not unsealed:
        return ""
    parts = [f"session {u['session']} {u['stream']} ({u['why']})" for u in unsealed]
    return (
        " Output not sealed into the object store, so readable only in its host's home: "
        + "; ".join(parts)
        + "."
    )


def _loss_words(losses: list[dict[str, Any]]) -> str:
    if not losses:
        return ""
    parts = [
        f"session {loss['session']} {loss['stream']} stored {loss['stored']} bytes and "
        f"{loss['dropped']} more were drained but not stored ({loss['reason']})"
        for loss in losses
    ]
    return " Output incomplete: " + "; ".join(parts) + "."


def protections(isolation: dict[str, Any] | None) -> tuple[list[str], dict[str, str]]:
    """The protections a session ran under, in words, and the missing ones with why."""
    if not isolation or "missing" not in isolation:
        return [], {"all": "no isolation was recorded for this session"}
    held = []
    if isolation.get("home_hidden"):
        held.append("settled home hidden")
    hidden = isolation.get("hidden", {})
    dirs, files = len(hidden.get("dirs", [])), len(hidden.get("files", []))
    if isolation.get("host") == "allow-list":  # nothing but its view exists for the command
        held.append(f"an allow-list view of {len(isolation.get('view', []))} entries")
        if dirs or files:
            held.append(f"{dirs} directory(ies) and {files} file(s) covered inside it")
    elif dirs or files:
        others = dirs - (1 if isolation.get("home_hidden") else 0)
        held.append(f"{others} other workspace(s) and {files} token file(s) hidden")
    for key, value, words in (
        ("proc", "private", "its own /proc"),
        ("sys", "read-only", "/sys read-only"),
        ("dev", "minimal", "no block devices"),
        ("cgroup", "namespace, read-only", "cgroup namespace, cgroup tree read-only"),
    ):
        if isolation.get(key) == value:
            held.append(words)
    if isinstance(isolation.get("capabilities"), list):
        held.append("bounding set of " + ", ".join(isolation["capabilities"]))
    if isolation.get("no_new_privs"):
        held.append("no_new_privs")
    network = (isolation.get("network") or {}).get("mode")
    if network == "none":
        held.append("its task's own network namespace: loopback only")
    elif network == "proxy":
        held.append("its task's own network namespace, out only through settled's proxy")
    elif network == "host":
        held.append("the host's network, granted (--network host)")
    held.append(f"uid {isolation.get('uid')} gid {isolation.get('gid')}")
    return held, dict(isolation.get("missing", {}))


def session_evidence(session: SessionRecord) -> dict[str, Any]:
    """Per session: what proved its death, in the boundary's words, and under what isolation."""
    receipt = session.receipt or {}
    death = receipt.get("death", {})
    held, missing = protections(receipt.get("isolation") or session.isolation)
    return {
        "session": session.session,
        "key": session.key,
        "command": command_words(session.spec),
        "state": session.state,
        "exit": receipt.get("exit"),
        "boundary": death.get("boundary") or session.boundary,
        "proven": bool(death.get("proven")),
        "evidence": death.get("evidence"),
        "source": death.get("source"),
        "receipt": receipt.get("digest"),
        "protections": held,
        "missing_protections": missing,
        "network": brief((receipt.get("network") or {}).get("ledger")),
    }


def _session_words(view: dict[str, Any]) -> str:
    if view["proven"]:
        proof = view["evidence"]
    elif is_live(view["state"]):  # its owner acts for it: none can exist yet
        proof = f"still {view['state']}, no death evidence yet"
    else:
        proof = f"{view['state']}, no death evidence"
    text = f" Session {view['session']}: {proof}"
    if view["missing_protections"]:
        gaps = "; ".join(f"{k}: {v}" for k, v in view["missing_protections"].items())
        text += f" (protections missing: {gaps})"
    if view.get("network"):
        text += f"; network through the proxy: {view['network']}"
    return text + "."


def explain(facts: CloseFacts) -> dict[str, Any]:
    """Which receipts allowed success, or which obligation blocks it, in words and as data."""
    result = _explain(facts)
    views = [session_evidence(s) for s in facts.sessions]
    result["sessions"] = views
    losses = output_losses(facts.sessions)
    result["output_incomplete"] = losses
    unsealed = output_unsealed(facts)
    result["output_unsealed"] = unsealed
    result["words"] += (
        _loss_words(losses) + _unsealed_words(unsealed) + "".join(_session_words(v) for v in views)
    )
    return result


def _ignored_words(ignored: dict[str, Any] | None) -> str:
    """Said when the checkpoint leaves paths out: what the proof does not cover."""
    if not ignored:
        return ""
    patterns = ", ".join(repr(p) for p in ignored.get("patterns", []))
    return (
        f" The checkpoint does not cover paths matching the task's ignore rules ({patterns}; "
        f"{ignored.get('digest')}), bound when the task was created."
    )


def _shared_words(workspace: dict[str, Any] | None) -> str:
    """Said when the checkpoint is not this task's work alone: its workspace was shared."""
    if workspace is None or not workspace.get("shared_with"):
        return ""
    shared = ", ".join(workspace["shared_with"])
    return (
        f" Its workspace {workspace['path']} was shared with task(s) {shared}: the checkpoint "
        "holds their writes too."
    )


def _explain(facts: CloseFacts) -> dict[str, Any]:
    decision = next_decision(facts)
    outcomes = command_outcomes(facts.sessions, live=True)
    if complete(facts):
        checkpoint = facts.steps["checkpoint"]["receipt"]
        allowed_by = {
            "process_receipts": [
                {"session": s.session, "digest": (s.receipt or {}).get("digest")}
                for s in facts.sessions
            ],
            "checkpoint_receipt": checkpoint.get("digest"),
            "manifest": checkpoint.get("manifest"),
            "fence": facts.steps["fenced"],
        }
        words = (
            f"task {facts.task.task} is complete: admission was sealed, "
            f"{len(facts.sessions)} session(s) each have a process receipt with death evidence, "
            f"checkpoint {checkpoint.get('manifest')} covers mutation "
            f"{checkpoint.get('watermark')} and read back exactly, and the generation is fenced."
        )
        workspace = facts.steps["outcome"]["receipt"].get("workspace")
        ignored = (checkpoint.get("covers") or {}).get("ignored")
        return {
            "task": facts.task.task,
            "state": facts.task.state,
            "complete": True,
            "allowed_by": allowed_by,
            "commands": outcomes,
            "workspace": workspace,
            "ignored": ignored,
            "words": words
            + _ignored_words(ignored)
            + _shared_words(workspace)
            + _command_words(outcomes),
        }
    if isinstance(decision, Blocked):
        blocked = decision.to_json()
        words = (
            f"task {facts.task.task} is blocked: {decision.authority} owes {decision.obligation}."
        )
    elif isinstance(decision, Next):
        blocked = {
            "authority": decision.step.authority,
            "obligation": decision.step.obligation,
            "session": None,
        }
        words = (
            f"task {facts.task.task} is not complete: the next step is {decision.step.name} "
            f"({decision.step.obligation}), owed by {decision.step.authority}."
        )
    else:
        blocked = {
            "authority": "close",
            "obligation": "; ".join(coverage_gaps(facts)),
            "session": None,
        }
        words = f"task {facts.task.task} is not complete: {blocked['obligation']}."
    return {
        "task": facts.task.task,
        "state": facts.task.state,
        "complete": False,
        "blocked_on": blocked,
        "blocked": isinstance(decision, Blocked),  # no step can run until the authority acts
        "gaps": coverage_gaps(facts),
        "commands": outcomes,
        "words": words + _command_words(outcomes),
    }


def _command_words(outcomes: dict[str, list[str]]) -> str:
    parts = [f"{len(v)} {k.replace('_', ' ')}" for k, v in outcomes.items() if v]
    failed = outcomes["failed"] + outcomes["timed_out"] + outcomes["not_started"]
    text = f" Commands: {', '.join(parts) or 'none'}."
    if failed:
        text += f" Did not succeed: {', '.join(failed)}."
    return text
