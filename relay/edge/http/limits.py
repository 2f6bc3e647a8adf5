"""Per-token and per-address stream limits, and the end of a stream at its token's expiry.

One :class:`StreamGuard` per edge server; counts are per relay process. The server's
hook is three calls on the connection itself (no object per stream of its own):
:meth:`StreamGuard.admit` when a stream is admitted (raises
:class:`relay.service.errors.Reject` 429 with ``Retry-After`` and a reason when the
token or the client address already holds its share of streams), :meth:`StreamGuard.bind`
once the stream is open (it ends the stream with ``token_expired`` when the token
expires: SSE ``: close token_expired ...``, WebSocket close 4401), and
:meth:`StreamGuard.release` when the stream ends or fails to open (idempotent).

Why: the relay-wide ``max_connections`` alone lets one token or one address hold every
slot, and a token checked only when its stream opens outlives its expiry for as long as
the connection lasts.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Final, Protocol

from relay.protocol.auth import Claims
from relay.protocol.codes import CloseCode, Refusal
from relay.service.errors import Reject

__all__ = ["EXPIRED_REASON", "Access", "Guarded", "StreamGuard", "token_key"]

EXPIRED_REASON: Final = "the token has expired; get a new one and reconnect"
RETRY_AFTER_S: Final = 5


def token_key(claims: Claims) -> int:
    """What a token's streams are counted under: the hash of its identity
    (:attr:`relay.protocol.auth.Claims.identity`: its kid and ``jti``, or its claims),
    not of its string, so that two spellings of one token (another JSON layout of the
    same claims, a malleated signature) share one count; a hash rather than the identity
    itself, which every open stream would keep. Per process and 64 bits wide: two live
    tokens share a count by accident about once in 10^19 pairs."""
    return hash(claims.identity)


@dataclass(frozen=True, slots=True)
class Access:
    """Who asks for a stream: the verified token's claims (None: auth off), the key its
    streams are counted under (:func:`token_key`) and the client address."""

    claims: Claims | None
    token: int
    address: str


class Guarded(Protocol):
    """What the guard keeps of a stream (:class:`relay.edge.conn.base.Conn`): who it is
    counted under, when its token expires (0: never), whether it is counted now."""

    token: int
    address: str
    expires: int
    ticket: bool

    def kick(self, code: CloseCode, reason: str) -> None: ...


class StreamGuard:
    """Counts open streams by token and by client address; ends streams at expiry.

    Expiry runs on one timer for every stream (a timer handle per stream would cost
    each idle connection about 600 bytes): streams are grouped by the second their
    token expires (``exp`` is whole seconds), and the timer is armed for the earliest
    second that still has streams."""

    def __init__(self, per_token: int, per_address: int) -> None:
        self.per_token, self.per_address = per_token, per_address
        self.by_token: Counter[int] = Counter()  # by token_key (0: auth off, not counted)
        self.by_address: Counter[str] = Counter()
        self._due: dict[int, set[Guarded]] = {}  # expiry second -> bound streams
        self._seconds: list[int] = []  # heap of the seconds of _due (and of emptied ones)
        self._queued: set[int] = set()  # the seconds in that heap, each pushed once
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0

    def admit(self, s: Guarded, access: Access) -> None:
        """Count one more stream for ``access`` on ``s``, or :class:`Reject` 429
        ``too_many_streams``."""
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        counted = access.claims is not None
        if counted and self.per_token and self.by_token[access.token] >= self.per_token:
            raise Reject(
                429,
                Refusal.TOO_MANY_STREAMS,
                f"this token already holds {self.per_token} open streams; close one",
                retry,
            )
        if self.per_address and self.by_address[access.address] >= self.per_address:
            raise Reject(
                429,
                Refusal.TOO_MANY_STREAMS,
                f"this client address already holds {self.per_address} open streams",
                retry,
            )
        if counted:
            self.by_token[access.token] += 1
        self.by_address[access.address] += 1
        s.token = access.token if counted else 0
        s.address = access.address
        s.expires = access.claims.expires if access.claims is not None else 0
        s.ticket = True

    def bind(self, s: Guarded) -> None:
        """Arm the expiry: when the token expires, the stream is told so and ends."""
        if not s.ticket or not s.expires:
            return
        second = s.expires
        bucket = self._due.get(second)
        if bucket is None:
            bucket = self._due[second] = set()
            if second not in self._queued:
                self._queued.add(second)
                heapq.heappush(self._seconds, second)
        bucket.add(s)
        if self._timer is None or second < self._timer_at:
            self._schedule(second)

    def release(self, s: Guarded) -> None:
        """The stream ended (or never opened): it is counted no more. Idempotent."""
        if not s.ticket:
            return
        s.ticket = False
        bucket = self._due.get(s.expires)
        if bucket is not None:
            bucket.discard(s)
            if not bucket:
                del self._due[s.expires]  # its heap entry is skipped when reached
        if s.token:
            _decrement(self.by_token, s.token)
        _decrement(self.by_address, s.address)

    def streams_of(self, claims: Claims) -> int:
        """Open streams counted under the token whose verified claims are ``claims``."""
        return self.by_token[token_key(claims)]

    @property
    def armed(self) -> int:
        """Streams waiting for their token's expiry."""
        return sum(len(b) for b in self._due.values())

    # -- the one expiry timer ------------------------------------------------------------

    def _schedule(self, second: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = second
        delay = max(second - time.time(), 0.0)
        self._timer = asyncio.get_running_loop().call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        now = time.time()
        heap = self._seconds
        while heap and (heap[0] <= now or heap[0] not in self._due):
            second = heapq.heappop(heap)
            self._queued.discard(second)
            for s in self._due.pop(second, ()):
                s.kick(CloseCode.TOKEN_EXPIRED, EXPIRED_REASON)
        if heap:
            self._schedule(heap[0])


def _decrement(counter: Counter[Any], key: object) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]  # an idle relay holds no per-client state
