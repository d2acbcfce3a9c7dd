"""The cost of evidence that leaves the sandbox: PostgreSQL + S3 against SQLite + a local directory.

For each pair of backends, on one machine and in one run (interleaved task by task, so load hits
every configuration alike): admission (``exec`` call to its return, fresh owners) and exit to a
verified close (the command's own exit, stamped by itself, to ``close`` returning a complete
receipt) of a task whose command changes 10 files of 1,000, each p50/p99 and as a ratio to the
embedded default. Then a sealed log: a command writes ``LOG_BYTES`` of incompressible bytes and
the owner seals them into the bucket after its receipt (the recorded seal's ``seal_s``), against
a plain upload of the same bytes with the same client in the same 4 MiB pieces (``put_object``, no
hashing or create-only check), and against ``S3ObjectStore.put_stream`` of the whole file
(multipart). The servers are the test fixtures' (tests/s3.py, tests/pg.py): real ones, local.

    .venv/bin/python bench/run.py remote [--quick]
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from common import MIB, distribution, fmt, header, log, machine, md_table, scratch, source_revision

TESTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path.insert(0, TESTS_DIR)

import s3 as weed_server  # noqa: E402  (tests/s3.py: the SeaweedFS launcher)

FILES = 1000
CHANGED = 10
PIECE = 4 * MIB
ENV_NAMES = (
    "SETTLED_STORE",
    "SETTLED_OBJECTS",
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_REGION",
)


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in ENV_NAMES}
    for name in ENV_NAMES:
        os.environ.pop(name, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _configs(root: str, weed: Any, postgres: Callable[[], str] | None) -> dict[str, dict[str, str]]:
    bucket = f"s3://{weed_server.VERSIONED_BUCKET}"
    configs = {
        "sqlite+local": {},
        "sqlite+s3": {
            "SETTLED_STORE": f"sqlite://{root}/shared/store.db",
            "SETTLED_OBJECTS": f"{bucket}/bench-{secrets.token_hex(4)}",
            **weed.env(),
        },
    }
    if postgres is not None:
        configs["postgresql+s3"] = {
            "SETTLED_STORE": postgres(),
            "SETTLED_OBJECTS": f"{bucket}/bench-{secrets.token_hex(4)}",
            **weed.env(),
        }
    return configs


def _one_task(root: str, name: str, index: int, env: dict[str, str]) -> dict[str, float]:
    from settled.runtime import Runtime

    workspace = os.path.join(root, f"w-{name}-{index}")
    os.makedirs(workspace)
    for i in range(FILES):
        with open(os.path.join(workspace, f"f{i:04d}"), "w") as handle:
            handle.write(f"file {i}\n")
    script = (
        f"import time; [open(f'f{{i:04d}}', 'a').write('changed\\n') for i in range({CHANGED})];"
        "print(time.time(), flush=True)"
    )
    with _environment(env), Runtime(os.path.join(root, f"home-{name}")) as runtime:
        task = runtime.new_task(workspace)
        runtime.checkpoint(task.task, incremental=False)  # the tree before, as an agent would
        started = time.perf_counter()
        admitted = runtime.exec(task.task, [sys.executable, "-c", script])
        admission = time.perf_counter() - started
        runtime.wait(admitted.session, timeout=120)
        exited = float(runtime.read(admitted.session, "stdout").split()[0])
        closed = runtime.close_task(task.task)
        done = time.time()
        if not closed.complete:
            raise RuntimeError(f"{name}: the close was not complete: {closed.blocked_on}")
    shutil.rmtree(workspace, ignore_errors=True)
    return {"admission_s": admission, "exit_to_close_s": done - exited}


def _recorded_seal_s(runtime: Any, task: str, session: str) -> float:
    """The owner's seal of stdout, recorded after its receipt (a fact of its own): its seal_s."""
    give_up = time.monotonic() + 600
    while time.monotonic() < give_up:
        seal = runtime.store.log_seals(task, session).get(session, {}).get("stdout")
        if seal is not None:
            if "manifest" not in seal:
                raise RuntimeError(f"the log was not sealed: {seal}")
            return float(seal["seal_s"])
        time.sleep(0.05)
    raise RuntimeError(f"no seal of session {session}'s stdout was recorded in 600 s")


def _sealed_log(root: str, env: dict[str, str], size: int, weed: Any) -> dict[str, float]:
    from settled.objects.s3 import open_s3
    from settled.runtime import Runtime

    source = os.path.join(root, "log.bin")
    with open(source, "wb") as handle:
        for _ in range(size // MIB):
            handle.write(os.urandom(MIB))
    workspace = os.path.join(root, "w-seal")
    os.makedirs(workspace, exist_ok=True)
    with _environment(env), Runtime(os.path.join(root, "home-seal")) as runtime:
        task = runtime.new_task(workspace)
        admitted = runtime.exec(task.task, ["cat", source])
        runtime.wait(admitted.session, timeout=600)
        seal_s = _recorded_seal_s(runtime, task.task, admitted.session)
        runtime.close_task(task.task)
    client = weed.client()
    prefix = f"plain-{secrets.token_hex(4)}"
    started = time.perf_counter()
    with open(source, "rb") as handle:
        index = 0
        while piece := handle.read(PIECE):
            client.put_object(
                Bucket=weed_server.VERSIONED_BUCKET, Key=f"{prefix}/{index}", Body=piece
            )
            index += 1
    plain_s = time.perf_counter() - started
    with _environment(env):
        store = open_s3(f"s3://{weed_server.VERSIONED_BUCKET}/multipart-{secrets.token_hex(4)}")
        started = time.perf_counter()
        with open(source, "rb") as handle:
            store.put_stream(handle)
        multipart_s = time.perf_counter() - started
    os.unlink(source)
    return {"bytes": size, "seal_s": seal_s, "plain_pieces_s": plain_s, "multipart_s": multipart_s}


def run(quick: bool) -> tuple[dict[str, Any], str]:
    tasks = 6 if quick else 12
    log_bytes = (64 if quick else 1024) * MIB
    with ExitStack() as stack:
        root = stack.enter_context(scratch("remote"))
        weed = weed_server.start(os.path.join(root, "weed"))
        stack.callback(weed.stop)
        weed_server.make_buckets(weed)
        postgres = _postgres(stack, root)
        configs = _configs(root, weed, postgres)
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
        for index in range(tasks):
            for name, env in configs.items():
                rows[name].append(_one_task(root, name, index, env))
        log("  sealed log")
        seal = _sealed_log(root, configs["sqlite+s3"], log_bytes, weed)
    data = {
        "machine": machine(),
        "revision": source_revision(),
        "quick": quick,
        "tasks": tasks,
        "runs": rows,
        "summary": _summary(rows),
        "seal": seal,
    }
    return data, render(data)


def _postgres(stack: ExitStack, root: str) -> Callable[[], str] | None:
    """A fresh database URL from tests/pg.py's cluster, or None where it cannot start."""
    import pg  # tests/pg.py: the PostgreSQL launcher

    if pg.missing_reason() is not None:
        log(f"  no PostgreSQL: {pg.missing_reason()}")
        return None
    cluster = pg.start_cluster()
    stack.callback(cluster.stop)
    os.environ[pg.URL_ENV] = cluster.url()
    return lambda: pg.url_for_directory(os.path.join(root, secrets.token_hex(4)))


def _summary(rows: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    base = {k: distribution([r[k] for r in rows["sqlite+local"]]) for k in rows["sqlite+local"][0]}
    summary: dict[str, Any] = {}
    for name, runs in rows.items():
        summary[name] = {}
        for key in runs[0]:
            dist = distribution([r[key] for r in runs])
            summary[name][key] = {
                **dist,
                "ratio_p50": dist["p50"] / base[key]["p50"],
                "ratio_p99": dist["p99"] / base[key]["p99"],
            }
    return summary


def render(data: dict[str, Any]) -> str:
    rows = []
    for name, values in data["summary"].items():
        a, c = values["admission_s"], values["exit_to_close_s"]
        rows.append(
            [
                name,
                fmt(a["p50"] * 1000, 1),
                fmt(a["p99"] * 1000, 1),
                fmt(a["ratio_p50"]),
                fmt(c["p50"] * 1000, 1),
                fmt(c["p99"] * 1000, 1),
                fmt(c["ratio_p50"]),
                fmt(c["ratio_p99"]),
            ]
        )
    seal = data["seal"]
    mb = seal["bytes"] / MIB
    return "\n".join(
        [
            header("Evidence outside the sandbox: PostgreSQL + S3 against SQLite + local", data),
            "",
            f"{data['tasks']} tasks per configuration, interleaved; each: a workspace of {FILES} "
            f"files checkpointed, then a command changing {CHANGED} of them, then close. "
            "Exit→close runs from the command's own exit stamp to a complete close receipt.",
            "",
            md_table(
                [
                    "backends",
                    "admission p50 ms",
                    "p99 ms",
                    "x default",
                    "exit→close p50 ms",
                    "p99 ms",
                    "x default p50",
                    "x default p99",
                ],
                rows,
            ),
            "",
            f"Sealed log of {mb:.0f} MiB (incompressible) into SeaweedFS: the owner's seal took "
            f"{fmt(seal['seal_s'])} s ({fmt(mb / seal['seal_s'], 0)} MiB/s); the same bytes as "
            f"plain `put_object` of 4 MiB pieces {fmt(seal['plain_pieces_s'])} s "
            f"(seal/plain {fmt(seal['seal_s'] / seal['plain_pieces_s'])}x), as one "
            f"`S3ObjectStore.put_stream` (multipart) {fmt(seal['multipart_s'])} s.",
        ]
    )
