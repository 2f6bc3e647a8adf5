"""Bearer API keys for the endpoints that belong to no session token: pure.

Session endpoints take a session token (``relay.protocol.auth``); the worker's OpenAI
gateway (``/v1/chat/completions``, ``/v1/responses``), its jobs without a session, and a
relay's Responses stream (``GET /v1/responses/{id}?stream=true``) take one of the
operator's API keys (``--gateway-key``, the same keys on workers and relays). Every
configured key is compared, in constant time, so the time taken does not tell which key
(or how much of one) matched.

Ownership: what a request made with a key creates (a Responses API response and its
conversation) belongs to that key, as OpenAI scopes a response to its project: another
key reaches it no more than a key that never existed (the fronts answer 404). The
object's record stores :func:`owner_tag`, the API's name and a keyed digest of the key
(HMAC-SHA256 keyed by the key, over the object's id): never the key, and a tag copied to
another object matches nothing there. With auth off every caller is the same owner.

Order of use: :func:`check_api_key` (refuse), then :func:`caller` (who asks),
:func:`owner_tag` when creating, :func:`owns` before any read or write.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Final

from relay.protocol.codes import Refusal

__all__ = ["MIN_KEY_CHARS", "caller", "check_api_key", "owner_tag", "owns"]

MIN_KEY_CHARS = 16
_OWNER_LABEL: Final = b"tokenrelay owner v1\x00"  # the digest's domain, before the object id
_DIGEST_CHARS: Final = 32  # 128 bits of the HMAC, in hex


def check_api_key(keys: Sequence[str], authorization: str | None) -> Refusal | None:
    """None when ``Authorization: Bearer <key>`` names one of ``keys``; else the error
    code: ``gateway_disabled`` (no key configured), ``missing_api_key``,
    ``invalid_api_key``."""
    if not keys:
        return Refusal.GATEWAY_DISABLED
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return Refusal.MISSING_API_KEY
    candidate = given.strip().encode()
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(candidate, k.encode())
    return None if ok else Refusal.INVALID_API_KEY


def caller(authorization: str | None, *, auth: bool) -> str:
    """Who a request is, for :func:`owner_tag` and :func:`owns`: the bearer key it sends
    (after :func:`check_api_key` accepted it); "" for everyone with auth off."""
    if not auth:
        return ""
    scheme, _, given = (authorization or "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else ""


def owner_tag(api: str, who: str, obj: str) -> str:
    """The owner an object's record stores: ``<api>:<digest>``, the digest an HMAC of the
    object's id keyed by the caller's key ``who`` (:func:`caller`)."""
    mac = hmac.new(who.encode(), _OWNER_LABEL + obj.encode(), hashlib.sha256).hexdigest()
    return f"{api}:{mac[:_DIGEST_CHARS]}"


def owns(tag: str, api: str, who: str, obj: str) -> bool:
    """Whether the caller ``who`` made object ``obj`` of ``api``, whose record says
    ``tag`` (compared in constant time); an empty or foreign tag: no."""
    return hmac.compare_digest(tag.encode(), owner_tag(api, who, obj).encode())
