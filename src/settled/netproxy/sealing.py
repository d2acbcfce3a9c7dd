"""A session's ledger sealed and said: what its owner (or, for a lost owner, recovery) puts in
the receipt's `network` once nothing of the command runs.

Asks the proxy to seal (it aborts what is still open and appends `sealed`), then folds the file
whatever the proxy answered: a proxy that is gone leaves what it wrote, and a connection it never
saw end is unknown (netledger.entries). `killed_at` (CLOCK_MONOTONIC) is when settled began to
kill the command, None if it killed nothing: ends seen from then on are not trusted.

Must never: fail the receipt it serves (a ledger that cannot be read is said, not raised).
"""

from __future__ import annotations

import os
from typing import Any

from settled import netledger, netpolicy
from settled.canonical import digest_of
from settled.home import session_dir
from settled.netproxy import wire
from settled.where import run_dir


def sealed_facts(
    home: str, session: str, allow_hosts: list[str], killed_at: float | None
) -> dict[str, Any]:
    trouble = wire.seal(run_dir(home), session, killed_at)
    path = os.path.join(session_dir(home, session), netledger.LEDGER_NAME)
    try:
        events, damaged = netledger.read_events(path)
    except OSError as exc:
        events, damaged = [], 0
        trouble = f"{trouble + '; ' if trouble else ''}the ledger could not be read: {exc}"
    listed = netledger.entries(events, killed_at)
    facts: dict[str, Any] = {
        "mode": "proxy",
        "proxy": netpolicy.PROXY_URL,
        "allow_hosts": list(allow_hosts),
        "ledger": netledger.facts(listed, damaged, digest_of(listed)),
        "ledger_file": path,
    }
    if netledger.unrecorded(events):
        facts["ledger"]["refused_unrecorded"] = netledger.unrecorded(events)
        facts["ledger"]["limit_hit"] = True
    if trouble is not None:
        facts["proxy_trouble"] = trouble
    return facts
