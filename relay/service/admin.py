"""Who may read the operator's endpoints (``/metrics`` on relays and workers, the
worker's ``/v1/router``). Pure.

Those endpoints name engines, workers and load: they are for the operator, not for the
clients the services face. The rule:

- with an admin key (``--admin-key`` / ``TOKENRELAY_ADMIN_KEY``, at least 32 bytes):
  ``Authorization: Bearer <admin key>``, compared in constant time; no header (or
  another scheme) is 401 ``admin_key_missing``, another key 403 ``admin_key_invalid``;
- without one: only a request whose TCP peer is a loopback address and that names no
  forwarded client (no ``X-Forwarded-For`` or ``Forwarded`` header: a proxy on the same
  host that adds one is not the operator), else 403 ``admin_loopback_only`` saying how
  to turn the key on. As Redis's protected mode does: nothing is open to the network
  until the operator says with what credential.

Order of use: :func:`admin_key` once on the configuration (``ValueError`` for a weak
key), then :func:`admin_refusal` per request; a shell turns a refusal into its answer
(:class:`relay.service.errors.Reject`).
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from typing import Final

from relay.protocol.auth import WeakSecret, check_secret
from relay.protocol.codes import Refusal

__all__ = ["ADMIN_REALM", "AdminRefusal", "admin_key", "admin_refusal"]

ADMIN_REALM: Final = 'Bearer realm="tokenrelay-admin"'
_TURN_ON: Final = "set TOKENRELAY_ADMIN_KEY (--admin-key) and send it as a Bearer token"


@dataclass(frozen=True, slots=True)
class AdminRefusal:
    """Why a request may not read an admin endpoint: its status, code and sentence."""

    status: int
    error: Refusal
    reason: str


def admin_key(text: str) -> bytes | None:
    """The admin key as bytes (None: not set); ``ValueError`` (one line) when it is weak
    (shorter than 32 bytes, too few distinct bytes, a published example)."""
    if not text:
        return None
    try:
        return check_secret(text, "the admin key")
    except WeakSecret as exc:
        raise ValueError(str(exc)) from None


def _loopback(peer: str | None) -> bool:
    if not peer:
        return False
    try:
        ip = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def admin_refusal(
    key: bytes | None, authorization: str | None, peer: str | None, forwarded: bool
) -> AdminRefusal | None:
    """None when the request may read an admin endpoint (see the module docstring);
    ``forwarded``: the request carries ``X-Forwarded-For`` or ``Forwarded``."""
    if key is None:
        if _loopback(peer) and not forwarded:
            return None
        return AdminRefusal(
            403,
            Refusal.ADMIN_LOOPBACK_ONLY,
            f"this endpoint answers only local requests until an admin key is set: {_TURN_ON}",
        )
    scheme, _, given = (authorization or "").strip().partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given:
        return AdminRefusal(401, Refusal.ADMIN_KEY_MISSING, f"send the admin key: {_TURN_ON}")
    if not hmac.compare_digest(given.encode(), key):
        return AdminRefusal(403, Refusal.ADMIN_KEY_INVALID, "this is not the admin key")
    return None
