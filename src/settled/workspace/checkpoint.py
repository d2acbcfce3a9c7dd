"""The workspace service: the only writer of checkpoints.

Owns the tasks' journal (the home's one daemon, told to watch a task's workspace when the task
is made or runs a command, and to release it when the close is done), the
final scan (of the directory bound at `task new`, checked by its recorded identity, else
``WorkspaceReplaced``: a full stat-cache scan that publishes blobs as it reads, then the trees
of the directories that changed, and records their stat-cache nodes), and the checkpoint: the
manifest written last, read back by its exact id (``readback``: after a full scan, which every
close is, every object the manifest reaches is re-hashed or unchanged since the verified-object
record saw it hash right; after an incremental one, everything this checkpoint published or
names directly, and the reused subtrees' contents trusted from the parent checkpoint, as the
receipt says), and the receipt recorded under the runtime generation (the store refuses a
fenced one).

A read-back that finds an object missing or damaged is not yet a failure: the workspace usually
still holds those bytes. A damaged object is quarantined (moved aside, kept as evidence), the
workspace is scanned again without the stat cache (every file re-read, every absent object
published again), the same manifest is written (same bytes, same id) and read back again; only
if that fails too is ``CheckpointUnverified`` raised, naming each object and the paths that use
it. The receipt of a healed checkpoint says what was found, moved and rescanned.

It depends on the ``Store`` and ``ObjectStore`` protocols, never on their implementations,
and is the one place that chooses the object store's (``open_object_store``).

Never touches processes and never decides a task's state.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any

from settled import faults
from settled.errors import SettledError
from settled.home import journal_socket, run_dir
from settled.objects import ObjectMissing, ObjectStore, StoredObject
from settled.objects import open_object_store as open_object_store
from settled.objects.hashing import algorithm_of, digest_bytes
from settled.receipts import seal
from settled.records import SessionRecord, TaskRecord
from settled.store import Store
from settled.workspace import cachetrust, ignore, rootid
from settled.workspace.index import Index
from settled.workspace.journal import lifecycle as journal_lifecycle
from settled.workspace.journal import wire as journal_wire
from settled.workspace.manifest import IndexMismatch, ManifestError, publish_manifest
from settled.workspace.nodecache import NodeCache
from settled.workspace.readback import QUARANTINABLE, Problem, ReadBack, read_back
from settled.workspace.scan import CLOCK_SLACK_NS, Vouches, gc_paused, scan
from settled.workspace.scanerrors import ScanError
from settled.workspace.verified import VerifiedRecord
from settled.workspace.xattrs import NOT_RECORDED

CHECKPOINT_RECEIPT_VERSION = "settled.receipt.checkpoint/v1"


class CheckpointUnverified(SettledError):
    """The manifest or an object it reaches did not read back exactly, even after a rescan:
    no checkpoint receipt is issued."""

    def __init__(self, manifest_id: str, problems: tuple[Problem, ...], why: str) -> None:
        named = "; ".join(str(problem) for problem in problems)
        super().__init__(f"manifest {manifest_id} did not read back: {named}. {why}")
        self.manifest_id, self.problems = manifest_id, problems


class Checkpoints:
    """The scans and checkpoints of a home's tasks: what `service.WorkspaceService` (the
    Runtime's and the close's way here) hands its checkpoint verbs to."""

    def __init__(self, home: str, store: Store, objects: ObjectStore | None = None) -> None:
        """``objects``: an object store chosen by the caller (a test's S3 bucket); by default
        the home's own (``open_object_store``)."""
        self.home, self.store = home, store
        self.objects: ObjectStore = objects if objects is not None else open_object_store(home)
        self._cache: NodeCache | None = None
        self._verified: VerifiedRecord | None = None
        self._indexes: dict[str, Index] = {}

    @property
    def cache(self) -> NodeCache:
        """The stat cache's nodes, opened at the first scan (most commands never scan)."""
        if self._cache is None:
            self._cache = NodeCache(os.path.join(self.home, "index.db"))
        return self._cache

    @property
    def verified(self) -> VerifiedRecord:
        """The verified-object record, beside the nodes (opened at the first read-back)."""
        if self._verified is None:
            self._verified = VerifiedRecord(os.path.join(self.home, "index.db"))
        return self._verified

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache = None
        if self._verified is not None:
            self._verified.close()
            self._verified = None

    # -- the journal ----------------------------------------------------------------------

    def socket(self) -> str:
        return journal_socket(self.home)

    def release(self, task: TaskRecord) -> None:
        """The close is done with this workspace: the journal stops watching it."""
        journal_lifecycle.release(self.socket(), task.task)

    def forget_journal(self, task: TaskRecord) -> None:
        """The task's creation is undone: no watch and no sequence state of it remain."""
        if not journal_lifecycle.release(self.socket(), task.task, forget=True):
            journal_lifecycle.forget_state(run_dir(self.home), task.task)

    # -- the final scan and the checkpoint ------------------------------------------------

    def final_scan(self, task: TaskRecord, *, incremental: bool = False) -> dict[str, Any]:
        """Scan after every session's death evidence; blobs and trees are durable when this
        returns (the stat-cache nodes need not be: a lost one costs a full scan).

        Full by default (what a close must do: the watcher is a hint, the scan is the proof).
        `incremental` re-lists only the directories the journal saw change since the last
        checkpoint, and only when the journal vouches for that whole interval; otherwise full.
        A stat cache that cannot be read is not an error: the scan runs without it, and says so.
        """
        rules = ignore.from_record(task.ignore_rules)  # bound at task new, never re-read
        expected = rootid.recorded(task.workspace_identity)  # the directory bound at task new
        watermark = journal_wire.barrier(self.socket(), task.task)
        started_at = time.time()
        latest = self.store.latest_checkpoint(task.task)
        previous, cache = self._previous(latest[1] if latest else None)
        only = None
        if incremental and previous is not None and watermark is not None:
            only = watermark.dirty_dirs if watermark.trustworthy else None
        vouches = self._vouches(task)
        try:
            result = scan(
                task.workspace, previous, self.objects, only=only, cache=self.cache,
                ignore=rules, list_published=True, vouches=vouches, expect=expected,
            )  # fmt: skip
        except IndexMismatch as error:
            cache, only = f"unusable, scanned without it: {error}", None
            result = scan(
                task.workspace, None, self.objects, cache=self.cache, ignore=rules,
                list_published=True, expect=expected,
            )  # fmt: skip
        started_ns = result.index.scan_started_ns
        self.cache.record_window(started_ns - CLOCK_SLACK_NS, started_ns, time.time_ns())
        faults.point("checkpoint.after_blobs")
        index_ref = result.index.ref
        self.cache.put_many([(index_ref, result.index.to_bytes())])
        self._indexes = {index_ref: result.index}  # the checkpoint step reads it next
        return {
            "published_ref": result.published_ref,
            "started_at": started_at,
            "watermark": watermark.seq if watermark else None,
            "journal": watermark.to_json() if watermark else {"running": False},
            **_journal_trust(watermark),
            "parent": latest[0]["manifest"] if latest else None,
            "index_ref": index_ref,
            "stat_cache": cache,
            "entries": result.index.count,
            "mode": "full" if only is None else "incremental",
            "mapped_writes": {
                "rule": cachetrust.RULE,
                "dirs_reread": result.stats.dirs_unvouched,
                **({} if only is None else {"not_covered": cachetrust.INCREMENTAL_GAP}),
            },
            "stats": dataclasses.asdict(result.stats),
            **({"ignore": rules.record()} if rules.patterns else {}),
        }

    def checkpoint_now(self, task: TaskRecord, *, incremental: bool = True) -> dict[str, Any]:
        """A checkpoint while the task is open (not a close): what the workspace holds now."""
        fact = self.final_scan(task, incremental=incremental)
        receipt = self.checkpoint(task, fact, [])
        if fact["watermark"] is not None:
            journal_wire.reset(self.socket(), task.task, int(fact["watermark"]))
        return {**receipt, "scan": {k: v for k, v in fact.items() if k != "index_ref"}}

    def checkpoint(
        self, task: TaskRecord, scan_fact: dict[str, Any], sessions: list[SessionRecord]
    ) -> dict[str, Any]:
        index = self._index(scan_fact["index_ref"])
        manifest = self._write_manifest(task, index, scan_fact)
        faults.point("checkpoint.after_manifest")
        faults.point("checkpoint.before_read_back")
        fresh, open_trees = self._fresh(scan_fact)
        with gc_paused():  # like the scan: ~100,000 objects re-read, none in a cycle
            check = self._read_back(manifest, index, fresh, open_trees)
        healed = None
        if not check.ok:
            healed, check, manifest = self._heal(task, index, scan_fact, check, fresh, open_trees)
        read_back_fact = check.summary(trusted_from=scan_fact["parent"])
        if healed is not None:
            read_back_fact["healed"] = healed
        receipt = seal(
            {
                "kind": "checkpoint",
                "v": CHECKPOINT_RECEIPT_VERSION,
                "authority": "workspace-service",
                "task": task.task,
                "manifest": manifest.digest,
                # the upload the read-back re-hashed: an S3 VersionId (v:...) or ETag
                # (etag:...); the local store keeps one copy, named by its digest
                "manifest_version": manifest.version,
                "parent": scan_fact["parent"],
                "algorithm": index.algorithm,
                "entries": index.count,
                "watermark": scan_fact["watermark"],
                "covers": {
                    **({"ignored": ignored} if (ignored := _ignore_fact(task)) else {}),
                    "scan_started_at": scan_fact["started_at"],
                    "not_recorded": list(NOT_RECORDED),
                    "terminal_mutations": {
                        s.session: (s.receipt or {}).get("terminal_mutation") for s in sessions
                    },
                },
                "read_back": read_back_fact,
                "generation": task.generation,
            }
        )
        self.store.record_checkpoint(task.task, task.generation, receipt, scan_fact["index_ref"])
        return receipt

    def _write_manifest(
        self, task: TaskRecord, index: Index, scan_fact: dict[str, Any]
    ) -> StoredObject:
        return publish_manifest(
            self.objects,
            index.algorithm,
            index.root,
            parent=scan_fact["parent"],
            watermark=scan_fact["watermark"],
            generation=task.generation,
            ignore=_ignore_fact(task),
        )

    def _fresh(self, scan_fact: dict[str, Any]) -> tuple[set[str], set[str] | None]:
        """What the scan published (never trusted: re-hashed), and the trees the read-back
        descends into: every tree after a full scan (None), the published ones after an
        incremental scan. A list that cannot be read back costs the closure, never trust."""
        try:
            ref = scan_fact["published_ref"]
            data = self.objects.read(ref)
            if digest_bytes(algorithm_of(ref), data) != ref:
                raise ValueError("the list does not hash to its name")
            published = json.loads(data)
            trees, blobs = set(published["trees"]), set(published["blobs"])
        except (ObjectMissing, ValueError, KeyError, TypeError, SettledError):
            return set(), None
        incremental = scan_fact.get("mode") == "incremental"
        return trees | blobs, trees if incremental else None

    def _read_back(
        self, manifest: StoredObject, index: Index, fresh: set[str], open_trees: set[str] | None
    ) -> ReadBack:
        return read_back(
            self.objects,
            manifest.digest,
            manifest_version=manifest.version,
            record=self.verified,
            index=index,
            root_tree=index.root.tree,
            fresh=fresh,
            open_trees=open_trees,
        )

    def _heal(
        self,
        task: TaskRecord,
        index: Index,
        scan_fact: dict[str, Any],
        first: ReadBack,
        fresh: set[str],
        open_trees: set[str] | None,
    ) -> tuple[dict[str, Any], ReadBack, StoredObject]:
        """Quarantine what is damaged, rescan without the stat cache (every file re-read and
        every absent object published again), write the same manifest and read it back again."""
        moved: dict[str, str | None] = {
            problem.object: self.objects.quarantine(problem.object)
            for problem in first.problems
            if problem.problem in QUARANTINABLE
        }
        quarantined = [{"object": key, "moved_to": path} for key, path in moved.items()]
        started_at = time.time()
        try:
            rules = ignore.from_record(task.ignore_rules)
            rescan = scan(
                task.workspace, None, self.objects, index.algorithm, ignore=rules,
                expect=rootid.recorded(task.workspace_identity),
            )  # fmt: skip
        except (ScanError, OSError) as error:
            why = f"The rescan that could have published them again failed: {error}"
            raise CheckpointUnverified(first.manifest_id, first.problems, why) from error
        healed: dict[str, Any] = {
            "problems": [problem.to_json() for problem in first.problems],
            "quarantined": quarantined,
            "rescan": {
                "started_at": started_at,
                "same_tree": rescan.index.root.tree == index.root.tree,
                **dataclasses.asdict(rescan.stats),
            },
        }
        suspects = fresh | {problem.object for problem in first.problems}
        try:
            manifest = self._write_manifest(task, index, scan_fact)
        except ManifestError as error:
            raise CheckpointUnverified(first.manifest_id, first.problems, str(error)) from None
        again = self._read_back(manifest, index, suspects, open_trees)
        if not again.ok:
            why = (
                "A rescan of the workspace without the stat cache did not publish these bytes "
                "again: the workspace no longer holds them"
                + ("" if healed["rescan"]["same_tree"] else " (it changed since the scan)")
            )
            found = {problem.object: problem for problem in first.problems}
            still = tuple(
                _as_found(p, found.get(p.object), moved.get(p.object)) for p in again.problems
            )
            raise CheckpointUnverified(manifest.digest, still, why)
        return healed, again, manifest

    def _vouches(self, task: TaskRecord) -> Vouches:
        """Whether a previous scan's rows are evidence now (``cachetrust``), given every
        session of this task and of the tasks sharing its workspace, as the store has them."""
        writers = [
            (session.created_at, session.settled_at)
            for owner in (task.task, *self.store.workspace_shares(task.task))
            for session in self.store.list_sessions(owner)
        ]
        now_ns = time.time_ns()

        @functools.cache
        def judged(trusted_before_ns: int, magic: int) -> bool:
            window = self.cache.window(trusted_before_ns)
            return cachetrust.vouches(window, writers, now_ns, magic)

        return judged

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


WorkspaceService = Checkpoints  # the name bench/close_phases.py profiles it by


def _as_found(now: Problem, first: Problem | None, moved_to: str | None) -> Problem:
    """An object still wrong after the heal, as the first read-back found it (a damaged one
    is missing now only because it was quarantined), and where its bytes were moved."""
    if first is None or moved_to is None:
        return now
    detail = "; ".join(part for part in (first.detail, f"quarantined as {moved_to}") if part)
    return Problem(first.object, first.problem, now.paths or first.paths, detail)


def _ignore_fact(task: TaskRecord) -> dict[str, Any] | None:
    """The task's bound ignore rules as manifests and receipts carry them; None without any."""
    rules = ignore.from_record(task.ignore_rules)
    return rules.record() if rules.patterns else None


def _journal_trust(watermark: journal_wire.Watermark | None) -> dict[str, Any]:
    """Whether the journal vouched for the interval, and if not, why (a kernel that refused
    the watches or the inotify instance, an overflow, a restart, no journal at all): the
    scan fact says it, whatever the scan's mode."""
    if watermark is None:
        return {"journal_trusted": False, "journal_untrusted_because": ["no journal answered"]}
    return {
        "journal_trusted": watermark.trustworthy,
        "journal_untrusted_because": [] if watermark.trustworthy else list(watermark.reasons),
    }
