"""A relay-wide budget of bytes: how much of the backlog replays may hold in memory.

Every connection that replays reads its backlog page by page
(:meth:`relay.edge.conn.base.Conn` asks for the next page once the socket took the
last); each page's bytes are reserved here before the read and released once the
transport took them below its high-water mark. Past the budget a new page waits its
turn (first come, first served): a burst of replays (a relay's clients reconnecting to
this one) costs time, never memory beyond the budget.

A reservation may name who it is for (``key``: a client address, for the Durable Streams
reads): one key holds at most ``share`` of the budget (a quarter by default), and its
reservations past that wait without holding back anyone else's, so that one address's
readers that do not read cannot keep every other client's reads waiting.

Order of use::

    budget = ByteBudget(64 << 20)
    n = await budget.acquire(page_bytes)   # waits while the budget is spent
    budget.release(n)
    n = await budget.acquire(n, key=address); ...; budget.release(n, key=address)
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["ByteBudget"]


class ByteBudget:
    """A relay-wide budget of bytes (replay pages in memory). :meth:`acquire` waits its
    turn, first come first served, when the budget is spent; it never refuses."""

    def __init__(self, total: int, share: int = 0) -> None:
        if total < 1:
            raise ValueError("a byte budget must be >= 1")
        self.total = total
        self.share = share if share > 0 else max(total // 4, 1)  # per key
        self.used = 0
        self.peak = 0
        self.waits = 0
        self._waiters: deque[tuple[int, str | None, asyncio.Future[None]]] = deque()
        self._keys: dict[str, int] = {}  # bytes held per key

    def _fits(self, n: int, key: str | None) -> bool:
        return key is None or self._keys.get(key, 0) + n <= self.share

    async def acquire(self, n: int, key: str | None = None) -> int:
        """Reserve ``n`` bytes (at most the whole budget, or a key's share); return what
        was reserved (release it with the same ``key``)."""
        n = max(min(n, self.total, self.share if key is not None else self.total), 0)
        if not self._waiters and self.used + n <= self.total and self._fits(n, key):
            self._take(n, key)
            return n
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, key, fut)
        self._waiters.append(entry)
        self._grant()  # waiters ahead may be over their share: this one may go first
        if fut.done():
            return n
        self.waits += 1
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n, key)  # granted while we were being cancelled
            else:
                self._waiters.remove(entry)
                self._grant()
            raise
        return n

    def release(self, n: int, key: str | None = None) -> None:
        self.used = max(self.used - n, 0)
        if key is not None:
            left = self._keys.get(key, 0) - n
            if left > 0:
                self._keys[key] = left
            else:
                self._keys.pop(key, None)
        self._grant()

    def _take(self, n: int, key: str | None) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)
        if key is not None:
            self._keys[key] = self._keys.get(key, 0) + n

    def _grant(self) -> None:
        """First come, first served, but a waiter over its key's share is passed over."""
        for entry in list(self._waiters):
            n, key, fut = entry
            if not self._fits(n, key):
                continue
            if self.used + n > self.total:
                break
            self._waiters.remove(entry)
            if not fut.done():
                self._take(n, key)
                fut.set_result(None)
