"""The `settled` command line: a thin shell over `Runtime` (contract in DESIGN.md). This module
holds the verbs' handlers and `main`; their grammar is `cli/parser.py`, and the verbs that start
a command and relay it (`exec`, `run`, `attach`) are `cli/running.py`'s.

Every exit code is one of `errors.EXIT_CODES` (listed below; no space on the home's filesystem is
3). `--json` prints exactly one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterable, Iterator

from settled.cli.frame import (
    bind_backends,
    broken_pipe,
    emit,
    execute,
    fail,
    settled_code,
    with_runtime,
    write_all,
)
from settled.cli.parser import UsageError, parse
from settled.errors import (
    EXIT_BLOCKED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    BadInput,
    NotSettled,
    SettledError,
)
from settled.printable import printable, printable_tree
from settled.render import close_text, explain_brief, receipt_text, status_text

TYPE_CHECKING = False
if TYPE_CHECKING:  # the runtime is imported by the verbs that open one (not --version, --help)
    from typing import Any

    from settled.runtime import Runtime


def cmd_task_new(rt: Runtime, args: argparse.Namespace) -> int:
    from settled.requests import TaskRequest

    options = {name: getattr(args, name) for name in TaskRequest.fields() - {"allow_hosts"}}
    record = rt.create_task(TaskRequest(allow_hosts=args.allow_host or (), **options))
    text = f"task {record.task} (key {printable(record.key)}) at {printable(record.workspace)}"
    emit(args, record.to_json(), text, brief=record.task)
    return EXIT_OK


def cmd_wait(rt: Runtime, args: argparse.Namespace) -> int:
    view = rt.wait(args.session, args.timeout)
    receipt = view.get("receipt")
    emit(args, receipt or view, receipt_text(receipt) if receipt else status_text(view))
    return settled_code(view)


def cmd_logs(rt: Runtime, args: argparse.Namespace) -> int:
    if args.view is not None:
        stream = "stdout" if args.stream == "merged" else args.stream
        sys.stdout.write(rt.view(args.session, stream, args.view))
        sys.stdout.flush()
        return EXIT_OK
    out = sys.stdout.buffer
    chunks = _merged_chunks(rt, args) if args.stream == "merged" else _stream_chunks(rt, args)
    try:
        for chunk in chunks:
            write_all(out, chunk)
        out.flush()
    except BrokenPipeError:
        return broken_pipe()
    except TimeoutError as exc:  # the follow's own bound: the session goes on, exit 3
        out.flush()
        raise NotSettled(f"logs --follow of {args.session}: {exc}; the session goes on") from None
    return EXIT_OK


def _stream_chunks(rt: Runtime, args: argparse.Namespace) -> Iterator[bytes]:
    if args.follow:
        return rt.follow(args.session, args.stream, args.start, timeout=args.timeout)
    return _range_chunks(rt, args.session, args.stream, args.start)


def _merged_chunks(rt: Runtime, args: argparse.Namespace) -> Iterator[bytes]:
    """Both streams in the order the owner stored them; from where that order is not recorded
    (a session from before the index), stdout then stderr, said once on stderr."""
    if args.follow:
        source: Iterable[Any] = rt.follow_merged(args.session, args.start, timeout=args.timeout)
    else:
        source = _merged_range(rt, args.session, args.start)
    warned = False
    for chunk in source:
        if not chunk.ordered and not warned:
            warned = True
            print(
                f"settled: the order of {args.session}'s output is not recorded from merged "
                f"cursor {chunk.at} on: stdout, then stderr",
                file=sys.stderr,
            )
        yield chunk.data


def _merged_range(rt: Runtime, session: str, start: int) -> Iterator[Any]:
    cursor = start
    while True:
        chunks = rt.read_merged(session, cursor)
        if not chunks:
            return
        yield from chunks
        cursor = chunks[-1].at + len(chunks[-1].data)


def _range_chunks(rt: Runtime, session: str, stream: str, start: int) -> Iterator[bytes]:
    cursor = start
    while True:
        chunk = rt.read(session, stream, cursor)
        if not chunk:
            return
        yield chunk
        cursor += len(chunk)


def cmd_cancel(rt: Runtime, args: argparse.Namespace) -> int:
    view = rt.cancel(args.session, args.reason)
    emit(args, view, status_text(view))
    return EXIT_OK


def cmd_close(rt: Runtime, args: argparse.Namespace) -> int:
    if args.list_fault_points:
        from settled.runtime import ALL_POINTS

        for name in ALL_POINTS:
            print(name)
        return EXIT_OK
    if args.task is None:
        raise BadInput("close needs a TASK (or --list-fault-points)")
    from settled.cli.closing import blocked_words, close_with_progress, interrupted_line

    try:
        result = close_with_progress(rt, args.task, args.final, args.deadline)
    except KeyboardInterrupt:
        print(interrupted_line(args.task), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    if result.complete:
        emit(args, result.to_json(), close_text(result.to_json()))
        return EXIT_OK
    payload = result.to_json()
    emit(args, payload, blocked_words(args.task, payload["blocked_on"]))
    return EXIT_BLOCKED


def cmd_checkpoint(rt: Runtime, args: argparse.Namespace) -> int:
    receipt = rt.checkpoint(args.task, incremental=not args.full)
    stats = receipt["scan"]["stats"]
    emit(
        args,
        receipt,
        f"checkpoint {receipt['manifest']} ({receipt['entries']} entries, "
        f"{receipt['scan']['mode']} scan: {stats['files_hashed']} hashed, "
        f"{stats['blobs_written']} blobs written), watermark {receipt['watermark']}",
    )
    return EXIT_OK


def cmd_recover(rt: Runtime, args: argparse.Namespace) -> int:
    if args.host is not None:
        if args.task is not None:
            raise UsageError("recover takes --task or --host, not both")
        vanished = rt.recover_host(args.host)
        results = vanished["sessions"]
        header = [f"host {args.host} vanished: {len(vanished['frozen_tasks'])} task(s) frozen"]
    else:
        results, header, vanished = rt.recover(args.task), [], {}
    still = [r for r in results if r["state"] == "unknown"]
    lines = [_settling_line(r) for r in printable_tree(results)]
    emit(
        args,
        {**vanished, "sessions": results},
        "\n".join(header + lines) or "no session needs recovery",
    )
    return EXIT_BLOCKED if still else EXIT_OK


def _settling_line(result: dict[str, Any]) -> str:
    """One session's line in what recover and destroy settled: its state and why."""
    return f"{result['session']}: {result['state']} — {result.get('evidence') or result.get('why')}"


def cmd_hosts(rt: Runtime, args: argparse.Namespace) -> int:
    hosts = rt.hosts()
    lines = [
        f"{h['host']}  {h['name']}  {h['home']}"
        + ("  (this host)" if h["this"] else "")
        + (f"  vanished: {h['vanished_why']}" if h["vanished_at"] else "")
        for h in printable_tree(hosts)
    ]
    emit(args, {"hosts": hosts}, "\n".join(lines))
    return EXIT_OK


def cmd_task_destroy(rt: Runtime, args: argparse.Namespace) -> int:
    result = rt.destroy_task(args.task)
    confirmed = (result["sandbox"] or {}).get("confirmation")
    said = f": {json.dumps(confirmed, sort_keys=True)}" if confirmed is not None else ""
    provider = printable(str(result["provider"]))
    lines = [f"sandbox of {args.task} destroyed by provider {provider}{said}"] + [
        f"  {_settling_line(r)}" for r in printable_tree(result["sessions"])
    ]
    emit(args, result, "\n".join(lines))
    return EXIT_BLOCKED if any(r["state"] == "unknown" for r in result["sessions"]) else EXIT_OK


def cmd_explain(rt: Runtime, args: argparse.Namespace) -> int:
    view = rt.explain(args.task)
    more = f"(every session's evidence: settled explain {args.task} --verbose)"
    emit(args, view, printable(view["words"]) if args.verbose else explain_brief(view, more))
    return EXIT_OK if view["complete"] else EXIT_BLOCKED


def cmd_restore(rt: Runtime, args: argparse.Namespace) -> int:
    result = rt.restore(args.target, args.dest, same_owner=args.same_owner)
    payload = {
        "manifest": result.manifest_id,
        "dest": result.dest,
        "files": result.files,
        "dirs": result.dirs,
        "symlinks": result.symlinks,
        "fifos": result.fifos,
        "bytes": result.bytes_written,
        "not_restorable": [list(item) for item in result.not_restorable],
        "same_owner": args.same_owner,
        "owners_restored": result.owners_restored,
        "owners_unrecorded": result.owners_unrecorded,
        "setid_dropped": list(result.setid_dropped),
        "times_unrecorded": result.times_unrecorded,
        "hard_links": result.hard_links,
        "xattrs_dropped": [list(item) for item in result.xattrs_dropped],
    }
    text = (
        f"restored {result.manifest_id} into {printable(result.dest)}: {result.files} files, "
        f"{result.dirs} dirs, {result.symlinks} symlinks, {result.bytes_written} bytes"
    )
    if result.owners_restored:
        text += "; every recorded owner restored"
    elif args.same_owner:
        text += (
            f"; owners not restored for {result.owners_unrecorded} entries: the checkpoint "
            "records no owner for them (written before owners were recorded), so they are yours"
        )
    else:
        text += "; every entry is owned by you (--same-owner, as root, restores owners)"
    if result.setid_dropped:
        dropped = ", ".join(printable(path) for path in result.setid_dropped)
        text += f"; set-id bits dropped (not earned by this restore): {dropped}"
    if result.times_unrecorded:
        text += (
            f"; modification times not restored for {result.times_unrecorded} entries (the "
            "checkpoint predates recorded times)"
        )
    if result.xattrs_dropped:
        shown = ", ".join(f"{path} {name}" for path, name in result.xattrs_dropped[:10])
        more = len(result.xattrs_dropped) - 10
        text += (
            f"; extended attributes not set (trusted.*, security.* and file capabilities need "
            f"--same-owner as root): {shown}" + (f" and {more} more" if more > 0 else "")
        )
    if result.hard_links:
        text += f"; {result.hard_links} files made as hard links of another, never copied"
    if result.not_restorable:
        kinds = ", ".join(f"{printable(path)} ({kind})" for path, kind in result.not_restorable)
        text += f"; not restorable: {kinds}"
    emit(args, payload, text)
    return EXIT_OK if result.complete else EXIT_BLOCKED


def cmd_verify(rt: Runtime, args: argparse.Namespace) -> int:
    result = rt.verify(args.target, read_data=args.read_data)
    lines = []
    for problem in printable_tree(result["problems"]):
        detail = f" ({problem['detail']})" if problem.get("detail") else ""
        used_by = ", ".join(problem["paths"]) or "the manifest"
        lines.append(f"{problem['object']} {problem['problem']}{detail}: {used_by}")
    checked = "re-hashed" if result["read_data"] else "present at their size"
    verdict = "verified" if result["verified"] else f"{len(lines)} problems: NOT verified"
    lines.append(
        f"manifest {result['manifest']}: {result['objects']} objects, {result['trees']} trees "
        f"re-hashed and parsed, {result['blobs']} blobs {checked}, {result['bytes_read']} bytes "
        f"read; {verdict}"
    )
    emit(args, result, "\n".join(lines))
    return EXIT_OK if result["verified"] else EXIT_BLOCKED


def cmd_demo(rt: Runtime, args: argparse.Namespace) -> int:
    from settled.demo import run_demo

    made = getattr(args, "made_home", False)
    try:
        return run_demo(rt)
    finally:
        if made and not args.keep_home:  # what it started ends before the home goes
            rt.stop_journal()
            rt.release_pods()


def cmd_probe(args: argparse.Namespace) -> int:
    """Never on the user's home: the settled runtime is probed on a fresh one it removes."""
    if getattr(args, "home", None) is not None:
        raise UsageError("probe runs settled on a fresh temporary home of its own; drop --home")
    from settled.probe import QUESTION_IDS, probe
    from settled.probe.report import text

    def progress(version: str, question: Any) -> None:
        print(f"probing {version}: {question.asks}", file=sys.stderr, flush=True)

    quiet = getattr(args, "json", False) or getattr(args, "quiet", False)
    with _terminate_unwinds():
        report = probe(args.runtime or ["settled"], args.only or QUESTION_IDS,
                       None if quiet else progress)  # fmt: skip
    emit(args, report.to_json(), text(report), brief="holds" if report.holds else "fails")
    return report.exit_code


@contextlib.contextmanager
def _terminate_unwinds() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like Ctrl-C meanwhile, so an interrupted probe still closes
    its tasks, ends the commands it started and removes its home."""
    import signal

    def unwind(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    before = {number: signal.signal(number, unwind) for number in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)


def _demo(args: argparse.Namespace) -> int:
    """The demo runs in a fresh home of its own unless one is named, so trying it leaves the
    user's home (and its list of tasks) as it was; that home is removed when it ends, its
    daemons stopped first, unless `--keep-home` (then its path is the last line)."""
    args.made_home = getattr(args, "home", None) is None and not os.environ.get("SETTLED_HOME")
    if not args.made_home:
        return with_runtime(args)
    import shutil
    import tempfile

    args.home = tempfile.mkdtemp(prefix="settled-demo-")
    try:
        return with_runtime(args)
    finally:
        if args.keep_home:
            print(f"the demo's home is kept: SETTLED_HOME={printable(args.home)} settled ls")
        else:
            shutil.rmtree(args.home, ignore_errors=True)
            print(f"the demo's home {printable(args.home)} is removed (--keep-home keeps it)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse(argv)
    except SettledError as exc:  # a BadValue of an argument's grammar, or a UsageError
        as_json = argparse.Namespace(json="--json" in argv)
        return fail(as_json, exc.to_json(), str(exc), exc.exit_code)
    return execute(args, _dispatch)


def _dispatch(args: argparse.Namespace) -> int:
    bind_backends(args)
    if args.verb == "mcp":  # stdio is the protocol: nothing else may print on stdout
        from settled.mcp_server import run_stdio

        return run_stdio(getattr(args, "home", None))
    if args.verb == "serve" and args.swerex:
        return _serve_swerex(args)
    if args.verb == "serve":  # the server keeps a Runtime per worker thread of its own
        from settled.server import serve

        return serve(getattr(args, "home", None), args.host, args.port, args.tokens)
    if args.verb == "probe":  # opens no Runtime on the user's home: it makes its own
        return cmd_probe(args)
    if args.verb == "soak":  # a temporary home of its own, never the caller's
        return _soak(args)
    if args.verb == "demo":
        return _demo(args)
    return with_runtime(args)


def _soak(args: argparse.Namespace) -> int:
    from settled.soak import parse_faults, parse_points, run_soak

    for flag in ("home", "store", "objects"):
        if getattr(args, flag, None):
            raise BadInput(f"soak runs in a temporary home of its own: --{flag} is not taken")
    seed = args.seed
    if seed is None:
        import random

        seed = random.SystemRandom().randrange(1 << 32)
    points, faults = parse_points(args.points), parse_faults(args.faults)
    return run_soak(args.crashes, seed, lanes=args.lanes, start=args.start, points=points,
                    as_json=bool(getattr(args, "json", False)), faults=faults,
                    per_kind=args.faults_per_kind)  # fmt: skip


def _serve_swerex(args: argparse.Namespace) -> int:
    """Never without a key (server/swerex_key.py: the one given, else one made and written
    0600, its path printed); the key leaves this process's environment before anything is
    served, so no command inherits it."""
    import contextlib

    from settled.runtime import ready_home
    from settled.server import bind
    from settled.server.swerex import announce, output_cap, serve_swerex
    from settled.server.swerex_key import choose_key, where_said
    from settled.where import run_dir

    home = ready_home(getattr(args, "home", None))
    cap = output_cap(os.environ)  # a bad one is refused before anything is made or said
    key, made, ours = choose_key(run_dir(home), args.api_key_file, os.environ)
    try:
        try:
            sock = bind(args.host, args.port)
        except OSError as exc:
            raise BadInput(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from exc
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        workspace = args.swerex_workspace or os.environ.get("SETTLED_SWEREX_WORKSPACE")
        announce(url, home, workspace, where_said(args.api_key_file, made))
        try:
            serve_swerex(home, sock, key, workspace, cap)
        finally:
            sock.close()
    finally:
        if ours and made is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(made)
    return EXIT_OK
