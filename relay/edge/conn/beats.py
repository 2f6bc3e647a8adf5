"""The one timer of every open connection: heartbeats, WebSocket pings, dead peers.

Every ``heartbeat_s / 2`` :func:`run` gives each connection of the server its
:meth:`relay.edge.conn.base.Conn.beat`, once:

- an SSE or UI stream silent for ``heartbeat_s`` gets a ``: heartbeat`` comment
  (proxies and browsers keep an idle stream open);
- a WebSocket whose client was not heard from for ``heartbeat_s`` (any message, a pong
  included) gets a ping; one whose ping stays unanswered for ``heartbeat_s / 2`` is
  aborted (a dead peer; it ends with ``client_gone``). This is aiohttp's ``heartbeat=``
  on one timer instead of a timer per connection: a dead peer goes within 1 to 2 x
  ``heartbeat_s`` of its last message (aiohttp's: 1.5 x).

Nothing is written to a socket that has frames queued or no room: frames are flowing
then, or the write timeout cuts the stream. Order of use: the server runs
``await run(server.streams, heartbeat_s)`` as a supervised loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Set
from typing import Final

from relay.edge.conn.base import Conn

__all__ = ["run"]

_SLICE: Final = 500  # connections looked at per event-loop turn


async def run(conns: Set[Conn], heartbeat_s: float) -> None:
    """Forever: every ``heartbeat_s / 2``, each connection of ``conns`` (the live set)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(heartbeat_s / 2)
        now = loop.time()
        for i, c in enumerate(list(conns)):
            c.beat(now, heartbeat_s)
            if i % _SLICE == _SLICE - 1:
                await asyncio.sleep(0)
