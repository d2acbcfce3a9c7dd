"""Where a task's workspace may be: the checks `Runtime.new_task` makes before recording one.

Owns the refusals of workspaces that cannot be right: one on a pseudo-filesystem (proc, sysfs,
devtmpfs, cgroup, ...: a checkpoint of it would be the kernel's state, and a command writing
there changes the host), `/` itself, the settled home, a path inside it (but for the default
workspaces the runtime makes in `home/workspaces/`) and a path that contains it (a scan would
read the store and the logs; the command would see them). Overlap with another task's
workspace is decided by the store, in the same transaction that records the task.
Never writes anything.
"""

from __future__ import annotations

import os

from settled.errors import BadInput
from settled.where import mountinfo_path

# Filesystems that hold the kernel's state rather than files: no workspace may be on one.
PSEUDO_FILESYSTEMS = frozenset(
    {
        "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
        "securityfs", "pstore", "bpf", "configfs", "fusectl", "mqueue", "hugetlbfs",
        "binfmt_misc", "autofs", "efivarfs", "selinuxfs", "rpc_pipefs", "nsfs",
    }
)  # fmt: skip
# Where the kernel's views are mounted, refused by name too (in a container /dev is a tmpfs).
KERNEL_TREES = ("/proc", "/sys", "/dev")
WORKSPACES_DIR = "workspaces"  # the default workspaces' parent in the home
MOUNTINFO = "/proc/self/mountinfo"


class WorkspaceRefused(BadInput):
    """A workspace that cannot be right: nothing was recorded."""

    def __init__(self, workspace: str, why: str) -> None:
        super().__init__(f"--workspace {workspace!r} is refused: {why}")
        self.workspace, self.why = workspace, why

    def to_json(self) -> dict[str, object]:
        return {**super().to_json(), "workspace": self.workspace, "why": self.why}


def default_workspaces(home: str) -> str:
    """The directory of the home where the runtime makes a task's default workspace."""
    return os.path.join(home, WORKSPACES_DIR)


def within(path: str, root: str) -> bool:
    """`path` is `root` or below it (both resolved)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def overlap(a: str, b: str) -> bool:
    """The two directories are the same, or one holds the other."""
    return within(a, b) or within(b, a)


def filesystem_type(path: str, mountinfo: str = MOUNTINFO) -> str | None:
    """The type of the filesystem mounted nearest above `path` (resolved), from mountinfo;
    None when mountinfo cannot be read."""
    best: tuple[int, str] | None = None
    try:
        with open(mountinfo, encoding="utf-8", errors="surrogateescape") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(" ")
        if "-" not in fields[6:]:
            continue
        point = mountinfo_path(fields[4])
        fstype = fields[fields.index("-", 6) + 1]
        if within(path, point) and (best is None or len(point) >= best[0]):
            best = (len(point), fstype)  # a later mount on the same point covers an earlier
    return best[1] if best else None


def check_workspace(workspace: str, root: str, home: str) -> None:
    """Refuse (WorkspaceRefused, naming the path and why) a resolved workspace `root` that is
    on a pseudo-filesystem or a kernel tree, is `/`, is the home, is inside the home (but for a
    default workspace directly in `home/workspaces/`), or contains the home."""
    if root == "/":
        raise WorkspaceRefused(workspace, "it is / itself: a checkpoint would be the whole host")
    for tree in KERNEL_TREES:
        if within(root, tree):
            raise WorkspaceRefused(workspace, f"it is in {tree}, the kernel's own view")
    fstype = filesystem_type(root)
    if fstype in PSEUDO_FILESYSTEMS:
        raise WorkspaceRefused(
            workspace, f"it is on a {fstype} filesystem, which holds the kernel's state, not files"
        )
    home = os.path.realpath(home)
    if root == home:
        raise WorkspaceRefused(workspace, f"it is the settled home {home}")
    if within(home, root):
        raise WorkspaceRefused(
            workspace, f"it contains the settled home {home} (its store, logs and objects)"
        )
    if within(root, home) and os.path.dirname(root) != default_workspaces(home):
        raise WorkspaceRefused(
            workspace,
            f"it is inside the settled home {home}; only the default workspaces in "
            f"{default_workspaces(home)} may be (omit --workspace to get one)",
        )
