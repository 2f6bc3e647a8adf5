"""Watch tokens: HMAC-SHA256 signed, bound to one session, with an expiry and a scope.

Pure (standard library only): no clock, no I/O. The caller passes ``now`` (Unix seconds).

A token is ``<payload>.<signature>``, both unpadded base64url::

    payload   = version (1 byte, 1) | expiry (8 bytes, big-endian Unix seconds)
                | scope (1 byte: 1 = watch, 2 = write) | session id (ASCII, 1-64 bytes)
    signature = HMAC-SHA256(secret, b"tokenrelay.token.v1\\x00" + payload)   (32 bytes)

About 90 characters for a 22-character session id; safe in a URL query as is.
A ``write`` token also allows watching (the worker hands out one token per session and
accepts it back on ``POST /v1/sessions/{sid}/turns``); a ``watch`` token does not allow
writing.

Order of use: the worker calls :func:`issue_token` when it creates a session; the relay
calls :func:`extract_token` on the request's ``Authorization`` header / ``?token=``
query, then :func:`verify_token`, which returns :class:`Claims` or raises:

    AuthError                 .status (HTTP), .error (stable code), .reason (sentence)
     +-- TokenMissing         401  no token in the request
     +-- TokenForbidden       403
          +-- TokenInvalid        malformed, bad signature, unknown version
          +-- TokenExpired        past its expiry
          +-- TokenWrongSession   signed for another session
          +-- TokenWrongScope     a watch token used to write

The signature is checked (constant time) before any claim is looked at, so a forged
token never learns which claim was wrong.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import struct
from dataclasses import dataclass
from typing import Final, Literal

from relay.keys import InvalidSessionId, parse_session

__all__ = [
    "MAX_TOKEN_LEN",
    "AuthError",
    "Claims",
    "Scope",
    "TokenExpired",
    "TokenForbidden",
    "TokenInvalid",
    "TokenMissing",
    "TokenWrongScope",
    "TokenWrongSession",
    "extract_token",
    "issue_token",
    "verify_token",
]

Scope = Literal["watch", "write"]

MAX_TOKEN_LEN: Final = 256
_VERSION: Final = 1
_DOMAIN: Final = b"tokenrelay.token.v1\x00"
_HEAD: Final = struct.Struct(">BQB")
_SIG_LEN: Final = 32
_SCOPE_CODE: Final[dict[str, int]] = {"watch": 1, "write": 2}
_CODE_SCOPE: Final[dict[int, Scope]] = {1: "watch", 2: "write"}
_B64URL: Final = re.compile(r"[A-Za-z0-9_-]+")
_MAX_EXPIRY: Final = 2**63 - 1


class AuthError(Exception):
    """A request that may not watch (or write to) the session. See the module tree."""

    status: int = 403
    error: str = "forbidden"

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TokenMissing(AuthError):
    status = 401
    error = "token_missing"


class TokenForbidden(AuthError):
    status = 403
    error = "forbidden"


class TokenInvalid(TokenForbidden):
    error = "token_invalid"


class TokenExpired(TokenForbidden):
    error = "token_expired"


class TokenWrongSession(TokenForbidden):
    error = "token_wrong_session"


class TokenWrongScope(TokenForbidden):
    error = "token_wrong_scope"


@dataclass(frozen=True, slots=True)
class Claims:
    """What a verified token says: its session, expiry (Unix seconds) and scope."""

    session: str
    expires: int
    scope: Scope

    def allows(self, need: Scope) -> bool:
        return need == "watch" or self.scope == "write"


def _key(secret: str | bytes) -> bytes:
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise ValueError("the token secret is empty")
    return key


def _sign(key: bytes, payload: bytes) -> bytes:
    return hmac.new(key, _DOMAIN + payload, hashlib.sha256).digest()


def _b64e(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64d(text: str) -> bytes:
    if _B64URL.fullmatch(text) is None or len(text) % 4 == 1:
        raise TokenInvalid("token is not base64url")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise TokenInvalid("token is not base64url") from None
    if _b64e(raw) != text:  # non-canonical trailing bits: one token, one spelling
        raise TokenInvalid("token is not canonical base64url")
    return raw


def issue_token(
    secret: str | bytes, sid: str, ttl_s: float, now: float, *, scope: Scope = "watch"
) -> str:
    """A token for ``sid`` valid until ``now + ttl_s`` (whole seconds, rounded down)."""
    sid = parse_session(sid)
    if ttl_s <= 0:
        raise ValueError("ttl_s must be positive")
    if scope not in _SCOPE_CODE:
        raise ValueError(f"unknown scope {scope!r}")
    expires = min(int(now + ttl_s), _MAX_EXPIRY)
    if expires < 0:
        raise ValueError("expiry before 1970")
    payload = _HEAD.pack(_VERSION, expires, _SCOPE_CODE[scope]) + sid.encode("ascii")
    return f"{_b64e(payload)}.{_b64e(_sign(_key(secret), payload))}"


def verify_token(
    secret: str | bytes, token: str, sid: str, now: float, *, need: Scope = "watch"
) -> Claims:
    """The claims of ``token`` if it is genuine, for ``sid``, unexpired and allows ``need``.

    Raises :class:`TokenInvalid`, :class:`TokenWrongSession`, :class:`TokenExpired` or
    :class:`TokenWrongScope` (checked in that order), :class:`TokenMissing` if empty.
    """
    key = _key(secret)
    if not token:
        raise TokenMissing("no token: send Authorization: Bearer <token> or ?token=")
    if len(token) > MAX_TOKEN_LEN:
        raise TokenInvalid(f"token longer than {MAX_TOKEN_LEN} characters")
    parts = token.split(".")
    if len(parts) != 2:
        raise TokenInvalid("token must be <payload>.<signature>")
    payload, sig = _b64d(parts[0]), _b64d(parts[1])
    if len(sig) != _SIG_LEN or not hmac.compare_digest(sig, _sign(key, payload)):
        raise TokenInvalid("token signature does not verify")
    # Genuine from here on: the claims were written by someone holding the secret.
    if len(payload) <= _HEAD.size:
        raise TokenInvalid("token payload too short")
    version, expires, scope_code = _HEAD.unpack_from(payload)
    if version != _VERSION:
        raise TokenInvalid(f"unsupported token version {version}")
    scope = _CODE_SCOPE.get(scope_code)
    if scope is None:
        raise TokenInvalid(f"unknown token scope {scope_code}")
    try:
        token_sid = parse_session(payload[_HEAD.size :].decode("ascii"))
    except (UnicodeDecodeError, InvalidSessionId):
        raise TokenInvalid("token names an invalid session") from None
    if not hmac.compare_digest(token_sid.encode(), sid.encode()):
        raise TokenWrongSession("token was issued for another session")
    if now >= expires:
        raise TokenExpired("token has expired")
    claims = Claims(token_sid, expires, scope)
    if not claims.allows(need):
        raise TokenWrongScope(f"token does not allow {need}")
    return claims


def extract_token(authorization: str | None, query_token: str | None) -> str:
    """The token from ``Authorization: Bearer <t>`` (preferred) or the ``token`` query.

    Raises :class:`TokenMissing` when neither carries one, :class:`TokenInvalid` for an
    ``Authorization`` header of another scheme or shape.
    """
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            raise TokenInvalid("Authorization must use the Bearer scheme")
        value = value.strip()
        if not value or " " in value:
            raise TokenInvalid("Authorization: Bearer takes exactly one token")
        return value
    if query_token:
        return query_token
    raise TokenMissing("no token: send Authorization: Bearer <token> or ?token=")
