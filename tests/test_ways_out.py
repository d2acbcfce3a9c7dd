"""Issue 34's five ways out, replayed as the hostile root command that found them did.

On main 12a778c each of these worked: a command reached another home's launcher and wrote into
its own task's workspace after the final scan; read and rewrote another home's receipts through
a store both homes shared; planted a file in the hidden home through a keyless `serve
--swerex`; left a message queue, a key and a /tmp file that another task read; and a memory hog
made the kernel kill settled's own owners. Each test here runs the attack through the Runtime
as root, end to end, and checks that settled's claims stay true. Each of the walls has its own
tests besides (test_view, test_podns, test_podnet, test_peers, test_limits); these are the
attacks themselves.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import COMMAND_PYTHON, _skip_unavailable, stop_journals
from test_trust import attack

from settled.owner import home_launcher
from settled.records import TaskRecord
from settled.runtime import Runtime

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the attacks are those of a root command"),
    pytest.mark.timeout(180),
]

# Every listening unix socket of the host's network namespace, as /proc/net/unix shows it,
# that looks like a settled launcher: connect to each, and say what happened.
REACH_LAUNCHERS = r"""
import socket
paths = [l.split()[-1] for l in open('/proc/net/unix').read().splitlines()[1:]
         if l.split()[-1].endswith('/run/launcher.sock')]
print(len(paths), 'listed')
for p in paths:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(p); s.send(b'{}'); print('ANSWERED', s.recv(64))
    except OSError as e:
        print(type(e).__name__)
"""


@pytest.fixture(autouse=True)
def _strong_paths() -> None:
    _skip_unavailable("cgroup2+pidns")


def test_another_homes_launcher_is_no_way_out(tmp_path: Path) -> None:
    """Way 1: task P's command lists every home's launcher.sock in /proc/net/unix and
    connects to home Q's to run a command there that writes P's workspace after P's final
    scan. The socket's path does not exist in P's view, so nothing answers; P's close stays
    true (its checkpoint is its workspace as its own command left it)."""
    (tmp_path / "p").mkdir()
    (tmp_path / "q").mkdir()
    with Runtime(str(tmp_path / "P")) as p, Runtime(str(tmp_path / "Q")) as q:
        task_p = p.new_task(str(tmp_path / "p"))
        q.new_task(str(tmp_path / "q"))
        home_launcher.start(str(tmp_path / "Q" / "run"))
        try:
            _, unlisted, _ = attack(p, task_p, f'{COMMAND_PYTHON} -I -S -c "{REACH_LAUNCHERS}"')
            assert int(unlisted.split()[0]) == 0, "its task's network namespace names none"
            _, out, _ = attack(
                p, task_p, f'{COMMAND_PYTHON} -I -S -c "{REACH_LAUNCHERS}"; touch mine',
                network="host",
            )  # fmt: skip
            listed = int(out.split()[0])
            assert listed >= 1, out  # the host's namespace still lists it: a name, no way in
            assert "ANSWERED" not in out and out.count("FileNotFoundError") == listed, out
            closed = p.close_task(task_p.task)
            assert closed.complete
            assert sorted(os.listdir(tmp_path / "p")) == ["mine"]
        finally:
            assert home_launcher.stop(str(tmp_path / "Q" / "run"))
            stop_journals(tmp_path)


def test_a_store_two_homes_share_is_no_way_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Way 2: two homes on one `--store sqlite:///...` outside both; home A's command reads
    task B's secret out of the shared objects and rewrites B's failed receipt to exit 0. The
    store and the objects do not exist in A's view; B's close still says its command failed."""
    shared = tmp_path / "shared"
    monkeypatch.setenv("SETTLED_STORE", f"sqlite://{shared}/store.db")
    monkeypatch.setenv("SETTLED_OBJECTS", f"file://{shared}/objects")
    (tmp_path / "wa").mkdir()
    (tmp_path / "wb").mkdir()
    (tmp_path / "wb" / "secret").write_text("B's secret")
    with Runtime(str(tmp_path / "A")) as a, Runtime(str(tmp_path / "B")) as b:
        task_a, task_b = a.new_task(str(tmp_path / "wa")), b.new_task(str(tmp_path / "wb"))
        failed = b.exec(task_b.task, shell="exit 3")
        b.wait(failed.session, timeout=60)
        b.checkpoint(task_b.task)  # B's secret is an object of the shared store now
        rewrite = (
            f"grep -rl secret {shared}/objects && echo READ; "
            f'{COMMAND_PYTHON} -c "import sqlite3; '
            f"sqlite3.connect('{shared}/store.db').execute('select 1')\" && echo OPENED; "
            f"ls {shared} || echo ABSENT"
        )
        _, out, _ = attack(a, task_a, rewrite)
        assert "READ" not in out and "OPENED" not in out and out.endswith("ABSENT\n"), out
        closed = b.close_task(task_b.task)
        assert closed.complete and closed.receipt is not None
        assert closed.receipt["outcome"]["all_commands_succeeded"] is False
        stop_journals(tmp_path)


def test_a_keyless_swerex_server_is_no_way_out(
    tmp_path: Path, rt: Runtime, task: TaskRecord
) -> None:
    """Way 3: `settled serve --swerex` with no key answered anyone on 127.0.0.1, so a
    command's `POST /write_file` planted a file in the hidden home and `/read_file` returned
    home.id. Now it makes itself a key (and says where), and a session's connection is refused
    before any route runs, key or not."""
    log = (tmp_path / "swerex.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "settled.cli", "serve", "--swerex", "--host", "127.0.0.1",
         "--port", "0"],
        env={**os.environ, "SETTLED_HOME": rt.home}, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        text = ""
        for _ in range(300):
            text = (tmp_path / "swerex.log").read_text()
            if "listening on" in text and "key" in text:
                break
            time.sleep(0.1)
        url = re.search(r"listening on (http://[0-9.]+:[0-9]+)", text)
        assert url is not None, text
        key_file = re.search(r"(/\S+\.key)", text)
        assert key_file is not None and os.stat(key_file[1]).st_mode & 0o777 == 0o600, text
        planted = Path(rt.home, "planted")
        Path(task.workspace, "plant.py").write_text(
            "import json, sys, urllib.error, urllib.request\n"
            "body = json.dumps({'path': sys.argv[2], 'content': 'x'}).encode()\n"
            "request = urllib.request.Request(sys.argv[1] + '/write_file', data=body,\n"
            "    headers={'Content-Type': 'application/json'})\n"
            "try:\n    print(urllib.request.urlopen(request, timeout=10).status)\n"
            "except urllib.error.HTTPError as e:\n    print(e.code)\n"
        )
        _, out, _ = attack(
            rt, task, f"{COMMAND_PYTHON} plant.py {url[1]} {planted}", network="host"
        )  # the host's loopback: the key is what stands
        assert "403" in out and not planted.exists(), out
        with pytest.raises(urllib.error.HTTPError) as refused:  # from the host, without the key
            urllib.request.urlopen(urllib.request.Request(f"{url[1]}/is_alive"), timeout=10)
        assert refused.value.code == 401
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
        log.close()


MESSAGE_QUEUE_AND_KEY = (
    "import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); "
    "q = libc.msgget(0x5e77, 0o1666 if sys.argv[1] == 'leave' else 0o666); "
    "k = libc.syscall(248 if __import__('os').uname().machine == 'x86_64' else 217, "
    "b'user', b'left-by-a', b'secret', 6, ctypes.c_long(-4)) if sys.argv[1] == 'leave' else "
    "libc.syscall(250 if __import__('os').uname().machine == 'x86_64' else 219, "
    "ctypes.c_long(10), ctypes.c_long(-4), b'user', b'left-by-a', ctypes.c_long(0)); "
    "print('queue', q >= 0, 'key', k >= 0)"
)


def test_what_a_task_leaves_behind_is_no_channel_to_another(rt: Runtime, tmp_path: Path) -> None:
    """Way 4: task A leaves a message queue, a key in its user keyring and a file in /tmp, and
    is closed; task B's command reads all three. Now they were A's pod's: B sees none of them,
    and A's close receipt says what A left and that it was discarded."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    task_a, task_b = rt.new_task(str(tmp_path / "a")), rt.new_task(str(tmp_path / "b"))
    _, out, _ = attack(
        rt, task_a,
        f"{COMMAND_PYTHON} -c \"{MESSAGE_QUEUE_AND_KEY}\" leave; echo A > /tmp/left-by-a",
    )  # fmt: skip
    assert out == "queue True key True\n", out
    closed = rt.close_task(task_a.task)
    assert closed.complete and closed.receipt is not None
    held = closed.receipt["pod"]
    assert "left-by-a" in held["directories"]["/tmp"]["names"]
    assert held["namespaces"]["sysv"]["message_queues"] == 1
    assert any("left-by-a" in k for k in held["namespaces"]["keys"]["user_keyring"])
    _, out, _ = attack(
        rt, task_b,
        f"{COMMAND_PYTHON} -c \"{MESSAGE_QUEUE_AND_KEY}\" read; cat /tmp/left-by-a || echo NONE",
    )  # fmt: skip
    assert out == "queue False key False\nNONE\n", out
    assert not Path("/tmp/left-by-a").exists()  # and nothing of it reached the host's /tmp
