"""Which address a request comes from, for per-address limits. Pure.

The client address is the TCP peer's address, unless the peer is a configured trusted
proxy: then ``X-Forwarded-For`` is read from the right (the hop the proxy itself added)
and the first address that is not a trusted proxy is the client. A client that sends its
own ``X-Forwarded-For`` to a proxy only adds entries to the left of what the proxy
appends, so it cannot pick its address; a client connecting directly is never believed.

One client, one bucket, however its address is spelled: an IPv4-mapped IPv6 address
(``::ffff:203.0.113.6``) is the IPv4 address, a port (``203.0.113.6:1234``,
``[2001:db8::1]:443``), brackets and an IPv6 zone (``%eth0``) are dropped, and an IPv6
address counts as its ``/64`` (``ipv6_prefix``): one subscriber line holds a whole /64,
so counting each of its 2^64 addresses would give it as many buckets as it likes. An
entry that is none of these (``203.000.113.009``: leading zeros, which some parsers
read as octal; ``unknown``; a name) from a trusted proxy is refused
(:class:`BadForwardedFor`, which the services answer with 400
``invalid_forwarded_for``): the proxy vouches for the entry, so a bucket of the proxy's
own, or one per spelling, would be a guess either way.

Order of use: :func:`parse_networks` once on the configuration (``"10.0.0.0/8,
127.0.0.1"``), then :func:`client_address` per request with the peer address and the
header; the key it returns is what limits count.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final

__all__ = [
    "DEFAULT_IPV6_PREFIX",
    "BadForwardedFor",
    "Networks",
    "client_address",
    "normalise",
    "parse_networks",
]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Networks = tuple[Network, ...]
DEFAULT_IPV6_PREFIX: Final = 64  # the smallest block an IPv6 subscriber is given
_MAX_HOPS: Final = 32  # a longer header is read only this far from the right
_MAX_SHOWN: Final = 64  # characters of a refused entry quoted in the reason
_V4_PORT: Final = re.compile(r"([0-9.]+):([0-9]{1,5})")
_V6_BRACKETS: Final = re.compile(r"\[([^\[\]]+)\](?::([0-9]{1,5}))?")


class BadForwardedFor(ValueError):
    """An ``X-Forwarded-For`` entry a trusted proxy vouches for that is no IP address;
    the message is the reason a client is shown (it quotes the entry, shortened)."""


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


def normalise(text: str) -> Address | None:
    """The address ``text`` spells (an IPv4-mapped IPv6 address as IPv4; port, brackets
    and zone dropped), or None when it is not an address in a canonical notation."""
    text = text.strip()
    port: str | None = None
    if text.startswith("["):
        m = _V6_BRACKETS.fullmatch(text)
        if m is None:
            return None
        text, port = m.group(1), m.group(2)
        if ":" not in text:  # brackets hold IPv6 only
            return None
    elif text.count(":") == 1:
        m = _V4_PORT.fullmatch(text)
        if m is None:
            return None
        text, port = m.group(1), m.group(2)
    if port is not None and not 0 < int(port) < 65536:
        return None
    text = text.split("%", 1)[0] if ":" in text else text  # an IPv6 zone: not the address
    try:
        ip = ipaddress.ip_address(text)  # refuses leading zeros in IPv4 (3.9.5+)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _key(ip: Address, ipv6_prefix: int) -> str:
    if isinstance(ip, ipaddress.IPv4Address) or ipv6_prefix >= 128:
        return str(ip)
    return str(ipaddress.IPv6Network((ip, ipv6_prefix), strict=False))


def _trusted(ip: Address | None, trusted: Networks) -> bool:
    return ip is not None and any(ip in net for net in trusted)


def client_address(
    peer: str | None,
    forwarded_for: str | None,
    trusted: Networks,
    *,
    ipv6_prefix: int = DEFAULT_IPV6_PREFIX,
) -> str:
    """The key per-address limits count: the client's IPv4 address, or its IPv6 address's
    ``/ipv6_prefix`` network (``"unknown"`` without a peer). Raises
    :class:`BadForwardedFor` when a trusted proxy forwards an entry that is not an IP
    address."""
    if not peer:
        return "unknown"
    ip = normalise(peer)
    if ip is None:  # a peer aiohttp did not give as an address (a Unix socket): as it is
        return peer
    if not forwarded_for or not trusted or not _trusted(ip, trusted):
        return _key(ip, ipv6_prefix)
    hops = forwarded_for.split(",")[-_MAX_HOPS:]
    for hop in reversed(hops):
        addr = normalise(hop)
        if addr is None:
            shown = hop.strip()[:_MAX_SHOWN]
            raise BadForwardedFor(
                f"X-Forwarded-For from a trusted proxy holds {shown!r}, which is not an IP "
                "address (dotted decimal without leading zeros, or IPv6)"
            )
        ip = addr
        if not _trusted(addr, trusted):
            break
    return _key(ip, ipv6_prefix)
