"""A stream's socket once aiohttp has let go of it: the part SSE and WebSocket share.

aiohttp keeps a request's objects (the request, its parser, the handler's task and
coroutines, the response) for as long as its handler runs, about 12 KB per connection.
A stream's handler therefore answers the request (the SSE response head, or the
WebSocket's 101), hands the socket to a :class:`Detached` protocol of the relay's
(:func:`detach`) and returns: an idle stream then holds its transport, its watch and
this one object, and no task.

What every :class:`Detached` does (subclasses: :class:`relay.edge.conn.sse.SseConn`,
:class:`relay.edge.conn.ws.WsConn`, which add how the client is read and how a stream
says goodbye):

- it is the writer of the stream's :class:`relay.edge.conn.streams.SocketOut`: frames reach
  the socket from the hub's reader; :meth:`drain` waits for the transport to resume
  writing after it pushed back;
- a task runs only when the stream's tap calls for one (:meth:`wake`): to drain what a
  pushed-back socket has queued, or to end the stream with the reason its watch closed
  (:meth:`goodbye`, then the transport is closed);
- a closing transport is aborted if the client has not taken what was left after
  ``GOODBYE_S`` (a client that stopped reading does not keep it open);
- once the transport is lost, the stream ends in the server (``host.end_stream``, once)
  with the reason decided first, and :attr:`done` completes: the server's drain waits
  on it, and cancelling it aborts the connection and ends the stream at once.

Order of use (the handlers)::

    conn = SseConn(host, stream, transport, ...)   # or WsConn
    detach(request, conn)                          # aiohttp forgets the connection
    conn.start(first_bytes, out_encoder, write_timeout_s)
    return response                                # the handler ends; the stream goes on
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from relay.broker.errors import WatchClosed
from relay.edge.conn.streams import GOODBYE_S, SocketOut, Stream
from relay.edge.core.resume import Delivery
from relay.edge.http.host import StreamHost
from relay.protocol.codes import CloseCode

__all__ = ["Detached", "detach"]

log = logging.getLogger(__name__)


def detach(request: web.Request, protocol: asyncio.Protocol) -> None:
    """Give the request's socket to ``protocol`` and make aiohttp forget it: aiohttp's
    connection no longer has a transport (it writes nothing more to it and does not
    close it when the handler returns), and its ``connection_lost`` runs now, which
    drops the connection from aiohttp's server and frees its request and parser.
    Call it with no await between the response's last write and the handler's return."""
    handler = request.protocol
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client went away")
    transport.set_protocol(protocol)
    handler.transport = None
    handler.connection_lost(None)


class Detached(asyncio.Protocol):
    """One stream's socket, owned by the relay. See the module docstring."""

    __slots__ = (
        "_code",
        "_host",
        "_loop",
        "_paused",
        "_stream",
        "_transport",
        "_waiter",
        "_writer",
        "done",
    )

    def __init__(self, host: StreamHost, stream: Stream, transport: asyncio.Transport) -> None:
        self._host, self._stream, self._transport = host, stream, transport
        self._loop = asyncio.get_running_loop()
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None  # drain, or a close's reply
        self._writer: asyncio.Task[None] | None = None
        self._code: CloseCode | None = None  # why the stream ends, once decided
        self.done: asyncio.Future[None] = self._loop.create_future()
        self.done.add_done_callback(self._cancelled)
        stream.sock = transport
        stream.task = self.done

    @property
    def chunked(self) -> bool:
        """As SocketOut's writer: whether each write is framed as an HTTP chunk."""
        return False

    def start(
        self,
        first: bytes,
        encode: Callable[[Delivery], bytes],
        sent: Callable[[list[Delivery], int], None],
        write_timeout_s: float,
    ) -> None:
        """Write ``first`` (as is), then stream the watch's frames."""
        stream = self._stream
        if first:
            self._transport.write(first)
        stream.out = SocketOut(
            stream,
            self._transport,
            self,  # type: ignore[arg-type]  # a writer with drain() and chunked
            encode,
            sent,
            write_timeout_s,
        )
        stream.watch.attach(stream.out, self.wake)

    # -- what subclasses say ----------------------------------------------------------------

    async def goodbye(self, code: CloseCode, reason: str) -> None:
        """The stream ends for ``code``: say so to the client (the transport is closed
        after this returns)."""

    # -- the transport's callbacks ------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        """The client is not read (subclasses that read it override this)."""

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._wake_waiter()
        self._finish(self._code if self._code is not None else self._stream.gone())

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_waiter()

    # -- as SocketOut's writer ------------------------------------------------------------------

    async def drain(self) -> None:
        """Wait until the transport takes writes again (ConnectionResetError if lost)."""
        if self._transport.is_closing():
            raise ConnectionResetError("the connection is closing")
        if not self._paused:
            return
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._transport.is_closing():
            raise ConnectionResetError("the connection is closing")

    # -- ending ---------------------------------------------------------------------------------

    def wake(self) -> None:
        """The tap calls for a writer: drain a pushed-back socket, or end the stream."""
        task = self._writer
        if self._code is not None or (task is not None and not task.done()):
            return
        self._writer = asyncio.create_task(self._write(), name=f"writer:{self._stream.sid}")

    async def _write(self) -> None:
        stream = self._stream
        try:
            await stream.watch.drain()
            return
        except WatchClosed as exc:
            code, reason = stream.ended(exc)
        except (ConnectionError, RuntimeError):  # the client went away, or was cut
            return
        except Exception:  # never leave a socket nobody closes
            log.exception("writer of %s failed", stream.sid)
            code, reason = CloseCode.INTERNAL, "internal error"
        if stream.stop is None:
            stream.stop = (code, reason)
        await self.end(code, reason)

    def end_soon(self, code: CloseCode, reason: str) -> None:
        """:meth:`end` in a task of its own (from a transport callback)."""
        self._stop_writer()
        self._writer = asyncio.create_task(self.end(code, reason), name=f"end:{self._stream.sid}")

    async def end(self, code: CloseCode, reason: str) -> None:
        """End the stream for ``code``: :meth:`goodbye`, then close the transport."""
        if self._code is None:
            self._code = code
        if self._transport.is_closing():
            return
        try:
            await self.goodbye(code, reason)
        finally:
            self.close_transport()

    def close_transport(self) -> None:
        """Close once what is buffered is written; abort if that takes over GOODBYE_S."""
        t = self._transport
        if t.is_closing():
            return
        t.close()
        self._loop.call_later(GOODBYE_S, _abort_if_open, t)

    def _stop_writer(self) -> None:
        task = self._writer
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()

    def _wake_waiter(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _finish(self, code: CloseCode) -> None:
        """The connection is lost: end the stream, unless _cancelled already did."""
        if not self.done.done():
            self._end(code)
            self.done.set_result(None)

    def _cancelled(self, fut: asyncio.Future[Any]) -> None:
        """The server's drain gave up waiting for this stream: abort it, end it now."""
        if fut.cancelled():
            self._transport.abort()
            self._end(self._code or self._stream.gone())

    def _end(self, code: CloseCode) -> None:
        self._stop_writer()
        self._stream.out = None
        self._host.end_stream(self._stream, code)


def _abort_if_open(t: asyncio.Transport) -> None:
    """A closing transport with bytes still unwritten: the client does not read."""
    try:
        stuck = t.get_write_buffer_size() > 0
    except Exception:  # a transport already gone
        return
    if stuck:
        t.abort()
