"""The one token check of an HTTP request, for every front of the relay and the worker.

A request carries its token as ``Authorization: Bearer <token>`` or ``?token=``
(:func:`relay.protocol.auth.extract_token`); :func:`request_claims` reads it and checks
it against the subject the route opens (a session id, or a stream's ``ds:<id>``: the
namespace rule of :mod:`relay.protocol.subjects`), the scope it needs (``watch`` or
``write``) and the longest lifetime a token may have (:func:`relay.protocol.auth.verify_token`).
A refused token is a :class:`relay.protocol.auth.AuthError` (``status``, ``error``,
``reason``); :func:`challenge` is the header a 401 answers with, whatever the front's
refusal shape.

Order of use::

    try:
        claims = request_claims(keys, request, sid, "write", max_lifetime_s=ttl)
    except AuthError as exc:
        return refusal(exc.status, exc.error, exc.reason, challenge(exc))
"""

from __future__ import annotations

import time
from urllib.parse import parse_qsl

from aiohttp import web

from relay.protocol.auth import AuthError, Claims, KeySet, Scope, extract_token, verify_token

__all__ = ["REALM", "challenge", "request_claims", "request_token"]

REALM = 'Bearer realm="tokenrelay"'


def request_token(request: web.BaseRequest) -> str:
    """The request's token: ``Authorization: Bearer`` (preferred), else the first
    ``token`` query parameter; :class:`relay.protocol.auth.TokenMissing` /
    ``TokenInvalid`` otherwise. The query is parsed here and dropped (``request.query``
    would keep a parsed copy with a stream's request for as long as it lasts)."""
    query_token = None
    raw = request.rel_url.raw_query_string
    if raw:
        query_token = next((v for k, v in parse_qsl(raw, keep_blank_values=True)
                            if k == "token"), None)  # fmt: skip
    return extract_token(request.headers.get("Authorization"), query_token)


def request_claims(
    keys: KeySet, request: web.BaseRequest, subject: str, need: Scope = "watch", *,
    max_lifetime_s: int, now: float | None = None, header: str | None = None,
) -> Claims:  # fmt: skip
    """The verified claims of the request's token for ``subject`` and ``need``; raises
    :class:`relay.protocol.auth.AuthError` (see the module docstring). ``header``: a
    request header that carries a second token, bare (a route that opens two subjects:
    a Durable Streams fork reads its source), checked instead of the request's own."""
    if header is not None:
        token = extract_token(None, request.headers.get(header))
    else:
        token = request_token(request)
    at = time.time() if now is None else now
    return verify_token(keys, token, subject, at, need=need, max_lifetime_s=max_lifetime_s)


def challenge(exc: AuthError) -> dict[str, str]:
    """The headers of a refused token's answer: ``WWW-Authenticate`` on a 401."""
    return {"WWW-Authenticate": REALM} if exc.status == 401 else {}
