"""Bearer API keys for the endpoints that belong to no session token: pure.

Session endpoints take a session token (``relay.protocol.auth``); the worker's OpenAI
gateway (``/v1/chat/completions``, ``/v1/responses``), its jobs without a session, and a
relay's Responses stream (``GET /v1/responses/{id}?stream=true``) take one of the
operator's API keys (``--gateway-key``, the same keys on workers and relays). Every
configured key is compared, in constant time, so the time taken does not tell which key
(or how much of one) matched.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from relay.protocol.codes import Refusal

__all__ = ["MIN_KEY_CHARS", "check_api_key"]

MIN_KEY_CHARS = 16


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
