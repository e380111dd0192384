"""The SSRF guard of the fetch stage: which hosts an http(s) fetch may connect to, checked
on every connection (so on every redirect hop that opens one), and the connection made to
the address that was checked (pinned: no second DNS lookup for a rebinding answer to win).

    GuardedBackend(guard, resolve)      an ``httpcore`` network backend: ``connect_tcp(host)``
        host listed in guard.allowed    resolved, connected (no address check)
        else                            ``host_refusal`` (the spelling), resolve (every A/AAAA
                                        answer), ``address_refusal`` of each (one bad answer
                                        refuses the host), then connect to those addresses
    pinned_transport(...)               an ``httpx`` transport on that backend

Rules (``address_refusal``, by ``ipaddress``, never by regex): loopback, private (RFC 1918,
fc00::/7, ...), link-local (169.254/16 with the 169.254.169.254 metadata address,
fe80::/10), unspecified, multicast, reserved, shared/CGNAT (100.64/10), and anything else
``ipaddress`` does not call global, are refused; an IPv6 address carrying an IPv4 one
(mapped ``::ffff:a.b.c.d``, compatible ``::a.b.c.d``, NAT64 64:ff9b::/96, 6to4, Teredo) is
judged by the IPv4 address too. A host spelled as a number other than dotted-quad
(``2130706433``, ``0x7f.1``, ``017700000001``, ``127.1``) is refused whatever it denotes:
resolvers and URL parsers disagree on those spellings. A trailing dot is dropped before any
check. A refusal is a ``MediaBlocked`` (a ``SourceError``, reason ``blocked``): that item's
error, or a server's 400. Light: httpcore and the stdlib.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from collections.abc import Callable, Iterable
from typing import Any

import httpcore
import httpx

from vlmbatch.preprocessing.limits import MediaGuard
from vlmbatch.preprocessing.sources import SourceError

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolve = Callable[[str, int], list[str]]  # host, port -> its addresses (every answer)
CGNAT = ipaddress.ip_network("100.64.0.0/10")
NAT64 = ipaddress.ip_network("64:ff9b::/96")
METADATA = {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}


class MediaBlocked(SourceError):
    """The SSRF guard refused this URL; the message names the host, the address and why."""

    def __init__(self, message: str, reason: str = "blocked") -> None:
        super().__init__(message, reason)


def normal_host(host: str) -> str:
    """``host`` as the guard compares it: lower case, brackets and one trailing dot off."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host[:-1] if host.endswith(".") else host


def is_allowed(host: str, allowed: Iterable[str]) -> bool:
    """Whether ``host`` is listed: an exact entry, or an entry ``.b.org`` for a subdomain of
    b.org (not b.org itself)."""
    h = normal_host(host)
    return any(h == e or (e.startswith(".") and h.endswith(e) and len(h) > len(e))
               for e in (normal_host(x) if not x.startswith(".") else "." + normal_host(x[1:])
                         for x in allowed))


def literal(host: str) -> Address | None:
    """The IP address ``host`` spells in canonical form (dotted-quad IPv4, IPv6), else None."""
    try:
        return ipaddress.ip_address(normal_host(host))
    except ValueError:
        return None


def legacy_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address ``inet_aton`` would read from ``host`` (1 to 4 parts, each decimal,
    0-leading octal or 0x hex, the last filling the remaining bytes), else None."""
    parts = normal_host(host).split(".")
    if not 1 <= len(parts) <= 4:
        return None
    values = []
    for p in parts:
        if p[:2] in ("0x", "0X"):
            digits, base = p[2:] or "0", 16
        elif len(p) > 1 and p.startswith("0"):
            digits, base = p[1:], 8
        else:
            digits, base = p, 10
        try:
            values.append(int(digits, base) if digits.isalnum() and digits.isascii() else None)
        except ValueError:
            return None
    if None in values:
        return None
    *head, last = values
    if any(v > 255 for v in head) or last >= 256 ** (5 - len(values)):  # type: ignore[operator]
        return None
    n = 0
    for v in head:
        n = n << 8 | v  # type: ignore[operator]
    return ipaddress.IPv4Address(n << 8 * (5 - len(values)) | last)  # type: ignore[operator]


def embedded_ipv4(a: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries (mapped, compatible, NAT64, 6to4,
    Teredo), which is where a packet to it may end up."""
    out = []
    if a.ipv4_mapped is not None:
        out.append(a.ipv4_mapped)
    if int(a) >> 32 == 0 and int(a) > 1:  # ::a.b.c.d (deprecated IPv4-compatible)
        out.append(ipaddress.IPv4Address(int(a) & 0xFFFFFFFF))
    if a in NAT64:
        out.append(ipaddress.IPv4Address(int(a) & 0xFFFFFFFF))
    if a.sixtofour is not None:
        out.append(a.sixtofour)
    if a.teredo is not None:
        out.extend(a.teredo)
    return out


def address_refusal(a: Address) -> str | None:
    """Why the guard refuses to connect to ``a`` (None: a global unicast address)."""
    for inner in embedded_ipv4(a) if isinstance(a, ipaddress.IPv6Address) else []:
        if (why := address_refusal(inner)) is not None:
            return f"it carries the IPv4 address {inner}, {why}"
    if a in METADATA:
        return "the cloud metadata address (link-local)"
    checks = [("unspecified", a.is_unspecified), ("loopback", a.is_loopback),
              ("link-local", a.is_link_local), ("multicast", a.is_multicast),
              ("shared/CGNAT (100.64/10)", a.version == 4 and a in CGNAT),
              ("private", a.is_private), ("reserved", a.is_reserved),
              ("not a global address", not a.is_global)]
    return next((f"{'an' if name[0] in 'aeiou' else 'a'} {name} address"
                 if name != checks[-1][0] else name
                 for name, hit in checks if hit), None)


def host_refusal(host: str) -> str | None:
    """Why ``host``'s spelling alone is refused (an IP literal the rules refuse, a numeric
    spelling other than dotted-quad), None if it needs resolving or is a global address."""
    if not normal_host(host):
        return "no host"
    if (a := literal(host)) is not None:
        return address_refusal(a)
    if any(not (c.isascii() and (c.isalnum() or c in "-._")) for c in normal_host(host)):
        return f"not a host name ({host!r}: characters a DNS name does not have)"
    if (legacy := legacy_ipv4(host)) is not None:
        return (f"a numeric host spelled other than dotted-quad ({host!r} reads as {legacy}); "
                "write the address as a.b.c.d")
    return None


def check_url_host(url: str, guard: MediaGuard) -> None:
    """``MediaBlocked`` if ``url``'s host (as httpx parses it) is refused by its spelling
    alone: the check a server makes before it queues anything (the connection is checked
    again, with DNS, by ``GuardedBackend``)."""
    try:
        host = httpx.URL(url).host
    except httpx.InvalidURL as e:
        raise SourceError(f"bad URL: {e}") from None
    if not is_allowed(host, guard.allowed_domains) and (why := host_refusal(host)):
        raise MediaBlocked(f"refused by the SSRF guard: host {host!r} is {why} (list it in "
                           "--allowed-media-domains to allow it)")


def system_resolve(host: str, port: int) -> list[str]:
    """Every address ``getaddrinfo`` answers for ``host`` (TCP), in its order, once each."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise SourceError(f"cannot resolve {host!r}: {e}", "connection") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class GuardedBackend(httpcore.NetworkBackend):
    """Connections for a guarded fetcher (module docstring): each checked, then made to the
    checked address. ``inner`` makes the sockets (httpcore's ``SyncBackend``); TLS's SNI and
    certificate check, and the ``Host`` header, keep the URL's host name (httpcore passes
    the origin's host to ``start_tls``, not the address connected to)."""

    def __init__(self, guard: MediaGuard, resolve: Resolve = system_resolve,
                 inner: httpcore.NetworkBackend | None = None) -> None:
        self.guard, self.resolve = guard, resolve
        self.inner = inner or httpcore.SyncBackend()

    def addresses(self, host: str, port: int) -> list[str]:
        """The addresses to connect to for ``host``, every one checked (``MediaBlocked``)."""
        name = normal_host(host)
        allowed = is_allowed(name, self.guard.allowed_domains)
        if not allowed and (why := host_refusal(name)):
            raise MediaBlocked(f"refused by the SSRF guard: host {name!r} is {why}")
        lit = literal(name)
        answers = [str(lit)] if lit is not None else self.resolve(name, port)
        if not answers:
            raise SourceError(f"cannot resolve {name!r}: no addresses", "connection")
        for text in answers if not allowed else []:
            a = ipaddress.ip_address(text.split("%")[0])
            if (why := address_refusal(a)) is not None:
                raise MediaBlocked(f"refused by the SSRF guard: host {name!r} resolves to "
                                   f"{a}, {why} (list the host in --allowed-media-domains "
                                   "to allow it)")
        return answers

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        error: Exception | None = None
        for address in self.addresses(host, port):  # the checked ones, in the resolver's order
            try:
                return self.inner.connect_tcp(address, port, timeout, local_address,
                                              socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                error = e
        assert error is not None
        raise error

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None
                            ) -> httpcore.NetworkStream:
        raise MediaBlocked("refused by the SSRF guard: a Unix socket")

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


class PinnedTransport(httpx.HTTPTransport):
    """httpx's transport (its request mapping and exceptions) over a ``GuardedBackend``:
    httpx 0.28's ``HTTPTransport`` takes no network backend (encode/httpx#3749 is open), so
    its connection pool is made again here with one; no proxy from the environment (a proxy
    would resolve the host itself, out of the guard's sight)."""

    def __init__(self, backend: GuardedBackend, limits: httpx.Limits,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(limits=limits, trust_env=False)
        self._pool = httpcore.ConnectionPool(
            ssl_context=ssl_context or httpx.create_ssl_context(trust_env=False),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry, network_backend=backend)
