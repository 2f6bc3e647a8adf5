"""The one token check of an HTTP request, for every front of the relay and the worker.

A request carries its token as ``Authorization: Bearer <token>``, or (a WebSocket
handshake, which a browser cannot give headers) as the subprotocol
``tokenrelay.bearer.<token>`` offered beside ``tokenrelay`` (:func:`protocol_token`; the
relay answers with ``tokenrelay``, never with the token), or, discouraged, as
``?token=`` (an address ends up in logs, histories and a browser's console lines;
accepted for compatibility) (:func:`relay.protocol.auth.extract_token`);
:func:`request_claims` reads it and checks it against the subject the route opens (a
session id, or a stream's ``ds:<id>``: the namespace rule of
:mod:`relay.protocol.subjects`), the scope it needs (``watch`` or ``write``) and the
longest lifetime a token may have (:func:`relay.protocol.auth.verify_token`).
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

from relay.protocol.auth import (
    AuthError,
    Claims,
    KeySet,
    Scope,
    TokenInvalid,
    extract_token,
    verify_token,
)

__all__ = [
    "REALM",
    "WS_BEARER",
    "WS_PROTOCOL",
    "challenge",
    "offered_protocols",
    "protocol_token",
    "request_claims",
    "request_token",
]

REALM = 'Bearer realm="tokenrelay"'
WS_PROTOCOL = "tokenrelay"  # the WebSocket subprotocol a relay answers with
WS_BEARER = "tokenrelay.bearer."  # + a token: the subprotocol that carries it


def offered_protocols(request: web.BaseRequest) -> list[str]:
    """The subprotocols a WebSocket handshake offers (``Sec-WebSocket-Protocol``, every
    value, comma-separated), in order."""
    return [p.strip() for v in request.headers.getall("Sec-WebSocket-Protocol", ())
            for p in v.split(",") if p.strip()]  # fmt: skip


def protocol_token(offered: list[str]) -> str | None:
    """The token offered as the subprotocol ``tokenrelay.bearer.<token>``, or None.
    :class:`relay.protocol.auth.TokenInvalid` when it comes without ``tokenrelay`` (the
    one the relay can answer: a browser fails a handshake whose answer names none of
    its offers, and the answer never repeats the token) or empty."""
    token = next((p[len(WS_BEARER) :] for p in offered if p.startswith(WS_BEARER)), None)
    if token is None:
        return None
    if WS_PROTOCOL not in offered:
        raise TokenInvalid(f"a token sent as the subprotocol {WS_BEARER}<token> needs the "
                           f"subprotocol {WS_PROTOCOL} offered beside it")  # fmt: skip
    if not token:
        raise TokenInvalid(f"the subprotocol {WS_BEARER}<token> carries no token")
    return token


def request_token(request: web.BaseRequest) -> str:
    """The request's token: ``Authorization: Bearer`` (preferred), else the subprotocol
    ``tokenrelay.bearer.<token>`` (:func:`protocol_token`), else the first ``token``
    query parameter; :class:`relay.protocol.auth.TokenMissing` / ``TokenInvalid``
    otherwise. The query is parsed here and dropped (``request.query`` would keep a
    parsed copy with a stream's request for as long as it lasts)."""
    query_token = None
    if not request.headers.get("Authorization"):
        query_token = protocol_token(offered_protocols(request))
    raw = request.rel_url.raw_query_string
    if raw and query_token is None:
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
