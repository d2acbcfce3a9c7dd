"""Where a command's network may go through settled's proxy: `--allow-host` patterns and the
one decision about each connection.

Owns the grammar of a pattern, the environment that points a command at its task's proxy, and
`decide`, the pure function the proxy (netproxy/daemon.py) asks once per connection, after it
resolved the name and before it connects. Facts in (the patterns, the host and port asked for,
the address the name resolved to, whether that address is one of this host's), a verdict out.

A pattern is one of (lower case; ASCII names, so an IDN is given in its xn-- form):

=======================  ==========================================================
``pypi.org``             that name, any port
``pypi.org:443``         that name, that port
``*.pythonhosted.org``   any name below that domain (not the domain itself), any port
``*.example.com:8443``   the same, that port
``10.0.0.7``             that IPv4 address (asked for by address, or a name that
                         resolved to it), any port; ``10.0.0.7:5432`` that port
``[fd00::7]:5432``       an IPv6 address, in brackets; the port optional
=======================  ==========================================================

The rule. With no pattern, any destination on the public internet may be reached. A
destination that is not (`ipaddress`'s ``is_global`` is false: loopback, link-local with the
cloud metadata address 169.254.169.254, the private ranges, multicast...) or that is one of this
host's own addresses is a host service or an internal one: it is reached only when a pattern
names it exactly (no wildcard), by its name or its address. With patterns, a destination must
match one of them. The address checked is the one the proxy connects to (never a second
resolution), so a name that resolves to 127.0.0.1 gets nowhere under a wildcard.

Must never: resolve a name, touch a socket, or let a wildcard reach a host service.
"""

from __future__ import annotations

import functools
import re

from settled.errors import BadInput

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

# ipaddress (~2 ms) is imported where an address is read: every spec checks its patterns, and
# `settled status` builds specs.

PROXY_PORT = 3128  # in each task's network namespace: its proxy's listener (netproxy/)
PROXY_URL = f"http://127.0.0.1:{PROXY_PORT}"
NO_PROXY = "localhost,127.0.0.1,::1"  # the task's own loopback is reached directly
MAX_PATTERNS = 256
MAX_PATTERN_BYTES = 261  # a name of 253 bytes, a colon and a port
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_NAME = re.compile(rf"(?:\*\.)?{_LABEL}(?:\.{_LABEL})*")
_AUTHORITY = re.compile(r"[a-z0-9_](?:[a-z0-9_.-]{0,251}[a-z0-9_])?")


def proxy_env() -> tuple[tuple[str, str], ...]:
    """What a command under `--network proxy` gets, upper and lower case (curl reads only
    `http_proxy`, pip and most others either)."""
    pairs = [("HTTP_PROXY", PROXY_URL), ("HTTPS_PROXY", PROXY_URL), ("ALL_PROXY", PROXY_URL),
             ("NO_PROXY", NO_PROXY)]  # fmt: skip
    return tuple(pairs + [(name.lower(), value) for name, value in pairs])


def check_patterns(field: str, values: object) -> tuple[str, ...]:
    """The patterns as given, each checked (BadInput naming the field and the pattern)."""
    if isinstance(values, str) or not isinstance(values, list | tuple):
        raise BadInput(f"{field} must be a list of host patterns")
    if len(values) > MAX_PATTERNS:
        raise BadInput(f"{field}: at most {MAX_PATTERNS} patterns, got {len(values)}")
    checked = []
    for value in values:
        if not isinstance(value, str):
            raise BadInput(f"{field}: a pattern must be text, not {type(value).__name__}")
        parse(field, value)
        checked.append(value)
    return tuple(checked)


def check_allowed(field: str, values: object, network: str | None) -> tuple[str, ...]:
    """The patterns, checked, once each and sorted; refused unless the network is the
    proxy's (None: not yet chosen), the only one that goes through it."""
    checked = tuple(sorted(set(check_patterns(field, values))))
    if checked and network not in (None, "proxy"):
        raise BadInput(f"{field}: only --network proxy goes through the proxy, not {network}")
    return checked


def parse(field: str, text: str) -> tuple[str, int | None]:
    """(host, port or None): host a lower-case name (maybe `*.` first) or an address."""
    if not text or len(text.encode("utf-8", "replace")) > MAX_PATTERN_BYTES or text != text.strip():
        raise BadInput(f"{field}: {text!r} is not a host pattern (HOST, HOST:PORT, *.DOMAIN)")
    host, port = _split(field, text)
    if host.startswith("["):
        return _bracketed(f"{field}: {text!r}", host), port
    if _is_address(host, 4):
        return host, port
    if host != host.lower() or not _NAME.fullmatch(host) or len(host) > 253:
        raise BadInput(
            f"{field}: {text!r}: {host!r} is not a lower-case host name, *.domain or address"
        )
    if host.startswith("*.") and "." not in host[2:]:
        raise BadInput(f"{field}: {text!r}: a wildcard needs a domain of two labels or more")
    return host, port


def parse_authority(text: str) -> tuple[str, int | None]:
    """(host, port or None) of a request's authority (`CONNECT host:port`, a URI's): a name
    in lower case without its final dot, or an address (IPv6 without brackets)."""
    host, port = _split("request", text)
    if host.startswith("["):
        return _bracketed(repr(text), host), port
    host = host.lower().rstrip(".")
    if not _AUTHORITY.fullmatch(host):
        raise BadInput(f"{text[:300]!r} is not host:port")
    return host, port


def _bracketed(said: str, host: str) -> str:
    """`[v6]`'s address in its one written form; BadInput after `said` when it is none."""
    import ipaddress

    if not host.endswith("]") or not _is_address(host[1:-1], 6):
        raise BadInput(f"{said}: {host} is not an IPv6 address in brackets")
    return str(ipaddress.ip_address(host[1:-1]))


@functools.lru_cache(maxsize=4096)
def _pattern(text: str) -> tuple[str, int | None]:
    """A pattern already checked at admission, parsed once per process (the proxy asks for
    each of a session's patterns at every connection)."""
    return parse("allow_host", text)


def _split(field: str, text: str) -> tuple[str, int | None]:
    if text.startswith("["):
        close = text.find("]")
        host, rest = (text[: close + 1], text[close + 1 :]) if close > 0 else (text, "")
        if rest and not rest.startswith(":"):
            raise BadInput(f"{field}: {text!r}: what follows {host} must be :PORT")
        port_text = rest[1:] if rest else None
    else:
        host, colon, port_text_or = text.partition(":")
        port_text = port_text_or if colon else None
    if port_text is None:
        return host, None
    if not port_text.isascii() or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise BadInput(f"{field}: {text!r}: the port must be 1..65535")
    return host, int(port_text)


def _is_address(text: str, version: int) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(text).version == version
    except ValueError:
        return False


def is_internal(address: str) -> bool:
    """Whether an address is not on the public internet (loopback, link-local, private...)."""
    import ipaddress

    return not ipaddress.ip_address(address).is_global


def may_resolve(patterns: Iterable[str], host: str, port: int) -> str | None:
    """None when the proxy may ask the resolver for `host` (a name): with no pattern, or one
    that names it (exactly or by wildcard, and its port); else why not. Asked before any DNS
    query, so a name no pattern allows never leaves as a query either (no exfiltration through
    the resolver)."""
    given = list(patterns)
    host = host.lower().rstrip(".")
    if not given or any(_match(pattern, host, port) for pattern in given):
        return None
    return f"{host}:{port} matches no --allow-host pattern ({', '.join(given)}); not resolved"


def decide(
    patterns: Iterable[str], host: str, port: int, address: str, own_address: bool
) -> str | None:
    """None: the connection to `host`:`port` at `address` may be made; else why not, one line.
    `host` is the name asked for (or the address), lower case; `own_address`: `address` is
    one of this host's (the proxy's own network namespace routes it to itself)."""
    host = host.lower().rstrip(".")
    service = own_address or is_internal(address)
    given = list(patterns)
    if not given:
        if not service:
            return None
        return (
            f"{host}:{port} is {_which(address, own_address)}; reached only when named "
            f"exactly: --allow-host {_shown(host)}:{port}"
        )
    for pattern in given:
        how = _match(pattern, host, port)
        if how == "exactly" or (how == "by wildcard" and not service):
            return None
    if service and any(_pattern(p)[0].startswith("*.") for p in given):
        return (
            f"{host}:{port} is {_which(address, own_address)}; a wildcard never reaches it: "
            f"--allow-host {_shown(host)}:{port}"
        )
    return f"{host}:{port} matches no --allow-host pattern ({', '.join(given)})"


def _match(pattern: str, host: str, port: int) -> str | None:
    """How `pattern` names `host`:`port`: "exactly" (the name, or an address asked for by
    address, never a name's), "by wildcard", or None."""
    wanted, wanted_port = _pattern(pattern)
    if wanted_port is not None and wanted_port != port:
        return None
    if wanted.startswith("*."):
        return "by wildcard" if host.endswith(wanted[1:]) else None
    return "exactly" if wanted == host else None


def _which(address: str, own_address: bool) -> str:
    import ipaddress

    parsed = ipaddress.ip_address(address)
    if parsed.is_loopback:
        return f"the host's loopback ({address})"
    if own_address:
        return f"one of this host's own addresses ({address})"
    if parsed.is_link_local:
        return f"link-local ({address}, where cloud metadata services answer)"
    return f"not on the public internet ({address})"


def _shown(host: str) -> str:
    return f"[{host}]" if ":" in host else host
