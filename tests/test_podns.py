"""A task is a pod: its IPC, hostname and keys are its sessions' and no other task's.

Real sessions through the Runtime, as root, on the strongest boundary (and every other one for
the join itself): what a command of task A leaves in its SysV and POSIX message queues, its user
keyring and its session keyring, and its hostname, are there for A's next session and for a
concurrent one, and absent for task B's command, which cannot read A's key by serial either; no
command can open a key to another task (through the i386 ABI neither), and one that revoked its
task's keyring leaves its task a new one of its own; a released pod is gone from the pods
namespace, a lost pin or a half-made pod is made again and the receipt says what was lost; two
first sessions get one pod; a home on a shared mount gets its pods too; `--user`, the cgroup
namespace, /proc and the read-only host hold inside the pod, whose capabilities reach none of
the command's mount, PID, cgroup or network namespaces (so no port below 1024, no raw socket);
the owner kills and recovery proves death across the pod's user namespace; and nothing stays
mounted once the home lets go. The command side runs the system Python (`pod_probe.py`, written
into each workspace) so that keys and POSIX queues need no tool the distribution may lack."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import _skip_unavailable, release_pods, stop_journals

from settled.boundary import linux, podhost, podns
from settled.records import TaskRecord
from settled.runtime import Runtime

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="pods need root's CAP_SYS_ADMIN"),
    pytest.mark.timeout(120),
]

SYSTEM_PYTHON = "/usr/bin/python3"

PROBE = r"""
import ctypes, errno, json, os, sys

NUMBERS = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mq_open.restype = ctypes.c_int


def call(*args):
    value = libc.syscall(*args)
    return value if value >= 0 else "E" + errno.errorcode[ctypes.get_errno()]


def keyctl(op, *args):
    padded = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    padded += [ctypes.c_long(0)] * (4 - len(padded))
    return call(ctypes.c_long(NUMBERS[1]), ctypes.c_long(op), *padded)


def add_key(description, payload, keyring):
    return call(ctypes.c_long(NUMBERS[0]), ctypes.c_char_p(b"user"), ctypes.c_char_p(description),
                ctypes.c_char_p(payload), ctypes.c_size_t(len(payload)), ctypes.c_long(keyring))


def read_key(serial):
    buffer = ctypes.create_string_buffer(256)
    size = keyctl(11, serial, buffer, 256)
    return size if isinstance(size, str) else buffer.raw[:size].decode()


def search(keyring, description):
    return keyctl(10, keyring, ctypes.c_char_p(b"user"), ctypes.c_char_p(description), 0)


def mq(flags):
    fd = libc.mq_open(b"/settled-podq", ctypes.c_int(flags), ctypes.c_uint(0o600), None)
    return "ok" if fd >= 0 else "E" + errno.errorcode[ctypes.get_errno()]


USER, SESSION = -4, -3
out = {"hostname": os.uname().nodename}
if sys.argv[1] == "make":
    out["mq"] = mq(os.O_CREAT | os.O_RDWR)
    out["user_key"] = add_key(b"podkey-u", b"secret-u", USER)
    out["session_key"] = add_key(b"podkey-s", b"secret-s", SESSION)
elif sys.argv[1] == "look":
    out["mq"] = mq(os.O_RDWR)
    out["user_search"] = search(USER, b"podkey-u")
    out["session_search"] = search(SESSION, b"podkey-s")
    out["read"] = [read_key(int(serial)) for serial in sys.argv[2:]]
elif sys.argv[1] == "revoke":
    out["revoked"] = keyctl(3, SESSION)
elif sys.argv[1] == "open":
    key = add_key(b"podkey-open", b"secret-open", SESSION)
    out["key"] = key
    out["all"] = keyctl(5, key, 0x3F3F3F3F)
    out["user_view"] = keyctl(5, key, 0x3F010000)
    out["possessor"] = keyctl(5, key, 0x3F000000)
    out["chown"] = keyctl(4, key, 1000, -1)
    out["join"] = keyctl(1, ctypes.c_char_p(b"another"))
print(json.dumps(out))
"""


@pytest.fixture(autouse=True)
def _strong_paths() -> None:
    _skip_unavailable("cgroup2+pidns")


def _task(rt: Runtime, root: Path, name: str) -> TaskRecord:
    workspace = root / name
    workspace.mkdir()
    (workspace / "pod_probe.py").write_text(PROBE)
    return rt.new_task(str(workspace))


def run(rt: Runtime, task: TaskRecord, shell: str, **kw: object) -> tuple[dict, str, str]:
    admission = rt.exec(task.task, shell=shell, **kw)  # type: ignore[arg-type]
    view = rt.wait(admission.session, timeout=60)
    assert view["state"] == "settled", view
    out = rt.read(admission.session, "stdout").decode(errors="replace")
    err = rt.read(admission.session, "stderr").decode(errors="replace")
    return view["receipt"], out, err


def probe(rt: Runtime, task: TaskRecord, *args: object) -> tuple[dict, dict]:
    words = " ".join(str(a) for a in args)
    receipt, out, err = run(rt, task, f"{SYSTEM_PYTHON} -I -S pod_probe.py {words}")
    assert receipt["exit"]["code"] == 0, err
    return receipt, json.loads(out)


@pytest.fixture
def two(rt: Runtime, tmp_path: Path) -> tuple[TaskRecord, TaskRecord]:
    return _task(rt, tmp_path, "a"), _task(rt, tmp_path, "b")


@pytest.fixture(params=["c", "ctypes"])
def binding(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The owners' (and so the inits') binding of the Linux calls: both are run."""
    if request.param == "ctypes":
        monkeypatch.setenv(linux.CALLS_ENV, "ctypes")
    return str(request.param)


def queues(out: str) -> list[str]:
    """The message queue ids `ipcs -q` lists."""
    return [line.split()[1] for line in out.splitlines() if line.startswith("0x")]


def test_a_tasks_ipc_keys_and_hostname_are_its_own_and_kept_for_its_next_session(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord], binding: str
) -> None:
    a, b = two
    receipt, made = probe(rt, a, "make")
    assert made["mq"] == "ok" and made["hostname"] == a.task
    user_key, session_key = made["user_key"], made["session_key"]
    assert isinstance(user_key, int) and isinstance(session_key, int), made
    _, out, _ = run(rt, a, "ipcmk -Q >/dev/null && ipcs -q")
    [queue] = queues(out)
    pod = receipt["isolation"]["pod"]
    assert pod["hostname"] == a.task and pod["state"] == "created" and pod["lost"] is None

    receipt_b, seen_by_b = probe(rt, b, "look", user_key, session_key)
    assert seen_by_b["hostname"] == b.task
    assert seen_by_b["mq"] == "EENOENT"
    assert seen_by_b["user_search"] == "EENOKEY" and seen_by_b["session_search"] == "EENOKEY"
    assert seen_by_b["read"] == ["EEACCES", "EEACCES"], "A's keys, by serial, from task B"
    _, out, _ = run(rt, b, "ipcs -q")
    assert queues(out) == []
    assert set(receipt_b["isolation"]["pod"]["namespaces"].values()).isdisjoint(
        pod["namespaces"].values()
    )

    receipt_a, seen_by_a = probe(rt, a, "look", user_key, session_key)
    assert receipt_a["isolation"]["pod"]["state"] == "found"
    assert receipt_a["isolation"]["pod"]["namespaces"] == pod["namespaces"]
    assert seen_by_a["mq"] == "ok" and seen_by_a["hostname"] == a.task
    assert (seen_by_a["user_search"], seen_by_a["session_search"]) == (user_key, session_key)
    assert seen_by_a["read"] == ["secret-u", "secret-s"]
    _, out, _ = run(rt, a, "ipcs -q")
    assert queues(out) == [queue]


def test_every_boundary_runs_its_command_in_the_pod(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord], boundary: str
) -> None:
    """The PID namespace's init joins the pod, and so does the forked child of a boundary
    without one (cgroup2, subreaper)."""
    a, b = two
    run(rt, a, "ipcmk -Q >/dev/null", boundary=boundary)
    receipt, out, _ = run(rt, a, "hostname; ipcs -q", boundary=boundary)
    assert out.split()[0] == a.task and len(queues(out)) == 1
    assert receipt["isolation"]["pod"]["state"] == "found"
    _, out, _ = run(rt, b, "hostname; ipcs -q", boundary=boundary)
    assert out.split()[0] == b.task and queues(out) == []


def test_a_service_and_an_exec_of_one_task_share_its_ipc(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord]
) -> None:
    a, b = two
    service = rt.exec(
        a.task, shell="ipcmk -Q >/dev/null && touch made && exec sleep 300", service=True
    )
    deadline = time.monotonic() + 30
    while not (Path(a.workspace) / "made").exists():
        assert time.monotonic() < deadline, rt.session_status(service.session)
        time.sleep(0.02)
    _, out, _ = run(rt, a, "ipcs -q")
    assert len(queues(out)) == 1, "the exec sees the queue its running service made"
    _, out, _ = run(rt, b, "ipcs -q")
    assert queues(out) == []
    rt.cancel(service.session, "test done")
    assert rt.wait(service.session, timeout=60)["receipt"]["death"]["proven"]


def test_no_command_can_open_a_key_to_another_task(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord], binding: str
) -> None:
    a, b = two
    receipt, tried = probe(rt, a, "open")
    assert tried["all"] == "EEPERM" and tried["user_view"] == "EEPERM"
    assert tried["chown"] == "EEPERM" and tried["join"] == "EEPERM"
    assert tried["possessor"] == 0, "what only its possessor may do stays allowed"
    assert "keys" not in receipt["isolation"]["missing"]
    _, seen_by_b = probe(rt, b, "look", tried["key"])
    assert seen_by_b["read"] == ["EEACCES"]


I386_SETPERM = r"""
#include <stdio.h>
#include <unistd.h>
int main(void) {
    long key = syscall(248, "user", "i386-probe", "x", 1, -3), ret;
    __asm__ volatile("int $0x80" : "=a"(ret) : "a"(288L), "b"(5L), "c"(key), "d"(0x3f3f3f3fL)
                     : "memory");
    printf("%ld %ld\n", key, ret);
    return 0;
}
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the i386 ABI of an x86_64 kernel")
def test_the_key_filter_holds_for_the_i386_abi_too(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord]
) -> None:
    """keyctl through `int 0x80` is another system call number under another audit arch: the
    filter checks each ABI the kernel offers a process of this machine."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler to build the i386 system call probe")
    a, _ = two
    source = Path(a.workspace) / "i386.c"
    source.write_text(I386_SETPERM)
    subprocess.run([compiler, "-O1", "-o", str(source.with_suffix("")), str(source)], check=True)
    _, out, _ = run(rt, a, "./i386")
    key, answer = (int(word) for word in out.split())
    assert key > 0 and answer == -1, "EPERM: the filter refused SETPERM through int 0x80"


def test_a_task_whose_command_revoked_its_keyring_gets_a_new_one_of_its_own(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord]
) -> None:
    a, b = two
    _, revoked = probe(rt, a, "revoke")
    assert revoked["revoked"] == 0
    _, made = probe(rt, a, "make")
    assert isinstance(made["session_key"], int), made
    _, seen_by_a = probe(rt, a, "look", made["session_key"])
    assert seen_by_a["session_search"] == made["session_key"], "kept for the next session"
    _, seen_by_b = probe(rt, b, "look", made["session_key"])
    assert seen_by_b["session_search"] == "EENOKEY" and seen_by_b["read"] == ["EEACCES"]


def test_what_a_pod_holds_is_described_for_its_close(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord]
) -> None:
    a, b = two
    assert podns.describe(rt.home, a.task) is None, "no session yet: no pod"
    probe(rt, a, "make")
    run(rt, a, "ipcmk -Q >/dev/null; ipcmk -M 8192 >/dev/null; ipcmk -S 2 >/dev/null")
    run(rt, b, "true")
    held = podns.describe(rt.home, a.task)
    assert held == {
        "hostname": a.task,
        "sysv": {
            "message_queues": 1, "message_bytes": 0, "shm_segments": 1, "shm_bytes": 8192,
            "semaphore_sets": 1,
        },
        "posix": {"message_queues": 1, "names": ["settled-podq"]},
        "network": {"interfaces": {"lo": "up"}},
        "keys": {"keyring": ["user:podkey-s"], "user_keyring": ["user:podkey-u"]},
    }  # fmt: skip
    empty = podns.describe(rt.home, b.task)
    assert empty is not None and empty["sysv"]["message_queues"] == 0
    assert empty["posix"]["names"] == [] and empty["keys"]["keyring"] == []
    podns.release(rt.home, a.task)
    assert podns.describe(rt.home, a.task) is None


def test_a_released_pod_is_gone_and_made_again_and_the_receipt_says_what_was_lost(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord]
) -> None:
    a, b = two
    first, _, _ = run(rt, a, "ipcmk -Q >/dev/null")
    run(rt, b, "true")
    pod = first["isolation"]["pod"]
    held = _nsfs_mounts(rt.home)
    assert {f"{name}:[{pod['namespaces'][name]}]" for name in ("user", "ipc", "uts", "net")} <= held

    podns.release(rt.home, a.task)
    podns.release(rt.home, a.task)  # idempotent
    left = _nsfs_mounts(rt.home)
    assert not any(str(inode) in entry for entry in left for inode in pod["namespaces"].values())
    assert len(left) == 4, "task B's pod is untouched"
    assert not _held_by_a_process(pod["namespaces"]["ipc"], "ipc")

    again, out, _ = run(rt, a, "ipcs -q")
    assert queues(out) == []
    assert again["isolation"]["pod"]["state"] == "recreated"
    assert "released" in again["isolation"]["pod"]["lost"]


def test_a_lost_pin_makes_the_pods_again_and_the_receipt_says_so(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord]
) -> None:
    a, _ = two
    run(rt, a, "ipcmk -Q >/dev/null")
    pin = podhost.pin_path(rt.home)
    linux.umount2(pin, linux.MNT_DETACH)  # as after a reboot: the file stays, the mount is gone
    receipt, out, _ = run(rt, a, "ipcs -q; hostname")
    pod = receipt["isolation"]["pod"]
    assert pod["state"] == "recreated" and "no longer mounted" in pod["lost"], pod
    assert queues(out) == [] and out.split()[-1] == a.task

    linux.umount2(pin, linux.MNT_DETACH)
    os.unlink(pin)
    receipt, _, _ = run(rt, a, "true")
    pod = receipt["isolation"]["pod"]
    assert pod["state"] == "recreated" and f"its pin {pin} was removed" in pod["lost"], pod


def test_a_half_made_pod_is_never_used(rt: Runtime, two: tuple[TaskRecord, TaskRecord]) -> None:
    """A crash between the mounts and the record leaves mounts without a record: the next
    session's pod is made anew over them, never the half-made one."""
    a, _ = two
    first = podns.ensure(rt.home, a.task)
    os.unlink(os.path.join(rt.home, "run", "pods", f"{a.task}.pod"))
    receipt, _, _ = run(rt, a, "true")
    pod = receipt["isolation"]["pod"]
    assert pod["state"] == "created"
    assert pod["namespaces"]["user"] != first["user"]
    mounted = _nsfs_mounts(rt.home)
    assert len(mounted) == 4 and f"user:[{first['user']}]" not in mounted


def test_two_first_sessions_of_a_task_get_the_same_pod(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord]
) -> None:
    a, _ = two
    script = (
        "import json, sys\nfrom settled.boundary import podns\n"
        "print(json.dumps(podns.ensure(sys.argv[1], sys.argv[2])))\n"
    )
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", script, rt.home, a.task],
            stdout=subprocess.PIPE,
            env={**os.environ, linux.CALLS_ENV: calls},
        )
        for calls in ("c", "ctypes", "c", "ctypes")
    ]
    pods = [json.loads(racer.communicate(timeout=60)[0]) for racer in racers]
    assert sorted(p["state"] for p in pods) == ["created", "found", "found", "found"]
    assert len({(p["user"], p["ipc"], p["uts"], p["net"], p["serial"]) for p in pods}) == 1
    receipt, _, _ = run(rt, a, "true")
    assert receipt["isolation"]["pod"]["namespaces"]["user"] == pods[0]["user"]


# For each of the command's namespaces, the user namespace that owns it (ioctl NS_GET_USERNS):
# its inode, or EPERM when that is outside the command's own user namespace (an ancestor: the
# host's), where none of its capabilities hold.
OWNERS = (
    "import fcntl, os\n"
    'for kind in ("mnt", "pid", "cgroup", "net", "ipc", "uts"):\n'
    "    try:\n"
    '        owner = fcntl.ioctl(os.open("/proc/self/ns/" + kind, os.O_RDONLY), 0xB701)\n'
    "        print(os.fstat(owner).st_ino)\n"
    "    except PermissionError:\n"
    '        print("EPERM")\n'
)


def test_inside_the_pod_the_user_the_cgroup_proc_and_the_read_only_host_hold() -> None:
    top = Path(tempfile.mkdtemp(prefix="settled-pod-", dir="/tmp"))  # another uid reaches it
    os.chmod(top, 0o755)
    try:
        with Runtime(str(top / "home")) as rt:
            a = _task(rt, top, "a")
            os.chmod(a.workspace, 0o777)
            receipt, out, err = run(
                rt,
                a,
                "id -u; hostname; readlink /proc/self/ns/user; ls /proc | grep -c '^[0-9]'; "
                "grep '^0::' /proc/self/cgroup; touch /usr/pod-was-here || echo RO; "
                "mount -t tmpfs none /tmp 2>/dev/null || echo NOMOUNT; "
                "ipcmk -Q >/dev/null && echo IPC",
                user="65534",
            )
            root_receipt, root_out, _ = run(
                rt, a, "grep CapEff /proc/self/status; umount /proc 2>/dev/null || echo NOUMOUNT"
            )
            _, owners, _ = run(rt, a, f"{SYSTEM_PYTHON} -I -S -c '{OWNERS}'", network="host")
    finally:
        with contextlib.suppress(Exception), Runtime(str(top / "home")) as runtime:
            runtime.recover()
        stop_journals(top)
        release_pods(top)
        shutil.rmtree(top)
    uid, hostname, user_ns, processes, cgroup, *rest = out.split("\n")
    pod = receipt["isolation"]["pod"]
    assert (uid, hostname) == ("65534", a.task)
    assert user_ns == f"user:[{pod['namespaces']['user']}]"
    assert user_ns != os.readlink("/proc/self/ns/user")
    assert int(processes) <= 4, "init, sh and what it runs: its own PID namespace only"
    assert cgroup == "0::/"
    assert rest[:3] == ["RO", "NOMOUNT", "IPC"], err
    assert receipt["isolation"]["cgroup"] == "namespace, read-only"
    assert receipt["isolation"]["uid"] == 65534
    assert int(root_out.split()[1], 16) & (1 << 21) == 0, "no CAP_SYS_ADMIN, even in the pod"
    assert "NOUMOUNT" in root_out and root_receipt["isolation"]["pod"]["state"] == "found"
    own = str(root_receipt["isolation"]["pod"]["namespaces"]["user"])
    assert owners.split() == ["EPERM"] * 4 + [own] * 2, "mnt, pid, cgroup, net: not the pod's"


def test_a_pods_root_holds_no_capability_over_the_hosts_network(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord]
) -> None:
    """Measured, and said in docs: CAP_NET_RAW and CAP_NET_BIND_SERVICE are kept, but over the
    pod's user namespace, while the network namespace is the host's: no raw socket (ping), no
    port below 1024."""
    a, _ = two
    script = (
        "import socket\n"
        "for family, kind, proto, port in ((2, 1, 0, 80), (2, 3, 1, None)):\n"
        "    try:\n"
        "        s = socket.socket(family, kind, proto)\n"
        "        s.bind(('127.0.0.1', port)) if port else None\n"
        "        print('ok')\n"
        "    except OSError as e:\n"
        "        print(e.errno)\n"
    )
    (Path(a.workspace) / "net.py").write_text(script)
    _, out, _ = run(rt, a, f"{SYSTEM_PYTHON} -I -S net.py", network="host")
    assert out.split() == ["13", "1"]  # EACCES binding port 80, EPERM for a raw socket


def test_the_owner_kills_and_recovery_proves_death_across_the_pods_user_namespace(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord]
) -> None:
    a, _ = two
    session = rt.exec(a.task, shell="sleep 300").session
    _wait_running(rt, session)
    rt.cancel(session, "test")
    view = rt.wait(session, timeout=60)
    assert view["receipt"]["death"]["proven"] and view["receipt"]["isolation"]["pod"]

    session = rt.exec(a.task, shell="setsid sleep 300 & exec sleep 301").session
    _wait_running(rt, session)
    owner = rt.store.get_session(session).owner
    assert owner is not None
    os.kill(owner.pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{owner.pid}") and _state(owner.pid) != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    [result] = rt.recover(a.task)
    assert result["state"] == "settled" and "PID namespace" in result["evidence"]


def test_a_home_on_a_shared_mount_gets_its_pods(tmp_path: Path) -> None:
    """systemd makes every mount shared, and the kernel refuses to bind a mount namespace's
    file on a mount with peers: the pin goes on a private mount of its own, and the peer gets
    nothing of the pods."""
    shared, peer = tmp_path / "shared", tmp_path / "peer"
    shared.mkdir()
    peer.mkdir()
    linux.mount("tmpfs", str(shared), "tmpfs", 0, "size=16m")
    try:
        linux.mount(None, str(shared), None, linux.MS_SHARED)
        linux.mount(str(shared), str(peer), None, linux.MS_BIND)
        try:
            home = str(shared / "home")
            (shared / "ws").mkdir()
            with Runtime(home) as rt:
                task = rt.new_task(str(shared / "ws"))
                receipt, out, _ = run(rt, task, "hostname")
            assert out.strip() == task.task and receipt["isolation"]["pod"]["state"] == "created"
            with open("/proc/self/mountinfo") as handle:
                assert f"{peer}/home/run/pods/pods.mnt" not in handle.read()
            podns.release_home(home)
            stop_journals(shared)
        finally:
            linux.umount2(str(peer), linux.MNT_DETACH)
    finally:
        linux.umount2(str(shared), linux.MNT_DETACH)


def test_nothing_stays_mounted_once_the_home_lets_go(
    rt: Runtime, two: tuple[TaskRecord, TaskRecord], tmp_path: Path
) -> None:
    a, b = two
    run(rt, a, "true")
    run(rt, b, "true")
    assert len(_nsfs_mounts(rt.home)) == 8  # user, ipc, uts, net of each
    podns.release_home(rt.home)
    podns.release_home(rt.home)  # idempotent
    assert podhost.mounts(rt.home) == []
    with open("/proc/self/mountinfo") as handle:
        assert str(tmp_path) not in handle.read()


def _nsfs_mounts(home: str) -> set[str]:
    """What the pods namespace's nsfs mounts hold ("ipc:[4026532185]", ...)."""
    return {line.split()[3] for line in podhost.mounts(home) if " - nsfs " in line}


def _held_by_a_process(inode: int, kind: str) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/{kind}") == f"{kind}:[{inode}]":
                    return True
            except OSError:
                continue
    return False


def _wait_running(rt: Runtime, session: str) -> None:
    deadline = time.monotonic() + 30
    while rt.session_status(session)["state"] != "running":
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
