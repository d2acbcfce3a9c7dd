"""The host's half of pods (podns.py says what a pod is): finding, making and releasing them.

Where a pod lives. No process holds a pod's namespaces: each is kept by an nsfs bind mount, and
those mounts live inside one private mount namespace per home, the "pods" namespace, so the
host's mount table (which every session's mount namespace copies) never grows with the tasks.
The pods namespace holds nothing of the host: its root is a small tmpfs (pivot_root, the copied
host mounts detached) with a procfs, and it is itself pinned by one nsfs bind mount at
`<home>/run/pods/pods.mnt` (a newer mount namespace may be bound into an older one). The kernel
refuses that bind on a shared mount (systemd makes every mount shared), so `<home>/run/pods` is
first bound onto itself and made private: the home's two host mounts. Inside the pods namespace,
task T's namespaces are `/T/user`, `/T/ipc`, `/T/uts` and `/T/net`. A pod recorded before pods
had a network namespace is found, then given one under its lock (podnet.add_namespace), its
other namespaces kept, and the returned dict says what was `added`; if that fails, the pod is
made again and `lost` says why.

What is known of them. `<home>/run/pods/namespace` names the pods namespace (its inode and a
token made with it); `<home>/run/pods/T.pod` is task T's pod as `ensure` returns it, with that
token, written only once every mount of the pod is in place. A pod is found from these two files
and one stat of the pin, with no process started (the init checks every inode again when it
opens them). A record whose token is not the current namespace's (the pin was lost: a reboot,
or `release_home`), or that was released, means the pod is made again, and the returned dict
says `recreated` and what was lost.

Making is done by a helper child (podmake.py: the caller may run threads, and the work needs a
single-threaded process, and a second one for the user namespace's maps). A half-made pod (a
crash in between) has no record, so it is never used: the next `ensure` unmounts what it left and
makes the pod again. Serialized by flock: per task for a pod, per home for the pods namespace,
so two first sessions of a task get the same pod.

Never decides whether a session gets a pod (handoff does); never runs on the owner's launch path.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import marshal
import os
import re
import time
from collections.abc import Iterator

from settled.atomic import write_atomic
from settled.boundary import podmake, podnet, podns
from settled.boundary.isolation import IsolationPlan, IsolationUnavailable
from settled.boundary.podmake import PodUnavailable, in_helper, inside, pinned
from settled.where import run_dir

TYPE_CHECKING = False  # the launcher imports this on every admission: no typing
if TYPE_CHECKING:
    from typing import Any

PODS_ENV = "SETTLED_PODS"  # "off": no pod (what bench/pods.py compares a pod against)
RECORDS = "pods"  # <home>/run/pods: the pin, the records, the locks, the pods namespace's root
PIN_NAME = "pods.mnt"
USE_LOCK = "use.lock"  # shared while a pod is made; exclusive to let the namespace go
RECORD_VERSION = 1
ADDED_NETWORK = (
    "a network namespace, made now: the pod was made before pods had one; its user, IPC and "
    "UTS namespaces and its keyring are the ones it had"
)
TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a hostname's length at most

__all__ = [
    "PodUnavailable", "attach", "describe", "ensure", "find", "mounts", "release", "release_home",
    "release_home_if_idle",
]  # fmt: skip


def pin_path(home: str) -> str:
    return os.path.join(run_dir(home), RECORDS, PIN_NAME)


def _records(home: str) -> str:
    return os.path.join(run_dir(home), RECORDS)


def _record_path(home: str, task: str) -> str:
    return os.path.join(_records(home), f"{task}.pod")


def _check_task(task: str) -> None:
    if not TASK_NAME.fullmatch(task):
        raise ValueError(f"task id {task!r} cannot name a pod (letters, digits, _ . -; 64 at most)")


def attach(plan: IsolationPlan, home: str, task: str, *, fallback: bool = False) -> None:
    """Give a plan with a mount namespace its task's pod (`plan.pod`, with the key filter its
    init installs: made here, once, not in every init, and the plan's network, which says
    whether the init joins the pod's network namespace), or say in its `missing` why it has none
    (and refuse `--isolation strict`). Where no key filter exists for this machine, `missing`
    says so. `--network none` without a pod is refused whatever the policy (nothing but a pod
    gives it), but under `--isolation none`, which builds nothing: the network is the host's,
    and `missing` says so. `--network proxy` (the default) likewise, but under `--isolation
    auto` with `fallback` (no --allow-host asked, which the host's network would ignore) it
    runs on the host's network, `missing` saying why."""
    joined = plan.network in podnet.JOINED
    if plan.network == "host":
        plan.missing["network"] = HOST_ASKED
    if not plan.mount_namespace:
        if joined and plan.policy == "none":
            plan.missing["network"] = NO_NETWORK_NAMESPACE.format(plan.network)
            plan.network = "host"
        elif joined:
            raise IsolationUnavailable(f"--network {plan.network}: {_no_pod_why(plan)}")
        return
    why: str | None = None
    if os.environ.get(PODS_ENV) == "off":
        why = f"{PODS_ENV}=off asked for no pod: SysV IPC, POSIX message queues, keys and "
        why += "the hostname are the host's"
    elif not plan.drop_caps:
        why = "needs CAP_SETPCAP: a pod's user namespace gives every capability inside it"
    else:
        try:
            pod = ensure(home, task)
            plan.pod = {**pod, "filter": podns.key_filter(), "network": plan.network}
        except (OSError, ValueError) as exc:
            why = str(exc)
    if why is not None:
        if plan.network == "proxy" and fallback and plan.policy == "auto":
            plan.missing["pod"] = why
            without_network(plan, f"--network proxy: no pod, which alone gives it: {why}")
            return
        if joined:
            raise IsolationUnavailable(
                f"--network {plan.network}: no pod, which alone gives it: {why}"
            )
        if plan.policy == "strict":
            raise IsolationUnavailable(f"--isolation strict: pod: {why}")
        plan.missing["pod"] = why
        return
    missing = podns.key_filter_missing()
    if missing is not None:
        plan.missing["keys"] = missing


def without_network(plan: IsolationPlan, why: str) -> None:
    """The plan runs on the host's network after all, `missing` saying why."""
    plan.network = "host"
    if plan.pod is not None:
        plan.pod = {**plan.pod, "network": "host"}
    plan.missing["network"] = f"{why}: the command's network is the host's, unrecorded"


HOST_ASKED = (
    "the host's network (--network host, or no namespace to put the proxy in): every address "
    "and port of it, its loopback services included, and nothing records what the command sends"
)
NO_NETWORK_NAMESPACE = (
    "--network {} was asked for, but --isolation none builds no namespace: the command's "
    "network is the host's, and nothing records what it sends"
)


def _no_pod_why(plan: IsolationPlan) -> str:
    """Why a plan without a mount namespace has no pod (its `missing` says)."""
    return plan.missing.get(
        "mount_namespace", "no mount namespace, so no pod, which alone gives it"
    )


# -- finding ----------------------------------------------------------------------------------


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as handle:
            value = marshal.loads(handle.read())
    except (FileNotFoundError, EOFError, ValueError, TypeError):
        return None
    return value if isinstance(value, dict) else None


def _current(home: str) -> dict[str, Any] | None:
    """The pods namespace's record, if the pin still holds the namespace it names."""
    namespace = _read(os.path.join(_records(home), "namespace"))
    if namespace is None or pinned(pin_path(home)) != namespace.get("pods"):
        return None
    return namespace


def find(home: str, task: str) -> dict[str, Any] | None:
    """The task's pod as last made, if it is still there (no process started)."""
    record = _read(_record_path(home, task))
    if record is None or record.get("released") or record.get("v") != RECORD_VERSION:
        return None
    namespace = _current(home)
    if namespace is None or namespace.get("token") != record.get("token"):
        return None
    return _public(record, "found", None)


def _public(record: dict[str, Any], state: str, lost: str | None) -> dict[str, Any]:
    found = {k: v for k, v in record.items() if k not in ("token", "v", "released")}
    return {**found, "state": state, "lost": lost}


def ensure(home: str, task: str) -> dict[str, Any]:
    """The task's pod: found, else made (or made again) by a helper child."""
    _check_task(task)
    found = find(home, task)
    if found is not None and "net" in found:
        return found
    os.makedirs(_records(home), mode=0o700, exist_ok=True)
    result = in_helper(lambda: _make(home, task), f"making the pod of task {task}")
    if "error" in result:
        raise PodUnavailable(errno.EIO, f"pod of task {task}: {result['error']}")
    return result


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive flock on `path`, made if missing. The file may be removed by its holder
    (release): a lock taken on a file that is no longer at `path` is taken again."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                yield
                return
        finally:
            os.close(fd)


# -- making (in the helper: podmake) ----------------------------------------------------------


def _make(home: str, task: str) -> dict[str, Any]:
    with _using(home):  # the pods namespace is not let go while a pod is made in it
        return _make_in(home, task)


def _make_in(home: str, task: str) -> dict[str, Any]:
    namespace = _pods_namespace(home)
    unextended: str | None = None
    with _locked(os.path.join(_records(home), f"{task}.lock")):
        found = find(home, task)  # made meanwhile by another first session
        if found is not None and "net" in found:
            return found
        earlier = _read(_record_path(home, task))
        if found is not None and earlier is not None:  # made before pods had a network
            try:
                net = podnet.add_namespace(pin_path(home), earlier)
            except OSError as exc:
                unextended = f"its network namespace could not be added to it: {exc}"
            else:
                extended = {**earlier, "net": net}
                write_atomic(_record_path(home, task), marshal.dumps(extended))
                return {**_public(extended, "found", None), "added": ADDED_NETWORK}
        made = {
            "v": RECORD_VERSION,
            "token": namespace["token"],
            "task": task,
            "hostname": task,
            "pin": pin_path(home),
            "pods": namespace["pods"],
            **podmake.make_pod(pin_path(home), task),
            "keyring": podns.keyring_name(task),
            "made_at": time.time(),
        }
        write_atomic(_record_path(home, task), marshal.dumps(made))
    if earlier is None:
        return _public(made, "created", None)
    if unextended is not None:
        lost = f"the pod was made before pods had a network namespace, and {unextended}"
    elif earlier.get("released"):
        lost = "the task's pod was released (its task was closed)"
    else:
        lost = f"the pods namespace was made again: {namespace['why']}"
    return _public(made, "recreated", f"{lost}; its IPC objects, keys and hostname were lost")


def _pods_namespace(home: str) -> dict[str, Any]:
    """The home's pods namespace: the pinned one, else a new one (pinned, and recorded with
    a new token, so every pod recorded before is known to be lost)."""
    with _locked(os.path.join(_records(home), "namespace.lock")):
        current = _current(home)
        if current is not None:
            return current
        pin = pin_path(home)
        why = _pin_lost_why(home, pin)
        podmake.unpin(pin)  # a pin of another namespace than the record's
        podmake.private_mount(_records(home))
        inode = podmake.new_pods_namespace(os.path.join(_records(home), "root"), pin)
        namespace = {"pods": inode, "token": os.urandom(16).hex(), "why": why}
        write_atomic(os.path.join(_records(home), "namespace"), marshal.dumps(namespace))
        return namespace


def _pin_lost_why(home: str, pin: str) -> str:
    if _read(os.path.join(_records(home), "namespace")) is None:
        return "the home's pods namespace was released (or never made)"
    if not os.path.exists(pin):
        return f"its pin {pin} was removed"
    if pinned(pin) is None:
        return f"its pin {pin} was no longer mounted (a reboot, or released)"
    return f"its pin {pin} held another namespace than the one recorded"


# -- releasing --------------------------------------------------------------------------------


def release(home: str, task: str) -> None:
    """Mark the task's record released, then unmount its namespace files inside the pods
    namespace (the namespaces end once no process is in them). Idempotent."""
    _check_task(task)
    if not os.path.isdir(_records(home)):
        return
    # shared with other pods' work, exclusive to release_home_if_idle: the pods namespace is
    # not let go while this enters it (two destroys at once met a pin unmounted between)
    with _using(home), _locked(os.path.join(_records(home), f"{task}.lock")):
        record = _read(_record_path(home, task))
        if record is not None and not record.get("released"):
            write_atomic(_record_path(home, task), marshal.dumps({**record, "released": True}))
        if _current(home) is None:
            return  # no pods namespace: nothing of the task's is mounted anywhere
        result = in_helper(lambda: _release_inside(home, task), f"releasing the pod of {task}")
    if "error" in result:
        raise PodUnavailable(errno.EIO, f"pod of task {task}: {result['error']}")


def _release_inside(home: str, task: str) -> dict[str, Any]:
    with inside(pin_path(home)):
        podmake.clear(f"/{task}")
    return {}


@contextlib.contextmanager
def _using(home: str) -> Iterator[None]:
    """A shared flock on the home's `use.lock`: held while a pod is made, so that
    `release_home_if_idle` (which takes it exclusively) never unpins a namespace in use."""
    fd = os.open(
        os.path.join(_records(home), USE_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def release_home_if_idle(home: str) -> bool:
    """Unpin the home's pods namespace once no task holds a pod in it (every record of the
    current namespace released: its tasks closed or destroyed), so that a home whose tasks are
    all closed keeps no mount and can be removed like any directory; the next pod makes a new
    namespace. False, and nothing done, while a pod is being made or one is still held."""
    records = _records(home)
    if not os.path.isdir(records) or pinned(pin_path(home)) is None:
        return False
    fd = os.open(os.path.join(records, USE_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a pod is being made: the namespace is in use
        current = _current(home)
        for name in os.listdir(records):
            record = _read(os.path.join(records, name)) if name.endswith(".pod") else None
            if (
                record is not None
                and not record.get("released")
                and current is not None
                and record.get("token") == current.get("token")
            ):
                return False
        release_home(home)
        return True
    finally:
        os.close(fd)


def release_home(home: str) -> None:
    """Unmount the pods namespace's pin and the private mount it sits on (the namespace ends
    with the last session that copied it; every pod in it then ends too) and forget it: the
    next `ensure` makes a new one and says every earlier pod was lost. Idempotent."""
    records = _records(home)
    if not os.path.isdir(records):
        return
    pin = pin_path(home)
    with _locked(os.path.join(records, "namespace.lock")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(records, "namespace"))
        podmake.unpin(pin)
        podmake.unmount_private(records)


def describe(home: str, task: str) -> dict[str, Any] | None:
    """What the task's pod holds now, or None when it has none (never made, released, or lost
    with its pods namespace): its hostname; its SysV message queues (count, bytes), shared
    memory segments (count, bytes) and semaphore sets; its POSIX message queues (count, the
    first names); its network namespace's interfaces (`network`; None for a pod made before
    pods had one); and the keys of its keyring and of its uid 0 user keyring ("type:name"; the
    keyring None where a command of the task revoked it). For a close to say what the pod held
    before it is released; costs a helper process."""
    _check_task(task)
    if find(home, task) is None:
        return None
    record = _read(_record_path(home, task))
    assert record is not None
    scratch = os.path.join(_records(home), "root")
    with _using(home):
        result = in_helper(
            lambda: podmake.contents(pin_path(home), record, scratch), f"describing pod {task}"
        )
    if "error" in result:
        raise PodUnavailable(errno.EIO, f"pod of task {task}: {result['error']}")
    return result


def mounts(home: str) -> list[str]:
    """The pods namespace's mount table (/proc/self/mountinfo lines), or [] without one: for
    tests and for a person checking what a home holds."""
    if pinned(pin_path(home)) is None:
        return []

    def read() -> dict[str, Any]:
        with inside(pin_path(home)), open("/proc/self/mountinfo") as handle:
            return {"mounts": handle.read().splitlines()}

    result = in_helper(read, "reading the pods namespace")
    if "error" in result:
        raise PodUnavailable(errno.EIO, result["error"])
    return list(result["mounts"])
