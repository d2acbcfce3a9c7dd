"""cgroup v2 boundary: a cgroup per session under a cgroup per task.

Evidence: `cgroup.kill`, then `cgroup.events` reporting `populated 0`, then a successful rmdir.
The hierarchy is found from /proc/self/mountinfo and /proc/self/cgroup (here it is mounted at
/sys/fs/cgroup/unified, not /sys/fs/cgroup). The command starts inside it (clone3 with
CLONE_INTO_CGROUP; where that is missing, the child joins before it execs). Never trusts a
missing pid as proof: only the kernel's populated flag counts.

The session's cgroup is made ahead of need: by the launcher, while the owner's interpreter
starts, before the claim that records it (one write for both). It is named for its session
(`settled/<task>/<session>`), so recovery finds it by name whether or not the owner lived to use
it; a claim that is lost removes it, and recovery removes the cgroup of a session that no owner
ever claimed (boundary/local.py). It never serves another session.

A root process can write its pid into the `cgroup.procs` of a cgroup above its own and leave;
its session's cgroup then reports `populated 0` while it runs on. Isolation prevents that (a
cgroup namespace rooted at the session's cgroup, read-only cgroup mounts, no CAP_SYS_ADMIN).
Where the plan cannot, `watch_escapes` makes the owner a child subreaper as well: a process that
left is still its descendant, and `populated 0` counts as evidence only once the owner has
found, killed and reaped every such process (they are named in the evidence).
"""

from __future__ import annotations

import errno
import os
import time

from settled.boundary import procfs, unavailable
from settled.boundary.base import Boundary, Evidence
from settled.boundary.spawn import join_cgroup
from settled.boundary.subreaper import EscapeWitness

ROOT_DIR_NAME = "settled"


def _cgroup2_mounts() -> list[str]:
    mounts = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            left, _, right = line.partition(" - ")
            if right.split(" ", 1)[0] == "cgroup2":
                mounts.append(left.split()[4])
    return mounts


def _own_cgroup() -> str | None:
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            if line.startswith("0::"):
                return line[3:].strip()
    return None


def find_hierarchy() -> str:
    """The writable directory of the v2 hierarchy that holds this process, or a loud reason."""
    override = os.environ.get("SETTLED_CGROUP_ROOT")
    if override:
        candidates = [override]
    else:
        own = _own_cgroup()
        if own is None:
            raise unavailable("cgroup2: this process is in no cgroup v2 hierarchy")
        candidates = [os.path.join(m, own.lstrip("/")) for m in _cgroup2_mounts()]
        if not candidates:
            raise unavailable("cgroup2: no cgroup2 filesystem is mounted")
    for base in candidates:
        if (
            os.path.isdir(base)
            and os.access(base, os.W_OK)
            and os.path.exists(os.path.join(base, "cgroup.procs"))
        ):
            if base not in _PROBED:
                _require_cgroup_kill(base)
                _PROBED.add(base)
            return base
    raise unavailable(f"cgroup2: no writable cgroup v2 directory among {candidates}")


_PROBED: set[str] = set()  # hierarchies whose children have cgroup.kill: a kernel's feature


def _require_cgroup_kill(base: str) -> None:
    """A root cgroup never has cgroup.kill, so probe with a child (mkdir + rmdir: 0.05 ms),
    once per hierarchy and process: an admission asked it three times."""
    probe = os.path.join(base, f"{ROOT_DIR_NAME}-probe-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.mkdir(probe)
    except OSError as exc:
        raise unavailable(f"cgroup2: cannot create a cgroup under {base}: {exc}") from exc
    try:
        if not os.path.exists(os.path.join(probe, "cgroup.kill")):
            raise unavailable(f"cgroup2: {base} offers no cgroup.kill (kernel < 5.14)")
    finally:
        os.rmdir(probe)


def _read_events(path: str) -> dict[str, str]:
    """A cgroup removed under us (the task's sandbox was destroyed) was empty when removed:
    the kernel refuses to rmdir a populated cgroup."""
    try:
        with open(os.path.join(path, "cgroup.events")) as handle:
            return dict(line.split() for line in handle if line.strip())
    except FileNotFoundError:
        return {"populated": "0", "removed": "1"}


class Cgroup2Boundary(Boundary):
    kind = "cgroup2"

    def __init__(
        self, task: str, session: str, hierarchy: str | None = None, *, watch_escapes: bool = False
    ) -> None:
        super().__init__(task, session)
        self.witness = EscapeWitness() if watch_escapes else None
        found = hierarchy or find_hierarchy()
        self.hierarchy = found
        self.task_path = os.path.join(found, ROOT_DIR_NAME, task)
        self.path = os.path.join(self.task_path, session)
        self._kill_rounds = 0
        self._removed = False
        self._emptied_after_s: float | None = None
        self._kill_started: float | None = None

    @property
    def ref(self) -> str:
        return self.path

    def create(self) -> None:
        """Make the session's cgroup. One that exists already is refused, never shared: it is
        another launch's of the same session (which loses its claim) or a leftover."""
        for _attempt in range(100):  # a sibling owner may rmdir an empty parent under us
            try:
                os.makedirs(self.task_path, exist_ok=True)
                os.mkdir(self.path)
                return
            except FileNotFoundError:
                continue
            except FileExistsError:
                raise unavailable(
                    f"cgroup2: {self.path} exists already: another launch of this session made "
                    "it, and it is never shared"
                ) from None
        raise unavailable(f"cgroup2: could not create {self.path}")

    def discard(self) -> None:
        """Undo `create` before anything started inside (a claim lost, a cancel): kill what a
        root process of another session may have put there all the same, then remove it.
        Never through the escape witness: in a launcher, its sweep would take the launcher's
        own children for the session's."""
        give_up = time.monotonic() + 5.0
        while os.path.isdir(self.path):
            self.kill_all()
            if _read_events(self.path).get("populated") == "0":
                self._remove()
                return
            if time.monotonic() > give_up:
                return
            time.sleep(0.001)

    def setup(self) -> None:
        if self.witness is not None:
            self.witness.setup()

    def birth_cgroup(self) -> str:
        return self.path

    def prepare_child(self, placed: bool) -> None:
        if not placed:
            join_cgroup(self.path)

    def members(self) -> list[int]:
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as handle:
                listed = [int(p) for p in handle.read().split()]
            return [p for p in listed if procfs.state_of(p) not in (None, "Z")]
        except FileNotFoundError:
            return []

    def kill_all(self) -> None:
        if self._kill_started is None:
            self._kill_started = time.monotonic()
        self._kill_rounds += 1
        try:
            with open(os.path.join(self.path, "cgroup.kill"), "w") as handle:
                handle.write("1")
        except FileNotFoundError:
            pass  # removed already, which needs it empty (see _read_events)

    def is_empty(self) -> bool:
        if _read_events(self.path).get("populated") != "0":
            return False
        if self._emptied_after_s is None and self._kill_started is not None:
            self._emptied_after_s = time.monotonic() - self._kill_started
        return self.witness is None or self.witness.sweep(self.main_pid, self.collect_main)

    def evidence(self) -> Evidence:
        populated = _read_events(self.path).get("populated")
        proven = populated == "0" and self.is_empty()
        if proven:
            self._remove()
        observed: dict[str, object] = {
            "cgroup": self.path,
            "populated": int(populated) if populated is not None else None,
            "kill_rounds": self._kill_rounds,
            "rmdir": self._removed,
        }
        if self._emptied_after_s is not None:
            observed["kill_to_empty_ms"] = round(self._emptied_after_s * 1000, 3)
        text = (
            f"cgroup.kill x{self._kill_rounds}; cgroup.events populated 0; rmdir {self.path}"
            if proven and self._removed
            else None
        )
        if self.witness is not None:
            observed["escaped"] = self.witness.escaped
            if text is not None:
                text += (
                    f"; the owner (a child subreaper) killed and reaped "
                    f"{len(self.witness.escaped)} process(es) that had left the cgroup and "
                    "found no other descendant"
                )
        return Evidence(self.kind, proven and self._removed, text, observed)

    def _remove(self) -> None:
        for _attempt in range(200):
            try:
                os.rmdir(self.path)
                self._removed = True
                break
            except FileNotFoundError:
                self._removed = True
                break
            except OSError as exc:  # EBUSY while the kernel finishes tearing down
                if exc.errno != errno.EBUSY:
                    raise
                time.sleep(0.001)
        for parent in (self.task_path, os.path.dirname(self.task_path)):
            try:
                os.rmdir(parent)
            except OSError:
                break  # another session of the task (or another task) still lives there

    def teardown(self) -> None:
        super().teardown()
        if not self._removed and os.path.isdir(self.path) and self.await_empty(5.0):
            self._remove()
