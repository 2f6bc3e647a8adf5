"""One client connection of the edge: the object every transport is built on.

A :class:`Conn` is the whole of one connection on the relay: the hub's watcher (fed
the session's live frames, reading its replay from the backlog), the socket's writer,
and the connection's end. Around it there is only its pure
:class:`relay.edge.core.watch.Watch` (queue, replay merge, cutoff) and the transport.
Subclasses say how a transport frames what it writes and how it says goodbye:
:class:`relay.edge.conn.sse.SseConn`, :class:`relay.edge.conn.ws.WsConn`,
:class:`relay.fronts.aisdk.conn.UiConn` (the AI SDK's UI message stream), and
:class:`relay.edge.conn.reader.Reader` (no socket: frames for code in this process).

What a connection does:

- **frames from the hub's reader** (:meth:`Conn.feed`, synchronous): when the watch is
  live, nothing is queued and the socket has room, the frames are encoded and written
  at once (one write per read chunk; the encoding is made once per frame and shared by
  every socket of the session: :func:`sse_bytes`, :func:`ws_bytes`); otherwise they go
  to the watch, which queues (and merges, and cuts off) them;
- **its replay**: the watch's fetches become backlog page reads
  (:meth:`relay.edge.fanout.hub.Hub.read_page`), under the relay-wide byte budget for
  replay pages in memory, one page at a time as the socket drains;
- **a task only when needed**: to drain a socket that pushed back (and cut it, as a
  slow consumer, if it does not drain within ``write_timeout_s``) or to say goodbye; an
  idle connection holds no task;
- **the socket** once aiohttp has let go of it
  (:func:`relay.edge.http.handlers.detach`, then :meth:`Conn.attach`):
  the connection is the transport's protocol (its ``pause_writing`` / ``resume_writing``
  say whether there is room; its ``connection_lost`` ends the stream in the server,
  once). :meth:`Conn.ended` completes then: the server's drain waits on it (made only
  when someone waits), and cancelling it aborts the connection at once;
- **its end**: :meth:`Conn.shut` (the watch closed: slow consumer, drain, token
  expiry...), then the transport's goodbye (:meth:`Conn.goodbye`), then the socket is
  closed (aborted if the client has not taken the last bytes after ``GOODBYE_S``). A
  deleted session's connection ends with :meth:`Conn.farewell`: its notice is the last
  frame written, before the goodbye.

Order of use (the stream handlers, relay/edge/http/handlers.py)::

    conn = SseConn(server, sid, offset, gen, access)   # or WsConn, UiConn
    await server.admit(conn)          # limits, then hub.open(conn): subscribe, replay
    ...answer the request (head, preamble, 101) through aiohttp...
    detach(request, conn); conn.attach(transport, first_bytes)
    return response                   # the handler ends; the connection goes on
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Final, Protocol

from relay.broker.errors import SessionDeleted
from relay.edge.core.compact import Compactor
from relay.edge.core.resume import Delivery, Fetch
from relay.edge.core.watch import Closed, Intent, Watch
from relay.edge.fanout.hub import Hub
from relay.edge.fanout.notices import DELETED_REASON, deleted_delivery
from relay.protocol import sse
from relay.protocol.codes import CloseCode
from relay.protocol.frame import KINDS
from relay.protocol.sse import FRAME_EVENT

__all__ = [
    "GOODBYE_S",
    "READER",
    "Conn",
    "ConnHost",
    "sse_bytes",
    "transports",
    "ws_bytes",
    "ws_text_frame",
]

log = logging.getLogger(__name__)

GOODBYE_S: Final = 1.0  # how long a closing socket may take to hand over its last bytes


READER: Final = "reader"  # the transport label of a connection with no socket (tests, benchmarks)
_KINDS: dict[str, None] = {}  # every connection class's transport label, in import order


def transports() -> tuple[str, ...]:
    """The transport labels (the metrics' ``transport``) of every connection class
    imported so far that reaches a client over a socket: a new transport's class names
    its own ``transport_kind`` and is counted here, with nothing else to register."""
    return tuple(kind for kind in _KINDS if kind != READER)


class ConnHost(Protocol):
    """What a connection needs of the server that admitted it."""

    def end_stream(self, conn: Conn, code: CloseCode) -> None:
        """The connection is over (``code``: why): release what admission took, count."""


Sent = Callable[[list[Delivery], int], None]


def _noop_sent(ds: list[Delivery], n: int) -> None:
    return None


class Conn(asyncio.Protocol):
    """One connection. See the module docstring."""

    transport_kind: ClassVar[str] = READER  # how it reaches its client: the metrics' label
    # a compacted join merges the replay's open run too (a stream of the running turn)
    compact_open: ClassVar[bool] = False
    # what the frames look like on the socket; made once per frame and shared
    encode: Callable[[Delivery], bytes] = staticmethod(lambda d: d.data)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _KINDS.setdefault(cls.transport_kind, None)  # transports(): the metrics' labels

    __slots__ = (
        "_closing",
        "_done",
        "_ended",
        "_farewell",
        "_fetch",
        "_held",
        "_host",
        "_hub",
        "_left_hub",
        "_loop",
        "_room",
        "_sent",
        "_stats",
        "_transport",
        "_waiter",
        "_writer",
        "address",
        "chunked",
        "expires",
        "last_write",
        "offset",
        "sid",
        "stop",
        "ticket",
        "token",
        "watch",
        "write_timeout_s",
    )

    def __init__(
        self,
        hub: Hub,
        sid: str,
        offset: int | None,
        gen: str | None = None,
        *,
        host: ConnHost | None = None,
        sent: Sent = _noop_sent,
        write_timeout_s: float = 10.0,
        compact: bool = False,
    ) -> None:
        self.sid, self.offset = sid, offset
        self._hub = hub
        self._host = host
        self._stats = hub.counters
        joined = Compactor(merge_open=self.compact_open) if compact else None
        self.watch = Watch(sid, offset, hub.limits, hub.counters, gen or "", joined)
        self._fetch: asyncio.Task[None] | None = None  # the replay page being read
        self._farewell: Delivery | None = None  # the last frame, written before the goodbye
        self._held = 0  # budget bytes of replay frames read and not yet written
        self._left_hub = False
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._room = False  # attached, writable, below the transport's high-water mark
        self._closing = False
        self._waiter: asyncio.Future[None] | None = None  # drain, or the client's close
        self._writer: asyncio.Task[None] | None = None
        self._sent = sent
        self.write_timeout_s = write_timeout_s
        self.chunked = False  # HTTP/1.1 chunked response: every write is one chunk
        self.last_write = self._loop.time()
        self.stop: tuple[CloseCode, str] | None = None  # why the server ends it, once said
        self._done: asyncio.Future[None] | None = None  # made by ended(), if someone waits
        self._ended = False
        # admission (relay.edge.http.limits): who is counted for this stream
        self.token = 0
        self.address = ""
        self.expires = 0
        self.ticket = False  # counted in the limits until released

    # -- state ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.watch.closed is not None

    @property
    def pending(self) -> int:
        return len(self.watch.queue)

    def gone(self) -> CloseCode:
        """Why a stream ended that the server did not end itself (the client went away,
        or its connection was lost or cut): the server's reason if it had one (a slow
        consumer cut, a drain), else ``client_gone``."""
        return self.stop[0] if self.stop is not None else CloseCode.CLIENT_GONE

    # -- driven by the hub ---------------------------------------------------------------

    def subscribed(self) -> None:
        """The channel is subscribed: ask for the replay (or the bounds) in the background."""
        self._apply(self.watch.subscribed())

    async def first_read(self) -> None:
        """Wait until the first backlog answer (the replay's start or the bounds) is in."""
        task = self._fetch
        if task is not None:
            await asyncio.shield(task)

    def feed(self, ds: list[Delivery]) -> None:
        """The session's live frames of one read chunk, in channel order (synchronous,
        on the hub's reader). The fast path: written now, the watch only told the last
        offset."""
        w = self.watch
        if w.live and self._room and not w.queue and ds[0].offset == w.last + 1:
            w.last = ds[-1].offset
            stats = self._stats
            stats["frames_out"] += len(ds)
            stats["writes_direct"] += 1
            self._write(ds)
            return
        intents = w.offer(ds)
        if intents:
            self._apply(intents)
        if w.queue:
            self._flush()

    def notice(self, d: Delivery) -> None:
        """A frame outside the session's order (presence): written now if nothing waits,
        else queued after what does; the watch's last offset is not touched."""
        w = self.watch
        if w.closed is not None:
            return
        if self._room and not w.queue:
            self._write([d])
            return
        w.notice(d)
        self._flush()

    def shut(self, reason: str, code: CloseCode) -> None:
        """End the watch (the connection then says goodbye and closes)."""
        self._apply(self.watch.close(code, reason))

    def kick(self, code: CloseCode, reason: str) -> None:
        """End the stream from outside (drain, token expiry): the client is told why."""
        if self.stop is None:
            self.stop = (code, reason)
        self.shut(reason, code)

    def farewell(self, d: Delivery, reason: str, code: CloseCode) -> None:
        """End the stream with ``d`` as its last frame (whatever was still queued is
        dropped), then the goodbye for ``code``: a deleted session's notice."""
        if self.closed:
            return
        self._farewell = d
        self.kick(code, reason)

    # -- the socket ----------------------------------------------------------------------

    def attach(self, transport: asyncio.Transport, first: bytes = b"") -> None:
        """The socket is this connection's (it is the transport's protocol now): write
        ``first`` as is, then what is queued, then whatever comes."""
        self._transport = transport
        if first:
            transport.write(first)
        self._room = not transport.is_closing()
        if self.closed:
            self._wake()
        elif self.watch.queue:
            self._flush()

    def _write(self, ds: list[Delivery]) -> None:
        """Frames to the socket in one write (one HTTP chunk when chunked)."""
        enc = self.encode
        data = enc(ds[0]) if len(ds) == 1 else b"".join([enc(d) for d in ds])
        n = len(data)
        if not n:
            return
        if self.chunked:
            data = b"%x\r\n%b\r\n" % (n, data)
        t = self._transport
        assert t is not None
        t.write(data)
        self.last_write = self._loop.time()
        self._sent(ds, n)

    def write_raw(self, data: bytes) -> None:
        """Bytes as they are (a heartbeat, a control frame), one chunk when chunked."""
        t = self._transport
        if t is None or self._closing:
            return
        if self.chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        t.write(data)
        self.last_write = self._loop.time()

    def idle_room(self) -> bool:
        """True when a heartbeat may be written: room, and no frame waiting."""
        return self._room and not self.watch.queue and not self.closed

    def cut(self) -> None:
        """A write did not finish in time: the client is slow. Abort the connection (its
        buffers are full: no goodbye would get through)."""
        if self.stop is None:
            self.stop = (CloseCode.SLOW_CONSUMER, "the client does not read fast enough")
        self.abort()

    def abort(self) -> None:
        self._room, self._closing = False, True
        if self._transport is not None:
            self._transport.abort()

    # -- the transport's callbacks (once attached) ----------------------------------------

    def data_received(self, data: bytes) -> None:
        """The client is not read (subclasses that read it override this)."""

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost follows

    def pause_writing(self) -> None:
        self._room = False

    def resume_writing(self) -> None:
        self._room = not self._closing
        self._wake_waiter()

    def connection_lost(self, exc: Exception | None) -> None:
        self._room, self._closing = False, True
        self._wake_waiter()
        self._finish(self.gone())

    # -- what subclasses say -------------------------------------------------------------

    async def goodbye(self, code: CloseCode, reason: str) -> None:
        """The stream ends for ``code``: say so to the client (the transport is closed
        after this returns)."""

    def beat(self, now: float, heartbeat_s: float) -> None:
        """The server's heartbeat timer: keep an idle connection open (or find it dead)."""

    # -- internals: intents ----------------------------------------------------------------

    def _apply(self, intents: Iterable[Intent]) -> None:
        for it in intents:
            if isinstance(it, Closed):
                self._closed()
            else:
                self._fetch = self._hub.supervisor.spawn(f"replay:{self.sid}", self._read(it))

    def _closed(self) -> None:
        """The watch closed: stop reading the backlog, leave the hub, say goodbye."""
        self._settle()
        task, self._fetch = self._fetch, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        if not self._left_hub:
            self._left_hub = True
            self._hub.conn_closed(self)
        self._wake()

    async def _read(self, fetch: Fetch) -> None:
        """One backlog page for the watch (under the replay budget)."""
        w, hub = self.watch, self._hub
        lim = w.limits
        replay = fetch.after is not None
        reserved = await hub.budget.acquire(lim.replay_page_bytes) if replay else 0
        try:
            page = await hub.read_page(
                self.sid, fetch.after, lim.replay_page_frames, lim.replay_page_bytes,
                lambda: not self.closed,
            )  # fmt: skip
        except SessionDeleted:  # the hub ended the session's connections, this one too
            hub.budget.release(reserved)
            self.farewell(deleted_delivery(self.sid), DELETED_REASON, CloseCode.SESSION_DELETED)
            return
        except BaseException:
            hub.budget.release(reserved)
            raise
        if page is None or self.closed:
            hub.budget.release(reserved)
            return
        entries, size, first, last, gen, frames = page
        keep = min(size, reserved)
        hub.budget.release(reserved - keep)
        self._held += keep
        r = w.resume
        if r is not None and r.started and r.last is not None and last < r.last:
            hub.offsets_lost(self.sid, r.last)  # a failover lost offsets we delivered
        if self._fetch is asyncio.current_task():
            self._fetch = None
        self._apply(w.backlog(entries, first, last, gen, frames))
        if w.queue:
            self._flush()

    # -- internals: writing what is queued -------------------------------------------------

    def _flush(self) -> None:
        if self._room:
            self._send_queued()
        else:
            self._wake()

    def _send_queued(self) -> None:
        w = self.watch
        ds, intents = w.take()
        if ds:
            self._write(ds)
            self._stats["writes_queued"] += 1
        if self._room:  # replay bytes the transport took below its high-water mark
            self._settle()
        if intents:
            self._apply(intents)

    def _settle(self) -> None:
        """Replay bytes stop counting against the budget once they left the connection."""
        if self._held:
            self._hub.budget.release(self._held)
            self._held = 0

    def _wake(self) -> None:
        """Frames wait on a pushed-back socket, or the watch closed: start the writer
        (once attached; before that, :meth:`attach` calls it)."""
        if self._transport is None:
            w = self._waiter
            if w is not None and not w.done():
                w.set_result(None)
            return
        task = self._writer
        if task is None or task.done():
            self._writer = self._hub.supervisor.spawn(f"writer:{self.sid}", self._drain())

    async def _drain(self) -> None:
        """Write what is queued as the socket drains; say goodbye once the watch closed."""
        w = self.watch
        while w.closed is None:
            if not w.queue:
                return
            if not self._room:
                if self._closing:
                    return
                await self._until_room()
                continue
            self._send_queued()
        code, reason = self.stop or (w.closed.code, w.closed.reason)
        if self.stop is None:
            self.stop = (code, reason)
        await self.end(code, reason)

    async def _until_room(self) -> None:
        """Wait for resume_writing; past ``write_timeout_s`` the client is cut as slow."""
        self._waiter = waiter = self._loop.create_future()
        timer = self._loop.call_later(self.write_timeout_s, self.cut)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _wake_waiter(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- internals: the end ----------------------------------------------------------------

    async def end(self, code: CloseCode, reason: str) -> None:
        """Say goodbye for ``code``, then close the socket."""
        t = self._transport
        if t is None or self._closing:
            return
        try:
            last, self._farewell = self._farewell, None
            if last is not None:
                self._write([last])
            await self.goodbye(code, reason)
        finally:
            self.close_transport()

    def end_soon(self, code: CloseCode, reason: str) -> None:
        """:meth:`end` in a task of its own (from a transport callback)."""
        if self.stop is None:
            self.stop = (code, reason)
        self._stop_writer()
        self._writer = self._hub.supervisor.spawn(f"end:{self.sid}", self.end(code, reason))

    def close_transport(self) -> None:
        """Close once what is buffered is written; abort if that takes over GOODBYE_S."""
        t = self._transport
        if t is None or self._closing:
            return
        self._room, self._closing = False, True
        t.close()
        self._loop.call_later(GOODBYE_S, _abort_if_open, t)

    def _stop_writer(self) -> None:
        task = self._writer
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()

    def ended(self) -> asyncio.Future[None]:
        """Completes when the connection is over; cancelling it aborts the connection and
        ends the stream at once (the server's drain, past its deadline)."""
        fut = self._done
        if fut is None:
            fut = self._done = self._loop.create_future()
            fut.add_done_callback(self._cancelled)
            if self._ended:
                fut.set_result(None)
        return fut

    def _finish(self, code: CloseCode) -> None:
        """The connection is lost: end the stream (once) and tell whoever waits."""
        self._end(code)
        fut = self._done
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _cancelled(self, fut: asyncio.Future[Any]) -> None:
        """The server's drain gave up waiting for this stream: abort it, end it now."""
        if fut.cancelled():
            self.abort()
            self._end(self.gone())

    def _end(self, code: CloseCode) -> None:
        """The stream is over for ``code``: once, whichever of the above comes first."""
        if self._ended:
            return
        self._ended = True
        self._stop_writer()
        self.shut("the connection ended", CloseCode.CLOSED)
        if self._host is not None:
            self._host.end_stream(self, code)


def _abort_if_open(t: asyncio.Transport) -> None:
    """A closing transport with bytes still unwritten: the client does not read."""
    try:
        stuck = t.get_write_buffer_size() > 0
    except Exception:  # a transport already gone
        return
    if stuck:
        t.abort()


# -- the frame encodings every socket of a session shares ------------------------------

_EVENT_KINDS: Final = {k: k.encode() for k in KINDS}


def sse_bytes(d: Delivery) -> bytes:
    """``d`` as one SSE event (``id:`` offset, ``event:`` kind, ``data:`` the frame as
    published), made once per delivery and kept on it (:attr:`Delivery.sse`)."""
    out = d.sse
    if out is None:
        data, kind = d.data, _EVENT_KINDS.get(d.kind)
        if kind is None or 10 in data or 13 in data:  # LF, CR (JSON with line breaks)
            out = sse.event(data, id=d.offset, kind=d.kind)
        else:  # what sse.event writes for it (its template), without the call
            out = FRAME_EVENT % (d.offset, kind, data)
        d.sse = out
    return out


def ws_text_frame(payload: bytes) -> bytes:
    """One unmasked, final WebSocket text frame (RFC 6455 section 5.2), as a server sends."""
    n = len(payload)
    if n < 126:
        return bytes((0x81, n)) + payload
    if n < 65536:
        return struct.pack("!BBH", 0x81, 126, n) + payload
    return struct.pack("!BBQ", 0x81, 127, n) + payload


def ws_bytes(d: Delivery) -> bytes:
    """``d`` as one WebSocket text frame, made once per delivery (:attr:`Delivery.ws`)."""
    out = d.ws
    if out is None:
        out = d.ws = ws_text_frame(d.data)
    return out
