"""checkpoint: `Runtime.checkpoint` against `git add -A && git commit` on a copy of the same tree.

Two trees under /tmp, built from a seed (text-like content, every file unique): 10,000 files of
100 KiB in 100 directories, and 100,000 files of ~100 B in 1,000 directories (--quick: 1,000 and
10,000 files). Each is copied (`cp -a`, same filesystem, before any timing) for git.

- Full: `rt.checkpoint(task, incremental=False)` on a fresh home (the first checkpoint publishes
  and fsyncs every blob, then re-hashes every added blob in the read-back) against `git init &&
  git add -A && git commit` on the copy (its `.git` removed before each run), interleaved, order
  alternating. git runs as installed (loose objects zlib-compressed, not fsynced) and, as a second
  baseline, with `core.fsync=added` and `core.fsyncMethod=batch` (durable like settled). Both with
  `gc.auto=0` and `maintenance.auto=false`: a detached auto-gc would outlive the timing.
- Incremental (100k tree): after changing the same 100 files (one in each of 100 directories) in
  both trees, `rt.checkpoint(task)` (journal-driven: re-lists only the directories the journal saw
  change; the receipt must say `mode: incremental`) and, after another such change,
  `rt.checkpoint(task, incremental=False)` (a full stat walk that re-reads only what the stat
  cache cannot vouch for), each against `git add -A && git commit` after the same change. A sweep
  of change sizes shows the incremental cost follows the change, not the tree.
- Full stat walk of the unchanged tree (right after the full checkpoints, before any change):
  the scan step of a full checkpoint (`WorkspaceService.final_scan`, stat cache in memory)
  against `git status` on the copy, whose index the last `git add -A` left fresh; interleaved,
  order alternating.
- Rescan with no change, in the same process, right after the full checkpoints (before any
  change): both modes against `git add -A` (nothing to add).

`os.sync()` before every timed call, so nobody pays for the other's dirty pages. Nothing is
deleted before the end (`Trash`): on this ext4 without a journal, files created soon after a
large deletion cost several times more, and that would charge one side for the other's cleanup.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from common import (
    MARK_ENV,
    await_exit,
    distribution,
    fmt,
    fs_of,
    header,
    kill_marked,
    log,
    machine,
    md_table,
    median,
    scratch,
    source_revision,
)

SEED = 20_261_202
BIG = "big"
SMALL = "small"
FULL = {
    BIG: {"files": 10_000, "dirs": 100, "size": 100 * 1024, "runs": 3},
    SMALL: {"files": 100_000, "dirs": 1_000, "size": 100, "runs": 2},
    "changed": 100,
    "incremental_runs": 3,
    "sweep": [10, 100, 1_000, 10_000],
    "rescan_runs": 3,
    "walk_runs": 6,
}
QUICK = {
    BIG: {"files": 1_000, "dirs": 10, "size": 100 * 1024, "runs": 1},
    SMALL: {"files": 10_000, "dirs": 100, "size": 100, "runs": 1},
    "changed": 100,
    "incremental_runs": 1,
    "sweep": [10, 1_000],
    "rescan_runs": 2,
    "walk_runs": 4,
}
GIT_TIMEOUT_S = 900.0
GIT_QUIET = {"gc.auto": "0", "maintenance.auto": "false"}
GIT_DURABLE = {**GIT_QUIET, "core.fsync": "added", "core.fsyncMethod": "batch"}
WORD_TEXT = (
    "def class return self import from for while if elif else try except finally with as "
    "None True False value index path data result items key name count total error buffer "
    "open read write close append extend len range print raise assert lambda yield async "
    "await = == != + - * / % ( ) [ ] { } : , . 0 1 2 42 100 'x' \"y\" # TODO the of and to"
)
WORDS = tuple(WORD_TEXT.split())


# -- trees ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def text_pool(seed: int, size: int) -> bytes:
    """Source-like text (indented lines of tokens): zlib shrinks it about 3x, like code."""
    rng = random.Random(seed)
    lines, n = [], 0
    while n < size:
        line = "    " * rng.randint(0, 3) + " ".join(rng.choices(WORDS, k=rng.randint(2, 12)))
        lines.append(line)
        n += len(line) + 1
    return ("\n".join(lines) + "\n").encode()[:size]


class Tree:
    """`files` files in `dirs` directories (d0000/f000000.txt, contiguous blocks per dir).

    Each file is a header naming the seed, the file and a tag, then a slice of a 1 MiB text pool
    at an offset drawn from the seed: unique, deterministic, and cheap to make."""

    def __init__(self, root: str, files: int, dirs: int, size: int, seed: int) -> None:
        self.root, self.files, self.dirs, self.size, self.seed = root, files, dirs, size, seed
        self.per_dir = files // dirs
        self.pool = text_pool(SEED, (1 << 20) + size)
        self.rng = random.Random(seed + 1)

    def rel(self, i: int) -> str:
        return f"d{i // self.per_dir:04d}/f{i:06d}.txt"

    def content(self, i: int, tag: str) -> bytes:
        head = f"# seed {self.seed} file {i} {tag}\n".encode()
        body = max(0, self.size - len(head))
        offset = self.rng.randrange(len(self.pool) - body)
        return head + self.pool[offset : offset + body]

    def build(self) -> None:
        for d in range(self.dirs):
            os.mkdir(os.path.join(self.root, f"d{d:04d}"))
        for i in range(self.files):
            with open(os.path.join(self.root, self.rel(i)), "wb") as handle:
                handle.write(self.content(i, "v0"))

    def spread(self, n: int, salt: int) -> list[int]:
        """`n` file indexes spread evenly over the tree (so over min(n, dirs) directories)."""
        spacing = max(1, self.files // n)
        shift = (salt * 13) % min(self.per_dir, spacing)
        return [(k * self.files // n + shift) % self.files for k in range(n)]

    def change(self, indexes: list[int], tag: str, *roots: str) -> None:
        """Rewrite the files (same size, new content) identically under every root."""
        for i in indexes:
            data = self.content(i, tag)
            for root in roots:
                with open(os.path.join(root, self.rel(i)), "wb") as handle:
                    handle.write(data)


# -- git --------------------------------------------------------------------------------


def git_env(config: dict[str, str], token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") and k != "SETTLED_HOME"}
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL="/dev/null",
        GIT_AUTHOR_NAME="bench",
        GIT_AUTHOR_EMAIL="bench@example.invalid",
        GIT_COMMITTER_NAME="bench",
        GIT_COMMITTER_EMAIL="bench@example.invalid",
        GIT_CONFIG_COUNT=str(len(config)),
    )
    env[MARK_ENV] = token
    for n, (key, value) in enumerate(config.items()):
        env[f"GIT_CONFIG_KEY_{n}"], env[f"GIT_CONFIG_VALUE_{n}"] = key, value
    return env


class Trash:
    """Where the benchmark moves what it is done with, deleted only at its end: this ext4 has
    no journal, and its inode allocator reads the table entry of every inode freed in the last
    60 s (360 s while its block is dirty) before it reuses one, so whoever creates files after
    a large deletion pays for it (100,000 files created after 100,000 deleted: several times
    slower). No timed call follows a deletion of the benchmark's own."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.count = 0
        os.makedirs(root, exist_ok=True)

    def put(self, path: str) -> None:
        if os.path.lexists(path):
            self.count += 1
            os.rename(path, os.path.join(self.root, f"{self.count:04d}-{os.path.basename(path)}"))


class Git:
    """git on the copy, every process marked; stragglers are killed and counted in `left`."""

    def __init__(self, repo: str, trash: Trash) -> None:
        self.repo, self.trash = repo, trash
        self.token = f"{os.getpid()}-checkpoint-git-{os.urandom(4).hex()}"
        self.left = 0

    def _run(self, config: dict[str, str], *commands: list[str]) -> float:
        env = git_env(config, self.token)
        os.sync()
        started = time.perf_counter()
        try:
            for argv in commands:
                subprocess.run(
                    ["git", *argv],
                    cwd=self.repo,
                    env=env,
                    check=True,
                    timeout=GIT_TIMEOUT_S,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                )
            return time.perf_counter() - started
        finally:
            self.left += len(kill_marked(self.token))

    def fresh_commit(self, config: dict[str, str]) -> float:
        self.trash.put(os.path.join(self.repo, ".git"))
        return self._run(
            config, ["init", "-q"], ["add", "-A"], ["commit", "-q", "--no-verify", "-m", "x"]
        )

    def commit(self) -> float:
        return self._run(GIT_QUIET, ["add", "-A"], ["commit", "-q", "--no-verify", "-m", "x"])

    def add(self) -> float:
        return self._run(GIT_QUIET, ["add", "-A"])

    def status(self) -> float:
        """`git status` (untracked files looked for too) against its index, fresh from the
        last `git add -A` on this copy: git's stat walk of the tree."""
        return self._run(GIT_QUIET, ["status", "--porcelain"])


# -- settled ----------------------------------------------------------------------------


class Settled:
    """A fresh home with one task on the tree; times `Runtime.checkpoint` and its final scan."""

    def __init__(self, home: str, tree: str, trash: Trash) -> None:
        from settled.runtime import Runtime
        from settled.workspace.journal import wire as journal_wire

        self.home, self.trash = home, trash
        self.rt = Runtime(home)
        self.task = self.rt.new_task(tree)
        self.socket = self.rt.workspace.socket()
        self.journal_pid = (journal_wire.ping(self.socket) or {}).get("pid")
        self.scan_s = 0.0
        self._time_scans(self.rt)

    def _time_scans(self, rt: Any) -> None:
        original: Callable[..., dict[str, Any]] = rt.workspace.final_scan

        def timed_scan(*args: Any, **kwargs: Any) -> dict[str, Any]:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.scan_s = time.perf_counter() - t0

        rt.workspace.final_scan = timed_scan

    def stat_walk(self) -> dict[str, Any]:
        """A full checkpoint of the unchanged tree, timed in its scan step
        (`WorkspaceService.final_scan`, what a close runs after death evidence) with the stat
        cache of the last checkpoint in memory: every directory listed, every entry lstat'd,
        nothing re-read that the cache vouches for. The whole checkpoint's time is kept too
        (its read-back checks each of the objects the manifest reaches)."""
        row = self.checkpoint(incremental=False)
        if row["mode"] != "full":
            raise RuntimeError(f"a full checkpoint reported mode {row['mode']}")
        return {"settled_s": row["scan_s"], "checkpoint_s": row["settled_s"], "stats": row["stats"]}

    def checkpoint(self, incremental: bool) -> dict[str, Any]:
        os.sync()
        started = time.perf_counter()
        receipt = self.rt.checkpoint(self.task.task, incremental=incremental)
        return self._row(receipt, time.perf_counter() - started, self.scan_s)

    def checkpoint_cold(self) -> dict[str, Any]:
        """A new Runtime on the same home: nothing of the stat cache is in memory."""
        from settled.runtime import Runtime

        os.sync()
        started = time.perf_counter()
        rt = Runtime(self.home)
        try:
            self._time_scans(rt)
            receipt = rt.checkpoint(self.task.task)
            elapsed = time.perf_counter() - started
        finally:
            rt.close()
        return self._row(receipt, elapsed, self.scan_s)

    def checkpoint_cli(self, token: str) -> dict[str, Any]:
        """`settled checkpoint TASK --json` in a new process, like an agent's tool call."""
        env = {k: v for k, v in os.environ.items() if k != "SETTLED_HOME"}
        env[MARK_ENV] = token
        argv = [sys.executable, "-m", "settled", "--home", self.home, "checkpoint"]
        os.sync()
        started = time.perf_counter()
        done = subprocess.run(
            [*argv, self.task.task, "--json"], env=env, capture_output=True, text=True,
            timeout=GIT_TIMEOUT_S, check=True,
        )  # fmt: skip
        elapsed = time.perf_counter() - started
        return self._row(json.loads(done.stdout), elapsed, None)

    @staticmethod
    def _row(receipt: dict[str, Any], elapsed: float, scan_s: float | None) -> dict[str, Any]:
        read_back = receipt["read_back"]  # an incremental one that reused subtrees is not
        whole_or_said = read_back["verified"] or "unchecked" in read_back  # verified: it says
        if read_back["problems_found"] or not whole_or_said:
            raise RuntimeError(f"checkpoint {receipt['manifest']} did not read back")
        scan = receipt["scan"]
        return {
            "settled_s": elapsed,
            "scan_s": scan_s,
            "manifest_and_read_back_s": None if scan_s is None else elapsed - scan_s,
            "mode": scan["mode"],
            "entries": scan["entries"],
            "trustworthy": scan["journal"].get("trustworthy"),
            "dirty_dirs": len(scan["journal"].get("dirty_dirs", [])),
            "stats": scan["stats"],
            "read_back": receipt["read_back"],
            "blobs_verified": receipt["read_back"]["blobs_verified"],
        }

    def close(self) -> None:
        from settled.workspace.journal import lifecycle as journal_lifecycle

        try:
            journal_lifecycle.stop(self.socket)
        finally:
            self.rt.close()
        if not await_exit(self.journal_pid, 10.0):
            log(f"warning: journal pid {self.journal_pid} still runs 10 s after stop")
        self.trash.put(self.home)


@contextlib.contextmanager
def settled_home(home: str, tree: str, trash: Trash) -> Iterator[Settled]:
    rig = Settled(home, tree, trash)
    try:
        yield rig
    finally:
        rig.close()


def _load1() -> float:
    with open("/proc/loadavg") as handle:
        return float(handle.read().split()[0])


# -- the parts --------------------------------------------------------------------------


def _prepare(root: str, kind: str, p: dict[str, Any], trash: Trash) -> tuple[Tree, str, Git]:
    tree_dir, copy = os.path.join(root, kind, "tree"), os.path.join(root, kind, "git")
    os.makedirs(tree_dir)
    tree = Tree(tree_dir, p["files"], p["dirs"], p["size"], SEED + p["files"])
    t0 = time.perf_counter()
    tree.build()
    subprocess.run(["cp", "-a", tree_dir, copy], check=True, timeout=GIT_TIMEOUT_S)
    log(
        f"checkpoint: built {kind} tree ({p['files']} x {p['size']} B in {p['dirs']} dirs) and "
        f"its copy in {time.perf_counter() - t0:.1f} s"
    )
    return tree, copy, Git(copy, trash)


def _full_runs(
    root: str, kind: str, p: dict[str, Any], tree: Tree, git: Git
) -> tuple[list[dict[str, Any]], Settled]:
    """Full checkpoints on fresh homes; the last home stays open (returned) for more parts."""
    runs: list[dict[str, Any]] = []
    keep: Settled | None = None
    for i in range(p["runs"]):
        rig = Settled(os.path.join(root, kind, f"home-{i}"), tree.root, git.trash)
        try:
            row: dict[str, Any] = {"run": i + 1, "load1": _load1()}
            row["order"] = "git first" if i % 2 == 0 else "settled first"
            if i % 2 == 0:
                row["git_s"] = git.fresh_commit(GIT_QUIET)
                row["git_durable_s"] = git.fresh_commit(GIT_DURABLE)
                row.update(rig.checkpoint(incremental=False))
            else:
                row.update(rig.checkpoint(incremental=False))
                row["git_durable_s"] = git.fresh_commit(GIT_DURABLE)
                row["git_s"] = git.fresh_commit(GIT_QUIET)
        except BaseException:
            rig.close()
            raise
        if row["mode"] != "full":
            raise RuntimeError(f"a full checkpoint reported mode {row['mode']}")
        row["ratio"] = row["settled_s"] / row["git_s"]
        row["ratio_durable"] = row["settled_s"] / row["git_durable_s"]
        runs.append(row)
        st = row["stats"]
        log(
            f"checkpoint {kind} full {i + 1}/{p['runs']}: git {row['git_s']:.2f} s, git durable "
            f"{row['git_durable_s']:.2f} s, settled {row['settled_s']:.2f} s (scan "
            f"{row['scan_s']:.2f} s), x{row['ratio']:.2f}; hashed {st['files_hashed']}, "
            f"blobs {st['blobs_written']}"
        )
        if i == p["runs"] - 1:
            keep = rig
        else:
            rig.close()
    assert keep is not None
    return runs, keep


VARIANTS = ("incremental", "full", "cold", "cli")
CALLS = {
    "incremental": "`rt.checkpoint(task)`",
    "full": "`rt.checkpoint(task, incremental=False)`",
    "cold": "`Runtime(home).checkpoint(task)`",
    "cli": "`settled checkpoint TASK` (new process)",
}


def _incremental_runs(
    rig: Settled, tree: Tree, git: Git, p: dict[str, Any], start: int
) -> list[dict[str, Any]]:
    """Each measurement follows its own change of p['changed'] files, applied to both trees."""
    runs: list[dict[str, Any]] = []
    salt = start
    for j in range(p["incremental_runs"]):
        for variant in VARIANTS if j % 2 == 0 else tuple(reversed(VARIANTS)):
            salt += 1
            files = tree.spread(p["changed"], salt)
            tree.change(files, f"change-{salt}", tree.root, git.repo)
            row: dict[str, Any] = {"run": j + 1, "changed": len(files), "load1": _load1()}
            if variant == "cold":
                row.update(rig.checkpoint_cold())
            elif variant == "cli":
                row.update(rig.checkpoint_cli(git.token))
                git.left += len(kill_marked(git.token))
            else:
                row.update(rig.checkpoint(incremental=variant == "incremental"))
            row["git_s"] = git.commit()
            row["asked"] = variant
            row["ratio"] = row["settled_s"] / row["git_s"]
            runs.append(row)
            st = row["stats"]
            log(
                f"checkpoint incremental {j + 1}/{p['incremental_runs']} ({variant} -> "
                f"{row['mode']}): settled {row['settled_s'] * 1000:.0f} ms, git "
                f"{row['git_s'] * 1000:.0f} ms; dirs listed {st['dirs_listed']}, hashed "
                f"{st['files_hashed']}, trees built {st['trees_built']}"
            )
    return runs


def _sweep(
    rig: Settled, tree: Tree, git: Git, sizes: list[int], start: int
) -> list[dict[str, Any]]:
    runs = []
    for n, size in enumerate(sizes):
        files = tree.spread(min(size, tree.files), start + n)
        tree.change(files, f"sweep-{start + n}", tree.root, git.repo)
        row: dict[str, Any] = {"changed": len(files), "load1": _load1()}
        row.update(rig.checkpoint(incremental=True))
        row["git_s"] = git.commit()
        row["ratio"] = row["settled_s"] / row["git_s"]
        runs.append(row)
        log(
            f"checkpoint sweep {len(files)} changed: settled ({row['mode']}) "
            f"{row['settled_s'] * 1000:.0f} ms, git {row['git_s'] * 1000:.0f} ms"
        )
    return runs


def _stat_walks(rig: Settled, git: Git, kind: str, runs_n: int) -> list[dict[str, Any]]:
    """The full stat walk of the unchanged tree against `git status`, interleaved."""
    runs = []
    rig.stat_walk()  # the nodes of the last checkpoint's index, loaded once as any scan has them
    git.status()  # and git's index read once, like the page cache of both trees
    for j in range(runs_n):
        row: dict[str, Any] = {"run": j + 1, "load1": _load1()}
        row["order"] = "git first" if j % 2 == 0 else "settled first"
        if j % 2 == 0:
            row["git_status_s"] = git.status()
            row.update(rig.stat_walk())
        else:
            row.update(rig.stat_walk())
            row["git_status_s"] = git.status()
        row["ratio"] = row["settled_s"] / row["git_status_s"]
        runs.append(row)
        log(
            f"checkpoint {kind} stat walk {j + 1}/{runs_n}: settled {row['settled_s'] * 1000:.0f} "
            f"ms ({row['stats']['walker']}), git status {row['git_status_s'] * 1000:.0f} ms, "
            f"x{row['ratio']:.2f}"
        )
    return runs


def _rescans(rig: Settled, git: Git, kind: str, runs_n: int) -> list[dict[str, Any]]:
    runs = []
    for j in range(runs_n):
        inc = rig.checkpoint(incremental=True)
        full = rig.checkpoint(incremental=False)
        row = {
            "run": j + 1,
            "load1": _load1(),
            "incremental": inc,
            "full": full,
            "git_add_s": git.add(),
        }
        row["ratio_incremental"] = inc["settled_s"] / row["git_add_s"]
        row["ratio_full"] = full["settled_s"] / row["git_add_s"]
        runs.append(row)
        log(
            f"checkpoint {kind} rescan {j + 1}/{runs_n}: incremental ({inc['mode']}) "
            f"{inc['settled_s'] * 1000:.1f} ms, full {full['settled_s'] * 1000:.0f} ms, git add "
            f"{row['git_add_s'] * 1000:.0f} ms"
        )
    return runs


def run(quick: bool) -> tuple[dict[str, Any], str]:
    p = QUICK if quick else FULL
    data: dict[str, Any] = {
        "benchmark": "checkpoint",
        "quick": quick,
        "machine": machine(),
        "revision": source_revision(),
        "params": {**p, "seed": SEED},
        "git_version": subprocess.run(
            ["git", "--version"], capture_output=True, text=True, check=True
        ).stdout.strip(),
        "git_config": {"default": GIT_QUIET, "durable": GIT_DURABLE},
    }
    git_left = 0
    with scratch("checkpoint") as root:
        data["filesystem"] = fs_of(root)
        trash = Trash(os.path.join(root, "trash"))
        for kind in (BIG, SMALL):
            tree, _copy, git = _prepare(root, kind, p[kind], trash)
            part: dict[str, Any] = {"params": p[kind]}
            try:
                full, rig = _full_runs(root, kind, p[kind], tree, git)
                part["full"] = full
                with contextlib.ExitStack() as stack:
                    stack.callback(rig.close)
                    part["stat_walk"] = _stat_walks(rig, git, kind, p["walk_runs"])
                    part["rescan"] = _rescans(rig, git, kind, p["rescan_runs"])
                    if kind == SMALL:
                        part["incremental"] = _incremental_runs(rig, tree, git, p, 0)
                        part["sweep"] = _sweep(rig, tree, git, p["sweep"], 1000)
            finally:
                git_left += git.left
            data[kind] = part
            trash.put(os.path.join(root, kind))  # deleted with the scratch dir, at the end
    data["git_left"] = git_left
    data["summary"] = summarize(data)
    return data, render(data)


# -- summary and tables -----------------------------------------------------------------


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in (BIG, SMALL):
        full = data[kind]["full"]
        out[kind] = {
            "git_s": median([r["git_s"] for r in full]),
            "git_durable_s": median([r["git_durable_s"] for r in full]),
            "settled_s": median([r["settled_s"] for r in full]),
            "ratio": median([r["ratio"] for r in full]),
            "ratio_durable": median([r["ratio_durable"] for r in full]),
        }
        walks = data[kind]["stat_walk"]
        out[kind]["stat_walk"] = {
            "settled_s": distribution([r["settled_s"] for r in walks]),
            "git_status_s": distribution([r["git_status_s"] for r in walks]),
            "ratio": median([r["ratio"] for r in walks]),
        }
        rescan = data[kind]["rescan"]
        out[kind]["rescan"] = {
            "incremental_s": median([r["incremental"]["settled_s"] for r in rescan]),
            "full_s": median([r["full"]["settled_s"] for r in rescan]),
            "git_add_s": median([r["git_add_s"] for r in rescan]),
        }
    inc = data[SMALL]["incremental"]
    for asked in VARIANTS:
        rows = [r for r in inc if r["asked"] == asked]
        out[f"after_change_{asked}"] = {
            "settled_s": distribution([r["settled_s"] for r in rows]),
            "git_s": distribution([r["git_s"] for r in rows]),
            "ratio": median([r["ratio"] for r in rows]),
            "modes": sorted({r["mode"] for r in rows}),
        }
    return out


def _kind_title(p: dict[str, Any]) -> str:
    size = f"{p['size'] // 1024} KiB" if p["size"] >= 1024 else f"~{p['size']} B"
    return f"{p['files']:,} files x {size} in {p['dirs']:,} dirs"


def _follows(rows: list[dict[str, Any]], entries: int) -> str:
    """Say in numbers how an incremental checkpoint's cost moves with the change."""
    inc = [r for r in rows if r["mode"] == "incremental" and r["scan_s"] is not None]
    if not inc:
        return "No incremental checkpoint was measured (the journal never vouched)."
    few = min(inc, key=lambda r: r["changed"])
    many = max(inc, key=lambda r: r["changed"])

    def part(r: dict[str, Any]) -> str:
        st, rb = r["stats"], r["read_back"]
        return (
            f"{r['changed']} changed files: {fmt(r['settled_s'] * 1000, 0)} ms in all, scan "
            f"{fmt(r['scan_s'] * 1000, 0)} ms ({st['dirs_listed']} dirs listed, "
            f"{st['files_hashed']} files hashed, {st['trees_built']} trees and "
            f"{st['nodes_built']} nodes built), manifest and read-back "
            f"{fmt(r['manifest_and_read_back_s'] * 1000, 0)} ms ({rb['trees_verified']} trees "
            f"and {rb['blobs_verified']} blobs re-hashed, {rb['trusted']} objects unchanged "
            f"since verified, {rb['trusted_subtrees']} reused subtrees trusted from the parent)"
        )

    return (
        f"In a tree of {entries:,} entries: {part(few)}; against {part(many)}. What the "
        "checkpoint lists, hashes, builds and reads back is counted in directories and files "
        "touched by the change; nothing is proportional to the entries it did not touch."
    )


def _read_back_cell(rb: dict[str, Any]) -> str:
    """What the read-back checked: objects reached, re-hashed, trusted unchanged since verified,
    and (incremental) reused subtrees whose contents it trusted from the parent checkpoint."""
    cell = f"{rb['objects_reached']} / {rb['rehashed']} / {rb['trusted']}"
    return cell + (f" (+{rb['trusted_subtrees']})" if rb["trusted_subtrees"] else "")


def _mb(stats: dict[str, Any]) -> str:
    return fmt(stats["bytes_read"] / 1e6, 1)


def render(data: dict[str, Any]) -> str:
    s, p = data["summary"], data["params"]
    fs = data["filesystem"]
    parts = [
        header("checkpoint", data) + f" Source `{data['revision']}`.",
        f"`Runtime.checkpoint` (blake3, blobs fsynced, manifest read back) against "
        f"{data['git_version']} on a copy of the same tree (`cp -a`, same filesystem: "
        f"`{fs['mount']}`, {fs['type']}, {fs['device']}), `os.sync()` before every timed call, "
        "warm page cache. git as installed: loose objects zlib-compressed and **not fsynced**; "
        "'git durable' adds `core.fsync=added`, `core.fsyncMethod=batch`. Both with `gc.auto=0`, "
        "`maintenance.auto=false` (a detached auto-gc would outlive the timing). Trees are "
        "source-like text from a seed, every file unique. Ratio = settled / git (below 1: "
        "settled is faster).",
    ]
    rows = []
    for kind in (BIG, SMALL):
        for r in data[kind]["full"]:
            st = r["stats"]
            rows.append(
                [
                    _kind_title(data[kind]["params"]),
                    r["run"],
                    r["order"],
                    fmt(r["git_s"], 2),
                    fmt(r["git_durable_s"], 2),
                    fmt(r["settled_s"], 2),
                    fmt(r["scan_s"], 2),
                    fmt(r["manifest_and_read_back_s"], 2),
                    fmt(r["ratio"]),
                    fmt(r["ratio_durable"]),
                    st["files_hashed"],
                    st["blobs_written"],
                    st.get("objects_grouped", "-"),
                    _mb(st),
                    fmt(r["load1"], 1),
                ]
            )
    parts += [
        "### Full checkpoint, fresh home (every blob published)",
        "Past the first 8 objects of a publish, objects are staged into one pack per publish "
        "(`objects grouped`): the pack fsynced, then its index written, fsynced and linked, "
        "then the directory fsynced; objects over 1 MiB get a file and an fsync each. The "
        "read-back re-reads each pack's objects between one pair of fstats of it.",
        md_table(
            [
                "tree",
                "run",
                "order",
                "git init+add+commit s",
                "git durable s",
                "settled s",
                "of which scan+publish s",
                "manifest + read-back s",
                "ratio",
                "ratio vs durable",
                "files hashed",
                "blobs written",
                "objects grouped",
                "MB read",
                "load (1 min)",
            ],
            rows,
        ),
        md_table(
            [
                "tree",
                "median git s",
                "median git durable s",
                "median settled s",
                "median ratio",
                "median ratio vs durable",
            ],
            [
                [
                    _kind_title(data[kind]["params"]),
                    fmt(s[kind]["git_s"], 2),
                    fmt(s[kind]["git_durable_s"], 2),
                    fmt(s[kind]["settled_s"], 2),
                    fmt(s[kind]["ratio"]),
                    fmt(s[kind]["ratio_durable"]),
                ]
                for kind in (BIG, SMALL)
            ],
        ),
    ]
    inc_rows = []
    for r in data[SMALL]["incremental"]:
        st = r["stats"]
        inc_rows.append(
            [
                r["run"],
                CALLS[r["asked"]],
                r["mode"],
                fmt(r["settled_s"] * 1000, 1),
                "-" if r["scan_s"] is None else fmt(r["scan_s"] * 1000, 1),
                st["dirs_listed"],
                st["files_hashed"],
                st["entries_reused"],
                st["entries_carried"],
                st["trees_built"],
                r["read_back"]["trees_verified"],
                _read_back_cell(r["read_back"]),
                fmt(r["git_s"] * 1000, 1),
                fmt(r["ratio"]),
                fmt(r["load1"], 1),
            ]
        )
    small = _kind_title(data[SMALL]["params"])
    parts += [
        f"### After changing {p['changed']} files ({small}; one file in each of "
        f"{min(p['changed'], data[SMALL]['params']['dirs'])} directories)",
        "Every row follows its own change of the same size, applied to both trees; git is "
        "`git add -A && git commit` after that change (two new processes). `dirs listed` and "
        "`files hashed` are the scan's own counters: the incremental scan lists only the "
        "directories the journal reported dirty, the full one every directory. A cold "
        "checkpoint reads the stat cache from the object store (the nodes on the paths to the "
        "dirty directories); the CLI row adds a new interpreter and its imports. The read-back "
        "of a full scan checks every object the manifest reaches (re-hashed, or trusted: an "
        "lstat shows it unchanged since it last hashed right); an incremental one checks what "
        "the new trees name and trusts the reused subtrees' contents from the parent.",
        md_table(
            [
                "run",
                "call",
                "mode",
                "settled ms",
                "of which scan ms",
                "dirs listed",
                "files hashed",
                "entries reused (stat cache)",
                "entries carried",
                "trees built",
                "trees read back",
                "read-back: reached / re-hashed / trusted (+ subtrees)",
                "git add+commit ms",
                "ratio",
                "load (1 min)",
            ],
            inc_rows,
        ),
        md_table(
            ["after the change", "settled p50 ms", "settled max ms", "git p50 ms", "median ratio"],
            [
                [
                    CALLS[asked] + (" (full stat walk)" if asked == "full" else ""),
                    fmt(s[f"after_change_{asked}"]["settled_s"]["p50"] * 1000, 1),
                    fmt(s[f"after_change_{asked}"]["settled_s"]["max"] * 1000, 1),
                    fmt(s[f"after_change_{asked}"]["git_s"]["p50"] * 1000, 1),
                    fmt(s[f"after_change_{asked}"]["ratio"]),
                ]
                for asked in VARIANTS
            ],
        ),
        "Incremental cost against the size of the change (same tree, one run each, files spread "
        "evenly over the directories):",
        md_table(
            [
                "files changed",
                "mode",
                "settled ms",
                "of which scan ms",
                "manifest + read-back ms",
                "dirs listed",
                "files hashed",
                "trees built",
                "git ms",
                "ratio",
                "load (1 min)",
            ],
            [
                [
                    r["changed"],
                    r["mode"],
                    fmt(r["settled_s"] * 1000, 1),
                    fmt(r["scan_s"] * 1000, 1),
                    fmt(r["manifest_and_read_back_s"] * 1000, 1),
                    r["stats"]["dirs_listed"],
                    r["stats"]["files_hashed"],
                    r["stats"]["trees_built"],
                    fmt(r["git_s"] * 1000, 1),
                    fmt(r["ratio"]),
                    fmt(r.get("load1"), 1),
                ]
                for r in data[SMALL]["sweep"]
            ],
        ),
        _follows(
            data[SMALL]["sweep"] + data[SMALL]["incremental"],
            data[SMALL]["incremental"][0]["entries"],
        ),
    ]
    walk_rows = []
    for kind in (BIG, SMALL):
        for r in data[kind]["stat_walk"]:
            st = r["stats"]
            walk_rows.append(
                [
                    _kind_title(data[kind]["params"]),
                    r["run"],
                    r["order"],
                    fmt(r["settled_s"] * 1000, 1),
                    fmt(r["git_status_s"] * 1000, 1),
                    fmt(r["ratio"]),
                    fmt(r["checkpoint_s"] * 1000, 1),
                    st["dirs_listed"],
                    st["entries_reused"],
                    st["files_hashed"],
                    st.get("walker", "-"),
                    fmt(r["load1"], 1),
                ]
            )
    parts += [
        "### Full stat walk of the unchanged tree",
        "settled: the scan step of `rt.checkpoint(task, incremental=False)` on the unchanged "
        "tree, `WorkspaceService.final_scan` (journal barrier, every directory listed and every "
        "entry lstat'd by the walker, the stat cache of the last checkpoint applied, the index "
        "recorded); the whole checkpoint (manifest, and a read-back that checks every object "
        "the manifest reaches, each unchanged since it last hashed right or re-hashed) beside "
        "it. git: `git status --porcelain` on the copy, whose index the last `git add -A` "
        "wrote (git's stat cache, fresh), untracked files looked for too; a new process each "
        "time, as git always is. Interleaved, order alternating.",
        md_table(
            [
                "tree",
                "run",
                "order",
                "settled scan ms",
                "git status ms",
                "ratio",
                "whole checkpoint ms",
                "dirs listed",
                "entries reused",
                "files hashed",
                "walker",
                "load (1 min)",
            ],
            walk_rows,
        ),
        md_table(
            ["tree", "settled p50 ms", "settled max ms", "git status p50 ms", "median ratio"],
            [
                [
                    _kind_title(data[kind]["params"]),
                    fmt(s[kind]["stat_walk"]["settled_s"]["p50"] * 1000, 1),
                    fmt(s[kind]["stat_walk"]["settled_s"]["max"] * 1000, 1),
                    fmt(s[kind]["stat_walk"]["git_status_s"]["p50"] * 1000, 1),
                    fmt(s[kind]["stat_walk"]["ratio"]),
                ]
                for kind in (BIG, SMALL)
            ],
        ),
    ]
    resc_rows = []
    for kind in (BIG, SMALL):
        for r in data[kind]["rescan"]:
            inc, full = r["incremental"], r["full"]
            resc_rows.append(
                [
                    _kind_title(data[kind]["params"]),
                    r["run"],
                    fmt(inc["settled_s"] * 1000, 1),
                    fmt(inc["scan_s"] * 1000, 1),
                    inc["stats"]["dirs_listed"],
                    fmt(full["settled_s"] * 1000, 1),
                    fmt(full["scan_s"] * 1000, 1),
                    full["stats"]["dirs_listed"],
                    full["stats"]["files_hashed"],
                    fmt(r["git_add_s"] * 1000, 1),
                    fmt(r["ratio_incremental"]),
                    fmt(r["ratio_full"]),
                    fmt(r.get("load1"), 1),
                ]
            )
    parts += [
        "### Rescan with no change (same process, right after the last full checkpoint)",
        "Each settled call still writes and reads back a manifest and records a receipt; git's "
        "baseline is `git add -A` with nothing to add (it refreshes its index, git's stat cache).",
        md_table(
            [
                "tree",
                "run",
                "incremental ms",
                "of which scan ms",
                "dirs listed",
                "full ms",
                "of which scan ms",
                "dirs listed",
                "files hashed",
                "git add -A ms",
                "ratio incremental",
                "ratio full",
                "load (1 min)",
            ],
            resc_rows,
        ),
        md_table(
            ["tree", "incremental p50 ms", "full p50 ms", "git add -A p50 ms"],
            [
                [
                    _kind_title(data[kind]["params"]),
                    fmt(s[kind]["rescan"]["incremental_s"] * 1000, 1),
                    fmt(s[kind]["rescan"]["full_s"] * 1000, 1),
                    fmt(s[kind]["rescan"]["git_add_s"] * 1000, 1),
                ]
                for kind in (BIG, SMALL)
            ],
        ),
        f"git processes left after the runs (marked, killed): {data['git_left']}.",
    ]
    return "\n\n".join(parts)
