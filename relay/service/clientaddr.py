"""Which address a request comes from, for per-address limits. Pure.

The client address is the TCP peer's address, unless the peer is a configured trusted
proxy: then ``X-Forwarded-For`` is read from the right (the hop the proxy itself added)
and the first address that is not a trusted proxy is the client. A client that sends its
own ``X-Forwarded-For`` to a proxy only adds entries to the left of what the proxy
appends, so it cannot pick its address; a client connecting directly is never believed.

Order of use: :func:`parse_networks` once on the configuration (``"10.0.0.0/8,
127.0.0.1"``), then :func:`client_address` per request with the peer address and the
header.
"""

from __future__ import annotations

import ipaddress
from typing import Final

__all__ = ["Networks", "client_address", "parse_networks"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Networks = tuple[Network, ...]
_MAX_HOPS: Final = 32  # a longer header is read only this far from the right


def parse_networks(text: str) -> Networks:
    """``"10.0.0.0/8, 127.0.0.1, ::1"`` -> networks; ValueError names a bad entry."""
    out: list[Network] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            out.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"{item!r} is not an IP address or CIDR network") from None
    return tuple(out)


def _trusted(addr: str, trusted: Networks) -> bool:
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    return any(ip in net for net in trusted)


def client_address(peer: str | None, forwarded_for: str | None, trusted: Networks) -> str:
    """The address per-address limits count (``"unknown"`` without a peer)."""
    client = peer or "unknown"
    if not forwarded_for or not trusted or not _trusted(client, trusted):
        return client
    hops = [h.strip() for h in forwarded_for.split(",")][-_MAX_HOPS:]
    for hop in reversed(hops):
        try:
            addr = str(ipaddress.ip_address(hop))
        except ValueError:
            return client  # a malformed hop: believe no further than the proxy we know
        client = addr
        if not _trusted(addr, trusted):
            return addr
    return client
