"""CLI start-up per tool call: `settled --version`, `status TASK --json`, `ls --json` and `run
--task T -- true` as whole processes, each a ratio to `python -c pass` of the same interpreter,
measured interleaved in the same run (issue 15, goals 1 and 2).

Children get bytecode caches (`compileall` first, PYTHONDONTWRITEBYTECODE removed), as an
installed package has; without them every start compiles settled again and measures that.
`-X importtime` of `status` says where the time goes.
"""

from __future__ import annotations

import compileall
import os
import subprocess
import sys
from typing import Any

from common import (
    distribution,
    fmt,
    header,
    log,
    machine,
    md_table,
    scratch,
    source_revision,
    timed_process,
)

FULL = {"rounds": 40}
QUICK = {"rounds": 8}
TARGETS = {"version": 3.0, "status": 3.0, "ls": None, "run": 5.0}  # x `python -c pass`
# The standard library `status` cannot do without in this process: json (which brings re) and
# sqlite3 (which brings datetime). What no lazy import removes.
STDLIB_FLOOR = "import json, sqlite3"
CASES_IN_ORDER = (
    "python -c pass", "stdlib floor", "version", "status", "ls", "run",
    "status, in this process", "run, in this process", "run, fresh owner",
)  # fmt: skip
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _settled_argv() -> list[str]:
    """The installed `settled` script next to this interpreter (what a user types), else
    `-m settled`."""
    script = os.path.join(os.path.dirname(sys.executable), "settled")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "settled"]


def _import_profile(argv: list[str], env: dict[str, str]) -> list[tuple[str, float]]:
    """The top-level imports of one CLI call and their cumulative milliseconds."""
    probe = "import sys; from settled.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", probe, *argv],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    tops = []
    for line in done.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[2].startswith(" ") and not parts[2].startswith("  "):
            name = parts[2].strip()
            if name != "imported package":
                tops.append((name, int(parts[1]) / 1e3))
    return sorted(tops, key=lambda item: -item[1])[:12]


def run(quick: bool) -> tuple[dict[str, Any], str]:
    params = QUICK if quick else FULL
    data: dict[str, Any] = {"machine": machine(), "quick": quick, "params": params}
    data["source"] = source_revision()
    compileall.compile_dir(os.path.join(SRC, "settled"), quiet=1)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    settled = _settled_argv()
    with scratch("startup") as home:
        env["SETTLED_HOME"] = home
        from settled.runtime import Runtime

        with Runtime(home) as rt:
            task = rt.new_task().task
            rt.wait(rt.exec(task, argv=["true"]).session, timeout=60)
        cases = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "stdlib floor": [sys.executable, "-c", STDLIB_FLOOR],
            "version": [*settled, "--version"],
            "status": [*settled, "status", task, "--json"],
            "ls": [*settled, "ls", "--json"],
            "run": [*settled, "run", "--task", task, "--", "true"],
            "status, in this process": [*settled, "status", task, "--json"],
            "run, in this process": [*settled, "run", "--task", task, "--", "true"],
            "run, fresh owner": [*settled, "run", "--task", task, "--", "true"],
        }
        envs = {name: env for name in cases}  # the home's warm process, as a user gets
        for name in ("status, in this process", "run, in this process"):
            envs[name] = {**env, "SETTLED_CLI": "local"}  # as with no zygote running
        envs["run, fresh owner"] = {**env, "SETTLED_CLI": "local", "SETTLED_LAUNCHER": "fresh"}
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for name, argv in cases.items():  # warm the page cache once (and start the launcher)
            timed_process(argv, envs[name])
        for n in range(params["rounds"]):
            for name, argv in cases.items():
                samples[name].append(timed_process(argv, envs[name]))
            if n % 10 == 9:
                log(f"startup: {n + 1}/{params['rounds']} rounds")
        local = {**env, "SETTLED_CLI": "local"}  # what a call imports when it runs its verb
        data["imports_of_status_ms"] = _import_profile(["status", task, "--json"], local)
        data["imports_of_run_ms"] = _import_profile(["run", "--task", task, "--", "true"], local)
        with Runtime(home) as rt:
            data["closed"] = rt.close_task(task).complete  # every `run` session settled
        from settled.home import run_dir
        from settled.owner import home_launcher

        home_launcher.stop(run_dir(home))  # the CLI's `run` started it; it ends with the bench
    data["results"] = {name: distribution(values) for name, values in samples.items()}
    data["command"] = " ".join(cases["status"]).replace(task, "TASK")
    return data, _markdown(data)


def _markdown(data: dict[str, Any]) -> str:
    results = data["results"]
    base = results["python -c pass"]["p50"]
    rows = []
    for name in CASES_IN_ORDER:
        d = results[name]
        target = TARGETS.get(name)
        ratio = d["p50"] / base
        verdict = "-" if target is None else ("met" if ratio <= target else "**missed**")
        rows.append([
            f"`{name}`", fmt(d["p50"], 1), fmt(d["p90"], 1), fmt(d["min"], 1),
            fmt(ratio, 2), "-" if target is None else f"<= {target:g}x", verdict,
        ])  # fmt: skip
    imports = md_table(
        ["top-level import of `status`, in this process", "cumulative ms (-X importtime)"],
        [[f"`{name}`", fmt(ms, 1)] for name, ms in data["imports_of_status_ms"]],
    )
    run_imports = md_table(
        ["top-level import of `run`, in this process", "cumulative ms (-X importtime)"],
        [[f"`{name}`", fmt(ms, 1)] for name, ms in data.get("imports_of_run_ms", [])],
    )
    return "\n\n".join([
        header("startup", data),
        f"Source `{data['source']}`; {data['params']['rounds']} interleaved rounds; "
        "each case is a whole process (`settled` is the installed script, bin/settled). The "
        "ratio is the p50 over the p50 of `python -c pass` of the same interpreter. "
        f"`stdlib floor` is `python -c '{STDLIB_FLOOR}'`: the standard library `status` "
        "needs in its own process, which no lazy import removes. `status`, `ls` and `run` are "
        "what a user gets once the home's warm process runs (the first `run` or `exec` of a "
        "home starts it; it leaves after 60 s without a call): the verb runs in a worker it "
        "forks, and the process measured is the thin client (cli/thin.py). `..., in this "
        "process` is the same call run where it is typed (SETTLED_CLI=local; what a call gets "
        "when no warm process runs), its owner still forked by the warm process; `run, fresh "
        "owner` also starts a new interpreter per owner (SETTLED_LAUNCHER=fresh).",
        md_table(["case", "p50 ms", "p90 ms", "min ms", "x pass", "target", ""], rows),
        imports,
        run_imports,
    ])  # fmt: skip


if __name__ == "__main__":
    print(run("--quick" in sys.argv)[1])
