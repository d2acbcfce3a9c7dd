"""Isolation: what a session's command can see and do, decided before it exists.

Owns the *plan*: which paths are hidden from the command (the settled home, other tasks'
workspaces, token files), which ancestors are pinned so they cannot be renamed away, which
paths stay writable on an otherwise read-only host (the workspace, /tmp, /var/tmp and what the
caller grants with --writable), whether /proc, /sys, /dev and the cgroup tree are replaced or
made read-only, which capabilities stay in the bounding set, `no_new_privs`, and the uid/gid the
command runs as.

Why a read-only host by default: a root command that can write the host's files can change
what host processes run later (settled's own interpreter and code, the shared libraries and the
loader's configuration, cron, a shell's rc files), and through them forge every later receipt.
A command that must install into the system is granted that path (`--writable /usr/local`), or
the whole host (`--writable /`), and its receipt says so. The owner makes the plan
in the host's namespaces from facts it can check (its own capabilities, the store's list of
workspaces); `mountview` and `privileges` carry it out in the child, where every step either
succeeds or the command never starts. The plan is what the receipt reports, protection by
protection, with why for each one that is missing: a receipt never claims a protection that was
not applied.

The threat it answers (docs/TRUST.md): the command is hostile, usually root. Without this, it
can rewrite its own receipt in the store, move itself out of its cgroup, read the server's
token, or open the disk's block device and read everything.
"""

from __future__ import annotations

import os

from settled.boundary import podnet, procfs

TYPE_CHECKING = False  # typing and dataclasses cost ~6 ms to import; the owner's launch path
if TYPE_CHECKING:  # rebuilds a plan from its orders, so this module does without both
    from collections.abc import Iterable
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
    "policy", "mount_namespace", "cgroup_namespace", "private_proc", "pins", "readonly_host",
    "writable", "protect", "hide_dirs", "hide_files", "expose", "readonly_sys", "minimal_dev",
    "drop_caps", "no_new_privs", "uid", "gid", "home", "missing", "pod", "network",
)  # fmt: skip


class IsolationPlan:
    """Everything the child will do to the command's view and privileges, decided up front.

    A plain class, not a dataclass: the owner rebuilds it from its orders (`fields`) on its
    launch path, which must not pay for dataclasses (and inspect, which it imports)."""

    __slots__ = _PLAN_FIELDS

    def __init__(
        self,
        policy: str,
        mount_namespace: bool = False,
        cgroup_namespace: bool = False,
        private_proc: bool = False,
        pins: tuple[str, ...] = (),  # ancestors bound onto themselves: cannot be renamed
        readonly_host: bool = False,
        writable: tuple[str, ...] = (),  # on a read-only host, bound back writable
        protect: tuple[str, ...] = (),  # settled's own code under a writable path: read-only
        hide_dirs: tuple[str, ...] = (),
        hide_files: tuple[str, ...] = (),
        expose: str | None = None,  # the workspace, re-bound inside a hidden directory
        readonly_sys: bool = False,
        minimal_dev: bool = False,
        drop_caps: bool = False,
        no_new_privs: bool = True,
        uid: int | None = None,
        gid: int | None = None,
        home: str | None = None,
        missing: dict[str, str] | None = None,
        pod: dict[str, Any] | None = None,  # the task's pod (podns.ensure): plain values
        network: str = "host",  # "none": the init joins the pod's network namespace (podnet)
    ) -> None:
        self.policy, self.mount_namespace = policy, mount_namespace
        self.cgroup_namespace, self.private_proc = cgroup_namespace, private_proc
        self.pins, self.readonly_host = tuple(pins), readonly_host
        self.writable, self.protect = tuple(writable), tuple(protect)
        self.hide_dirs, self.hide_files, self.expose = tuple(hide_dirs), tuple(hide_files), expose
        self.readonly_sys, self.minimal_dev = readonly_sys, minimal_dev
        self.drop_caps, self.no_new_privs = drop_caps, no_new_privs
        self.uid, self.gid, self.home = uid, gid, home
        self.missing = dict(missing or {})
        self.pod, self.network = pod, network

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

    def to_json(self) -> dict[str, Any]:
        """The receipt's `isolation`: each protection as it was applied, and why any is not."""
        return {
            "policy": self.policy,
            "mount_namespace": self.mount_namespace,
            "home_hidden": self.home is not None and self.home in self.hide_dirs,
            "hidden": {"dirs": list(self.hide_dirs), "files": list(self.hide_files)},
            "pinned": len(self.pins),
            "host": "read-only" if self.readonly_host else "writable",
            "writable": list(self.writable) if self.readonly_host else ["/"],
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


CONTAINED_CGROUP: Final = "namespace, read-only"


def recorded_cgroup_contained(recorded: dict[str, Any] | None) -> bool:
    """From a recorded plan (`to_json`): could none of the command's processes leave its
    cgroup? Nothing recorded (an older settled, or no isolation) means it could."""
    return recorded is not None and recorded.get("cgroup") == CONTAINED_CGROUP


def _has(caps: int, cap: int) -> bool:
    return bool(caps >> cap & 1)


def _is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def ancestors(path: str) -> list[str]:
    """Every directory above `path`, outermost first, "/" excluded."""
    found: list[str] = []
    parent = os.path.dirname(path)
    while parent not in ("/", ""):
        found.append(parent)
        parent = os.path.dirname(parent)
    return found[::-1]


def _ancestors_of_all(paths: Iterable[str]) -> set[str]:
    """Every directory above any of `paths` ("/" excluded), as `ancestors` gives each: one
    walk per distinct parent, where a home's workspaces mostly share one."""
    parents = {os.path.dirname(p) for p in paths}
    return {a for parent in parents for a in (*ancestors(parent), parent) if a not in ("/", "")}


def choose_hidden(
    workspace: str, home: str, others: Iterable[str]
) -> tuple[tuple[str, ...], str | None]:
    """The directories to hide (the home, other workspaces that exist) and the workspace to
    re-expose if one of them holds it. A directory that holds the workspace itself is never
    hidden (the command would lose its own files): overlapping workspaces are visible to each
    other, and the receipt lists exactly what was hidden."""
    candidates = [home, *others]
    kept: list[str] = []
    covered: set[str] = set()  # the kept, by their normalized names: one look per ancestor
    for path in sorted(set(candidates), key=len):
        if path == workspace or (_is_within(workspace, path) and path != home):
            continue  # an ancestor of the workspace (other than the home) stays visible
        if _inside_any(path, covered):
            continue  # already inside a hidden directory
        if path != home and not os.path.isdir(path):
            continue  # a task whose workspace is gone has nothing left to hide
        kept.append(path)
        covered.add(path.rstrip("/") or "/")
    expose = workspace if _inside_any(workspace, covered) else None
    return tuple(kept), expose


def _inside_any(path: str, roots: set[str]) -> bool:
    """`_is_within(path, root)` for some root of `roots` (normalized as `choose_hidden` keeps
    them), by looking up `path` and each directory above it: a home that hosted thousands of
    tasks has as many workspaces to hide, and a scan of every kept one per candidate made the
    plan quadratic (500 workspaces: 17 ms on the admission path)."""
    current = path.rstrip("/") or "/"
    while current not in roots:
        cut = current.rfind("/")  # os.path.dirname, without its cost on thousands of paths
        if cut < 0 or current == "/":
            return False
        current = current[:cut] or "/"
    return True


DEFAULT_WRITABLE: Final = ("/tmp", "/var/tmp")


_RUNTIME_PATHS: list[tuple[str, ...]] = []


def settled_runtime_paths() -> tuple[str, ...]:
    """What settled's own processes execute: its code, blake3, the interpreter's prefixes. A
    command must never change them (the next owner would run its code), even where they lie
    under a path it may write, such as a clone in /tmp. Found once per process (every plan
    asks, on the admission path)."""
    if not _RUNTIME_PATHS:
        import sys

        from settled.isolated import import_roots

        paths = {*import_roots("settled", "blake3"), sys.prefix, sys.base_prefix}
        paths.add(os.path.dirname(os.path.realpath(sys.executable)))
        _RUNTIME_PATHS.append(tuple(sorted(os.path.realpath(p) for p in paths)))
    return _RUNTIME_PATHS[0]


def choose_protected(writable: Iterable[str], runtime: Iterable[str]) -> tuple[str, ...]:
    """The outermost of settled's runtime paths that a writable path would otherwise expose."""
    writable = tuple(writable)
    kept: list[str] = []
    for path in sorted(set(runtime), key=len):
        if any(_is_within(path, outer) for outer in kept):
            continue
        if any(_is_within(path, w) for w in writable) and os.path.isdir(path):
            kept.append(path)
    return tuple(kept)


def choose_writable(
    workspace: str, granted: Iterable[str], hidden: Iterable[str]
) -> tuple[str, ...]:
    """The outermost of the workspace, /tmp, /var/tmp and the granted paths that exist; never
    one inside a hidden directory (no grant reaches into the home)."""
    covered = {h.rstrip("/") or "/" for h in hidden}
    wanted = sorted({workspace, *DEFAULT_WRITABLE, *granted}, key=len)
    kept: list[str] = []
    for path in wanted:
        if path != workspace and _inside_any(path, covered):
            continue
        if any(_is_within(path, outer) for outer in kept) or not os.path.isdir(path):
            continue
        kept.append(path)
    return tuple(kept)


def check_available(
    policy: str, *, pid_namespace: bool, uid: int | None = None, writable: Iterable[str] = ()
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
) -> IsolationPlan:
    """The strongest plan this process can carry out for `policy` ("none": nothing but the
    environment and descriptor hygiene every session gets). Raises IsolationUnavailable for
    `strict` when a protection is missing."""
    if policy == "none":
        return IsolationPlan(
            policy, no_new_privs=False, uid=uid, gid=gid,
            missing={"all": "isolation none was asked for: the command sees and may change "
                     "everything its uid can, the settled home included"},
        )  # fmt: skip
    granted = tuple(writable)
    caps, missing = check_available(policy, pid_namespace=pid_namespace, uid=uid, writable=granted)
    drop_caps = _has(caps, CAP_SETPCAP)
    if not _has(caps, CAP_SYS_ADMIN):
        return IsolationPlan(policy, drop_caps=drop_caps, uid=uid, gid=gid, missing=missing)
    dirs, expose = choose_hidden(workspace, home, other_workspaces)
    covered = {d.rstrip("/") or "/" for d in dirs}
    files = tuple(
        sorted({f for f in hidden_files if os.path.isfile(f) and not _inside_any(f, covered)})
    )  # a file inside a hidden directory is hidden with it
    pins = sorted(_ancestors_of_all((*dirs, *files)), key=lambda p: p.count("/"))
    readonly_host = "/" not in granted
    open_paths = choose_writable(workspace, granted, dirs) if readonly_host else ()
    return IsolationPlan(
        policy,
        mount_namespace=True,
        cgroup_namespace=True,
        private_proc=pid_namespace,
        pins=tuple(p for p in pins if not _inside_any(p, covered)),
        readonly_host=readonly_host,
        writable=open_paths,
        protect=choose_protected((*open_paths, workspace), settled_runtime_paths())
        if readonly_host
        else (),
        hide_dirs=dirs,
        hide_files=files,
        expose=expose,
        readonly_sys=True,
        minimal_dev=True,
        drop_caps=drop_caps,
        uid=uid,
        gid=gid,
        home=home,
        missing=missing,
    )
