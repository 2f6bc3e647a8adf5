"""An SSE stream after its response head, owned by the relay, not by aiohttp.

The handler sends the response head and the stream's preamble (``retry:`` and the
``hello`` event) through aiohttp, then hands the socket to an :class:`SseConn`
(:func:`relay.edge.conn.detached.detach`) and returns, so that aiohttp's request, parser and
handler task are freed (:mod:`relay.edge.conn.detached` says what every detached stream
does). What an :class:`SseConn` adds: events are written as HTTP chunks when the
response is chunked (HTTP/1.1); nothing the client sends is read (an SSE client sends
nothing after its request); its goodbye is the ``: close <code> <reason>`` comment with
a ``retry:`` hint (jittered for a relay that shuts down, so its clients do not come
back all at once), then the response's last chunk.

Order of use (:func:`relay.edge.http.handlers.sse_handler`)::

    writer = await resp.prepare(request); await resp.write(preamble)
    conn = SseConn(host, stream, transport, chunked=writer.chunked, retry_ms=...)
    detach(request, conn)
    conn.start(b"", sse_bytes, sent, write_timeout_s)
    return resp
"""

from __future__ import annotations

import asyncio

from relay.edge.conn.detached import Detached
from relay.edge.conn.streams import Stream, jitter
from relay.edge.http.host import StreamHost
from relay.protocol import sse
from relay.protocol.codes import CloseCode

__all__ = ["SseConn"]


class SseConn(Detached):
    """One SSE stream's socket. See the module docstring."""

    __slots__ = ("_chunked", "_retry_ms")

    def __init__(
        self,
        host: StreamHost,
        stream: Stream,
        transport: asyncio.Transport,
        *,
        chunked: bool,
        retry_ms: int,
    ) -> None:
        super().__init__(host, stream, transport)
        self._chunked = chunked
        self._retry_ms = retry_ms

    @property
    def chunked(self) -> bool:
        return self._chunked

    async def goodbye(self, code: CloseCode, reason: str) -> None:
        retry = jitter(self._retry_ms) if code is CloseCode.RELAY_SHUTDOWN else self._retry_ms
        data = sse.goodbye(code, reason, retry)
        if self._chunked:  # the event in a chunk, then the last chunk of the response
            data = b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)
        self._transport.write(data)
