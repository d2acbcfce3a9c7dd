"""docs/TRUST.md names a test for every claim: each name it gives must be a test that exists.

A name is `tests/test_x.py::test_y` (that file), `::test_y` (the file named last before it), or
a bare `test_y` (tests/test_trust.py, as the page says, or the file named last before it).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRUST = ROOT / "docs" / "TRUST.md"
NAME = re.compile(r"`((?:tests/(test_\w+\.py))?(?:::)?(test_\w+)?)`")


def _defined(file: str) -> set[str]:
    text = (ROOT / "tests" / file).read_text()
    return set(re.findall(r"^def (test_\w+)\(", text, flags=re.M))


def test_every_test_trust_md_names_exists() -> None:
    text = TRUST.read_text()
    last = "test_trust.py"
    cited, missing = 0, []
    for match in NAME.finditer(text):
        whole, file, name = match.groups()
        if file and not name:  # a file named alone: the bare names after it are its
            last = file
            continue
        if not name:
            continue
        cited += 1
        if file:
            last = file
            found = name in _defined(file)
        elif whole.startswith("::"):
            found = name in _defined(last)
        else:
            found = name in _defined("test_trust.py") or name in _defined(last)
        if not found:
            missing.append(f"{name} (looked in {file or last})")
    assert cited > 50, "the page names its tests"
    assert missing == []
