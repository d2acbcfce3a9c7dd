"""Isolation: what a session's command can see and do, decided before it exists.

Owns the *plan*: the command's view of the filesystem (an allow-list chosen by viewplan.py:
the distribution's system roots read-only, the workspace and the grants at their own paths, the
task's pod directories, a new /proc, a minimal /dev, /sys read-only, and nothing else of the
host), whether its mount and cgroup namespaces are new, which capabilities stay in the
bounding set, `no_new_privs`, the uid/gid the command runs as, and the task's pod namespaces
(`pod`: podns.py's, opaque here) the init joins around the view.

Why an allow-list: a deny-list hides what settled knows of (its home, its workspaces, its
tokens) and leaves every other door open: another home on the same machine and its launcher's
socket, a store or object directory shared by two homes, the host's /tmp, any user's files.
What the command is not granted does not exist for it. The owner makes the plan in the
host's namespaces from facts it can check (its own capabilities, the store's list of
workspaces); `mountview` and `privileges` carry it out in the child, where every step either
succeeds or the command never starts. The plan is what the receipt reports (`to_json`): the
view, entry by entry, with its digest, and each protection that is missing with why: a
receipt never claims a protection that was not applied.

The threat it answers (docs/TRUST.md): the command is hostile, usually root. Without this, it
can rewrite its own receipt in the store, move itself out of its cgroup, read the server's
token, reach another home's launcher, or open the disk's block device and read everything.
"""

from __future__ import annotations

import os

from settled.boundary import procfs

TYPE_CHECKING = False  # typing and dataclasses cost ~6 ms to import; the owner's launch path
if TYPE_CHECKING:  # rebuilds a plan from its orders, so this module does without both
    from collections.abc import Iterable, Mapping
    from typing import Any, Final

ISOLATION_POLICIES: Final = ("auto", "strict", "none")

CAP_NAMES: Final = (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
    "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
    "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
    "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
    "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
    "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE",
)  # fmt: skip
# What a root command keeps: a container runtime's default set without MKNOD (settled gives no
# device cgroup, so a new block device node would be a way to the raw disk). Everything else,
# SYS_ADMIN, SYS_PTRACE, SYS_MODULE, SYS_RAWIO, DAC_READ_SEARCH (open_by_handle_at), BPF and
# SYS_TIME (the lease and scan clocks) among them, leaves the bounding set before exec.
KEPT_CAPS: Final = frozenset(
    CAP_NAMES.index(name)
    for name in (
        "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
        "NET_BIND_SERVICE", "NET_RAW", "SYS_CHROOT", "AUDIT_WRITE", "SETFCAP",
    )
)  # fmt: skip
CAP_SYS_ADMIN: Final = CAP_NAMES.index("SYS_ADMIN")
CAP_SETPCAP: Final = CAP_NAMES.index("SETPCAP")
CAP_SETUID: Final = CAP_NAMES.index("SETUID")
CAP_SETGID: Final = CAP_NAMES.index("SETGID")


class IsolationUnavailable(Exception):
    """`--isolation strict` was asked for and this machine cannot give every protection."""


def cap_name(cap: int) -> str:
    return CAP_NAMES[cap] if cap < len(CAP_NAMES) else f"CAP_{cap}"


_PLAN_FIELDS: Final = (
    "policy", "mount_namespace", "cgroup_namespace", "private_proc", "view", "pins",
    "writable", "readable", "protect", "hide_dirs", "hide_files", "readonly_sys", "minimal_dev",
    "drop_caps", "no_new_privs", "uid", "gid", "home", "pod", "missing", "network",
)  # fmt: skip


class IsolationPlan:
    """Everything the child will do to the command's view and privileges, decided up front.

    A plain class, not a dataclass: the owner rebuilds it from its orders (`fields`) on its
    launch path, which must not pay for dataclasses (and inspect, which it imports). Every
    field is a plain value (marshal carries the orders)."""

    __slots__ = _PLAN_FIELDS

    def __init__(
        self,
        policy: str,
        mount_namespace: bool = False,
        cgroup_namespace: bool = False,
        private_proc: bool = False,
        view: tuple[dict[str, str], ...] = (),  # viewplan's entries, in build order
        pins: tuple[str, ...] = (),  # directories bound onto themselves: cannot be renamed
        writable: tuple[str, ...] = (),  # the grants kept, read-write
        readable: tuple[str, ...] = (),  # the grants kept, read-only
        protect: tuple[str, ...] = (),  # settled's own code under a writable path: read-only
        hide_dirs: tuple[str, ...] = (),  # covered: inside a root of the view, yet hidden
        hide_files: tuple[str, ...] = (),
        readonly_sys: bool = False,
        minimal_dev: bool = False,
        drop_caps: bool = False,
        no_new_privs: bool = True,
        uid: int | None = None,
        gid: int | None = None,
        home: str | None = None,
        pod: dict[str, Any] | None = None,  # podns.ensure()'s, joined by the init
        missing: dict[str, str] | None = None,
        network: str = "host",  # "none": the init joins the pod's network namespace (podnet)
    ) -> None:
        self.policy, self.mount_namespace = policy, mount_namespace
        self.cgroup_namespace, self.private_proc = cgroup_namespace, private_proc
        self.view, self.pins = tuple(view), tuple(pins)
        self.writable, self.readable = tuple(writable), tuple(readable)
        self.protect = tuple(protect)
        self.hide_dirs, self.hide_files = tuple(hide_dirs), tuple(hide_files)
        self.readonly_sys, self.minimal_dev = readonly_sys, minimal_dev
        self.drop_caps, self.no_new_privs = drop_caps, no_new_privs
        self.uid, self.gid, self.home, self.pod = uid, gid, home, pod
        self.missing = dict(missing or {})
        self.network = network

    def fields(self) -> dict[str, Any]:
        """The plan as plain values (what the launcher hands its owner): IsolationPlan(**it)."""
        return {name: getattr(self, name) for name in _PLAN_FIELDS}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IsolationPlan) and self.fields() == other.fields()

    def __hash__(self) -> int:
        return hash(tuple(repr(v) for v in self.fields().values()))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.fields().items())
        return f"IsolationPlan({args})"

    @property
    def cgroup_contained(self) -> bool:
        """True when a process of the command cannot move itself to another cgroup: a cgroup
        namespace rooted at its session's cgroup, the cgroup mounts read-only, and no
        CAP_SYS_ADMIN to mount another."""
        return self.cgroup_namespace and self.readonly_sys and self.drop_caps

    @property
    def home_hidden(self) -> bool:
        """True when nothing of the home reaches the command: its view holds no bind of the
        home or of a directory above it, or the home is covered there."""
        if not self.mount_namespace or self.home is None:
            return False
        if self.home in self.hide_dirs:
            return True
        from settled.boundary import viewplan  # the view's rules: an owner's init needs them

        return not any(
            e["kind"] in viewplan.IDENTITY_KINDS
            and e["mode"] != "symlink"
            and "source" in e
            and viewplan.is_within(self.home, e["source"])
            for e in self.view
        )

    def host(self) -> str:
        """What of the host the command sees: "allow-list" (only its view), "read-only" or
        "writable" (the whole host, granted with --readable / or --writable /)."""
        if not self.mount_namespace:
            return "writable"
        root = next((e for e in self.view if e["path"] == "/"), None)
        if root is None:
            return "allow-list"
        return "writable" if root["mode"] == "rw" else "read-only"

    def to_json(self) -> dict[str, Any]:
        """The receipt's `isolation`: each protection as it was applied, and why any is not."""
        from settled.boundary import podnet, viewplan  # not on an owner's launch path
        from settled.canonical import digest_of  # json: off the owner's launch path

        view = [dict(e) for e in self.view]
        return {
            "policy": self.policy,
            "mount_namespace": self.mount_namespace,
            "home_hidden": self.home_hidden,
            "hidden": {"dirs": list(self.hide_dirs), "files": list(self.hide_files)},
            "pinned": len(self.pins),
            "host": self.host(),
            "view": view,
            "view_digest": digest_of(view),
            "writable": [
                e["path"]
                for e in self.view
                if e["kind"] in viewplan.READ_WRITE_KINDS and e["mode"] == "rw"
            ]
            if self.mount_namespace
            else ["/"],
            "readable": list(self.readable),
            "protected": list(self.protect),
            "proc": "private" if self.private_proc else "host",
            "sys": "read-only" if self.readonly_sys else "host",
            "dev": "minimal" if self.minimal_dev else "host",
            "cgroup": CONTAINED_CGROUP if self.cgroup_contained else "host",
            "capabilities": (
                sorted(cap_name(c) for c in KEPT_CAPS) if self.drop_caps else "unchanged"
            ),
            "no_new_privs": self.no_new_privs,
            "uid": self.uid if self.uid is not None else os.geteuid(),
            "gid": self.gid if self.gid is not None else os.getegid(),
            "descriptors": "0, 1, 2 only",
            "missing": dict(self.missing),
            "pod": pod_facts(self.pod),
            "network": podnet.facts(self.network, self.pod),
        }


def pod_facts(pod: dict[str, Any] | None) -> dict[str, Any] | None:
    """The receipt's `isolation.pod`: which pod the command ran in (its namespaces by inode,
    its keyring by name) and whether it was made for this session, found, or made again (with
    what was lost)."""
    if pod is None:
        return None
    return {
        "hostname": pod["hostname"],
        "namespaces": {name: pod[name] for name in ("user", "ipc", "uts", "net") if name in pod},
        "keyring": pod["keyring"],
        "state": pod["state"],
        "lost": pod["lost"],
        **({"added": pod["added"]} if pod.get("added") else {}),
    }


SANDBOX_NETWORK: Final = "the sandbox's network, which settled neither builds nor checks"


def isolation_facts(plan: IsolationPlan, sandbox: dict[str, Any] | None) -> dict[str, Any]:
    """The plan as recorded and receipted, naming the sandbox the command ran inside. Here, not
    in the launcher's handoff: an owner writes it into its receipt, and importing the
    launcher's half there (the pods' host side, shutil) cost a fresh owner ~6 ms between its
    command's death evidence and its receipt."""
    if sandbox is None:
        return plan.to_json()
    network = {"mode": "host", "namespace": "the sandbox's", "shared": SANDBOX_NETWORK}
    return {**plan.to_json(), "sandbox": sandbox, "network": network}


CONTAINED_CGROUP: Final = "namespace, read-only"


def recorded_cgroup_contained(recorded: dict[str, Any] | None) -> bool:
    """From a recorded plan (`to_json`): could none of the command's processes leave its
    cgroup? Nothing recorded (an older settled, or no isolation) means it could."""
    return recorded is not None and recorded.get("cgroup") == CONTAINED_CGROUP


def _has(caps: int, cap: int) -> bool:
    return bool(caps >> cap & 1)


_RUNTIME_PATHS: list[tuple[str, ...]] = []


def settled_runtime_paths() -> tuple[str, ...]:
    """What settled's own processes execute: its code, blake3, the interpreter's prefixes. A
    command must never change them (the next owner would run its code), even where they lie
    under a path it may write, such as a clone in its workspace. Found once per process (every
    plan asks, on the admission path)."""
    if not _RUNTIME_PATHS:
        import sys

        from settled.helper_process import import_roots

        paths = {*import_roots("settled", "blake3"), sys.prefix, sys.base_prefix}
        paths.add(os.path.dirname(os.path.realpath(sys.executable)))
        _RUNTIME_PATHS.append(tuple(sorted(os.path.realpath(p) for p in paths)))
    return _RUNTIME_PATHS[0]


def check_available(
    policy: str,
    *,
    pid_namespace: bool,
    uid: int | None = None,
    writable: Iterable[str] = (),
    readable: Iterable[str] = (),
) -> tuple[int, dict[str, str]]:
    """This process's effective capabilities and each protection it cannot give, with why.
    Raises IsolationUnavailable for `strict` when one is missing, or for a `--user` it cannot
    switch to. One read of /proc/self/status: admission calls it before recording anything."""
    caps = procfs.effective_capabilities()
    missing: dict[str, str] = {}
    if not _has(caps, CAP_SYS_ADMIN):
        why = "needs CAP_SYS_ADMIN, which the owner lacks"
        for name in ("mount_namespace", "home_hidden", "host", "sys", "dev", "cgroup"):
            missing[name] = why
    elif "/" in writable:
        missing["host"] = (
            "writable, as asked (--writable /): the command may change programs that host "
            "processes run later, settled's own included, so receipts written after it are "
            "only as trustworthy as the host"
        )
    elif "/" in readable:
        missing["host"] = (
            "visible, as asked (--readable /): the command may read every file of the host its "
            "uid can, but for what settled covers"
        )
    if not pid_namespace:
        missing["proc"] = "no PID namespace: /proc shows the host's processes"
    if not _has(caps, CAP_SETPCAP) and os.geteuid() == 0:
        missing["capabilities"] = "needs CAP_SETPCAP to shrink the bounding set"
    if uid is not None and not (_has(caps, CAP_SETUID) and _has(caps, CAP_SETGID)):
        raise IsolationUnavailable(f"--user {uid}: the owner lacks CAP_SETUID/CAP_SETGID")
    if policy == "strict" and set(missing) - {"host"}:
        raise IsolationUnavailable(
            "--isolation strict: " + "; ".join(f"{k}: {v}" for k, v in missing.items())
        )
    return caps, missing


def make_plan(
    policy: str,
    *,
    workspace: str,
    home: str,
    other_workspaces: Iterable[str] = (),
    hidden_files: Iterable[str] = (),
    pid_namespace: bool,
    uid: int | None = None,
    gid: int | None = None,
    writable: Iterable[str] = (),
    readable: Iterable[str] = (),
    pod_dirs: Mapping[str, str] | None = None,
    command_home: str | None = None,
    pod: dict[str, Any] | None = None,
    workspace_identity: tuple[int, int] | None = None,
) -> IsolationPlan:
    """The strongest plan this process can carry out for `policy` ("none": nothing but the
    environment and descriptor hygiene every session gets). `pod_dirs`: the task's pod
    directories (poddirs.ensure), bound at /tmp, /var/tmp, /dev/shm and `command_home` (the
    command's $HOME). `workspace_identity`: the workspace's (dev, ino) recorded at `task new`,
    which the bind checks (mountview). Raises IsolationUnavailable for `strict` when a
    protection is missing."""
    if policy == "none":
        return IsolationPlan(
            policy, no_new_privs=False, uid=uid, gid=gid,
            missing={"all": "isolation none was asked for: the command sees and may change "
                     "everything its uid can, the settled home included; no view was built"},
        )  # fmt: skip
    granted, shown = tuple(writable), tuple(readable)
    caps, missing = check_available(
        policy, pid_namespace=pid_namespace, uid=uid, writable=granted, readable=shown
    )
    drop_caps = _has(caps, CAP_SETPCAP)
    if not _has(caps, CAP_SYS_ADMIN):
        return IsolationPlan(policy, drop_caps=drop_caps, uid=uid, gid=gid, missing=missing)
    from settled.boundary import viewplan  # the launcher's: never on an owner's launch path

    chosen = viewplan.plan_view(
        workspace=workspace,
        home=home,
        others=other_workspaces,
        hidden_files=hidden_files,
        writable=granted,
        readable=shown,
        pod_dirs=pod_dirs,
        command_home=command_home,
        runtime=settled_runtime_paths(),
        workspace_identity=workspace_identity,
    )
    return IsolationPlan(
        policy,
        mount_namespace=True,
        cgroup_namespace=True,
        private_proc=pid_namespace,
        view=chosen.view,
        pins=chosen.pins,
        writable=chosen.writable,
        readable=chosen.readable,
        protect=chosen.protect,
        hide_dirs=chosen.hide_dirs,
        hide_files=chosen.hide_files,
        readonly_sys=True,
        minimal_dev=True,
        drop_caps=drop_caps,
        uid=uid,
        gid=gid,
        home=home,
        pod=pod,
        missing=missing,
    )
