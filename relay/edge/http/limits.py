"""Per-token and per-address stream limits, and the end of a stream at its token's expiry.

One :class:`StreamGuard` per edge server; counts are per relay process. The server's
hook is three calls: :meth:`StreamGuard.admit` when a stream is admitted (raises
:class:`~relay.edge.conn.streams.Reject` 429 with ``Retry-After`` and a reason when the token or
the client address already holds its share of streams), :meth:`Ticket.bind` once the
stream is open (arms a timer that ends the stream with ``token_expired`` when the token
expires: SSE ``: close token_expired ...``, WebSocket close 4401), and
:meth:`Ticket.release` when the stream ends or fails to open (idempotent).

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
from typing import Any, Final

from relay.edge.conn.streams import Stream
from relay.protocol.auth import Claims
from relay.protocol.codes import CloseCode, Refusal
from relay.service.errors import Reject

__all__ = ["EXPIRED_REASON", "Access", "StreamGuard", "Ticket", "token_key"]

EXPIRED_REASON: Final = "the token has expired; get a new one and reconnect"
RETRY_AFTER_S: Final = 5


def token_key(token: str) -> int:
    """What a token's streams are counted under: its hash, not the token (a few hundred
    bytes that every open stream would keep). Per process and 64 bits wide: two live
    tokens share a count by accident about once in 10^19 pairs."""
    return hash(token)


@dataclass(frozen=True, slots=True)
class Access:
    """Who asks for a stream: the verified token's claims (None: auth off), the key its
    streams are counted under (:func:`token_key`) and the client address."""

    claims: Claims | None
    token: int
    address: str


class Ticket:
    """One admitted stream's share of the limits, and its place in the expiry timer."""

    __slots__ = ("_due", "_guard", "_stream", "access", "released")

    def __init__(self, guard: StreamGuard, access: Access) -> None:
        self._guard, self.access = guard, access
        self._stream: Stream | None = None
        self._due = 0  # the second its token expires at, once bound
        self.released = False

    def bind(self, stream: Stream) -> None:
        """Arm the expiry: when the token expires, the stream is told so and ends."""
        claims = self.access.claims
        if claims is None or self.released:
            return
        self._stream = stream
        self._due = claims.expires
        self._guard._arm(self)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self._stream is not None:
            self._guard._disarm(self)
            self._stream = None
        self._guard.forget(self.access)


class StreamGuard:
    """Counts open streams by token and by client address; ends streams at expiry.

    Expiry runs on one timer for every stream (a timer handle per stream would cost
    each idle connection about 600 bytes): tickets are grouped by the second their
    token expires (``exp`` is whole seconds), and the timer is armed for the earliest
    second that still has tickets."""

    def __init__(self, per_token: int, per_address: int) -> None:
        self.per_token, self.per_address = per_token, per_address
        self.by_token: Counter[int] = Counter()  # by token_key
        self.by_address: Counter[str] = Counter()
        self._kicks: set[asyncio.Task[None]] = set()
        self._due: dict[int, set[Ticket]] = {}  # expiry second -> bound tickets
        self._seconds: list[int] = []  # heap of the seconds of _due (and of emptied ones)
        self._queued: set[int] = set()  # the seconds in that heap, each pushed once
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0

    def admit(self, access: Access) -> Ticket:
        """A ticket for one more stream, or :class:`Reject` 429 ``too_many_streams``."""
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        if (
            access.claims is not None
            and self.per_token
            and self.by_token[access.token] >= self.per_token
        ):
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
        if access.claims is not None:
            self.by_token[access.token] += 1
        self.by_address[access.address] += 1
        return Ticket(self, access)

    def streams_of(self, token: str) -> int:
        """Open streams counted under ``token``."""
        return self.by_token[token_key(token)]

    def forget(self, access: Access) -> None:
        if access.claims is not None:
            _decrement(self.by_token, access.token)
        _decrement(self.by_address, access.address)

    def expire(self, stream: Stream) -> None:
        task = asyncio.ensure_future(stream.kick(CloseCode.TOKEN_EXPIRED, EXPIRED_REASON))
        self._kicks.add(task)
        task.add_done_callback(self._kicks.discard)

    @property
    def armed(self) -> int:
        """Streams waiting for their token's expiry."""
        return sum(len(b) for b in self._due.values())

    # -- the one expiry timer ------------------------------------------------------------

    def _arm(self, ticket: Ticket) -> None:
        second = ticket._due
        bucket = self._due.get(second)
        if bucket is None:
            bucket = self._due[second] = set()
            if second not in self._queued:
                self._queued.add(second)
                heapq.heappush(self._seconds, second)
        bucket.add(ticket)
        if self._timer is None or second < self._timer_at:
            self._schedule(second)

    def _disarm(self, ticket: Ticket) -> None:
        bucket = self._due.get(ticket._due)
        if bucket is not None:
            bucket.discard(ticket)
            if not bucket:
                del self._due[ticket._due]  # its heap entry is skipped when reached

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
            for ticket in self._due.pop(second, ()):
                stream, ticket._stream = ticket._stream, None
                if stream is not None:
                    self.expire(stream)
        if heap:
            self._schedule(heap[0])


def _decrement(counter: Counter[Any], key: object) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]  # an idle relay holds no per-client state
