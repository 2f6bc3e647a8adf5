"""The worker's access rules: who may write, which tokens it mints, how often a client may
create sessions and a session may post turns.

- Tokens (:mod:`relay.protocol.auth`): ``POST /v1/sessions`` answers a ``write`` token;
  ``POST /v1/sessions/{sid}/tokens`` with a write token mints a ``watch`` or ``write``
  token whose lifetime is bounded by ``max_token_ttl_s`` and by the session's lifetime
  (the store's ``ttl_s``: a session lives that long after its last turn).
- Session creation: a token bucket per client address (``session_rate_per_s``,
  ``session_burst``), per worker process; and at most ``max_sessions_per_address`` live
  sessions per client address, counted in Redis (one sorted set per address, shared by
  every worker: a session counts for the session lifetime after its creation), so that
  what one address can make Redis hold is bounded by that many sessions' budgets
  (backlog bytes, history bytes).
- Turns: at most ``turns_per_minute`` turn requests per session per clock minute,
  counted in Redis (one ``INCR`` on the session's slot), so shared by every worker.
- The client address is the peer, or ``X-Forwarded-For`` from a trusted proxy
  (:mod:`relay.service.clientaddr`).

Every refusal is a :class:`RateLimited` (a :class:`relay.service.errors.Reject`): 429 +
``Retry-After`` + a :class:`relay.protocol.codes.Refusal` code and a reason.

Order of use: the app builds one :class:`WorkerAccess` at startup; handlers call
:meth:`~WorkerAccess.authorize`, :meth:`~WorkerAccess.check_creation` then
:meth:`~WorkerAccess.take_session`, :meth:`~WorkerAccess.check_turn_rate` and
:meth:`~WorkerAccess.mint`.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any, Final

import orjson
from aiohttp import web

from relay.broker.port import RecordStore
from relay.broker.rediscluster.store import RedisStore
from relay.protocol.auth import (
    SCOPES,
    AuthError,
    Claims,
    KeySet,
    Scope,
    issue_token,
)
from relay.protocol.codes import Refusal
from relay.protocol.keys import SESSION_TTL_S, address_sessions_key, parse_session, turn_rate_key
from relay.service.clientaddr import (
    DEFAULT_IPV6_PREFIX,
    BadForwardedFor,
    client_address,
    parse_networks,
)
from relay.service.errors import Reject, retry_after
from relay.service.jsonbody import BodyRefused, parse_json
from relay.service.ratelimit import Buckets
from relay.service.tokens import request_claims

__all__ = [
    "INSECURE_TOKEN",
    "BadTokenRequest",
    "RateLimited",
    "WorkerAccess",
    "parse_token_request",
]

INSECURE_TOKEN: Final = "insecure-no-auth"


def _records(store: RecordStore | Any) -> RecordStore:
    """``store``, or the Redis store of a cluster client (the gateway's callers pass
    their client)."""
    return store if isinstance(store, RecordStore) else RedisStore(store)


class RateLimited(Reject):
    """A request over an abuse limit: 429 with ``Retry-After`` and this reason."""

    def __init__(self, code: Refusal, reason: str, retry_after_s: float) -> None:
        super().__init__(429, code, reason, retry_after(retry_after_s))


class BadTokenRequest(ValueError):
    """A ``POST .../tokens`` body the worker cannot serve (400)."""


def parse_token_request(raw: bytes) -> tuple[Scope, int | None]:
    """``{"scope": "watch"|"write", "ttl_s"?: int}`` -> (scope, ttl_s or None)."""
    try:
        body = parse_json(raw, empty={})
    except BodyRefused as exc:
        raise BadTokenRequest(exc.reason) from None
    scope = body.get("scope", "watch")
    if scope not in SCOPES:
        raise BadTokenRequest("'scope' must be 'watch' or 'write'")
    ttl = body.get("ttl_s")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
        raise BadTokenRequest("'ttl_s' must be a positive integer (seconds)")
    return scope, ttl


@dataclass(frozen=True, slots=True)
class Minted:
    token: str
    scope: Scope
    expires_at: int

    def body(self, sid: str) -> dict[str, Any]:
        return {"session": sid, "token": self.token, "scope": self.scope,
                "expires_at": self.expires_at}  # fmt: skip


class WorkerAccess:
    """Tokens and abuse limits of one worker process (see the module docstring)."""

    def __init__(
        self,
        keys: KeySet | None,
        *,
        trusted_proxies: str = "",
        ipv6_prefix: int = DEFAULT_IPV6_PREFIX,
        max_token_ttl_s: int = SESSION_TTL_S,
        session_ttl_s: int = SESSION_TTL_S,
        session_rate_per_s: float = 1.0,
        session_burst: int = 20,
        turns_per_minute: int = 30,
        max_sessions_per_address: int = 64,
    ) -> None:
        self.keys = keys
        self.trusted = parse_networks(trusted_proxies)
        self.ipv6_prefix = ipv6_prefix
        self.max_ttl_s = max(1, min(max_token_ttl_s, session_ttl_s))
        self.lifetime_s = session_ttl_s  # the longest token verified: as long as a session
        self.creations = Buckets(session_rate_per_s, session_burst)
        self.turns_per_minute = turns_per_minute
        self.max_sessions = max_sessions_per_address  # 0: no limit
        self.session_ttl_s = session_ttl_s

    def address(self, request: web.Request) -> str:
        """The key this request's client is counted under (IPv6: its network); 400
        ``invalid_forwarded_for`` (:class:`Reject`) for an entry of a trusted proxy's
        ``X-Forwarded-For`` that is not an address."""
        forwarded = request.headers.get("X-Forwarded-For")
        try:
            return client_address(
                request.remote, forwarded, self.trusted, ipv6_prefix=self.ipv6_prefix
            )
        except BadForwardedFor as exc:
            raise Reject(400, Refusal.INVALID_FORWARDED_FOR, str(exc)) from None

    def authorize(self, request: web.Request, sid: str, need: Scope) -> Claims | None:
        """The request's verified claims (None with auth off); raises AuthError."""
        if self.keys is None:
            return None
        return request_claims(self.keys, request, sid, need, max_lifetime_s=self.lifetime_s)

    def token_session(self, request: web.Request) -> str | None:
        """The session whose genuine ``write`` token the request carries, whatever
        session it names elsewhere (its own ``sub``, verified by :meth:`authorize`), or
        None: no token, not a JWT, not genuine, or not a write token."""
        if self.keys is None:
            return None
        header = request.headers.get("Authorization") or ""
        scheme, _, token = header.strip().partition(" ")
        parts = token.strip().split(".")
        if scheme.lower() != "bearer" or len(parts) != 3:
            return None
        try:
            claims = orjson.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
            sid = claims["sub"] if isinstance(claims, dict) else None
            if not isinstance(sid, str):
                return None
            sid = parse_session(sid)  # a stream's token names no session (ValueError)
            self.authorize(request, sid, "write")  # the signature decides, not the text read
        except (ValueError, KeyError, AuthError):
            return None
        return sid

    def mint(self, sid: str, scope: Scope, ttl_s: int | None = None) -> Minted:
        """A token for ``sid``; its lifetime is ``ttl_s`` capped by config and session."""
        ttl = self.max_ttl_s if ttl_s is None else min(ttl_s, self.max_ttl_s)
        now = time.time()
        if self.keys is None:
            return Minted(INSECURE_TOKEN, scope, int(now + ttl))
        token = issue_token(self.keys, sid, ttl, now, scope=scope)
        return Minted(token, scope, int(now + ttl))

    def check_creation(self, request: web.Request) -> None:
        """Raise :class:`RateLimited` when this address creates sessions too fast
        (:class:`Reject` 400 when its address cannot be read)."""
        wait = self.creations.take(self.address(request), time.monotonic())
        if wait > 0:
            raise RateLimited(
                Refusal.SESSION_RATE,
                f"too many new sessions from this address; at most {self.creations.burst} at "
                f"once and {self.creations.rate:g} per second",
                wait,
            )

    async def take_session(self, store: RecordStore | Any, request: web.Request, sid: str) -> None:
        """Count ``sid`` as a live session of this request's address; :class:`RateLimited`
        ``too_many_sessions`` (``Retry-After``: until its oldest session stops counting)
        when the address holds ``max_sessions_per_address`` (the store's clock says when a
        session stops counting). The store's errors surface as RelayError (the API answers 503)."""
        if self.max_sessions <= 0:
            return
        name = address_sessions_key(self.address(request))
        wait_ms = await _records(store).take_slot(
            name, sid, self.max_sessions, self.session_ttl_s * 1000
        )
        if wait_ms:
            raise RateLimited(
                Refusal.TOO_MANY_SESSIONS,
                f"this client address holds {self.max_sessions} live sessions; use one of "
                "them, or wait until the oldest expires",
                int(wait_ms) / 1000,
            )

    async def check_turn_rate(self, store: RecordStore | Any, sid: str) -> None:
        """Count one turn request of ``sid``; :class:`RateLimited` past the minute's budget.
        The store's errors surface as RelayError (the API answers 503)."""
        if self.turns_per_minute <= 0:
            return
        now = time.time()
        minute = int(now // 60)
        count = await _records(store).count(turn_rate_key(sid, minute), 120)
        if count > self.turns_per_minute:
            raise RateLimited(
                Refusal.TURN_RATE,
                f"at most {self.turns_per_minute} turns per session per minute",
                (minute + 1) * 60 - now,
            )
