"""Waiting for a slot: :func:`route_wait`, the router's one asynchronous entry.

The router (:mod:`worker.routing.router`) is pure and synchronous; a request that finds
every engine full may wait here for a release or for a load view that grants this
worker a share, counted meanwhile as unmet demand (what the load exchange reports).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Protocol

from worker.routing.cost import TurnInfo
from worker.routing.lease import Lease

__all__ = ["Routable", "route_wait"]


class Routable(Protocol):
    """What :func:`route_wait` needs of :class:`worker.routing.router.Router`."""

    def route(self, key: str, avoid: str | None = None, turn: TurnInfo | None = None) -> Lease: ...

    def try_route(
        self, key: str, avoid: str | None = None, turn: TurnInfo | None = None
    ) -> Lease | None: ...

    def retry_after(self) -> float: ...

    def add_waiter(self, key: str, turn: TurnInfo | None = None) -> str: ...

    def remove_waiter(self, engine_id: str) -> None: ...

    def add_release_listener(self, cb: Callable[[], None]) -> None: ...

    def remove_release_listener(self, cb: Callable[[], None]) -> None: ...


async def route_wait(
    router: Routable, key: str, deadline_s: float, turn: TurnInfo | None = None
) -> Lease:
    """Route ``key``, waiting up to ``deadline_s`` seconds for a slot when all are full.

    While it waits the request counts as unmet demand (:meth:`Router.add_waiter`), which
    the load exchange turns into a share of the cap for this worker. Wakes on every lease
    release and every load view that frees room (at the retry-after hint at the latest);
    raises :class:`AllEnginesFull` when the deadline passes (``deadline_s=0``: one try,
    the same as :meth:`Router.route`). Not FIFO-fair."""
    if deadline_s <= 0:
        return router.route(key, turn=turn)
    lease = router.try_route(key, turn=turn)
    if lease is not None:
        return lease
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    wake = asyncio.Event()
    wanted = router.add_waiter(key, turn)
    router.add_release_listener(wake.set)
    try:
        while True:
            left = end - loop.time()
            if left <= 0:
                return router.route(key, turn=turn)  # a last try: a lease, or the refusal
            wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), min(left, router.retry_after()))
            lease = router.try_route(key, turn=turn)
            if lease is not None:
                return lease
    finally:
        router.remove_release_listener(wake.set)
        router.remove_waiter(wanted)
