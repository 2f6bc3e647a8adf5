"""The one timer of every open stream: SSE heartbeat comments and WebSocket pings.

Every ``heartbeat_s / 2`` :func:`run` looks at each stream of the server once:

- an SSE stream silent for ``heartbeat_s`` gets a ``: heartbeat`` comment (proxies
  and browsers keep an idle stream open);
- a WebSocket whose client was not heard from for ``heartbeat_s`` (any message, a
  pong included; :mod:`relay.edge.http.handlers` notes it in ``Stream.heard_at``) gets a
  ping; one whose ping stays unanswered for ``heartbeat_s / 2`` is aborted (a dead
  peer; its handler ends with ``client_gone``). This is aiohttp's ``heartbeat=`` on
  one timer instead of a timer per connection: a dead peer goes within 1 to 2 x
  ``heartbeat_s`` of its last message (aiohttp's: 1.5 x).

Nothing is written to a socket that has frames queued or no room: frames are flowing
then, or the write timeout cuts the stream. Order of use: the server runs
``await run(server.streams, heartbeat_s)`` as a supervised loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Set
from typing import Final

from relay.edge.conn.streams import WS_PING, SocketOut, Stream, Transport
from relay.protocol import sse

__all__ = ["HEARTBEAT", "beat_ws", "run"]

log = logging.getLogger(__name__)

HEARTBEAT: Final = sse.comment("heartbeat")
_SLICE: Final = 500  # streams looked at per event-loop turn


async def run(streams: Set[Stream], heartbeat_s: float) -> None:
    """Forever: every ``heartbeat_s / 2``, each stream of ``streams`` (the live set)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(heartbeat_s / 2)
        now = loop.time()
        due = now - heartbeat_s
        for i, s in enumerate(list(streams)):
            out = s.out
            if out is not None:
                if s.transport is Transport.SSE:
                    if out.last_write <= due:
                        s.watch.try_write(lambda o=out: o.write(HEARTBEAT))  # type: ignore[misc]
                elif s.transport is Transport.WS:
                    beat_ws(s, out, now, heartbeat_s)
            if i % _SLICE == _SLICE - 1:
                await asyncio.sleep(0)


def beat_ws(s: Stream, out: SocketOut, now: float, heartbeat_s: float) -> None:
    """One WebSocket's turn: a ping when its client was silent for ``heartbeat_s``;
    the connection aborted when that ping is unanswered ``heartbeat_s / 2`` later."""
    if s.pinged_at:
        if now - s.pinged_at >= heartbeat_s / 2 and s.sock is not None:
            log.info("WebSocket of %s: no pong within %.1f s; closing", s.sid, heartbeat_s / 2)
            s.sock.abort()  # the handler ends with client_gone
    elif s.heard_at <= now - heartbeat_s and s.watch.try_write(lambda: out.write(WS_PING)):
        s.pinged_at = now
