r"""Text a command controls, made safe to show a person on a terminal: the one escape of every
human view (`settled ps`, `status`, `ls`, receipts, explain, errors).

Why: argv, shell strings, keys, labels, paths and file names are the command's to choose, and a
terminal obeys what it is sent: ESC [ 2K and a carriage return erase a row, a backspace or a
bidi override (U+202E) makes a row read as another, an OSC 8 sequence forges a link. A view
settled composes must show such text as characters, never as orders to the terminal.

The scheme (like `ls -b` and git's quotePath, one rule for every character):

- a character `str.isprintable` accepts, and the space, is itself (`é`, CJK, emoji);
- the backslash is `\\`, so every other backslash in a view starts an escape;
- C0 controls and DEL (U+0000-U+001F, U+007F) are `\xNN` (ESC is `\x1b`, a newline `\x0a`);
- a lone surrogate U+DC80-U+DCFF, which is what `os.fsdecode` makes of a byte that is not
  UTF-8, is `\xNN` of that byte (U+DCFF is `\xff`); `\xNN` is therefore a byte below 0x20, 0x7f,
  or a byte from 0x80 up that was not UTF-8, never a character from U+0080 up (U+0085 and
  the byte 0x85 read apart);
- every other character `str.isprintable` refuses is `\uNNNN`, or `\UNNNNNNNN` above the BMP:
  C1 controls (U+0080-U+009F), format characters (category Cf: bidi controls U+202A-U+202E and
  U+2066-U+2069, zero-width characters, U+FEFF, tag characters), the line and paragraph
  separators U+2028/U+2029, spaces other than U+0020, private-use and unassigned code points,
  and the surrogates not made from a byte.

So distinct texts give distinct views: reading a view back is unambiguous. A view is not
idempotent (escaping it again doubles its backslashes); escape once, where text is composed.
`printable_tree` escapes every string (and key) of a JSON-shaped value, so a renderer escapes
its whole input once and formats it as before. `surrogates_escaped` escapes lone surrogates
alone, the same way, for a face that must send strict UTF-8 but is not a terminal (MCP).

Must never: raise for any str, change what is printable (the fast path returns the same
object), import anything (every `settled status` loads it), or be applied to JSON output or to
a command's own output bytes that a verb relays on purpose (`read`, `logs`, `run`, `attach`).
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_BYTE_SURROGATES = range(0xDC80, 0xDD00)  # os.fsdecode's surrogateescape of bytes 0x80-0xFF


def printable(text: str) -> str:
    """`text` with every character a terminal could obey (or hide, or reorder) escaped."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(_escape(char) for char in text)


def _escape(char: str) -> str:
    if char == "\\":
        return "\\\\"
    if char.isprintable():
        return char
    code = ord(char)
    if code < 0x20 or code == 0x7F:
        return f"\\x{code:02x}"
    if code in _BYTE_SURROGATES:
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def surrogates_escaped(value: Any) -> Any:
    """A JSON-shaped value whose strings hold no lone surrogate, each shown as `printable`
    shows it (`\\xff` for a byte), all else as it was: for an answer whose transport encodes
    UTF-8 strictly (MCP's), whose text keeps its lines and is not a person's terminal."""
    if isinstance(value, str):
        if value.isascii() or not any(0xD800 <= ord(char) <= 0xDFFF for char in value):
            return value
        return "".join(_escape(c) if 0xD800 <= ord(c) <= 0xDFFF else c for c in value)
    if isinstance(value, dict):
        return {surrogates_escaped(k): surrogates_escaped(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [surrogates_escaped(item) for item in value]
    return value


def printable_tree(value: Any) -> Any:
    """A JSON-shaped value with `printable` applied to every string in it, keys included."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_tree(k): printable_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [printable_tree(item) for item in value]
    return value
