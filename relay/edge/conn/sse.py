"""An SSE stream (``GET /v1/sessions/{sid}/events``) as one connection.

What an :class:`SseConn` adds to :class:`relay.edge.conn.base.Conn`: each frame is one
SSE event (``id:`` offset, ``event:`` kind, ``data:`` the frame as published; made once
per frame and shared: :func:`relay.edge.conn.base.sse_bytes`), written as HTTP chunks
when the response is chunked (HTTP/1.1); nothing the client sends is read (an SSE
client sends nothing after its request); a ``: heartbeat`` comment after
``heartbeat_s`` without a write (the server's one timer, :mod:`relay.edge.conn.beats`);
its goodbye is the ``: close <code> <reason>`` comment with a ``retry:`` hint (jittered
for a relay that shuts down, so its clients do not come back all at once), then the
response's last chunk.

Order of use (:func:`relay.edge.http.handlers.sse_handler`)::

    conn = SseConn(hub, sid, offset, gen, host=server, retry_ms=...)
    await server.admit(conn)
    writer = await resp.prepare(request); await resp.write(preamble)
    conn.chunked = writer.chunked; conn.attach(detach(request, conn))
    return resp
"""

from __future__ import annotations

import random
from typing import Any, ClassVar, Final

from relay.edge.conn.base import Conn, sse_bytes
from relay.edge.fanout.hub import Hub
from relay.protocol import sse
from relay.protocol.codes import CloseCode

__all__ = ["HEARTBEAT", "SseConn", "jitter"]

HEARTBEAT: Final = sse.comment("heartbeat")


def jitter(retry_ms: int) -> int:
    """Spread reconnects after a drain over [retry/2, retry] so peers are not stampeded."""
    return retry_ms // 2 + random.randint(0, max(retry_ms // 2, 0))


class SseConn(Conn):
    """One SSE stream. See the module docstring."""

    transport_kind: ClassVar[str] = "sse"
    encode = staticmethod(sse_bytes)

    __slots__ = ("_retry_ms",)

    def __init__(self, hub: Hub, sid: str, offset: int | None, gen: str | None = None,
                 *, retry_ms: int = 1000, **kw: Any) -> None:  # fmt: skip
        super().__init__(hub, sid, offset, gen, **kw)
        self._retry_ms = retry_ms

    def beat(self, now: float, heartbeat_s: float) -> None:
        if self.last_write <= now - heartbeat_s and self.idle_room():
            self.write_raw(HEARTBEAT)

    async def goodbye(self, code: CloseCode, reason: str) -> None:
        retry = jitter(self._retry_ms) if code is CloseCode.RELAY_SHUTDOWN else self._retry_ms
        data = sse.goodbye(code, reason, retry)
        if self.chunked:  # the event in a chunk, then the last chunk of the response
            data = b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)
        t = self._transport
        if t is not None:
            t.write(data)
