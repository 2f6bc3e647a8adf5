"""Session tokens: standard JWTs (RFC 7519), bound to one session, with a scope and a lifetime.

Pure (no clock, no I/O): the caller passes ``now`` (Unix seconds) and the key set.

A token is a JWS compact serialisation signed with one key of a :class:`KeySet`::

    header  = {"alg": "HS256" | "ES256" | "RS256", "typ": "JWT", "kid": <key id>}
    claims  = {"sub": <session id>, "scope": "watch" | "write", "iat": <s>, "exp": <s>}

``nbf`` is honoured when present; ``jti`` names the token (tokens minted here carry a
random one); other claims are ignored. A relay counts streams per token identity
(:attr:`Claims.identity`: the kid and ``jti``, or every claim without one), never per
token string, so two spellings of one token share a count. Any JWT library mints them
(docs/PROTOCOL.md has a Python and a Node example). A ``write``
token also allows watching; a ``watch`` token does not allow writing (posting a turn,
minting a token).

Keys: HS256 secrets by key id (several at once: tokens signed with the previous secret
keep verifying during a rotation, and removing a kid revokes every token signed with
it), and, as an option, ES256 / RS256 public keys, so that a relay holding only the
public key can verify tokens but never mint one. The algorithm is pinned per key: the
header's ``alg`` must be the algorithm of the key its ``kid`` names (no ``none``, no
HS256 token verified with an RSA key's bytes). HS256 secrets shorter than
:data:`MIN_SECRET_BYTES`, with too few distinct bytes or a well-known default are
refused (:func:`check_secret`).

Refused as well, each as :class:`TokenInvalid`: a header with ``crit`` (RFC 7515 4.1.11:
this verifier understands no extension, so it must not accept one it is told it has to
understand), an ES256 signature that is not 64 bytes of ``r || s`` with ``0 < r < n`` and
``0 < s <= n/2`` (an ECDSA signature ``(r, s)`` has a twin ``(r, n - s)`` that verifies
too: only the low-S form is accepted, and :func:`issue_token` mints only that form), and
a lifetime ``exp - iat`` over ``max_lifetime_s`` (the session's lifetime: no token is
issued for longer, so a longer one was made outside the rules).

Order of use: a process builds a :class:`KeySet` once (:func:`load_keys` from its
configuration); the worker calls :func:`issue_token`; the relay and the worker call
:func:`extract_token` on the request's ``Authorization`` header / ``?token=`` query,
then :func:`verify_token`, which returns :class:`Claims` or raises:

    AuthError                 .status (HTTP), .error (stable code), .reason (sentence)
     +-- TokenMissing         401  no token in the request
     +-- TokenForbidden       403
          +-- TokenInvalid        malformed, bad signature, algorithm not allowed
          |    +-- TokenUnknownKey   a kid this process does not hold
          +-- TokenExpired        past its ``exp``
          +-- TokenNotYetValid    ``iat`` / ``nbf`` in the future (beyond the leeway)
          +-- TokenWrongSession   signed for another session or stream (or kind)
          +-- TokenWrongScope     a watch token used to write

The signature is checked (constant time, by PyJWT) before any claim is looked at, so a
forged token never learns which claim was wrong.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from relay.protocol.codes import Refusal
from relay.protocol.keys import SESSION_TTL_S
from relay.protocol.subjects import namespace_refusal, parse_subject

__all__ = [
    "DEFAULT_KID",
    "MAX_LIFETIME_S",
    "MAX_TOKEN_LEN",
    "MIN_SECRET_BYTES",
    "AuthError",
    "Claims",
    "Key",
    "KeySet",
    "Scope",
    "TokenExpired",
    "TokenForbidden",
    "TokenInvalid",
    "TokenMissing",
    "TokenNotYetValid",
    "TokenUnknownKey",
    "TokenWrongScope",
    "TokenWrongSession",
    "WeakSecret",
    "check_secret",
    "extract_token",
    "issue_token",
    "load_keys",
    "verify_token",
]

Scope = Literal["watch", "write"]
Alg = Literal["HS256", "ES256", "RS256"]

MAX_TOKEN_LEN: Final = 2048  # an RS256 token with a 4096-bit key is about 900 characters
MIN_SECRET_BYTES: Final = 32
MIN_RSA_BITS: Final = 2048
DEFAULT_KID: Final = "k1"
MAX_LIFETIME_S: Final = SESSION_TTL_S  # the longest exp - iat a verifier takes by default
# the order of the P-256 group: an ES256 signature's s must be at most half of it
P256_ORDER: Final = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
_ES256_HALF: Final = P256_ORDER // 2
LEEWAY_S: Final = 30  # clock skew allowed on iat / nbf (never on exp)
SCOPES: Final[tuple[Scope, ...]] = ("watch", "write")
# Secrets that have shipped in examples somewhere: refused wherever they appear.
_KNOWN_DEFAULTS: Final = ("change-me", "changeme", "change_me", "demo-secret", "secret-key")
_MIN_DISTINCT_BYTES: Final = 8
_KID_MAX: Final = 64
_JTI_MAX: Final = 128
_JWS: Final = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")


class AuthError(Exception):
    """A request that may not watch (or write to) the session. See the module tree."""

    status: int = 403
    error: Refusal = Refusal.FORBIDDEN

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TokenMissing(AuthError):
    status = 401
    error = Refusal.TOKEN_MISSING


class TokenForbidden(AuthError):
    status = 403
    error = Refusal.FORBIDDEN


class TokenInvalid(TokenForbidden):
    error = Refusal.TOKEN_INVALID


class TokenUnknownKey(TokenInvalid):
    error = Refusal.TOKEN_UNKNOWN_KEY


class TokenExpired(TokenForbidden):
    error = Refusal.TOKEN_EXPIRED


class TokenNotYetValid(TokenForbidden):
    error = Refusal.TOKEN_NOT_YET_VALID


class TokenWrongSession(TokenForbidden):
    error = Refusal.TOKEN_WRONG_SESSION


class TokenWrongScope(TokenForbidden):
    error = Refusal.TOKEN_WRONG_SCOPE


class WeakSecret(ValueError):
    """A key the process refuses to start with; the message says why (one line)."""


@dataclass(frozen=True, slots=True)
class Claims:
    """What a verified token says: its session, expiry (Unix seconds) and scope; its
    ``jti`` ("" when it has none)."""

    session: str
    expires: int
    scope: Scope
    issued: int = 0
    kid: str = ""
    jti: str = ""

    def allows(self, need: Scope) -> bool:
        return need == "watch" or self.scope == "write"

    @property
    def identity(self) -> tuple[str | int, ...]:
        """Which token this is, whatever its spelling: the kid and the ``jti``, or, without
        a ``jti``, every claim that decides what it allows."""
        if self.jti:
            return (self.kid, self.jti)
        return (self.kid, self.session, self.scope, self.issued, self.expires)


def check_secret(secret: str | bytes, what: str = "the token secret") -> bytes:
    """``secret`` as bytes if it is strong enough to sign tokens, else :class:`WeakSecret`:
    shorter than 32 bytes, fewer than 8 distinct bytes, or a well-known example value."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < MIN_SECRET_BYTES:
        raise WeakSecret(
            f"{what} is {len(raw)} bytes; it needs at least {MIN_SECRET_BYTES} "
            "(generate one: python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    low = raw.lower()
    if any(d.encode() in low for d in _KNOWN_DEFAULTS):
        raise WeakSecret(f"{what} is a published example value; generate a random one")
    if len(set(raw)) < _MIN_DISTINCT_BYTES:
        raise WeakSecret(f"{what} has fewer than {_MIN_DISTINCT_BYTES} distinct bytes")
    return raw


@dataclass(frozen=True, slots=True)
class Key:
    """One key of a :class:`KeySet`: its id, its pinned algorithm, what verifies and
    (if this process may mint tokens with it) what signs."""

    kid: str
    alg: Alg
    verifier: Any  # bytes (HS256) or a public key object
    signer: Any = None  # bytes (HS256) or a private key object; None: verify only

    @classmethod
    def hs256(cls, kid: str, secret: str | bytes) -> Key:
        raw = check_secret(secret, f"the secret of key {kid!r}")
        return cls(_check_kid(kid), "HS256", raw, raw)


def _check_kid(kid: object) -> str:
    if not isinstance(kid, str) or not 1 <= len(kid) <= _KID_MAX or not kid.isprintable():
        raise WeakSecret(f"key id {kid!r}: 1-{_KID_MAX} printable characters")
    return kid


class KeySet:
    """The keys one process verifies tokens with, by kid, and the one it signs with."""

    def __init__(self, keys: Sequence[Key], signing_kid: str | None = None) -> None:
        self.keys: dict[str, Key] = {}
        for k in keys:
            if k.kid in self.keys:
                raise WeakSecret(f"key id {k.kid!r} appears twice")
            self.keys[k.kid] = k
        if not self.keys:
            raise WeakSecret("no token key: give a secret or a key file")
        self.signing: Key | None = None
        if signing_kid is not None:
            key = self.keys.get(signing_kid)
            if key is None:
                raise WeakSecret(f"signing key id {signing_kid!r} is not in the key set")
            if key.signer is None:
                raise WeakSecret(f"key {signing_kid!r} is a public key: it cannot sign")
            self.signing = key

    @classmethod
    def from_secret(cls, secret: str | bytes, kid: str = DEFAULT_KID) -> KeySet:
        return cls([Key.hs256(kid, secret)], kid)

    def has_private_keys(self) -> list[str]:
        """Kids of asymmetric keys this set could sign with (a relay should hold none)."""
        return [k.kid for k in self.keys.values() if k.alg != "HS256" and k.signer is not None]


def _jwk_key(obj: Mapping[str, Any]) -> Key:
    """One JWK (RFC 7517): ``oct`` -> HS256, ``EC`` P-256 -> ES256, ``RSA`` -> RS256."""
    kid = _check_kid(obj.get("kid"))
    kty = obj.get("kty")
    try:
        if kty == "oct":
            raw = jwt.utils.base64url_decode(str(obj.get("k", "")))
            return Key.hs256(kid, raw)
        text = json.dumps(dict(obj))
        if kty == "EC":
            if obj.get("crv") != "P-256":
                raise WeakSecret(f"key {kid!r}: only EC keys on P-256 (ES256)")
            ec_key = jwt.algorithms.ECAlgorithm.from_jwk(text)
            if isinstance(ec_key, ec.EllipticCurvePrivateKey):
                return Key(kid, "ES256", ec_key.public_key(), ec_key)
            return Key(kid, "ES256", ec_key)
        if kty == "RSA":
            rsa_key = jwt.algorithms.RSAAlgorithm.from_jwk(text)
            if rsa_key.key_size < MIN_RSA_BITS:
                raise WeakSecret(f"key {kid!r}: RSA keys need at least {MIN_RSA_BITS} bits")
            if isinstance(rsa_key, rsa.RSAPrivateKey):
                return Key(kid, "RS256", rsa_key.public_key(), rsa_key)
            return Key(kid, "RS256", rsa_key)
    except (jwt.exceptions.InvalidKeyError, ValueError, TypeError) as exc:
        if isinstance(exc, WeakSecret):
            raise
        raise WeakSecret(f"key {kid!r} is not a valid {kty} JWK: {exc}") from None
    raise WeakSecret(f"key {kid!r}: kty must be oct, EC or RSA, not {kty!r}")


def parse_jwks(text: str) -> list[Key]:
    """The keys of a JWK Set document ``{"keys": [...]}``."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise WeakSecret(f"the key file is not JSON: {exc}") from None
    keys = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(keys, list) or not all(isinstance(k, dict) for k in keys):
        raise WeakSecret('the key file must be a JWK Set: {"keys": [{...}, ...]}')
    return [_jwk_key(k) for k in keys]


def load_keys(secret: str | None, kid: str = DEFAULT_KID, keys_file: str | None = None) -> KeySet:
    """A process's key set: the HS256 ``secret`` as ``kid`` (if given) plus the keys of
    the JWK Set file ``keys_file`` (if given). Signs with ``kid`` when this process holds
    a signing key of that id. Raises :class:`WeakSecret` with a one-line reason."""
    keys: list[Key] = []
    if secret:
        keys.append(Key.hs256(kid, secret))
    if keys_file:
        try:
            text = Path(keys_file).read_text()
        except OSError as exc:
            raise WeakSecret(f"cannot read the key file {keys_file}: {exc.strerror}") from None
        keys.extend(parse_jwks(text))
    signer = next((k for k in keys if k.kid == kid and k.signer is not None), None)
    return KeySet(keys, signer.kid if signer is not None else None)


def _as_keyset(keys: KeySet | str | bytes) -> KeySet:
    return keys if isinstance(keys, KeySet) else KeySet.from_secret(keys)


def issue_token(
    keys: KeySet | str | bytes,
    sid: str,
    ttl_s: float,
    now: float,
    *,
    scope: Scope = "watch",
) -> str:
    """A token for ``sid`` (a session id or a stream's subject) valid from ``now`` until
    ``now + ttl_s`` (whole seconds, down), signed with the key set's signing key."""
    ks = _as_keyset(keys)
    if ks.signing is None:
        raise ValueError("this key set holds no signing key")
    sid = parse_subject(sid)
    if ttl_s < 1:
        raise ValueError("ttl_s must be at least 1 second")
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}")
    iat = int(now)
    jti = secrets.token_urlsafe(9)  # two tokens minted in one second differ (per-token limits)
    claims = {"sub": sid, "scope": scope, "iat": iat, "exp": int(now + ttl_s), "jti": jti}
    key = ks.signing
    token = jwt.encode(claims, key.signer, algorithm=key.alg, headers={"kid": key.kid})
    return _low_s(token) if key.alg == "ES256" else token


def _low_s(token: str) -> str:
    """``token`` with its ES256 signature ``(r, s)`` as ``(r, n - s)`` when s is high."""
    head, claims, sig = token.rsplit(".", 2)
    raw = _segment(sig)
    s = int.from_bytes(raw[32:], "big")
    if s <= _ES256_HALF:
        return token
    low = raw[:32] + (P256_ORDER - s).to_bytes(32, "big")
    return f"{head}.{claims}.{base64.urlsafe_b64encode(low).rstrip(b'=').decode('ascii')}"


def _check_es256(signature: bytes) -> None:
    """TokenInvalid unless ``signature`` is 64 bytes ``r || s``, 0 < r < n, 0 < s <= n/2."""
    if len(signature) != 64:
        raise TokenInvalid("ES256 signature must be 64 bytes (r || s)")
    r = int.from_bytes(signature[:32], "big")
    s = int.from_bytes(signature[32:], "big")
    if not 0 < r < P256_ORDER or not 0 < s <= _ES256_HALF:
        raise TokenInvalid("ES256 signature is not canonical: r, s in range and s low-S")


# PyJWT's implementations of the three algorithms, called directly: the token's shape is
# checked here once (three canonical base64url parts), which is 5-10x cheaper than
# ``jwt.decode`` re-validating every segment character by character; what decides, the
# signature check (constant time for HS256), is PyJWT's.
_VERIFIERS: Final[dict[str, Any]] = {
    "HS256": jwt.algorithms.HMACAlgorithm(jwt.algorithms.HMACAlgorithm.SHA256),
    "ES256": jwt.algorithms.ECAlgorithm(jwt.algorithms.ECAlgorithm.SHA256),
    "RS256": jwt.algorithms.RSAAlgorithm(jwt.algorithms.RSAAlgorithm.SHA256),
}


def _segment(part: str) -> bytes:
    """One base64url part, decoded; TokenInvalid unless it is the canonical spelling
    (decoders ignore the unused low bits of the last character, which would let several
    strings verify as one signature)."""
    if len(part) % 4 == 1:
        raise TokenInvalid("token is not canonical base64url")
    try:
        raw = base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
    except (binascii.Error, ValueError):
        raise TokenInvalid("token is not base64url") from None
    if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != part:
        raise TokenInvalid("token is not canonical base64url")
    return raw


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except ValueError:
        raise TokenInvalid(f"token {what} is not JSON") from None
    if not isinstance(obj, dict):
        raise TokenInvalid(f"token {what} is not a JSON object")
    return obj


def _int_claim(claims: Mapping[str, Any], name: str) -> int:
    value = claims.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TokenInvalid(f"token claim {name!r} must be an integer (Unix seconds)")
    return value


def verify_token(
    keys: KeySet | str | bytes,
    token: str,
    sid: str,
    now: float,
    *,
    need: Scope = "watch",
    max_lifetime_s: int = MAX_LIFETIME_S,
) -> Claims:
    """The claims of ``token`` if it is genuine, for ``sid`` (a session's id or a stream's
    ``ds:<id>``, :mod:`relay.protocol.subjects`), in its lifetime (``exp - iat`` at most
    ``max_lifetime_s``), allowing ``need``. Raises (in this order) :class:`TokenMissing`,
    :class:`TokenInvalid` / :class:`TokenUnknownKey`, :class:`TokenWrongSession`,
    :class:`TokenNotYetValid`, :class:`TokenExpired`, :class:`TokenWrongScope`."""
    ks = _as_keyset(keys)
    if not token:
        raise TokenMissing("no token: send Authorization: Bearer <token> or ?token=")
    if len(token) > MAX_TOKEN_LEN:
        raise TokenInvalid(f"token longer than {MAX_TOKEN_LEN} characters")
    if _JWS.fullmatch(token) is None:
        raise TokenInvalid("token is not a JWT (header.claims.signature, base64url)")
    head_b64, claims_b64, sig_b64 = token.split(".")
    header = _json_object(_segment(head_b64), "header")
    if "crit" in header:  # RFC 7515 4.1.11: no extension is understood here
        raise TokenInvalid("token header names critical extensions (crit) this server refuses")
    kid = header.get("kid")
    key = ks.keys.get(kid) if isinstance(kid, str) else None
    if key is None:
        raise TokenUnknownKey("token names no key id this server holds (kid)")
    if header.get("alg") != key.alg:  # pinned: no 'none', no HS256 with an RSA key's bytes
        raise TokenInvalid(f"key {key.kid!r} verifies {key.alg} tokens only")
    signature, claims_raw = _segment(sig_b64), _segment(claims_b64)
    if key.alg == "ES256":
        _check_es256(signature)  # one signature, one token: no (r, n - s) twin
    signed = f"{head_b64}.{claims_b64}".encode("ascii")
    if not _VERIFIERS[key.alg].verify(signed, key.verifier, signature):
        raise TokenInvalid("token signature does not verify")
    claims = _json_object(claims_raw, "claims")
    # Genuine from here on: the claims were written by someone holding the key.
    try:
        token_sid = parse_subject(claims.get("sub"))
    except ValueError:  # InvalidSessionId is one
        raise TokenInvalid("token claim 'sub' is not a session id or a stream's subject") from None
    scope = claims.get("scope")
    if scope not in SCOPES:
        raise TokenInvalid("token claim 'scope' must be 'watch' or 'write'")
    expires = _int_claim(claims, "exp")
    issued = _int_claim(claims, "iat")
    not_before = _int_claim(claims, "nbf") if "nbf" in claims else None
    if expires - issued > max_lifetime_s:
        raise TokenInvalid(f"token lifetime (exp - iat) is over the maximum of {max_lifetime_s} s")
    jti = claims.get("jti", "")
    if not isinstance(jti, str) or len(jti) > _JTI_MAX:
        raise TokenInvalid(f"token claim 'jti' must be a string of at most {_JTI_MAX} characters")
    if not hmac.compare_digest(token_sid.encode(), sid.encode()):  # a stream's sub is no sid
        why = namespace_refusal(token_sid, sid)  # the one namespace rule, and its reason
        raise TokenWrongSession(why or "token was issued for another session or stream")
    if issued > now + LEEWAY_S or (not_before is not None and not_before > now + LEEWAY_S):
        raise TokenNotYetValid("token is not valid yet (iat / nbf in the future)")
    if now >= expires:
        raise TokenExpired("token has expired")
    # the caller's sid (equal, checked above) and the module's scope literal rather than
    # the strings the JSON decoder made: a relay keeps these claims per open stream
    result = Claims(sid, expires, SCOPES[SCOPES.index(scope)], issued, key.kid, jti)
    if not result.allows(need):
        raise TokenWrongScope(f"token does not allow {need}")
    return result


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
