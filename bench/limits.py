"""limits: what the resource walls cost at admission, against a baseline tree without them.

Each session of this tree starts inside its limits' cgroups: its owner forks a placer before
its orders (which joins the v1 cgroups) and has it clone the command's init at launch
(boundary/placer.py); the baseline's owner clones the init itself and places nothing. Two
drivers run side by side, one per tree (`PYTHONPATH` = its `src`), each a Runtime on a home of
its own, and the parent asks them in turn (ABAB, so both see the same load): `Runtime.exec`
of `true` to its return (the owner reported `running`: exec to running), to its receipt, and
the owner's `spawn_s`, for the fresh owner and through the warm launchers (the Runtime's
zygote, the home's). Then the CLI's `settled run --task T -- true` of each tree as a whole
process against `python -c pass`, interleaved likewise.

The baseline is `SETTLED_BENCH_BASE` (a checkout's root), else `git archive` of `main` into
the scratch directory, its C binding built with this interpreter. Ratios and differences are
between the two trees in one run; nothing is compared across runs.
"""

from __future__ import annotations

import compileall
import json
import os
import subprocess
import sys
from typing import Any

from common import (
    distribution,
    exported_tree,
    fmt,
    header,
    log,
    machine,
    md_table,
    scratch,
    source_revision,
    timed_process,
)

FULL = {"runs": 200, "cli_rounds": 40}
QUICK = {"runs": 20, "cli_rounds": 6}
LAUNCHERS = ("fresh", "warm", "home")
TREES = ("base", "limits")
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DRIVER = r"""
import json, os, sys, time
from settled.runtime import Runtime
home, workspace, launcher = sys.argv[1:4]
os.makedirs(workspace, exist_ok=True)
rt = Runtime(home, launcher=launcher)
task = rt.new_task(workspace).task
print(json.dumps({"task": task}), flush=True)
for line in sys.stdin:
    if not line.strip():
        break
    started = time.perf_counter()
    admission = rt.exec(task, argv=["true"])
    returned = time.perf_counter()
    view = rt.wait(admission.session, timeout=60)
    settled = time.perf_counter()
    receipt = view["receipt"]
    assert receipt["death"]["proven"] and receipt["exit"]["code"] == 0, receipt
    print(json.dumps({
        "return_ms": (returned - started) * 1e3,
        "receipt_ms": (settled - started) * 1e3,
        "spawn_ms": receipt["timings"]["spawn_s"] * 1e3,
        "walls": "resources" in receipt,
    }), flush=True)
rt.close_task(task)
rt.close()
from settled.workspace.journal import lifecycle
lifecycle.stop(os.path.join(home, "run", "journal.sock"))
if launcher == "home":  # the home's zygote (and its spare, with its placer) ends with us
    from settled.owner import home_launcher
    home_launcher.stop(os.path.join(home, "run"))
"""


# A home whose task stays open keeps its pods namespace mounted (run/pods.mnt), which would keep
# the scratch directory; a tree from before pods has nothing to let go.
RELEASE_PODS = """
import sys
try:
    from settled.boundary import podns
except ImportError:
    sys.exit(0)
podns.release_home(sys.argv[1])
"""


def _env(src: str, home: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPATH": src, "SETTLED_HOME": home, **extra}


class Driver:
    """One tree's Runtime in a process of its own, asked for one exec at a time."""

    def __init__(self, src: str, root: str, launcher: str) -> None:
        home = os.path.join(root, "home")
        self.process = subprocess.Popen(
            [sys.executable, "-c", DRIVER, home, os.path.join(root, "ws"), launcher],
            env=_env(src, home), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.task = self._answer()["task"]

    def _answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"a driver ended: exit {self.process.wait(timeout=30)}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def once(self) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=120)


def run(quick: bool) -> tuple[dict[str, Any], str]:
    sizes = QUICK if quick else FULL
    data: dict[str, Any] = {"machine": machine(), "quick": quick, "sizes": sizes}
    data["source"] = source_revision()
    with scratch("limits") as root:
        srcs = {
            "base": os.path.join(exported_tree(root, "main"), "src"),
            "limits": os.path.join(HERE, "src"),
        }
        for src in srcs.values():
            compileall.compile_dir(os.path.join(src, "settled"), quiet=1)
        data["launchers"] = {}
        for launcher in LAUNCHERS:
            drivers = {
                tree: Driver(src, os.path.join(root, f"{launcher}-{tree}"), launcher)
                for tree, src in srcs.items()
            }
            rows: dict[str, list[dict[str, Any]]] = {tree: [] for tree in TREES}
            try:
                for tree in TREES:  # warm-up: the zygote, the journal, the page cache
                    drivers[tree].once()
                for index in range(sizes["runs"]):
                    for tree in TREES if index % 2 == 0 else TREES[::-1]:
                        rows[tree].append(drivers[tree].once())
                    if index % 50 == 49:
                        log(f"limits: {launcher} {index + 1}/{sizes['runs']}")
            finally:
                for driver in drivers.values():
                    driver.close()
            assert all(r["walls"] for r in rows["limits"]), "this tree's receipts name the walls"
            data["launchers"][launcher] = {
                tree: {
                    key: distribution([r[key] for r in tree_rows])
                    for key in ("return_ms", "receipt_ms", "spawn_ms")
                }
                for tree, tree_rows in rows.items()
            }
        data["cli"] = _cli(srcs, root, sizes["cli_rounds"])
    return data, _markdown(data)


def _cli(srcs: dict[str, str], root: str, rounds: int) -> dict[str, Any]:
    """`settled run --task T -- true` of each tree (its home's warm process, as a user gets)
    against `python -c pass`, interleaved."""
    envs, cases = {}, {"python -c pass": [sys.executable, "-c", "pass"]}
    for tree, src in srcs.items():
        home = os.path.join(root, f"cli-{tree}")
        envs[tree] = _env(src, home)
        made = subprocess.run(
            [sys.executable, "-m", "settled", "task", "new", "--json"],
            env=envs[tree], capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        task = json.loads(made.stdout)["task"]
        cases[f"run ({tree})"] = [sys.executable, "-m", "settled", "run", "--task", task,
                                  "--", "true"]  # fmt: skip
    env_of = {"python -c pass": envs["base"], "run (base)": envs["base"]}
    env_of["run (limits)"] = envs["limits"]
    samples: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for name, argv in cases.items():  # the home launcher starts here
            timed_process(argv, env_of[name])
        for _ in range(rounds):
            for name, argv in cases.items():
                samples[name].append(timed_process(argv, env_of[name]))
    finally:
        for env in envs.values():
            subprocess.run(
                [sys.executable, "-c", "import sys; from settled.owner import home_launcher; "
                 "home_launcher.stop(sys.argv[1])", os.path.join(env["SETTLED_HOME"], "run")],
                env=env, check=False, timeout=60,
            )  # fmt: skip
            subprocess.run(  # its task is never closed: its pods namespace is let go here
                [sys.executable, "-c", RELEASE_PODS, env["SETTLED_HOME"]],
                env=env, check=False, timeout=60,
            )  # fmt: skip
            sock = os.path.join(env["SETTLED_HOME"], "run", "journal.sock")
            subprocess.run(
                [sys.executable, "-c", "import sys; from settled.workspace.journal import "
                 "lifecycle; lifecycle.stop(sys.argv[1])", sock],
                env=env, check=False, timeout=60,
            )  # fmt: skip
    return {name: distribution(values) for name, values in samples.items()}


def _markdown(data: dict[str, Any]) -> str:
    rows = []
    for launcher, trees in data["launchers"].items():
        for key in ("return_ms", "receipt_ms", "spawn_ms"):
            base, mine = trees["base"][key], trees["limits"][key]
            rows.append([
                launcher, key.removesuffix("_ms"), fmt(base["p50"]), fmt(mine["p50"]),
                fmt(mine["p50"] - base["p50"]), fmt(mine["p50"] / base["p50"]),
                fmt(base["p99"]), fmt(mine["p99"]),
            ])  # fmt: skip
    table = md_table(
        ["launcher", "exec to", "base p50", "limits p50", "+ms p50", "ratio", "base p99",
         "limits p99"], rows,
    )  # fmt: skip
    cli = data["cli"]
    floor = cli["python -c pass"]["p50"]
    cli_rows = [[name, fmt(d["p50"]), fmt(d["p99"]), fmt(d["p50"] / floor)]
                for name, d in cli.items()]  # fmt: skip
    return "\n\n".join([
        header("limits: exec with the resource walls placed, against the baseline tree", data),
        "ms, p50 and p99 of each tree's drivers asked in turn; `return` is exec to running.",
        table,
        "`settled run --task T -- true` as a whole process (the home's warm process), "
        "and its ratio to `python -c pass` (the issue's target: 5x):",
        md_table(["case", "p50 ms", "p99 ms", "x python -c pass"], cli_rows),
    ])  # fmt: skip
