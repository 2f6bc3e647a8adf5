"""A relay-wide budget of bytes: how much of the backlog replays may hold in memory.

Every connection that replays reads its backlog page by page
(:meth:`relay.edge.conn.base.Conn` asks for the next page once the socket took the
last); each page's bytes are reserved here before the read and released once the
transport took them below its high-water mark. Past the budget a new page waits its
turn (first come, first served): a burst of replays (a relay's clients reconnecting to
this one) costs time, never memory beyond the budget.

Order of use::

    budget = ByteBudget(64 << 20)
    n = await budget.acquire(page_bytes)   # waits while the budget is spent
    budget.release(n)
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["ByteBudget"]


class ByteBudget:
    """A relay-wide budget of bytes (replay pages in memory). :meth:`acquire` waits its
    turn, first come first served, when the budget is spent; it never refuses."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("a byte budget must be >= 1")
        self.total = total
        self.used = 0
        self.peak = 0
        self.waits = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, n: int) -> int:
        """Reserve ``n`` bytes (at most the whole budget); return what was reserved."""
        n = max(min(n, self.total), 0)
        if not self._waiters and self.used + n <= self.total:
            self._take(n)
            return n
        self.waits += 1
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted while we were being cancelled
            else:
                self._waiters.remove(entry)
                self._grant()
            raise
        return n

    def release(self, n: int) -> None:
        self.used = max(self.used - n, 0)
        self._grant()

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    def _grant(self) -> None:
        while self._waiters and self.used + self._waiters[0][0] <= self.total:
            n, fut = self._waiters.popleft()
            if not fut.done():
                self._take(n)
                fut.set_result(None)
