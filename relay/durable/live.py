"""Live reads' wake-ups: a long-poll or SSE reader waits on its stream's channel, which
the relay's one-subscription-per-shard subscriber (through
:meth:`relay.broker.rediscluster.broker.RedisBroker.tap_subscribe`) SSUBSCRIBEs while
someone waits; every write's SPUBLISH wakes them, and they re-read Redis (the message
says only "something changed"). A waiter also re-reads every ``recheck_s`` so that a
wake-up lost in a failover delays a reader, never loses data.

Order of use::

    waker = Waker(broker)                       # hub.tap = waker.on_message
    async with waker.wakeups(ref.channel) as wake:
        view = await read(...)                  # after subscribing: no write is missed
        await wake.wait(timeout_s)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Final, Protocol

__all__ = ["Wake", "Waker"]

log = logging.getLogger(__name__)
RECHECK_S: Final = 5.0


class TapBroker(Protocol):
    async def tap_subscribe(self, channel: str) -> None: ...

    def tap_unsubscribe(self, channel: str) -> None: ...


class Wake:
    """One waiter's wake-up: set by a message on its channel."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    async def wait(self, timeout_s: float) -> bool:
        """Whether woken within ``timeout_s`` (at most :data:`RECHECK_S`: the caller
        re-reads Redis either way); clears the wake-up."""
        try:
            await asyncio.wait_for(self.event.wait(), min(timeout_s, RECHECK_S))
        except TimeoutError:
            return False
        finally:
            self.event.clear()
        return True


class Waker:
    """The waiters of this relay, by channel."""

    def __init__(self, broker: TapBroker) -> None:
        self.broker = broker
        self._waiters: dict[bytes, set[Wake]] = {}
        self.woken = 0

    def on_message(self, msgs: list[list[bytes]]) -> None:
        """The hub's tap: wake every waiter of each message's channel."""
        if not self._waiters:  # nobody waits: a read costs one test
            return
        for msg in msgs:
            for w in self._waiters.get(bytes(msg[1]), ()):
                w.event.set()
                self.woken += 1

    @contextlib.asynccontextmanager
    async def wakeups(self, channel: str) -> AsyncIterator[Wake]:
        """Wake-ups of ``channel`` while the block runs (subscribed on entry by the
        first waiter, unsubscribed on exit by the last)."""
        key = channel.encode()
        wake = Wake()
        first = key not in self._waiters
        self._waiters.setdefault(key, set()).add(wake)
        try:
            if first:
                await self.broker.tap_subscribe(channel)
            yield wake
        finally:
            waiters = self._waiters.get(key)
            if waiters is not None:
                waiters.discard(wake)
                if not waiters:
                    del self._waiters[key]
                    self.broker.tap_unsubscribe(channel)

    @property
    def waiting(self) -> int:
        return sum(len(w) for w in self._waiters.values())
