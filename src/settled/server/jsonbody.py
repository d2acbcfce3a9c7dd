r"""Every JSON answer of the HTTP services (`settled serve` and `--swerex`), written as ASCII.

Why: Starlette's `JSONResponse` writes `ensure_ascii=False` and encodes to UTF-8 strictly, so
a string holding a lone surrogate (a byte of a file name or of a file's content that is not
UTF-8, as `os.fsdecode` or `errors="surrogateescape"` make it, both the command's to choose)
raised `UnicodeEncodeError` while the answer was written. ASCII JSON writes that character as
`\udcff`, as `settled --json` does; every other string keeps its value (`é` is sent as
`\u00e9`, which every JSON parser reads as `é`).

Must never: change a value, only how it is spelled on the wire.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse


class AsciiJSONResponse(JSONResponse):
    """A `JSONResponse` whose body is ASCII JSON: any str can be answered."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")
