"""The command's view is an allow-list: nothing of the host exists for it but what it was given.

Real sessions through the Runtime as root (the attacks are a root command's), and, for what the
Runtime cannot ask for yet (`readable`), the plan built by `make_plan` and carried out by
`mountview` in a forked child, as an owner's init does. Each test creates what it looks for
(a host directory under /srv, a file in the host's /tmp, another home) and removes it.
"""

from __future__ import annotations

import ctypes
import json
import marshal
import os
import secrets
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import COMMAND_PYTHON, _skip_unavailable, stop_journals
from test_trust import attack

from settled.boundary import linux, mountview, poddirs, privileges, viewplan
from settled.boundary.isolation import IsolationPlan, make_plan
from settled.canonical import digest_of
from settled.grants import BadGrant
from settled.owner import home_launcher
from settled.records import TaskRecord
from settled.runtime import Runtime

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the attacks are those of a root command"),
    pytest.mark.timeout(120),
]


@pytest.fixture(autouse=True)
def _strong_paths() -> None:
    _skip_unavailable("cgroup2+pidns")


@pytest.fixture(params=("c", "ctypes"))
def calls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which binding of boundary/linux.py the owners (and their inits) use."""
    if request.param == "ctypes":
        monkeypatch.setenv("SETTLED_LINUX_CALLS", "ctypes")
    else:
        monkeypatch.delenv("SETTLED_LINUX_CALLS", raising=False)
        assert linux.BINDING == "c", "the C binding is not built: run scripts/setup"
    return str(request.param)


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A directory of the host that settled knows nothing of, with a secret in it."""
    path = Path(f"/srv/settled-test-{secrets.token_hex(6)}")
    path.mkdir(parents=True)
    (path / "secret").write_text("the host's secret")
    try:
        yield path
    finally:
        shutil.rmtree(path)


def _roots(task: TaskRecord, home: str = "/root") -> set[str]:
    """The names `ls -A /` shows in the view: the distribution's roots the host has, what the
    view makes, and the first components of the workspace's and $HOME's paths."""
    made = {"dev", "proc", "run", "sys", "tmp", "var"}
    system = {r[1:] for r in viewplan.SYSTEM_ROOTS if os.path.lexists(r)}
    return made | system | {task.workspace.split("/")[1], home.split("/")[1]}


# -- nothing of the host but the view -------------------------------------------------------


def test_a_host_path_settled_does_not_know_does_not_exist_for_the_command(
    rt: Runtime, task: TaskRecord, host_dir: Path, calls: str
) -> None:
    receipt, out, _err = attack(
        rt,
        task,
        f"ls -A /; echo --; test -e {host_dir} || echo GONE; cat {host_dir}/secret; "
        "for p in /srv /home /opt /mnt /media /boot /old_root /var/lib /var/log; do "
        "test -e $p && echo $p; done; ls -A /var; ls -A /run; ls -A /root; echo --; "
        "for r in /bin /sbin /lib /lib64; do test -L $r && echo $r $(readlink $r); done",
    )
    listing, rest, links = out.split("--\n")
    assert set(listing.split()) == _roots(task), listing
    assert rest.split() == ["GONE", "tmp"], rest  # /var holds only tmp; /run and ~ are empty
    for line in links.splitlines():  # a symlinked root is the host's same symlink
        path, target = line.split()
        assert os.readlink(path) == target
    assert receipt["isolation"]["host"] == "allow-list"
    assert receipt["owner"]["calls"] == calls


def test_the_commands_tmp_is_its_tasks_own_and_lasts_across_its_sessions(
    rt: Runtime, task: TaskRecord, tmp_path: Path
) -> None:
    """/tmp, /var/tmp, /dev/shm and $HOME are the task's pod directories: what one session
    leaves there the next one of the task finds; the host's /tmp and another task's pod are
    not there."""
    name = f"left-{secrets.token_hex(4)}"
    fd, host_file = tempfile.mkstemp(prefix="settled-view-", dir="/tmp")
    os.close(fd)
    try:
        _, out, _ = attack(
            rt,
            task,
            f"test -e {host_file} && echo HOST; echo a > /tmp/{name}; echo b > /var/tmp/{name}; "
            f'echo c > /dev/shm/{name}; echo d > "$HOME/{name}"; echo "$HOME"',
        )
        assert out == "/root\n"
        _, out, _ = attack(rt, task, f"cat /tmp/{name} /var/tmp/{name} /dev/shm/{name} ~/{name}")
        assert out == "a\nb\nc\nd\n"
        other_workspace = tmp_path / "other"
        other_workspace.mkdir()
        other = rt.new_task(str(other_workspace))
        _, out, err = attack(
            rt, other, f"cat /tmp/{name} /var/tmp/{name} /dev/shm/{name} ~/{name}; echo END"
        )
        assert out == "END\n" and err.count("No such file") == 4
    finally:
        os.unlink(host_file)
    for where in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not os.path.exists(f"{where}/{name}")  # nothing reached the host's
    held = poddirs.describe(rt.home, task.task)
    for pod_dir in ("tmp", "var-tmp", "shm", "home"):
        assert name in held[pod_dir]["names"] and held[pod_dir]["bytes"] >= 2
    assert all(name not in d["names"] for d in poddirs.describe(rt.home, other.task).values())


def test_another_homes_launcher_and_a_store_shared_by_two_homes_are_out_of_reach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's first two ways out: home B's launcher socket (which serves any root peer)
    and the store and objects two homes share, outside both. Not in A's command's view; and a
    grant of a directory that holds them is refused, naming what it would open."""
    shared = tmp_path / "shared"
    monkeypatch.setenv("SETTLED_STORE", f"sqlite://{shared}/store.db")
    monkeypatch.setenv("SETTLED_OBJECTS", f"file://{shared}/objects")
    home_a, home_b = tmp_path / "A", tmp_path / "B"
    (tmp_path / "wa").mkdir()
    (tmp_path / "wb").mkdir()
    (tmp_path / "wb" / "secret").write_text("B's secret")
    with Runtime(str(home_a)) as a, Runtime(str(home_b)) as b:
        task_a = a.new_task(str(tmp_path / "wa"))
        b.new_task(str(tmp_path / "wb"))
        home_launcher.start(str(home_b / "run"))
        sock = home_b / "run" / home_launcher.SOCKET_NAME
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
                probe.connect(str(sock))  # it serves, from the host
            reach = (
                "import socket, sys\n"
                "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
                "try:\n    s.connect(sys.argv[1]); print('CONNECTED')\n"
                "except OSError as e:\n    print(type(e).__name__)\n"
            )
            shell = (
                f"{COMMAND_PYTHON} -I -S -c '{reach}' {sock}; "
                f"for p in {shared} {shared}/store.db {home_b} {tmp_path}/wb; do "
                "test -e $p && echo $p; done; echo END"
            )
            receipt, out, _ = attack(a, task_a, shell)
            assert out == "FileNotFoundError\nEND\n", out
            assert receipt["isolation"]["hidden"] == {"dirs": [], "files": []}
            for granted, opened in (
                (tmp_path, "the settled home"),
                (shared, "a store or object directory"),
                (home_b, "another settled home"),
                (tmp_path / "wb", "another task's workspace"),
            ):
                with pytest.raises(BadGrant, match=opened):
                    attack(a, task_a, "true", writable=[str(granted)])
        finally:
            assert home_launcher.stop(str(home_b / "run"))
            stop_journals(tmp_path)


def test_a_writable_grant_is_the_hosts_at_its_own_path_and_nothing_beside_it(
    rt: Runtime, task: TaskRecord
) -> None:
    base = Path(tempfile.mkdtemp(prefix="settled-view-", dir="/var/lib"))
    granted = base / "granted"
    beside = base / "beside"
    granted.mkdir()
    beside.mkdir()
    try:
        receipt, out, _ = attack(
            rt,
            task,
            f"echo made > {granted}/made && echo GRANTED; ls -A {base}; "
            f"test -e {beside} && echo BESIDE; touch {base}/x && echo PARENT; true",
            writable=[str(granted)],
        )
        assert out == "GRANTED\ngranted\n"
        assert (granted / "made").read_text() == "made\n"
        assert {"path": str(granted), "kind": "writable", "mode": "rw", "source": str(granted)} in (
            receipt["isolation"]["view"]
        )
        assert str(granted) in receipt["isolation"]["writable"]
    finally:
        shutil.rmtree(base)


def test_the_root_and_the_system_are_read_only_and_the_workspace_is_not(
    rt: Runtime, task: TaskRecord
) -> None:
    _, out, err = attack(
        rt,
        task,
        "touch /x && echo ROOT; mkdir /opt && echo OPT; touch /usr/x && echo USR; "
        "touch /etc/x && echo ETC; touch /run/x && echo RUN; touch /var/x && echo VAR; "
        "rm -f /bin && echo BIN; touch mine && echo WORKSPACE; touch /tmp/t && echo TMP; true",
    )
    assert out.split() == ["WORKSPACE", "TMP"]
    assert err.count("Read-only file system") == 7, err


def test_proc_dev_and_sys_are_the_views_own(rt: Runtime, task: TaskRecord) -> None:
    """/proc of the session's PID namespace with its knobs read-only and its leaks covered, a
    /dev of a dozen entries whose shm is the pod's, /sys read-only with the cgroup tree (so
    the cgroup stays contained), and not one mount of the host beyond what the view binds."""
    receipt, out, err = attack(
        rt,
        task,
        "ls /proc | grep -c '^[0-9]'; echo 1 > /proc/sys/kernel/ns_last_pid && echo KNOB; "
        "wc -c < /proc/keys; ls -A /dev | tr '\\n' ' '; echo; touch /dev/shm/s && echo SHM; "
        "touch /sys/x && echo SYS; test -d /sys/fs/cgroup && echo CGROUP; echo --; "
        "cut -d' ' -f5 /proc/self/mountinfo",
    )
    head, mounts = out.split("--\n")
    lines = head.splitlines()
    assert int(lines[0]) <= 4, "init, sh and what it runs"
    assert lines[1] == "0", "/proc/keys reads as /dev/null"
    assert set(lines[2].split()) == {
        "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout",
        "tty", "urandom", "zero",
    }  # fmt: skip
    assert lines[3:] == ["SHM", "CGROUP"]
    assert err.count("Read-only file system") == 2
    assert receipt["isolation"]["cgroup"] == "namespace, read-only"
    entries = {e["path"] for e in receipt["isolation"]["view"]}
    strays = [
        m for m in set(mounts.split()) - entries - {"/", "/dev/pts"} if not m.startswith("/sys/")
    ]
    assert strays == []


# -- a root command trying its way out ------------------------------------------------------


def test_a_command_cannot_mount_umount_or_pivot_root_its_way_out(
    rt: Runtime, task: TaskRecord, host_dir: Path
) -> None:
    """It holds no CAP_SYS_ADMIN: umount, mount, remount, pivot_root and unshare fail; in a user
    namespace of its own its mounts are locked together; a chroot escape (it keeps
    CAP_SYS_CHROOT) climbs to the view's root, which is all there is."""
    escape = (
        "import os\n"
        "os.makedirs('/tmp/jail', exist_ok=True); os.chroot('/tmp/jail')\n"
        "for _ in range(64): os.chdir('..')\n"
        "os.chroot('.'); print(' '.join(sorted(os.listdir('/'))))\n"
    )
    _, out, _ = attack(
        rt,
        task,
        "umount /tmp && echo UMOUNT; umount -l /usr && echo LAZY; "
        "mount -o remount,rw / && echo REMOUNT; mount -t tmpfs none /tmp && echo MOUNT; "
        "mkdir -p /tmp/new/old && pivot_root /tmp/new /tmp/new/old && echo PIVOT; "
        "unshare -m true && echo UNSHARE; "
        "unshare -Urm sh -c 'umount -l /usr && echo USERNS; umount -l /tmp && echo USERNS_TMP; "
        f"ls -A /; test -e {host_dir} && echo HOST'; echo --; "
        f'{COMMAND_PYTHON} -I -S -c "{escape}"',
    )
    attempts, climbed = out.split("--\n")
    for word in ("UMOUNT", "LAZY", "REMOUNT", "MOUNT", "PIVOT", "UNSHARE", "USERNS", "HOST"):
        assert word not in attempts.split(), attempts
    assert set(climbed.split()) == _roots(task)


def test_the_old_root_is_out_of_reach_through_proc_dot_dot_and_handles(
    rt: Runtime, task: TaskRecord, host_dir: Path
) -> None:
    """/proc/self/root, /proc/1/root and `..` from the workspace all lead to the view's own
    root; the command holds no descriptor of the old one (0, 1, 2 only; its init's cannot be
    read or opened); and a file handle of a host file, made outside, cannot be opened
    (open_by_handle_at needs CAP_DAC_READ_SEARCH, which the command does not hold)."""
    handle = _handle_of(host_dir / "secret")
    opener = (
        "import ctypes, os, sys\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "raw = bytes.fromhex(sys.argv[1])\n"
        "buf = ctypes.create_string_buffer(raw, len(raw))\n"
        "fd = libc.open_by_handle_at(os.open('/', os.O_RDONLY), buf, os.O_RDONLY)\n"
        "print('OPENED' if fd >= 0 else os.strerror(ctypes.get_errno()))\n"
    )
    depth = task.workspace.count("/") + 3
    _, out, _ = attack(
        rt,
        task,
        f"ls -A /proc/self/root | tr '\\n' ' '; echo; ls -A /proc/1/root 2>/dev/null | wc -l; "
        f"ls -A {'../' * depth} | tr '\\n' ' '; echo; ls /proc/self/fd | tr '\\n' ' '; echo; "
        "readlink /proc/1/fd/0 /proc/1/fd/3 || echo NOFD; readlink /proc/1/cwd || echo NOCWD; "
        f'{COMMAND_PYTHON} -I -S -c "{opener}" {handle}',
    )
    lines = out.splitlines()
    assert set(lines[0].split()) == _roots(task)
    assert lines[1] == "0", "init is not dumpable: its root is not readable"
    assert set(lines[2].split()) == _roots(task)
    assert lines[3].split() == ["0", "1", "2", "3"]  # 3: ls's own directory
    assert lines[4:6] == ["NOFD", "NOCWD"]
    assert lines[6] == os.strerror(1), "EPERM"


def _handle_of(path: Path) -> str:
    """name_to_handle_at(2) of a host file, as hex of struct file_handle."""

    class Handle(ctypes.Structure):
        _fields_ = [("bytes", ctypes.c_uint), ("type", ctypes.c_int), ("f", ctypes.c_ubyte * 128)]

    libc = ctypes.CDLL(None, use_errno=True)
    handle, mount_id = Handle(128, 0), ctypes.c_int()
    result = libc.name_to_handle_at(-100, os.fsencode(path), ctypes.byref(handle),
                                    ctypes.byref(mount_id), 0)  # fmt: skip
    assert result == 0, os.strerror(ctypes.get_errno())
    return bytes(handle)[: 8 + handle.bytes].hex()


def test_a_symlink_left_on_the_workspaces_mount_point_path_never_steers_the_view(
    rt: Runtime, task: TaskRecord, tmp_path: Path, host_dir: Path
) -> None:
    """The workspace lies under /tmp, so its mount point is made in the task's pod /tmp, which
    the command fills. A symlink it leaves there in place of a directory on that path (to a
    host directory) is never followed: the next session is refused at `isolation`, naming
    the path, and nothing is made where the link points. Once it is gone, sessions run."""
    parts = Path(task.workspace).relative_to("/tmp").parts
    first = f"/tmp/{parts[0]}"
    _, out, _ = attack(
        rt, task, f"mv {first} /tmp/moved && ln -s {host_dir} {first} && echo PLANTED"
    )
    assert out == "PLANTED\n"
    admission = rt.exec(task.task, shell="echo RAN")
    view = rt.wait(admission.session, timeout=60)
    receipt = view["receipt"]
    assert receipt["exit"]["reason"] == "not_started", receipt["exit"]
    assert receipt["exit"]["stage"] == "isolation"
    assert first in receipt["exit"]["error"]
    assert sorted(p.name for p in host_dir.iterdir()) == ["secret"]
    os.unlink(os.path.join(poddirs.pod_path(rt.home, task.task), "tmp", parts[0]))
    receipt, out, _ = attack(rt, task, "pwd")
    assert out == f"{task.workspace}\n"


def test_a_child_that_ended_before_its_gate_opened_is_reported_at_its_stage_not_epipe() -> None:
    """The placer's child builds its view before its gate; refused there, it reports on its
    error pipe and exits, closing the gate's read end, often before the owner opens the gate
    (the race the symlink test above meets). The owner's start gets the child's report (stage
    `isolation`, the path), not an EPIPE from writing into a gate that no one reads."""
    from settled.boundary.placer import Placer
    from settled.boundary.spawn import read_spawn_error

    gate_r, gate_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    os.write(err_w, b"isolation:40:/tmp/pytest-of-root is a symlink, not a directory")
    for fd in (gate_r, err_w, status_w):  # the child is gone: its ends are closed
        os.close(fd)
    fds = {"errpipe_r": err_r, "status_r": status_r, "gate_w": gate_w}
    placer = Placer(os.getpid(), fds)
    placer.answer, placer.child = {"pid": 4321}, 4321
    pid, errpipe, status = placer.start()
    try:
        assert pid == 4321 and "gate_w" not in placer.fds
        failure = read_spawn_error(errpipe)  # closes it
        assert failure is not None and failure.stage == "isolation", failure
        assert "/tmp/pytest-of-root" in str(failure)
    finally:
        os.close(status)


def test_a_workspace_inside_the_commands_home_is_bound_inside_the_pods_home(
    rt: Runtime, tmp_path: Path
) -> None:
    """$HOME is the pod's home; a workspace below $HOME's path gets its mount point made in
    that directory, so the command finds both: its workspace at its path, and its home's files
    around it."""
    home = tmp_path / "user"
    workspace = home / "project"
    workspace.mkdir(parents=True)
    (workspace / "code.py").write_text("print()")
    (home / ".host-rc").write_text("the host's")
    task = rt.new_task(str(workspace))
    env = {"HOME": str(home)}
    _, out, _ = attack(rt, task, 'echo kept > "$HOME/.cache-file"; ls -A "$HOME"', env=env)
    assert out.split() == [".cache-file", "project"]  # not the host's .host-rc
    _, out, _ = attack(rt, task, "cat ~/.cache-file; ls project 2>/dev/null; ls", env=env)
    assert out.split() == ["kept", "code.py"]
    pod_home = Path(poddirs.pod_path(rt.home, task.task), "home")
    assert sorted(p.name for p in pod_home.iterdir()) == [".cache-file", "project"]
    assert not (home / ".cache-file").exists()


def test_the_receipt_names_the_view_entry_by_entry_and_its_digest(
    rt: Runtime, task: TaskRecord
) -> None:
    receipt, _, _ = attack(rt, task, "true")
    isolation = receipt["isolation"]
    view = isolation["view"]
    assert isolation["view_digest"] == digest_of(view)
    kinds = {e["kind"] for e in view}
    assert {"system", "workspace", "pod", "proc", "dev", "sys", "cover"} <= kinds
    assert all(set(e) <= {"path", "kind", "mode", "source", "identity"} for e in view)
    by_path = {e["path"]: e for e in view}
    bound = os.stat(task.workspace)  # the directory recorded at task new, checked at the bind
    assert by_path[task.workspace] == {
        "path": task.workspace, "kind": "workspace", "mode": "rw", "source": task.workspace,
        "identity": f"{bound.st_dev}:{bound.st_ino}",
    }  # fmt: skip
    assert [e for e in view if "identity" in e] == [by_path[task.workspace]]
    pod = poddirs.pod_path(rt.home, task.task)
    assert by_path["/tmp"]["source"] == f"{pod}/tmp"
    assert set(isolation["writable"]) == {task.workspace, "/tmp", "/var/tmp", "/dev/shm", "/root"}
    assert isolation["readable"] == [] and isolation["home_hidden"] is True
    assert [by_path[p]["mode"] for p in ("/usr", "/etc", "/sys")] == ["ro", "ro", "ro"]


def test_isolation_none_builds_no_view_and_says_so(rt: Runtime, task: TaskRecord) -> None:
    fd, host_file = tempfile.mkstemp(prefix="settled-view-", dir="/tmp")
    os.close(fd)
    try:
        receipt, out, _ = attack(rt, task, f"test -e {host_file} && echo HOST", isolation="none")
    finally:
        os.unlink(host_file)
    assert out == "HOST\n"
    isolation = receipt["isolation"]
    assert isolation["view"] == [] and isolation["host"] == "writable"
    assert "no view was built" in isolation["missing"]["all"]
    assert not os.path.exists(poddirs.pod_path(rt.home, task.task))


# -- the plan, and a view built from it in a forked child -----------------------------------


def _in_view(plan: IsolationPlan, shell: str) -> tuple[int, str, str]:
    """`shell` run as root in the view `plan` describes, built in a forked child as an owner's
    init builds it (its privileges dropped after); (exit status, stdout, stderr)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            mountview.enter(plan)
            privileges.drop(plan)
            os.chdir("/")
            os.execv("/bin/sh", ["sh", "-c", shell])
        except BaseException as exc:
            os.write(2, f"VIEW FAILED {exc!r}".encode())
        finally:
            os._exit(127)
    os.close(out_w)
    os.close(err_w)
    with os.fdopen(out_r, "rb") as out, os.fdopen(err_r, "rb") as err:
        stdout, stderr = out.read(), err.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), stdout.decode(), stderr.decode()


@pytest.fixture
def grants(tmp_path: Path) -> Iterator[Path]:
    """/var/lib/settled-view-*/{ro/{rw/{ro},x},rw2}: nested grants of both modes."""
    base = Path(tempfile.mkdtemp(prefix="settled-view-", dir="/var/lib"))
    for path in ("ro/rw/ro", "ro/x", "rw2"):
        (base / path).mkdir(parents=True)
    try:
        yield base
    finally:
        shutil.rmtree(base)


def test_readable_and_writable_grants_nest_as_asked(tmp_path: Path, grants: Path) -> None:
    """`readable` (ro) and `writable` (rw) at their own paths, the inner one on top: a
    readable inside a writable inside a readable grant is each as it was asked."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    pods = poddirs.ensure(str(home), "t_grants", 0, 0)
    plan = make_plan(
        "auto", workspace=str(workspace), home=str(home), pid_namespace=False,
        writable=[str(grants / "ro/rw"), str(grants / "rw2")],
        readable=[str(grants / "ro"), str(grants / "ro/rw/ro"), str(grants / "ro/x")],
        pod_dirs=pods, command_home="/root",
    )  # fmt: skip
    assert plan.writable == (str(grants / "rw2"), str(grants / "ro/rw"))
    assert plan.readable == (str(grants / "ro"), str(grants / "ro/rw/ro"))  # ro/x adds nothing
    checks = " ".join(
        f"touch {grants}/{p}/f 2>/dev/null && echo {p}:rw || echo {p}:ro;"
        for p in ("ro", "ro/rw", "ro/rw/ro", "ro/x", "rw2")
    )
    code, out, err = _in_view(plan, f"{checks} ls -A {grants}")
    assert code == 0, err
    assert out.split() == ["ro:ro", "ro/rw:rw", "ro/rw/ro:ro", "ro/x:ro", "rw2:rw", "ro", "rw2"]
    assert plan.to_json()["readable"] == list(plan.readable)


def test_a_grant_of_the_home_or_another_workspace_or_of_proc_is_dropped(tmp_path: Path) -> None:
    workspace, other, home = (tmp_path / n for n in ("ws", "other", "home"))
    for path in (workspace, other, home / "inner"):
        path.mkdir(parents=True)
    plan = make_plan(
        "auto", workspace=str(workspace), home=str(home), other_workspaces=[str(other)],
        pid_namespace=True, writable=[str(home / "inner"), "/proc/sys", str(workspace)],
        readable=[str(other), "/sys/fs/cgroup", "/dev", str(tmp_path / "missing")],
    )  # fmt: skip
    assert plan.writable == () and plan.readable == ()
    assert plan.cgroup_contained


def test_the_pods_home_is_bound_at_home_unless_home_is_the_root_or_the_workspace(
    tmp_path: Path,
) -> None:
    workspace = tmp_path / "ws"
    (workspace / "sub").mkdir(parents=True)
    (tmp_path / "home").mkdir()
    pods = poddirs.ensure(str(tmp_path / "home"), "t_home", 0, 0)

    def home_entry(command_home: str | None) -> dict[str, str] | None:
        plan = make_plan(
            "auto", workspace=str(workspace), home=str(tmp_path / "home"),
            pid_namespace=True, pod_dirs=pods, command_home=command_home,
        )  # fmt: skip
        found = [e for e in plan.view if e["kind"] == "pod" and e["source"] == pods["home"]]
        return found[0] if found else None

    for unbound in (None, "/", str(workspace), str(workspace / "sub"), "/usr/no-such-home"):
        assert home_entry(unbound) is None, unbound
    assert home_entry("/nonexistent") == {
        "path": "/nonexistent", "kind": "pod", "mode": "rw", "source": pods["home"]
    }  # fmt: skip
    assert home_entry(str(tmp_path / "user")) is not None  # the workspace may lie below it
    assert home_entry("/tmp") is None  # the pod's /tmp is there


def test_a_symlinked_resolv_conf_brings_its_target_and_the_roots_are_the_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd-resolved's /etc/resolv.conf links to /run/...: that file is bound read-only at
    its path (DNS works) when nothing else of the view holds it. Checked on a link made for
    the purpose, since the host's own may be a plain file."""
    target = tmp_path / "run" / "stub-resolv.conf"
    target.parent.mkdir()
    target.write_text("nameserver 127.0.0.53\n")
    link = tmp_path / "resolv.conf"
    link.symlink_to(target)
    monkeypatch.setattr(viewplan, "RESOLV_CONF", str(link))
    regions = {"/etc": viewplan.entry("/etc", "system", "ro", "/etc")}
    assert viewplan.resolv_entry(regions) == viewplan.entry(
        str(target), "system", "ro", str(target)
    )
    regions[str(tmp_path)] = viewplan.entry(str(tmp_path), "readable", "ro", str(tmp_path))
    assert viewplan.resolv_entry(regions) is None  # a grant holds it already
    for made in viewplan.system_entries(set()):
        if made["mode"] == "symlink":
            assert os.readlink(made["path"]) == made["source"]
        elif made["path"] != "/run":
            assert os.path.isdir(made["path"]) and not os.path.islink(made["path"])


def test_the_plan_travels_as_plain_values(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    plan = make_plan(
        "auto", workspace=str(tmp_path), home=str(home), pid_namespace=True,
        pod_dirs=poddirs.ensure(str(home), "t_plain", 0, 0), command_home="/root",
        pod={"hostname": "t_plain", "user": 1, "ipc": 2, "uts": 3, "keyring": "k",
             "state": "found", "lost": None, "dir": "/t_plain"},
    )  # fmt: skip
    again = IsolationPlan(**marshal.loads(marshal.dumps(plan.fields())))
    assert again == plan and again.to_json() == plan.to_json()
    assert json.loads(json.dumps(plan.to_json())) == plan.to_json()


def test_the_pod_directories_are_made_owned_described_and_removed(tmp_path: Path) -> None:
    home = str(tmp_path / "home")
    os.makedirs(home, mode=0o700)
    paths = poddirs.ensure(home, "t_pod", 65534, 65534)
    modes = {n: stat.S_IMODE(os.lstat(p).st_mode) for n, p in paths.items()}
    assert modes == {"tmp": 0o1777, "var-tmp": 0o1777, "shm": 0o1777, "home": 0o700}
    assert (os.stat(paths["home"]).st_uid, os.stat(paths["home"]).st_gid) == (65534, 65534)
    assert stat.S_IMODE(os.stat(os.path.dirname(paths["tmp"])).st_mode) == 0o700
    Path(paths["tmp"], "a").write_bytes(b"12345")
    Path(paths["tmp"], "d").mkdir()
    Path(paths["tmp"], "d", "b").write_bytes(b"678")
    Path(paths["tmp"], "link").symlink_to("/etc")  # never followed
    assert poddirs.ensure(home, "t_pod", 0, 0) == paths  # a later session's, as root
    assert os.stat(paths["home"]).st_uid == 0
    held = poddirs.describe(home, "t_pod")
    assert held["tmp"] == {"entries": 4, "bytes": 8, "names": ["a", "d", "link"]}
    assert held["home"] == {"entries": 0, "bytes": 0, "names": []}
    poddirs.remove(home, "t_pod")
    assert not os.path.exists(os.path.dirname(paths["tmp"])) and os.path.isdir("/etc")
    poddirs.remove(home, "t_pod")  # nothing left: nothing to do
    for bad in ("", "..", "a/b"):
        with pytest.raises(ValueError):
            poddirs.ensure(home, bad, 0, 0)
