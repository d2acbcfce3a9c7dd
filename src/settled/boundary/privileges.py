"""The command's privileges: bounding set, capabilities, uid/gid and `no_new_privs`.

Runs in the command's own process, last before exec (after its view is built, which needs the
capabilities this takes away). Order matters: the bounding set shrinks first (it needs
CAP_SETPCAP), then the uid and gid change, then the capability sets are cut to what is left in
the bounding set with an empty inheritable set (a root exec gets `inheritable | bounding`, so
a capability left inheritable would come back), then `no_new_privs`, so no set-uid binary or file
capability can give any of it back. Never decides what to keep (isolation.py does).
"""

from __future__ import annotations

import os

from settled.boundary import linux
from settled.boundary.isolation import KEPT_CAPS

TYPE_CHECKING = False  # the owner's launch path imports this: no typing at run time
if TYPE_CHECKING:
    from settled.boundary.isolation import IsolationPlan


def drop(plan: IsolationPlan) -> None:
    if plan.drop_caps:
        for cap in range(linux.last_cap() + 1):
            if cap not in KEPT_CAPS:
                linux.prctl(linux.PR_CAPBSET_DROP, cap)
        linux.prctl(linux.PR_CAP_AMBIENT, linux.PR_CAP_AMBIENT_CLEAR_ALL)
    if plan.gid is not None:
        os.setgroups([])
        os.setresgid(plan.gid, plan.gid, plan.gid)
    if plan.uid is not None:
        os.setresuid(plan.uid, plan.uid, plan.uid)  # a non-root uid loses every capability
    if plan.drop_caps and os.geteuid() == 0:
        kept = sum(1 << cap for cap in KEPT_CAPS)
        _effective, permitted, _inheritable = linux.capget()
        linux.capset(permitted & kept, permitted & kept, 0)
    if plan.no_new_privs:
        linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
