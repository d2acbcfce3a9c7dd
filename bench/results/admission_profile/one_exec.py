"""One fresh `Runtime.exec(argv=["true"])` between two markers on stderr, after three untimed
ones, for `strace -f -tt` (see README.md in this directory)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from common import end_process, settled_rig

with settled_rig("once", None) as rig:
    for _ in range(3):
        warm = rig.exec(argv=["true"])
        end_process(rig.runtime.wait(warm.session, timeout=30)["receipt"]["owner"]["pid"], "owner")
    os.write(2, b"MARKER_BEGIN\n")
    admission = rig.exec(argv=["true"])
    os.write(2, b"MARKER_END\n")
    receipt = rig.runtime.wait(admission.session, timeout=30)["receipt"]
    end_process(receipt["owner"]["pid"], "owner")
