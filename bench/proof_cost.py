"""What issue 36's rules cost, measured as a user meets them: whole `settled` processes.

1. `settled close` of a 100,000-file workspace after a session changed 10 files, with this
   tree's rules (a stat row vouches only if no session could have written a mapped page unseen
   since it was listed: `workspace/cachetrust.py`) against the rules before issue 36 (the
   baseline tree), on ext4 and on tmpfs, rounds interleaved. Before each close: `task new`, a
   full `checkpoint` while no session runs (the stat cache the close may reuse), then one
   session that rewrites 10 files. On ext4 that quiet listing still vouches; on tmpfs a session
   ran since it, so this tree re-reads every file.
2. The first `settled close` of 1,000,000 empty files (1,000 directories of 1,000: its full
   scan, checkpoint and read-back) against `git add -A && git commit` of the same tree: wall
   time and peak RSS of each process tree.

The baseline is `SETTLED_BENCH_BASE` (a checkout's root), else `git archive` of the commit
before issue 36 (`BEFORE`), its C binding built with this interpreter. `--quick`: 10,000 files
and 10,000 empty files, one round.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from common import exported_tree, header, log, machine, md_table, scratch, source_revision

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEFORE = "f0d73ef"  # main before issue 36: the stat cache's rules as they were
CHANGED = 10
GOAL_RATIO, GOAL_RSS_MIB = 1.5, 300


def _verdict(held: bool) -> str:
    return "met" if held else "missed"


def _settled(tree: str, home: str, *args: str, timeout: float = 1800) -> tuple[Any, float]:
    """One `settled` process of ``tree``: its JSON answer and wall seconds."""
    env = {**os.environ, "PYTHONPATH": os.path.join(tree, "src"), "SETTLED_HOME": home}
    split = args.index("--") if "--" in args else len(args)
    argv = [sys.executable, "-m", "settled", *args[:split], "--json", *args[split:]]
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, timeout=timeout)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"settled {' '.join(args)}: exit {done.returncode}: {done.stderr!r}")
    return json.loads(done.stdout) if done.stdout.strip() else None, elapsed


END_HOME = """
import os, sys
home = sys.argv[1]
from settled.owner import home_launcher
home_launcher.stop(os.path.join(home, "run"))
from settled.workspace.journal import lifecycle
lifecycle.stop(os.path.join(home, "run", "journal.sock"))
try:
    from settled.netproxy import lifecycle as proxy
    proxy.stop(home)
except ImportError:
    pass
from settled.boundary import podns
podns.release_home(home)
"""


def _end_home(tree: str, home: str) -> None:
    """The home's launcher, journal and proxy stopped and its pods let go, by ``tree``'s code."""
    env = {**os.environ, "PYTHONPATH": os.path.join(tree, "src")}
    subprocess.run([sys.executable, "-c", END_HOME, home], env=env, check=True, timeout=60)


def _peak_rss(argv: list[str], cwd: str, env: dict[str, str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (KiB) of one process tree, measured by a fresh interpreter
    so this process's own children do not count (RUSAGE_CHILDREN is a maximum, not a sum)."""
    probe = (
        "import resource, subprocess, sys, time, json\n"
        "t = time.perf_counter()\n"
        "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)\n"
        "print(json.dumps([time.perf_counter() - t,"
        " resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, *argv], cwd=cwd, env=env, capture_output=True,
        text=True, check=True, timeout=3600,
    )  # fmt: skip
    elapsed, rss = json.loads(done.stdout)
    return float(elapsed), int(rss)


def _tree(root: str, dirs: int, files: int, size: int) -> None:
    body = b"x" * size
    for d in range(dirs):
        path = os.path.join(root, f"d{d:04d}")
        os.mkdir(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for f in range(files):
                out = os.open(f"f{f:04d}", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd)
                if body:
                    os.write(out, body)
                os.close(out)
        finally:
            os.close(fd)


def _close_after_changes(tree: str, home: str, workspace: str) -> dict[str, Any]:
    task, _ = _settled(tree, home, "task", "new", "--workspace", workspace)
    task_id = task["task"]
    time.sleep(0.1)  # past the racy cutoff: the quiet listing can vouch for every file
    _settled(tree, home, "checkpoint", task_id, "--full")
    time.sleep(1.2)  # the session begins clearly after that listing (cachetrust's slack)
    change = "; ".join(f"echo changed > d{d:04d}/f0000" for d in range(CHANGED))
    session, _ = _settled(tree, home, "exec", "--task", task_id, "--wait", "--", "sh", "-c", change)
    if session["receipt"]["exit"]["code"] != 0:
        raise RuntimeError(f"the change failed: {session['receipt']['exit']}")
    close, elapsed = _settled(tree, home, "close", task_id)
    stats = close["final_scan"]["stats"]
    return {"close_s": elapsed, "files_hashed": stats["files_hashed"]}


def _mount_tmpfs(where: str) -> None:
    os.mkdir(where)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g", "tmpfs", where], check=True)


def run(quick: bool = False) -> tuple[dict[str, Any], str]:
    dirs, files = (10, 1000) if quick else (100, 1000)
    empty_dirs = 10 if quick else 1000
    rounds = 1 if quick else 3
    data: dict[str, Any] = {"machine": machine(), "quick": quick, "source": source_revision()}
    data.update({"files": dirs * files, "changed": CHANGED, "close": {}, "first": {}})
    with scratch("proof_cost") as root:
        base = exported_tree(root, BEFORE)
        trees = {"this tree": HERE, "before issue 36": base}
        tmpfs = os.path.join(root, "tmpfs")
        _mount_tmpfs(tmpfs)
        try:
            for fs, where in (("ext4", os.path.join(root, "ext4")), ("tmpfs", tmpfs)):
                workspace = os.path.join(where, "ws")
                os.makedirs(workspace)
                _tree(workspace, dirs, files, 100)
                for n in range(rounds):
                    for name, tree in trees.items():
                        home = os.path.join(root, f"home-{fs}-{n}-{len(name)}")
                        try:
                            row = _close_after_changes(tree, home, workspace)
                        finally:
                            _end_home(tree, home)
                        data["close"].setdefault(f"{fs}/{name}", []).append(row)
                        log(f"proof_cost: {fs} {name} round {n}: {row}")
        finally:
            subprocess.run(["umount", "-l", tmpfs], check=False)
        empty = os.path.join(root, "empty")
        os.mkdir(empty)
        _tree(empty, empty_dirs, 1000, 0)
        home = os.path.join(root, "home-first")
        task, _ = _settled(HERE, home, "task", "new", "--workspace", empty)
        env = {**os.environ, "PYTHONPATH": os.path.join(HERE, "src"), "SETTLED_HOME": home}
        first = [sys.executable, "-m", "settled", "close", task["task"], "--json"]
        try:
            data["first"]["settled close"] = _peak_rss(first, empty, env)
        finally:
            _end_home(HERE, home)
        git_env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b",
                   "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@b"}  # fmt: skip
        git_copy = os.path.join(root, "git")
        subprocess.run(["cp", "-a", empty, git_copy], check=True, timeout=1800)
        subprocess.run(["git", "init", "-q"], cwd=git_copy, check=True)
        data["first"]["git add -A"] = _peak_rss(["git", "add", "-A"], git_copy, git_env)
        commit = ["git", "commit", "-q", "-m", "x"]
        data["first"]["git commit"] = _peak_rss(commit, git_copy, git_env)
    return data, _markdown(data, quick)


def _markdown(data: dict[str, Any], quick: bool) -> str:
    def median(rows: list[dict[str, Any]], key: str) -> float:
        values = sorted(row[key] for row in rows)
        return float(values[len(values) // 2])

    rows = []
    for fs in ("ext4", "tmpfs"):
        now = data["close"][f"{fs}/this tree"]
        before = data["close"][f"{fs}/before issue 36"]
        rows.append([
            fs, f"{median(now, 'close_s'):.2f}", f"{median(before, 'close_s'):.2f}",
            f"{median(now, 'close_s') / median(before, 'close_s'):.2f}x",
            int(median(now, "files_hashed")), int(median(before, "files_hashed")),
        ])  # fmt: skip
    first = data["first"]
    git_s = first["git add -A"][0] + first["git commit"][0]
    git_rss = max(first["git add -A"][1], first["git commit"][1])
    settled_s, settled_rss = first["settled close"]
    return "\n\n".join(
        [
            header("Issue 36: the cost of a proof that covers every write", data),
            f"Source `{data['source']}`; command `python bench/run.py proof_cost`.",
            f"`settled close` of {data['files']:,} files after {CHANGED} changed (median of the"
            " rounds; whole processes):",
            md_table(
                ["fs", "this tree s", "before s", "ratio", "hashed now", "hashed before"], rows
            ),
            "The first close of the empty-file tree (a full scan, the checkpoint, its read-back)"
            " against git of the same tree (whole processes):",
            md_table(
                ["", "s", "peak RSS MiB"],
                [
                    ["settled close", f"{settled_s:.1f}", settled_rss // 1024],
                    ["git add -A && git commit", f"{git_s:.1f}", git_rss // 1024],
                    ["ratio", f"{settled_s / git_s:.2f}x", f"{settled_rss / git_rss:.2f}x"],
                ],
            ),
            f"Goal (issue 36, at 1,000,000 entries): within {GOAL_RATIO}x git's time and under"
            f" {GOAL_RSS_MIB} MiB: time **{_verdict(settled_s <= GOAL_RATIO * git_s)}**, memory"
            f" **{_verdict(settled_rss // 1024 < GOAL_RSS_MIB)}**.",
            "(quick: small sizes)" if quick else "",
        ]
    )
