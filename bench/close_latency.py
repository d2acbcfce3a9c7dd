"""close_latency: from a command's exit to a verified close receipt, and where the time goes.

Each run: a fresh 1,000-file workspace (its contents unique to the run) and a fresh task on it;
`Runtime.exec` of a shell command that rewrites 10 files (one in each of 10 directories) and
prints `date +%s.%N` as its last act; `Runtime.wait`; then at once `Runtime.close_task`, as an
agent harness would. Latency runs from the command's own last timestamp (its exit follows within
a fraction of a millisecond) to the moment `close_task` returns a complete close receipt whose
checkpoint read back verified.

Broken down with the receipt's wall-clock timings (`settled_at`: the owner built the receipt
after death evidence, the drain to EOF and the journal barrier) and the close steps' `recorded_at`
in the store's `close_steps` table. The receipt's own exit estimate (`spawned_at +
exited_after_s`) runs late by the boundary's spawn time (`spawned_at` is taken after the spawn
returns, `exited_after_s` counts from before it), so it is reported beside the command's stamp.

Variants, interleaved run by run, one Runtime (own home) each: the warm launcher (primary), the
default fresh launcher, and the warm launcher with a checkpoint taken before the command (so the
close's full scan re-reads only the 10 changed files instead of hashing all 1,000).
Baseline in the same loop: the same command under `subprocess` (exit to waitpid) followed by
`git add -A && git commit` in a git copy of the same workspace, as installed and durable
(`core.fsync=added`, `core.fsyncMethod=batch`).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sqlite3
import subprocess
import time
from typing import Any

from checkpoint import GIT_DURABLE, GIT_QUIET, Tree, git_env
from common import (
    MARK_ENV,
    await_exit,
    distribution,
    end_process,
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

SEED = 20_261_203
FULL = {"files": 1_000, "dirs": 10, "size": 4096, "changed": 10, "runs": 100}
QUICK = {"files": 1_000, "dirs": 10, "size": 4096, "changed": 10, "runs": 10}
# name -> (launcher, checkpoint before the command)
VARIANTS = {
    "warm": ("warm", False),
    "fresh": ("fresh", False),
    "warm, checkpoint before": ("warm", True),
}
PRIMARY = "warm"
WAIT_S = 60.0
CLOSE_DEADLINE_S = 60.0
PLOT_NAME = "close_latency.svg"  # a vector plot: its text stays searchable and diffable
# The close's steps, in order (settled.close.decide.STEPS), and how the table names them.
STEP_LABELS = {
    "final_pending": "final_pending (store the final response)",
    "sealed": "sealed (seal admission)",
    "sessions_settled": "sessions_settled (wait: already settled)",
    "receipts": "receipts (check death evidence)",
    "final_scan": "final_scan (barrier, full scan, publish blobs)",
    "checkpoint": "checkpoint (manifest, read back, record)",
    "fenced": "fenced (advance the generation)",
    "outcome": "outcome (close receipt, journal released)",
}
COMPONENTS = (
    ("exit_to_settled_at", "owner: exit -> receipt built (evidence, drain, barrier)"),
    ("settled_at_to_wait", "owner: receipt built -> Runtime.wait returned"),
    *((f"step_{name}", f"join: {label}") for name, label in STEP_LABELS.items()),
    ("close_return", "join: outcome recorded -> close_task returned"),
)


def command(tree: Tree, files: list[int], tag: str) -> str:
    writes = [f"printf '%s\\n' '{tag} {i}' > {tree.rel(i)}" for i in files]
    return "; ".join([*writes, "date +%s.%N"])


def _build(root: str, p: dict[str, Any], seed: int) -> Tree:
    os.makedirs(root)
    tree = Tree(root, p["files"], p["dirs"], p["size"], seed)
    tree.build()
    return tree


def _load1() -> float:
    with open("/proc/loadavg") as handle:
        return float(handle.read().split()[0])


def _stamp(output: bytes) -> float:
    text = output.decode().strip().splitlines()
    if not text:
        raise RuntimeError("the command printed no exit timestamp")
    return float(text[-1])


class Variant:
    def __init__(self, name: str, root: str) -> None:
        from settled.runtime import Runtime

        self.name = name
        self.launcher, self.checkpoint_first = VARIANTS[name]
        self.home = os.path.join(root, "home-" + name.replace(" ", "").replace(",", "-"))
        self.rt = Runtime(self.home, launcher=self.launcher)
        self.db = sqlite3.connect(os.path.join(self.rt.home, "settled.db"), timeout=30.0)
        self.token = f"{os.getpid()}-close-{os.urandom(4).hex()}"
        self.left = 0
        self.unclosed: list[Any] = []

    def close(self) -> None:
        """The home's one journal daemon outlives each close (it watches the home's open
        tasks and exits after a minute idle): stopped here, once, and awaited."""
        from settled.workspace.journal import lifecycle as journal_lifecycle
        from settled.workspace.journal import wire as journal_wire

        socket = self.rt.workspace.socket()
        pid = (journal_wire.ping(socket) or {}).get("pid")
        with contextlib.suppress(Exception):
            journal_lifecycle.stop(socket)
        if not await_exit(pid, 10.0):
            log(f"warning: journal pid {pid} still runs 10 s after stop")
            self.left += 1
        self.db.close()
        self.rt.close()

    def once(self, root: str, p: dict[str, Any], i: int) -> dict[str, Any]:
        workspace = os.path.join(root, f"ws-{self.launcher}-{int(self.checkpoint_first)}-{i}")
        tree = _build(workspace, p, SEED + 1000 * i + len(self.name))
        try:
            task = self.rt.new_task(workspace)
            self.unclosed.append(task)
            if self.checkpoint_first:
                self.rt.checkpoint(task.task)
            files = tree.spread(p["changed"], i)
            os.sync()  # the workspace's own pages, written just now, are not the close's cost
            admission = self.rt.exec(
                task.task,
                shell=command(tree, files, f"run {i} {self.name}"),
                key=f"close-latency-{i}",
                env={MARK_ENV: self.token},
            )
            view = self.rt.wait(admission.session, timeout=WAIT_S)
            waited = time.time()
            result = self.rt.close_task(task.task, deadline=CLOSE_DEADLINE_S)
            closed = time.time()
            if not result.complete or result.receipt is None:
                raise RuntimeError(f"task {task.task}: close blocked on {result.blocked_on}")
            self.unclosed.remove(task)
            row = self._row(task.task, view["receipt"], result.receipt, waited, closed)
            row["stamp"] = _stamp(self.rt.read(admission.session, "stdout"))
            end_process(view["receipt"]["owner"]["pid"], "session owner")
            self.left += len(kill_marked(self.token))
        finally:
            shutil.rmtree(workspace, ignore_errors=True)
        return _components(row)

    def _row(
        self,
        task: str,
        receipt: dict[str, Any],
        close: dict[str, Any],
        waited: float,
        closed: float,
    ) -> dict[str, Any]:
        problems = []
        if receipt["exit"].get("code") != 0 or not receipt["death"]["proven"]:
            problems.append(f"process receipt {receipt['exit']} proven={receipt['death']}")
        if not close["checkpoint"]["read_back"]["verified"]:
            problems.append("checkpoint not read back")
        if not close["outcome"]["all_commands_succeeded"]:
            problems.append(f"outcome {close['outcome']}")
        if problems:
            raise RuntimeError(f"task {task}: {'; '.join(problems)}")
        steps = dict(
            self.db.execute("SELECT step, recorded_at FROM close_steps WHERE task=?", (task,))
        )
        t = receipt["timings"]
        scan = close["final_scan"]
        return {
            "task": task,
            "boundary": receipt["death"]["boundary"],
            "timings": t,
            "receipt_exit": t["spawned_at"] + t["exited_after_s"],
            "waited": waited,
            "closed": closed,
            "steps_recorded_at": steps,
            "scan": {"mode": scan["mode"], "entries": scan["entries"], "stats": scan["stats"]},
            "blobs_verified": close["checkpoint"]["read_back"]["blobs_verified"],
        }


def _components(row: dict[str, Any]) -> dict[str, Any]:
    """Milliseconds between consecutive instants, from the command's stamp to close's return."""
    t, steps = row["timings"], row["steps_recorded_at"]
    ms: dict[str, float] = {
        "exit_to_complete": row["closed"] - row["stamp"],
        "exit_to_complete_receipt_anchor": row["closed"] - row["receipt_exit"],
        "receipt_exit_minus_stamp": row["receipt_exit"] - row["stamp"],
        "evidence_after_exit": t.get("evidence_after_exit_s", math.nan),
        "exit_to_wait": row["waited"] - row["stamp"],
        "wait_to_complete": row["closed"] - row["waited"],
        "exit_to_settled_at": t["settled_at"] - row["stamp"],
        "settled_at_to_wait": row["waited"] - t["settled_at"],
    }
    previous = row["waited"]
    for name in STEP_LABELS:
        ms[f"step_{name}"] = steps[name] - previous
        previous = steps[name]
    ms["close_return"] = row["closed"] - previous
    row["ms"] = {k: v * 1000 for k, v in ms.items()}
    return row


class Baseline:
    """The same command under subprocess, then a git commit of the workspace (two configs).

    One git workspace for all runs, like an agent's long-lived repository: built and committed
    once (untimed); every run's command writes new contents into it."""

    def __init__(self, root: str, p: dict[str, Any], token: str) -> None:
        self.p, self.token = p, token
        self.workspace = os.path.join(root, "ws-git")
        self.tree = _build(self.workspace, p, SEED - 1)
        env = git_env(GIT_QUIET, token)
        for argv in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
            subprocess.run(["git", *argv], cwd=self.workspace, env=env, check=True, timeout=60)
        self.left = len(kill_marked(token))

    def once(self, i: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        try:
            for n, (name, config) in enumerate((("git", GIT_QUIET), ("git_durable", GIT_DURABLE))):
                env = git_env(config, self.token)
                files = self.tree.spread(self.p["changed"], 2 * i + n)
                os.sync()
                shell = command(self.tree, files, f"run {i} {name}")
                done = subprocess.run(
                    ["/bin/sh", "-c", shell],
                    cwd=self.workspace,
                    env=env,
                    capture_output=True,
                    timeout=60,
                )
                waited = time.time()
                if done.returncode != 0:
                    raise RuntimeError(f"baseline command failed: {done.stderr!r}")
                for argv in (["add", "-A"], ["commit", "-q", "--no-verify", "-m", f"run {i}"]):
                    subprocess.run(
                        ["git", *argv], cwd=self.workspace, env=env, check=True, timeout=60
                    )
                committed = time.time()
                stamp = _stamp(done.stdout)
                out[f"{name}_exit_to_wait_ms"] = (waited - stamp) * 1000
                out[f"{name}_exit_to_commit_ms"] = (committed - stamp) * 1000
        finally:
            left = len(kill_marked(self.token))
            self.left += left
            out["left"] = left
        return out


def run(quick: bool) -> tuple[dict[str, Any], str]:
    p = QUICK if quick else FULL
    data: dict[str, Any] = {
        "benchmark": "close_latency",
        "quick": quick,
        "machine": machine(),
        "revision": source_revision(),
        "params": {**p, "variants": {k: list(v) for k, v in VARIANTS.items()}, "seed": SEED},
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    baseline: list[dict[str, Any]] = []
    token = f"{os.getpid()}-close-git-{os.urandom(4).hex()}"
    with scratch("close-latency") as root, contextlib.ExitStack() as stack:
        data["filesystem"] = fs_of(root)
        variants = {}
        for name in VARIANTS:
            variants[name] = Variant(name, root)
            stack.callback(variants[name].close)
        for variant in variants.values():  # untimed: start each warm zygote, warm caches
            variant.once(root, p, -1)
        git = Baseline(root, p, token)
        for i in range(p["runs"]):
            order = list(variants) if i % 2 == 0 else list(reversed(variants))
            load = _load1()
            for name in order:
                row = variants[name].once(root, p, i)
                row.update(run=i + 1, load1=load)
                runs[name].append(row)
            base = git.once(i)
            base.update(run=i + 1, load1=load)
            baseline.append(base)
            if (i + 1) % max(1, p["runs"] // 10) == 0 or i == 0:
                log(
                    f"close_latency {i + 1}/{p['runs']}: exit -> complete "
                    + ", ".join(f"{n} {runs[n][-1]['ms']['exit_to_complete']:.1f} ms" for n in runs)
                    + f"; git {base['git_exit_to_commit_ms']:.1f} ms"
                )
        data["left"] = {name: v.left for name, v in variants.items()}
        data["left"]["baseline"] = git.left
    data["runs"] = runs
    data["baseline"] = baseline
    data["summary"] = summarize(runs, baseline)
    return data, render(data)


def summarize(runs: dict[str, list[dict[str, Any]]], baseline: list[dict[str, Any]]) -> dict:
    out: dict[str, Any] = {"variants": {}}
    keys = ["exit_to_complete", "exit_to_complete_receipt_anchor", "receipt_exit_minus_stamp",
            "evidence_after_exit", "exit_to_wait", "wait_to_complete"]  # fmt: skip
    keys += [k for k, _ in COMPONENTS]
    for name, rows in runs.items():
        out["variants"][name] = {k: distribution([r["ms"][k] for r in rows]) for k in keys}
        out["variants"][name]["files_hashed"] = distribution(
            [r["scan"]["stats"]["files_hashed"] for r in rows]
        )
    out["baseline"] = {
        k: distribution([b[k] for b in baseline])
        for k in ("git_exit_to_wait_ms", "git_exit_to_commit_ms", "git_durable_exit_to_commit_ms")
    }
    git_p50 = out["baseline"]["git_exit_to_commit_ms"]["p50"]
    durable_p50 = out["baseline"]["git_durable_exit_to_commit_ms"]["p50"]
    for name in runs:
        p50 = out["variants"][name]["exit_to_complete"]["p50"]
        out["variants"][name]["ratio_to_git"] = p50 / git_p50
        out["variants"][name]["ratio_to_git_durable"] = p50 / durable_p50
    return out


def render(data: dict[str, Any]) -> str:
    p, s = data["params"], data["summary"]
    fs = data["filesystem"]
    v = s["variants"]
    n = p["runs"]
    first = data["runs"][PRIMARY][0]
    rows = []
    for name in VARIANTS:
        d = v[name]["exit_to_complete"]
        rows.append(
            [
                f"settled, {name} launcher" if "," not in name else f"settled, {name}",
                d["n"],
                fmt(d["p50"], 1),
                fmt(d["p90"], 1),
                fmt(d["p99"], 1),
                fmt(d["max"], 1),
                fmt(v[name]["files_hashed"]["p50"], 0),
                fmt(v[name]["ratio_to_git"]),
                fmt(v[name]["ratio_to_git_durable"]),
            ]
        )
    for key, label in (
        ("git_exit_to_commit_ms", "baseline: subprocess, then `git add -A && git commit`"),
        ("git_durable_exit_to_commit_ms", "baseline: the same, git durable"),
        ("git_exit_to_wait_ms", "baseline: subprocess exit -> wait returned only"),
    ):
        d = s["baseline"][key]
        rows.append(
            [
                label,
                d["n"],
                fmt(d["p50"], 1),
                fmt(d["p90"], 1),
                fmt(d["p99"], 1),
                fmt(d["max"], 1),
                "",
                "",
                "",
            ]
        )
    comp_rows = []
    for key, label in [
        ("exit_to_wait", "**owner: exit -> Runtime.wait returned (process receipt)**"),
        *[(k, f"&nbsp;&nbsp;{lab}") for k, lab in COMPONENTS[:2]],
        ("wait_to_complete", "**join: Runtime.wait returned -> close_task returned**"),
        *[(k, f"&nbsp;&nbsp;{lab}") for k, lab in COMPONENTS[2:]],
        ("exit_to_complete", "**exit -> complete (total)**"),
    ]:
        cells = [label]
        for name in VARIANTS:
            d = v[name][key]
            cells += [fmt(d["p50"], 2), fmt(d["p90"], 2), fmt(d["max"], 2)]
        comp_rows.append(cells)
    comp_headers = ["component (ms)"]
    for name in VARIANTS:
        comp_headers += [f"{name} p50", f"{name} p90", f"{name} max"]
    pv = v[PRIMARY]
    left = ", ".join(f"{k} {val}" for k, val in data["left"].items())
    loads = [b["load1"] for b in data["baseline"] if "load1" in b]
    load = (
        f"1-minute load average during the runs: {fmt(min(loads), 1)}-{fmt(max(loads), 1)} "
        f"(median {fmt(median(loads), 1)}) on {data['machine']['nproc']} CPUs. "
        if loads
        else ""
    )
    return "\n\n".join(
        [
            header("close_latency", data) + f" Source `{data['revision']}`.",
            f"From a command's exit to a verified close receipt, {n} runs per variant, "
            f"interleaved. Each run: a fresh task on a fresh {p['files']:,}-file workspace "
            f"({p['dirs']} dirs, {p['size'] // 1024} KiB files, contents unique to the run) on "
            f"`{fs['mount']}` ({fs['type']}, {fs['device']}); `Runtime.exec` of `/bin/sh -c` "
            f"rewriting {p['changed']} files in {p['changed']} directories and printing "
            f"`date +%s.%N` last; `Runtime.wait`; at once `Runtime.close_task`. Exit = the "
            f"command's own last timestamp; complete = `close_task` returned a close receipt "
            f"whose checkpoint read back verified (boundary `{first['boundary']}`). Without a "
            f"checkpoint before the command, the close's final scan is the task's first, so it "
            f"hashes and publishes all {p['files']:,} files (fsynced); with one, only the "
            f"changed files. Baseline, same loop: the same command under `subprocess`, then "
            f"`git add -A && git commit` in a git repository of an identical workspace; ratio = "
            f"settled p50 / baseline p50.",
            md_table(
                [
                    "exit -> complete (ms)",
                    "n",
                    "p50",
                    "p90",
                    "p99",
                    "max",
                    "files hashed by the close (p50)",
                    "ratio to git",
                    "ratio to git durable",
                ],
                rows,
            ),
            "Where the time goes (ms; consecutive instants from the receipt's `timings` and the "
            "close steps' `recorded_at`, so the parts of one run add up to its total; "
            "percentiles of parts do not add up).",
            md_table(comp_headers, comp_rows),
            f"The receipt's own exit estimate (`spawned_at + exited_after_s`) runs late of the "
            f"command's stamp by p50 {fmt(pv['receipt_exit_minus_stamp']['p50'], 2)} ms (max "
            f"{fmt(pv['receipt_exit_minus_stamp']['max'], 2)} ms), the boundary's spawn time: "
            f"exit -> complete measured from it has p50 "
            f"{fmt(pv['exit_to_complete_receipt_anchor']['p50'], 1)} ms ({PRIMARY}). The owner's "
            f"exit -> death evidence (`evidence_after_exit_s`): p50 "
            f"{fmt(pv['evidence_after_exit']['p50'], 2)} ms. Marked processes left after "
            f"the runs (killed): {left}. {load}",
        ]
    )


# -- the plot ---------------------------------------------------------------------------

PLOT_GROUPS = (
    ("owner: exit → receipt", ("exit_to_settled_at", "settled_at_to_wait"), "#4c72b0"),
    (
        "join: seal, settle, receipts",
        ("step_final_pending", "step_sealed", "step_sessions_settled", "step_receipts"),
        "#8172b2",
    ),
    ("join: final scan + publish", ("step_final_scan",), "#dd8452"),
    ("join: checkpoint (manifest, read-back)", ("step_checkpoint",), "#c44e52"),
    (
        "join: fence, receipt, journal release",
        ("step_fenced", "step_outcome", "close_return"),
        "#55a868",
    ),
)


def _load_note(data: dict[str, Any]) -> str:
    loads = [b["load1"] for b in data["baseline"] if "load1" in b]
    if not loads:
        return ""
    return f", 1-min load average {min(loads):.1f}-{max(loads):.1f} during the runs"


def plot(out: str, data: dict[str, Any]) -> str:
    """close_latency.svg: CDF of exit -> complete (and its two halves), and a per-part bar."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "Plot skipped: matplotlib is not installed (`pip install matplotlib`)."
    os.makedirs(out, exist_ok=True)
    runs, p, m = data["runs"], data["params"], data["machine"]
    fig, (ax, bx) = plt.subplots(
        1, 2, figsize=(14, 6.6), gridspec_kw={"width_ratios": [1.15, 1]}, layout="constrained"
    )
    colors = {"warm": "#1f77b4", "fresh": "#ff7f0e", "warm, checkpoint before": "#2ca02c"}
    for name, rows in runs.items():
        values = sorted(r["ms"]["exit_to_complete"] for r in rows)
        ys = [(k + 1) / len(values) for k in range(len(values))]
        label = f"{name}: exit → complete (p50 {median(values):.0f} ms)"
        ax.step(values, ys, where="post", color=colors.get(name), lw=2, label=label)
    for key, label, style in (
        ("exit_to_wait", "owner part: exit → receipt", ":"),
        ("wait_to_complete", "join part: receipt → complete", "--"),
    ):
        values = sorted(r["ms"][key] for r in runs[PRIMARY])
        ys = [(k + 1) / len(values) for k in range(len(values))]
        ax.step(values, ys, where="post", color=colors[PRIMARY], lw=1.2, ls=style,
                label=f"{PRIMARY}, {label}")  # fmt: skip
    for key, label, style in (
        ("git_exit_to_commit_ms", "git: subprocess, add -A && commit", "-"),
        ("git_durable_exit_to_commit_ms", "git durable (fsync)", "--"),
    ):
        values = sorted(b[key] for b in data["baseline"])
        ys = [(k + 1) / len(values) for k in range(len(values))]
        ax.step(values, ys, where="post", color="grey", lw=1.5, ls=style,
                label=f"{label} (p50 {median(values):.0f} ms)")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("latency from the command's exit (ms, log scale)")
    ax.set_ylabel("fraction of runs with latency ≤ x")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    ax.set_title("Empirical CDF of exit → complete", fontsize=10)

    names = list(runs)
    labels = [name.replace(", ", ",\n") for name in names]
    left = [0.0] * len(names)
    for label, keys, color in PLOT_GROUPS:
        widths = [median([sum(r["ms"][k] for k in keys) for r in runs[name]]) for name in names]
        bx.barh(labels, widths, left=left, color=color, label=label, edgecolor="white")
        left = [a + b for a, b in zip(left, widths, strict=True)]
    git = median([b["git_exit_to_commit_ms"] for b in data["baseline"]])
    durable = median([b["git_durable_exit_to_commit_ms"] for b in data["baseline"]])
    bx.barh(["git baseline", "git durable"], [git, durable], color="grey", label="git baseline")
    for y, total in enumerate([*left, git, durable]):
        bx.text(total + max(left) * 0.01, y, f"{total:.0f} ms", va="center", fontsize=8)
    bx.invert_yaxis()
    bx.set_xlim(0, max(left) * 1.15)
    bx.set_xlabel("ms after the command's exit (medians of the parts; sum ≈ the median total)")
    bx.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    bx.grid(True, axis="x", alpha=0.3)
    bx.set_title("Where the time goes: median of each part", fontsize=10)
    fig.suptitle(
        f"settled: command exit → verified close receipt — {p['files']:,}-file workspace, "
        f"{p['changed']} files changed by the command, {p['runs']} runs per variant\n"
        f"kernel {m['kernel']}, nproc {m['nproc']}, {m['date'][:10]}{_load_note(data)}"
        + (" (quick sizes)" if data.get("quick") else ""),
        fontsize=10.5,
    )
    path = os.path.join(out, PLOT_NAME)
    matplotlib.rcParams["svg.hashsalt"] = "settled"  # stable ids: a re-run diffs by its data
    fig.savefig(path + ".tmp.svg", format="svg", metadata={"Date": None})
    plt.close(fig)
    os.replace(path + ".tmp.svg", path)
    data["plot"] = PLOT_NAME
    return (
        f"![exit to complete: CDF and breakdown]({PLOT_NAME})\n\n"
        f"`{PLOT_NAME}`: left, the empirical CDF of exit -> complete per variant (log x), with "
        f"the {PRIMARY} variant's two halves and the git baseline; right, the median of each "
        "part of the close per variant."
    )
