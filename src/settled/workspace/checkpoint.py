"""The workspace service: the only writer of checkpoints.

Owns the task's journal daemon (started with the task, stopped when the close releases it), the
final scan (a full stat-cache scan that publishes blobs as it reads), and the checkpoint: the
manifest written last, read back by its exact id, every blob this checkpoint added re-hashed,
and the receipt recorded under the runtime generation (the store refuses a fenced one).
Never touches processes and never decides a task's state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from settled import faults
from settled.canonical import canonical_bytes
from settled.errors import SettledError
from settled.home import journal_socket
from settled.receipts import seal
from settled.store import SessionRecord, TaskRecord
from settled.store.sqlite import SQLiteStore
from settled.workspace import journal
from settled.workspace.manifest import (
    Index,
    build_manifest,
    verify_manifest,
    write_manifest,
)
from settled.workspace.objects import LocalObjectStore
from settled.workspace.scan import scan

CHECKPOINT_RECEIPT_VERSION = "settled.receipt.checkpoint/v1"


class CheckpointUnverified(SettledError):
    """The manifest or a blob did not read back exactly: no checkpoint receipt is issued."""


class WorkspaceService:
    def __init__(self, home: str, store: SQLiteStore) -> None:
        self.home, self.store = home, store
        self.objects = LocalObjectStore(os.path.join(home, "objects"))
        self._indexes: dict[str, Index] = {}

    # -- the journal ----------------------------------------------------------------------

    def ensure_journal(self, task: TaskRecord) -> str:
        return journal.ensure_running(task.workspace, os.path.dirname(self.socket(task)))

    def socket(self, task: TaskRecord) -> str:
        return journal_socket(self.home, task.task)

    def release(self, task: TaskRecord) -> None:
        """The close is done with this workspace: stop its journal."""
        journal.stop(self.socket(task))

    # -- the final scan and the checkpoint ------------------------------------------------

    def final_scan(self, task: TaskRecord, *, incremental: bool = False) -> dict[str, Any]:
        """Scan after every session's death evidence; blobs are durable when this returns.

        Full by default (what a close must do: the watcher is a hint, the scan is the proof).
        `incremental` re-lists only the directories the journal saw change since the last
        checkpoint, and only when the journal vouches for that whole interval; otherwise full.
        """
        watermark = journal.barrier(self.socket(task))
        started_at = time.time()
        latest = self.store.latest_checkpoint(task.task)
        previous = self._index(latest[1]) if latest and latest[1] else None
        only = None
        if incremental and previous is not None and watermark is not None:
            only = watermark.dirty_dirs if watermark.trustworthy else None
        result = scan(task.workspace, previous, self.objects, only=only)
        faults.point("checkpoint.after_blobs")
        index_ref = self.objects.put_bytes(result.index.to_bytes())
        self._indexes = {index_ref: result.index}  # the checkpoint step reads it next
        added = _file_digests(result.index) - (_file_digests(previous) if previous else set())
        return {
            "added_ref": self.objects.put_bytes(canonical_bytes(sorted(added))),
            "started_at": started_at,
            "watermark": watermark.seq if watermark else None,
            "journal": watermark.to_json() if watermark else {"running": False},
            "parent": latest[0]["manifest"] if latest else None,
            "index_ref": index_ref,
            "entries": len(result.index.entries),
            "mode": "full" if only is None else "incremental",
            "stats": dataclasses.asdict(result.stats),
        }

    def checkpoint_now(self, task: TaskRecord, *, incremental: bool = True) -> dict[str, Any]:
        """A checkpoint while the task is open (not a close): what the workspace holds now."""
        fact = self.final_scan(task, incremental=incremental)
        receipt = self.checkpoint(task, fact, [])
        if fact["watermark"] is not None:
            journal.reset(self.socket(task), int(fact["watermark"]))
        return {**receipt, "scan": {k: v for k, v in fact.items() if k != "index_ref"}}

    def checkpoint(
        self, task: TaskRecord, scan_fact: dict[str, Any], sessions: list[SessionRecord]
    ) -> dict[str, Any]:
        index = self._index(scan_fact["index_ref"])
        manifest = build_manifest(
            index,
            parent=scan_fact["parent"],
            watermark=scan_fact["watermark"],
            generation=task.generation,
        )
        manifest_id = write_manifest(self.objects, manifest)
        faults.point("checkpoint.after_manifest")
        faults.point("checkpoint.before_read_back")
        added = json.loads(self.objects.read(scan_fact["added_ref"]))
        verification = verify_manifest(self.objects, manifest_id, added)
        if not verification.ok:
            problems = verification.manifest_error or ", ".join(
                f"{p.digest} ({p.problem}: {', '.join(p.paths)})" for p in verification.problems
            )
            raise CheckpointUnverified(f"manifest {manifest_id} did not read back: {problems}")
        receipt = seal(
            {
                "kind": "checkpoint",
                "v": CHECKPOINT_RECEIPT_VERSION,
                "authority": "workspace-service",
                "task": task.task,
                "manifest": manifest_id,
                "parent": scan_fact["parent"],
                "algorithm": manifest.algorithm,
                "entries": len(manifest.entries),
                "watermark": scan_fact["watermark"],
                "covers": {
                    "scan_started_at": scan_fact["started_at"],
                    "terminal_mutations": {
                        s.session: (s.receipt or {}).get("terminal_mutation") for s in sessions
                    },
                },
                "read_back": {
                    "id": manifest_id,
                    "verified": True,
                    "blobs_verified": verification.checked,
                },
                "generation": task.generation,
            }
        )
        self.store.record_checkpoint(task.task, task.generation, receipt, scan_fact["index_ref"])
        return receipt

    def _index(self, ref: str) -> Index:
        """The stat cache of a scan: parsing 100,000 entries costs ~0.7 s, so the one this
        service just wrote is kept in memory for the checkpoint step that follows."""
        cached = self._indexes.get(ref)
        if cached is not None:
            return cached
        index = Index.from_bytes(self.objects.read(ref))
        self._indexes = {ref: index}
        return index


def _file_digests(index: Index) -> set[str]:
    """The blobs an index references: those a later scan did not add itself."""
    return {e.digest for e in index.entries if e.digest is not None}
