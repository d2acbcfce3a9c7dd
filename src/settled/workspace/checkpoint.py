"""The workspace service: the only writer of checkpoints.

Owns the task's journal daemon (started with the task, stopped when the close releases it), the
final scan (a full stat-cache scan that publishes blobs as it reads, then the trees of the
directories that changed, and records their stat-cache nodes), and the checkpoint: the
manifest written last, read back by its exact id, every tree and blob this checkpoint published
re-hashed, every subtree it reuses present, and the receipt recorded under the runtime
generation (the store refuses a fenced one). Never touches processes and never decides a
task's state.
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
from settled.workspace.index import Index
from settled.workspace.manifest import IndexMismatch, verify_published, write_manifest
from settled.workspace.nodecache import NodeCache
from settled.workspace.objects import LocalObjectStore, ObjectMissing
from settled.workspace.scan import ScanResult, scan

CHECKPOINT_RECEIPT_VERSION = "settled.receipt.checkpoint/v1"


class CheckpointUnverified(SettledError):
    """The manifest or a blob did not read back exactly: no checkpoint receipt is issued."""


class WorkspaceService:
    def __init__(self, home: str, store: SQLiteStore) -> None:
        self.home, self.store = home, store
        self.objects = LocalObjectStore(os.path.join(home, "objects"))
        self._cache: NodeCache | None = None
        self._indexes: dict[str, Index] = {}

    @property
    def cache(self) -> NodeCache:
        """The stat cache's nodes, opened at the first scan (most commands never scan)."""
        if self._cache is None:
            self._cache = NodeCache(os.path.join(self.home, "index.db"))
        return self._cache

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache = None

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
        """Scan after every session's death evidence; blobs and trees are durable when this
        returns (the stat-cache nodes need not be: a lost one costs a full scan).

        Full by default (what a close must do: the watcher is a hint, the scan is the proof).
        `incremental` re-lists only the directories the journal saw change since the last
        checkpoint, and only when the journal vouches for that whole interval; otherwise full.
        A stat cache that cannot be read is not an error: the scan runs without it, and says so.
        """
        watermark = journal.barrier(self.socket(task))
        started_at = time.time()
        latest = self.store.latest_checkpoint(task.task)
        previous, cache = self._previous(latest[1] if latest else None)
        only = None
        if incremental and previous is not None and watermark is not None:
            only = watermark.dirty_dirs if watermark.trustworthy else None
        try:
            result = scan(task.workspace, previous, self.objects, only=only, cache=self.cache)
        except IndexMismatch as error:
            cache, only = f"unusable, scanned without it: {error}", None
            result = scan(task.workspace, None, self.objects, cache=self.cache)
        faults.point("checkpoint.after_blobs")
        index_ref = result.index.ref
        self.cache.put_many([(index_ref, result.index.to_bytes())])
        self._indexes = {index_ref: result.index}  # the checkpoint step reads it next
        return {
            "published_ref": self.objects.put_bytes(canonical_bytes(_published(result))),
            "started_at": started_at,
            "watermark": watermark.seq if watermark else None,
            "journal": watermark.to_json() if watermark else {"running": False},
            "parent": latest[0]["manifest"] if latest else None,
            "index_ref": index_ref,
            "stat_cache": cache,
            "entries": result.index.count,
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
        manifest_id = write_manifest(
            self.objects,
            index.algorithm,
            index.root,
            parent=scan_fact["parent"],
            watermark=scan_fact["watermark"],
            generation=task.generation,
        )
        faults.point("checkpoint.after_manifest")
        faults.point("checkpoint.before_read_back")
        published = json.loads(self.objects.read(scan_fact["published_ref"]))
        verification = verify_published(
            self.objects, manifest_id, published["trees"], published["blobs"]
        )
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
                "algorithm": index.algorithm,
                "entries": index.count,
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
                    "trees_verified": verification.trees_checked,
                    "blobs_verified": verification.checked,
                    "reused_present": verification.present_checked,
                },
                "generation": task.generation,
            }
        )
        self.store.record_checkpoint(task.task, task.generation, receipt, scan_fact["index_ref"])
        return receipt

    def _previous(self, ref: str | None) -> tuple[Index | None, str]:
        """The last checkpoint's stat cache, or None and why not."""
        if ref is None:
            return None, "none: the first checkpoint of this workspace"
        try:
            return self._index(ref), "used"
        except (IndexMismatch, ObjectMissing) as error:
            return None, f"unusable, scanned without it: {error}"

    def _index(self, ref: str) -> Index:
        """The stat cache of a scan: the one this service just wrote is kept in memory (with
        every node it loaded) for the checkpoint step and the next scan."""
        cached = self._indexes.get(ref)
        if cached is not None:
            return cached
        index = Index.from_bytes(self.cache.read(ref), self.cache, ref)
        self._indexes = {ref: index}
        return index


def _published(result: ScanResult) -> dict[str, Any]:
    """What this scan published, for the read-back: tree id -> directory, blob digests."""
    return {"trees": result.trees, "blobs": sorted(result.blobs)}
