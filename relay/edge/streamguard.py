"""Per-token and per-address stream limits, and the end of a stream at its token's expiry.

One :class:`StreamGuard` per edge server; counts are per relay process. The server's
hook is three calls: :meth:`StreamGuard.admit` when a stream is admitted (raises
:class:`~relay.edge.streams.Reject` 429 with ``Retry-After`` and a reason when the token or
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
import time
from collections import Counter
from dataclasses import dataclass
from typing import Final

from relay.edge.streams import Reject, Stream
from relay.protocol.auth import Claims
from relay.protocol.codes import CloseCode, Refusal

__all__ = ["EXPIRED_REASON", "Access", "StreamGuard", "Ticket"]

EXPIRED_REASON: Final = "the token has expired; get a new one and reconnect"
RETRY_AFTER_S: Final = 5


@dataclass(frozen=True, slots=True)
class Access:
    """Who asks for a stream: the verified token's claims (None: auth off), the token
    itself (the key its streams are counted under) and the client address."""

    claims: Claims | None
    token: str
    address: str


class Ticket:
    """One admitted stream's share of the limits, and its expiry timer."""

    __slots__ = ("_guard", "_timer", "access", "released")

    def __init__(self, guard: StreamGuard, access: Access) -> None:
        self._guard, self.access = guard, access
        self._timer: asyncio.TimerHandle | None = None
        self.released = False

    def bind(self, stream: Stream) -> None:
        """Arm the expiry: when the token expires, the stream is told so and ends."""
        claims = self.access.claims
        if claims is None or self.released:
            return
        loop = asyncio.get_running_loop()
        delay = max(claims.expires - time.time(), 0.0)
        self._timer = loop.call_later(delay, self._guard.expire, stream)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self._timer is not None:
            self._timer.cancel()
        self._guard.forget(self.access)


class StreamGuard:
    """Counts open streams by token and by client address; ends streams at expiry."""

    def __init__(self, per_token: int, per_address: int) -> None:
        self.per_token, self.per_address = per_token, per_address
        self.by_token: Counter[str] = Counter()
        self.by_address: Counter[str] = Counter()
        self._kicks: set[asyncio.Task[None]] = set()

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

    def forget(self, access: Access) -> None:
        if access.claims is not None:
            _decrement(self.by_token, access.token)
        _decrement(self.by_address, access.address)

    def expire(self, stream: Stream) -> None:
        task = asyncio.ensure_future(stream.kick(CloseCode.TOKEN_EXPIRED, EXPIRED_REASON))
        self._kicks.add(task)
        task.add_done_callback(self._kicks.discard)


def _decrement(counter: Counter[str], key: str) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]  # an idle relay holds no per-client state
