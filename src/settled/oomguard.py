"""settled's own processes under memory pressure: never the kernel's first choice.

The owners, the zygotes, the journal daemon and the servers call `protect_self()` when they
start: it sets the process's `oom_score_adj` to -1000 (the OOM killer never picks it) where the
process holds CAP_SYS_RESOURCE. Without it no process can lower its own below its floor (0,
or what a privileged writer last set), and it stays as it was: `protect_self` says which. The
commands go to 1000 (boundary/spawn.py), so under a session's memory limit, or under the host's
own pressure, the kernel takes a command first either way.

Standard library only, one write: the owner's launch path imports it. Must never raise.
"""

from __future__ import annotations

PROTECTED = -1000  # OOM_SCORE_ADJ_MIN: never chosen
COMMAND = 1000  # OOM_SCORE_ADJ_MAX: chosen first
_PATH = "/proc/self/oom_score_adj"


def current() -> int | None:
    """This process's oom_score_adj, or None where /proc cannot tell."""
    try:
        with open(_PATH, "rb") as handle:
            return int(handle.read())
    except (OSError, ValueError):
        return None


def protect_self() -> int | None:
    """Lower this process to PROTECTED where allowed; its oom_score_adj after the attempt."""
    try:
        with open(_PATH, "wb") as handle:
            handle.write(b"-1000")
    except OSError:  # EACCES: no CAP_SYS_RESOURCE, so its floor holds
        pass
    return current()


def facts(value: int | None) -> dict[str, object]:
    """What a receipt says of an owner's protection, from its `protect_self()` answer."""
    held = value == PROTECTED
    fact: dict[str, object] = {"oom_score_adj": value, "protected": held}
    if not held:
        fact["why"] = (
            "this process lacks CAP_SYS_RESOURCE, so it cannot lower its oom_score_adj below "
            "its floor; the commands at 1000 are still chosen before it"
        )
    return fact
