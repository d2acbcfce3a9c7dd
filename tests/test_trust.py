"""A command cannot escape its boundary, forge its receipts or read another's secrets.

Each test is an attack a hostile root command would try (docs/TRUST.md names the test for each
claim), run as root in a real session with the default isolation, and asserts that it failed and
that what settled then claims is still true. The strong paths need CAP_SYS_ADMIN and a writable
cgroup2; elsewhere they are skipped with the reason (and fail under CI=true, which has both).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import COMMAND_PYTHON, _skip_unavailable, kill_marked, release_pods, stop_journals

from settled.boundary import find_hierarchy, procfs
from settled.boundary.isolation import make_plan
from settled.errors import HomeUnusable, ReceiptTampered
from settled.grants import BadGrant
from settled.records import TaskRecord
from settled.runtime import Runtime
from settled.store.rows import HIDDEN_INLINE_MAX
from settled.store.sqlite import SQLiteStore

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the attacks are those of a root command")


@pytest.fixture(autouse=True)
def _strong_paths() -> None:
    _skip_unavailable("cgroup2+pidns")


def attack(rt: Runtime, task: TaskRecord, shell: str, **kw: object) -> tuple[dict, str, str]:
    """Run `shell` as the command; returns its receipt, stdout and stderr."""
    admission = rt.exec(task.task, shell=shell, **kw)  # type: ignore[arg-type]
    view = rt.wait(admission.session, timeout=60)
    assert view["state"] == "settled", json.dumps(view, default=str)[:3000]
    receipt: dict = view["receipt"]
    out = rt.read(admission.session, "stdout").decode(errors="replace")
    err = rt.read(admission.session, "stderr").decode(errors="replace")
    return receipt, out, err


# -- 1. leave the boundary -------------------------------------------------------------------


def test_a_command_cannot_move_itself_into_another_cgroup(rt: Runtime, task: TaskRecord) -> None:
    root = find_hierarchy()
    receipt, out, err = attack(
        rt,
        task,
        f"cat /proc/self/cgroup | grep '^0::'; echo $$ > {root}/cgroup.procs && echo MOVED; "
        f"mkdir {root}/escape && echo MADE; "
        "mkdir -p /tmp/cg && mount -t cgroup2 none /tmp/cg && echo MOUNTED; true",
    )
    assert "0::/\n" in out, "the cgroup namespace is rooted at the session's cgroup"
    assert "MOVED" not in out and "MADE" not in out and "MOUNTED" not in out
    assert "Read-only file system" in err
    assert not os.path.exists(f"{root}/escape")
    assert receipt["death"]["proven"] and receipt["death"]["boundary"] == "cgroup2+pidns"
    assert receipt["isolation"]["cgroup"] == "namespace, read-only"


def test_an_escape_from_a_plain_cgroup_is_found_killed_and_named(
    rt: Runtime, task: TaskRecord, marker: str
) -> None:
    """Without isolation a root process can leave a plain cgroup; the owner, a subreaper,
    still finds it among its descendants, kills it, and says so in the evidence."""
    root = find_hierarchy()
    escapee = (
        f"sh -c 'echo $$ > {root}/cgroup.procs; touch left; exec sleep 300' & "
        "while [ ! -e left ]; do sleep 0.01; done; echo main exits"
    )
    receipt, _out, _ = attack(rt, task, escapee, isolation="none", boundary="cgroup2", grace=0.5)
    death = receipt["death"]
    assert death["proven"] is True
    [escaped] = death["observed"]["escaped"]
    assert "sleep 300" in escaped["cmdline"] and escaped["cgroup"] != death["observed"]["cgroup"]
    assert "left the cgroup" in death["evidence"]
    assert not _alive(escaped["pid"])
    assert kill_marked(marker, b"sleep 300") == []


def test_recovery_does_not_take_a_leavable_cgroup_as_proof(
    rt: Runtime, task: TaskRecord, marker: str
) -> None:
    admission = rt.exec(task.task, shell="sleep 300", isolation="none", boundary="cgroup2")
    owner = rt.store.get_session(admission.session).owner
    assert owner is not None
    os.kill(owner.pid, signal.SIGKILL)
    _wait(lambda: not _alive(owner.pid))
    [result] = rt.recover(task.task)
    assert result["state"] == "unknown" and "cgroup namespace" in result["why"]
    assert rt.session_status(admission.session)["state"] == "unknown"
    kill_marked(marker, b"sleep 300")


def test_recovery_of_a_contained_session_proves_death_from_its_cgroup_and_namespace(
    rt: Runtime, task: TaskRecord, marker: str
) -> None:
    admission = rt.exec(task.task, shell="setsid sleep 300 & exec sleep 301")
    owner = rt.store.get_session(admission.session).owner
    assert owner is not None
    os.kill(owner.pid, signal.SIGKILL)
    _wait(lambda: not _alive(owner.pid))
    [result] = rt.recover(task.task)
    assert result["state"] == "settled"
    assert "PID namespace" in result["evidence"] and "populated 0" in result["evidence"]
    assert kill_marked(marker, b"sleep 30") == [], "every process of the session is dead"


# -- 2. rewrite the record -------------------------------------------------------------------


def test_the_home_does_not_exist_for_the_command(rt: Runtime, task: TaskRecord) -> None:
    home = rt.home
    _, out, _ = attack(
        rt,
        task,
        f"ls -A {home} | wc -l; test -e {home}/settled.db && echo DB; env; "
        f"cat /proc/1/cmdline | tr '\\0' ' '; echo; grep -c '{home}' /proc/1/cmdline",
    )
    lines = out.splitlines()
    assert lines[0] == "0", "the home is an empty directory"
    assert "DB" not in lines
    assert not any(line.startswith("SETTLED_") for line in lines)
    assert home not in out.replace(f"grep -c '{home}'", "")


def test_what_the_command_finds_at_the_homes_path_is_its_own_and_the_home_is_untouched(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    """The home is not in the view: its path and its parents' are, at most, directories of the
    task's own /tmp (here, where the workspace's mount point is made). Renaming them and
    planting a forged home there changes nothing of the real home, and the next session still
    runs in its workspace, which it still sees whole."""
    home = Path(rt.home)
    (Path(task.workspace) / "kept").write_text("mine")
    stored = (home / "settled.db").stat()
    _, out, _err = attack(
        rt,
        task,
        f"test -e {home}/settled.db && echo SEEN; mv {home.parent} /tmp/moved && echo MOVED; "
        f"mkdir -p {home} && echo forged > {home}/settled.db && echo PLANTED; true",
    )
    assert "SEEN" not in out and "PLANTED" in out
    after = (home / "settled.db").stat()  # never opened here: closing a descriptor of the
    assert (after.st_ino, after.st_dev) == (stored.st_ino, stored.st_dev)  # store drops its locks
    assert tmp_path.is_dir() and not (tmp_path.parent / "moved").exists()
    receipt, out, _err = attack(rt, task, "pwd; cat kept; echo; ls /tmp")
    assert receipt["exit"]["code"] == 0
    lines = out.split()
    assert lines[:2] == [task.workspace, "mine"] and "moved" in lines[2:]


def test_a_receipt_edited_in_the_store_is_refused_by_status_close_and_explain(
    rt: Runtime, task: TaskRecord
) -> None:
    receipt, _, _ = attack(rt, task, "exit 1")
    forged = json.dumps({**receipt, "exit": {**receipt["exit"], "code": 0}}, sort_keys=True)
    with sqlite3.connect(os.path.join(rt.home, "settled.db")) as db:
        db.execute("UPDATE sessions SET receipt=? WHERE session=?", (forged, receipt["session"]))
    with pytest.raises(ReceiptTampered, match=receipt["session"]):
        rt.session_status(receipt["session"])
    with pytest.raises(ReceiptTampered):
        rt.close_task(task.task)
    with pytest.raises(ReceiptTampered):
        rt.explain(task.task)
    cli = subprocess.run(
        [sys.executable, "-m", "settled.cli", "--home", rt.home, "status", receipt["session"]],
        capture_output=True,
        timeout=60,
    )
    assert cli.returncode == 3 and b"ReceiptTampered" in cli.stderr


def test_a_close_fact_edited_in_the_store_is_refused(rt: Runtime, task: TaskRecord) -> None:
    attack(rt, task, "true")
    assert rt.close_task(task.task).complete
    with sqlite3.connect(os.path.join(rt.home, "settled.db")) as db:
        (fact,) = db.execute(
            "SELECT fact FROM close_steps WHERE task=? AND step='fenced'", (task.task,)
        ).fetchone()
        edited = fact.replace('"fenced_at":', '"fenced_at":1,"x":')
        db.execute(
            "UPDATE close_steps SET fact=? WHERE task=? AND step='fenced'", (edited, task.task)
        )
    with pytest.raises(ReceiptTampered, match="fenced"):
        rt.explain(task.task)


def test_a_checkpoint_receipt_edited_in_the_store_is_refused_by_restore(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    attack(rt, task, "echo hi > file")
    assert rt.close_task(task.task).complete
    with sqlite3.connect(os.path.join(rt.home, "settled.db")) as db:
        (text,) = db.execute(
            "SELECT receipt FROM checkpoints WHERE task=?", (task.task,)
        ).fetchone()
        edited = text.replace('"verified":true', '"verified":true,"x":1', 1)
        db.execute("UPDATE checkpoints SET receipt=? WHERE task=?", (edited, task.task))
    with pytest.raises(ReceiptTampered, match="checkpoint receipt"):
        rt.restore(task.task, str(tmp_path / "restored"))
    assert not (tmp_path / "restored").exists()


def test_an_unknown_sessions_receipt_edited_to_claim_proof_is_refused_by_recovery(
    rt: Runtime, task: TaskRecord, marker: str
) -> None:
    """A pgroup receipt is never proof; rewritten to say `proven: true`, recovery refuses it."""
    admission = rt.exec(task.task, shell="true", boundary="pgroup")
    rt.wait(admission.session, timeout=60)
    with sqlite3.connect(os.path.join(rt.home, "settled.db")) as db:
        (text,) = db.execute(
            "SELECT receipt FROM sessions WHERE session=?", (admission.session,)
        ).fetchone()
        forged = text.replace('"proven":false', '"proven":true', 1)
        assert forged != text
        db.execute("UPDATE sessions SET receipt=? WHERE session=?", (forged, admission.session))
    with pytest.raises(ReceiptTampered, match=admission.session):
        rt.recover(task.task)


def test_stdin_reaches_the_command_but_its_stored_copy_cannot_be_changed(
    rt: Runtime, task: TaskRecord
) -> None:
    _receipt, out, _err = attack(
        rt, task, "cat; echo forged >> /proc/self/fd/0 && echo WROTE; true", stdin=b"payload\n"
    )
    assert out.startswith("payload\n") and "WROTE" not in out
    stored = [p for p in Path(rt.home, "stdin").iterdir()]
    assert [p.read_bytes() for p in stored] == [b"payload\n"]


# -- 4. read the secrets ---------------------------------------------------------------------


@pytest.fixture
def in_a_system_root() -> Iterator[Path]:
    """A directory inside /usr (a root of every view, read-only): where a workspace or a home
    lies inside what the command sees, and so must be covered. Removed after."""
    made = Path(tempfile.mkdtemp(prefix="settled-trust-", dir="/usr/local"))
    try:
        yield made
    finally:
        shutil.rmtree(made)


def test_other_tasks_workspaces_and_hidden_files_are_absent_or_empty_to_the_command(
    rt: Runtime, task: TaskRecord, tmp_path: Path, in_a_system_root: Path
) -> None:
    """Outside every root of the view they do not exist (and nothing needs covering); a grant
    that would open another task's workspace is refused; inside a root of the view (a
    workspace under /usr), another task's workspace is an empty directory, and a tokens file
    inside a granted directory reads as /dev/null."""
    shared = tmp_path / "shared"
    other = shared / "other-workspace"
    other.mkdir(parents=True)
    (other / "secret").write_text("another task's secret")
    rt.new_task(str(other))
    tokens_dir = tmp_path / "tokens"
    tokens_dir.mkdir()
    tokens = tokens_dir / "tokens.json"
    tokens.write_text('{"tokens": [{"token": "a-very-secret-token-value", "tasks": "*"}]}')
    rt.hide_paths([str(tokens)])
    probe = f"ls -A {other}; cat {tokens}; ls {shared} || echo ABSENT; echo END"
    receipt, out, _ = attack(rt, task, probe)
    assert out == "ABSENT\nEND\n"
    assert receipt["isolation"]["hidden"] == {"dirs": [], "files": []}
    with pytest.raises(BadGrant, match="another task's workspace"):
        attack(rt, task, probe, writable=[str(shared)])
    receipt, out, _ = attack(rt, task, f"cat {tokens}; ls {tokens_dir}; echo END",
                             readable=[str(tokens_dir)])  # fmt: skip
    assert out == "tokens.json\nEND\n"
    assert receipt["isolation"]["hidden"] == {"dirs": [], "files": [str(tokens)]}
    inside = in_a_system_root / "ws"
    inside.mkdir()
    (inside / "secret").write_text("another task's secret")
    rt.new_task(str(inside))
    receipt, out, _ = attack(rt, task, f"ls -A {inside}; touch {inside}/x || echo RO; echo END")
    assert out == "RO\nEND\n"
    assert receipt["isolation"]["hidden"]["dirs"] == [str(inside)]
    covers = {e["path"] for e in receipt["isolation"]["view"] if e["kind"] == "cover"}
    assert str(inside) in covers
    assert [p.name for p in inside.iterdir()] == ["secret"]


def test_every_other_workspace_is_covered_empty_and_read_only_beside_the_homes_own_cover(
    rt: Runtime, in_a_system_root: Path
) -> None:
    """Where a root of the view holds them (a home and its workspaces under /usr): the first
    cover that holds no workspace is an empty read-only tmpfs, bound over every other hidden
    directory; the home's, which holds this task's workspace, is a tmpfs of its own with the
    workspace bound back in."""
    with Runtime(str(in_a_system_root / "home")) as runtime:
        others = []
        for name in ("a", "b", "c"):
            other = in_a_system_root / f"other-{name}"
            other.mkdir()
            (other / "secret").write_text(f"{name}'s secret")
            runtime.new_task(str(other))
            others.append(other)
        task = runtime.new_task()  # its workspace lies in the home
        probe = "; ".join(f"ls -A {o}; touch {o}/planted && echo PLANTED {o}" for o in others)
        home = runtime.home
        receipt, out, err = attack(
            runtime,
            task,
            f"{probe}; ls -A {home}; touch {home}/planted && echo HOME; touch mine && echo MINE",
        )
        assert out == "workspaces\nMINE\n", out
        assert err.count("Read-only file system") == len(others) + 1, err
        assert home in receipt["isolation"]["hidden"]["dirs"]
        assert receipt["isolation"]["home_hidden"] is True
        assert {str(o) for o in others} <= set(receipt["isolation"]["hidden"]["dirs"])
        for other in others:
            assert [p.name for p in other.iterdir()] == ["secret"]
        assert Path(task.workspace, "mine").exists()
        assert runtime.close_task(task.task).complete
        release_pods(in_a_system_root)


def test_a_home_of_many_tasks_stores_their_hidden_list_once_and_each_receipt_names_them_all(
    rt: Runtime, task: TaskRecord, in_a_system_root: Path
) -> None:
    """Past rows.HIDDEN_INLINE_MAX covered workspaces (inside a root of the view that holds
    them all), the list is stored apart, once for every session that hides the same ones: each
    receipt still names all of them, sealed as written, and the command still sees none of
    them. (The view names each cover too.)"""
    others = []
    for n in range(HIDDEN_INLINE_MAX + 4):
        other = in_a_system_root / f"other-{n:02d}"
        other.mkdir()
        (other / "secret").write_text(f"{n}'s secret")
        rt.new_task(str(other))
        others.append(str(other))
    receipts = [  # each inside /usr: covered, so named in the receipt
        attack(rt, task, f"for d in {' '.join(others)}; do ls -A $d; done; echo END")
        for _ in range(2)
    ]
    for receipt, out, _err in receipts:
        assert out == "END\n", out
        assert set(others) <= set(receipt["isolation"]["hidden"]["dirs"])
    if not isinstance(rt.store, SQLiteStore):
        return  # the store's own tests check the rows of every backend
    with sqlite3.connect(os.path.join(rt.home, "settled.db")) as db:
        rows = db.execute(
            "SELECT receipt, isolation FROM sessions WHERE task=?", (task.task,)
        ).fetchall()
        (sets,) = db.execute("SELECT count(*) FROM hidden_sets").fetchone()
    assert sets == 1
    for receipt_text, isolation_text in rows:
        assert '"dirs_set":' in receipt_text and '"dirs_set":' in isolation_text
        hidden_text = json.dumps(json.loads(receipt_text)["isolation"]["hidden"])
        assert not any(o in hidden_text for o in others)
        view = json.loads(isolation_text)["view"]  # the view names each cover, as it was made
        assert set(others) <= {e["path"] for e in view if e["kind"] == "cover"}


def test_the_command_sees_only_its_own_processes(rt: Runtime, task: TaskRecord) -> None:
    _, out, _err = attack(
        rt,
        task,
        f"ls /proc | grep -c '^[0-9]'; test -e /proc/{os.getpid()} && echo SEES-US; "
        "cat /proc/1/environ > /dev/null && echo READ-INIT; cat /proc/1/fd/1 && echo FDS; "
        "readlink /proc/1/fd/1 && echo LINK; cat /proc/1/mem && echo MEM; true",
    )
    assert int(out.splitlines()[0]) <= 4, "init, sh and what it runs, nothing of the host"
    for leak in ("SEES-US", "READ-INIT", "FDS", "LINK", "MEM"):
        assert leak not in out


def test_ptrace_and_namespace_tools_are_refused(rt: Runtime, task: TaskRecord) -> None:
    probe = (
        "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
        "r = libc.ptrace(16, 1, 0, 0); print('ptrace', r, os.strerror(ctypes.get_errno()))"
    )
    _, out, _ = attack(
        rt,
        task,
        f'{COMMAND_PYTHON} -I -S -c "{probe}"; nsenter -t 1 -m true && echo NSENTER; '
        "unshare -m true && echo UNSHARE; mount -t tmpfs none /mnt && echo MOUNT; "
        "grep CapBnd /proc/self/status; grep NoNewPrivs /proc/self/status; true",
    )
    assert "NoNewPrivs:\t1" in out
    assert "ptrace -1 Operation not permitted" in out
    assert "NSENTER" not in out and "UNSHARE" not in out and "MOUNT" not in out
    bounding = int(out.split("CapBnd:")[1].split()[0], 16)
    for cap in (16, 17, 19, 21, 2, 27):  # SYS_MODULE, SYS_RAWIO, SYS_PTRACE, SYS_ADMIN, ...
        assert not bounding >> cap & 1


def test_a_user_namespace_cannot_uncover_the_home(rt: Runtime, task: TaskRecord) -> None:
    _, out, _ = attack(
        rt,
        task,
        f"unshare -Urm sh -c 'umount {rt.home} && echo UNCOVERED; ls -A {rt.home} | wc -l'; true",
    )
    assert "UNCOVERED" not in out
    assert out.strip().splitlines()[-1:] in (["0"], [])


def test_there_is_no_way_to_the_raw_disk_or_the_kernels_knobs(
    rt: Runtime, task: TaskRecord
) -> None:
    _, out, _err = attack(
        rt,
        task,
        "ls /dev; mknod /dev/disk b 254 0 && echo MKNOD; "
        "echo '|/bin/sh' > /proc/sys/kernel/core_pattern && echo CORE; "
        "echo 1 > /proc/sysrq-trigger && echo SYSRQ; "
        "test -w /sys/kernel/uevent_helper && echo > /sys/kernel/uevent_helper && echo UEVENT;"
        " true",
    )
    devices = set(out.split())
    assert devices >= {"null", "zero", "urandom", "pts", "shm"}
    assert not {d for d in devices if d.startswith(("vd", "sd", "nvme", "loop", "mem", "kmem"))}
    for escaped in ("MKNOD", "CORE", "SYSRQ", "UEVENT"):
        assert escaped not in out


def test_only_stdin_stdout_and_stderr_are_inherited(rt: Runtime, task: TaskRecord) -> None:
    _, out, _ = attack(rt, task, "ls /proc/$$/fd")
    assert out.split() == ["0", "1", "2"]


# -- as another user, and what the receipt says ----------------------------------------------


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory another uid can reach (pytest's tmp_path sits under a 0700 parent)."""
    path = Path(tempfile.mkdtemp(prefix="settled-trust-", dir="/tmp"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        with contextlib.suppress(Exception), Runtime(str(path / "home")) as runtime:
            runtime.recover()
        stop_journals(path)
        release_pods(path)
        shutil.rmtree(path, ignore_errors=True)


def test_a_command_runs_as_the_user_asked_for(open_dir: Path) -> None:
    workspace = open_dir / "ws"
    workspace.mkdir(mode=0o777)
    os.chmod(workspace, 0o777)
    with Runtime(str(open_dir / "home")) as rt:
        task = rt.new_task(str(workspace))
        receipt, out, _ = attack(
            rt, task, "id -u; id -g; grep CapEff /proc/self/status", user="65534"
        )
    uid, gid, caps = out.split("\n")[:3]
    assert (uid, gid) == ("65534", "65534")
    assert int(caps.split()[1], 16) == 0
    assert (receipt["isolation"]["uid"], receipt["isolation"]["gid"]) == (65534, 65534)


def test_a_task_default_user_applies_to_its_commands(open_dir: Path) -> None:
    with Runtime(str(open_dir / "home")) as rt:
        task = rt.new_task(user="65534:65534")  # its workspace, in the home, is the user's
        _, out, _ = attack(rt, task, "id -u; touch mine && stat -c %u mine")
    assert out.split() == ["65534", "65534"]


def test_isolation_none_is_said_in_the_receipt_and_explain(rt: Runtime, task: TaskRecord) -> None:
    receipt, _, _ = attack(rt, task, "true", isolation="none")
    assert "all" in receipt["isolation"]["missing"]
    assert "all" in rt.session_status(receipt["session"])["protections_missing"]
    view = rt.explain(task.task)
    [session] = view["sessions"]
    assert session["missing_protections"]["all"].startswith("isolation none")
    assert "protections missing" in view["words"]


def test_explain_names_each_sessions_evidence_and_protections(
    rt: Runtime, task: TaskRecord
) -> None:
    attack(rt, task, "true")
    rt.close_task(task.task)
    [session] = rt.explain(task.task)["sessions"]
    assert "init" in session["evidence"] and "populated 0" in session["evidence"]
    assert "settled home hidden" in session["protections"]
    assert session["missing_protections"] == {}


def test_strict_isolation_is_refused_where_a_protection_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(procfs, "effective_capabilities", lambda: 0)
    plan = make_plan("auto", workspace="/w", home="/h", pid_namespace=False)
    assert set(plan.missing) >= {"mount_namespace", "home_hidden", "proc", "cgroup"}
    assert plan.to_json()["home_hidden"] is False
    with pytest.raises(Exception, match="strict"):
        make_plan("strict", workspace="/w", home="/h", pid_namespace=True)


def test_the_covers_and_the_grants_are_what_their_definitions_say(tmp_path: Path) -> None:
    """choose_covers keeps, of the home and the other workspaces that exist and lie inside a
    root of the view, those inside no other kept one, never the workspace or an ancestor of
    it but the home. choose_grants keeps the existing grants, none inside the home or another
    workspace, none equal to the workspace, writable over readable at one path, and none
    inside a kept grant (or the workspace) of its own mode. Both checked against those
    definitions on random trees (one look per ancestor replaced a scan of every hidden
    directory, which made a plan quadratic in its home's tasks)."""
    from settled.boundary.viewplan import choose_covers, choose_grants, entry, is_within

    rng = random.Random(7)
    names = [tmp_path / f"d{i}" for i in range(4)]
    tree = [*names, *(n / f"e{j}" for n in names for j in range(3))]
    tree += [d / "f" for d in tree[4:10]]
    for path in tree:
        path.mkdir(parents=True, exist_ok=True)
    paths = [str(p) for p in tree]
    for _ in range(300):
        workspace, home = rng.sample(paths, 2)
        others = [*rng.sample(paths, rng.randint(0, len(paths))), str(tmp_path / "gone")]
        roots = rng.sample([*paths, str(tmp_path)], rng.randint(0, 4))
        regions = {r: entry(r, "readable", "ro", r) for r in roots}
        kept, _files = choose_covers(workspace, home, others, (), regions)
        expected: list[str] = []
        for path in sorted({home, *others}, key=len):
            if path == workspace or (is_within(workspace, path) and path != home):
                continue
            if not any(is_within(path, r) for r in roots):
                continue
            if any(is_within(path, outer) for outer in expected):
                continue
            if path != home and not os.path.isdir(path):
                continue
            expected.append(path)
        assert list(kept) == expected
        writable = [*rng.sample(paths, rng.randint(0, 3)), str(tmp_path / "gone")]
        readable = rng.sample(paths, rng.randint(0, 3))
        forbidden = {home, *rng.sample(paths, 2)}
        rw, ro = choose_grants(workspace, writable, readable, forbidden)
        chosen = {workspace: "rw"}
        for mode, asked in (("rw", writable), ("ro", readable)):
            for path in sorted(set(asked), key=lambda p: p.count("/")):
                if path in chosen or any(is_within(path, f) for f in forbidden):
                    continue
                if os.path.isdir(path):
                    chosen[path] = mode
        kept_grants: dict[str, str] = {}
        for path in sorted(chosen, key=lambda p: p.count("/")):
            holders = [k for k in kept_grants if is_within(path, k) and k != path]
            nearest = max(holders, key=len) if holders else None
            if path != workspace and nearest and kept_grants[nearest] == chosen[path]:
                continue
            kept_grants[path] = chosen[path]
        del kept_grants[workspace]
        assert sorted(rw) == sorted(p for p, m in kept_grants.items() if m == "rw")
        assert sorted(ro) == sorted(p for p, m in kept_grants.items() if m == "ro")


# -- helpers ---------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    state = procfs.state_of(pid)
    return state is not None and state != "Z"


def _wait(predicate: object, timeout: float = 20.0) -> None:
    give_up = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.01)


# -- the host outside the workspace ----------------------------------------------------------


def test_the_host_does_not_exist_but_for_the_view_whose_root_and_system_are_read_only(
    rt: Runtime, task: TaskRecord
) -> None:
    """settled's own code and interpreter, root's shell files, the host's /tmp: not in the view.
    The loader's configuration and the distribution's programs are, read-only, and so is the
    view's own root: what a host process would run next cannot be changed from a session."""
    import settled

    code = os.path.dirname(settled.__file__)
    receipt, out, err = attack(
        rt,
        task,
        f"test -e {code} && echo CODE; test -e {sys.base_prefix}/bin && echo PYTHON; "
        "test -e /root/.bashrc && echo RC; touch /etc/ld.so.preload && echo PRELOAD; "
        "touch /usr/bin/planted && echo USR; touch /planted && echo ROOT; mkdir /opt && echo OPT; "
        "touch inside && echo WORKSPACE; touch /tmp/settled-trust-$$ && echo TMP; true",
    )
    assert out.split() == ["WORKSPACE", "TMP"]
    assert err.count("Read-only file system") == 4, err
    assert receipt["isolation"]["host"] == "allow-list"
    assert not any(Path("/tmp").glob("settled-trust-*"))  # the task's own /tmp, not the host's


def test_a_granted_path_is_writable_and_the_whole_host_never_granted(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    granted = Path(tempfile.mkdtemp(prefix="settled-grant-", dir="/var/lib"))
    try:
        receipt, out, _ = attack(
            rt, task, f"touch {granted}/made && echo GRANTED", writable=[str(granted)]
        )
        assert out == "GRANTED\n" and str(granted) in receipt["isolation"]["writable"]
        with pytest.raises(BadGrant, match="whole host"):
            attack(rt, task, "true", writable=["/"])
    finally:
        shutil.rmtree(granted)


def test_every_file_and_directory_of_the_home_is_private_whatever_the_umask(
    tmp_path: Path,
) -> None:
    old = os.umask(0o000)
    try:
        workspace = tmp_path / "ws"
        workspace.mkdir()
        with Runtime(str(tmp_path / "home")) as rt:
            task = rt.new_task(str(workspace))
            attack(rt, task, "echo out; echo err >&2", stdin=b"in")
            assert rt.close_task(task.task).complete
    finally:
        os.umask(old)
    exposed = []
    nsfs = os.stat("/proc/self/ns/mnt").st_dev  # the pods pin: a namespace's inode, 0444 by
    for below, dirs, files in os.walk(tmp_path / "home"):  # the kernel, in the 0700 run dir
        if Path(below).parent == tmp_path / "home" / "pods":  # a task's pod: the command's
            modes = {d: stat.S_IMODE(os.lstat(os.path.join(below, d)).st_mode) for d in dirs}
            assert modes == {"home": 0o700, "shm": 0o1777, "tmp": 0o1777, "var-tmp": 0o1777}
            dirs[:] = []
            continue
        for name in [*dirs, *files]:
            found = os.lstat(os.path.join(below, name))
            mode = found.st_mode
            if mode & 0o077 and found.st_dev != nsfs:
                exposed.append((os.path.join(below, name), oct(mode)))
    assert exposed == []
    assert os.stat(tmp_path / "home").st_mode & 0o777 == 0o700


def test_a_home_reached_through_a_symlink_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(HomeUnusable, match="symlink"):
        Runtime(str(tmp_path / "link" / "home"))
