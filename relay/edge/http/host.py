"""What a stream handler needs of the edge server: :class:`StreamHost`.

The SSE and WebSocket handlers (:mod:`relay.edge.http.handlers`) and the AI SDK UI stream
(:mod:`relay.edge.conn.ui`) are written against this interface, not against
:class:`relay.edge.http.server.EdgeServer` itself, so they do not import the server module
(which registers their routes).

Order of use, per request: ``sid = host.session(request)``, ``access =
host.authorize(request, sid)``, ``stream = await host.open_stream(transport, sid,
offset, access, gen)`` (each may raise :class:`~relay.edge.conn.streams.Reject`: the handler
answers ``host.refuse(reject)``), write through ``await host.guarded(stream, write,
timeout_s)``, and always ``await host.close_stream(stream, code)`` (or, with no task
to await in, ``host.end_stream(stream, code)``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web
from redis.asyncio.cluster import RedisCluster

from relay.edge.config import RelayConfig
from relay.edge.conn.streams import Stream, Transport
from relay.edge.core.resume import Delivery
from relay.edge.http.limits import Access
from relay.protocol.codes import CloseCode
from relay.service.errors import Reject

__all__ = ["StreamHost"]


class StreamHost(Protocol):
    config: RelayConfig
    redis: RedisCluster | None

    def session(self, request: web.Request) -> str:
        """The path's session id, or :class:`~relay.edge.conn.streams.Reject` 400."""

    def authorize(self, request: web.Request, sid: str) -> Access:
        """The request's verified token, or :class:`~relay.edge.conn.streams.Reject` 401/403."""

    def check_capacity(self) -> None:
        """:class:`~relay.edge.conn.streams.Reject` 503 unless a stream may open now."""

    async def open_stream(
        self,
        transport: Transport,
        sid: str,
        offset: int | None,
        access: Access,
        gen: str | None = None,
    ) -> Stream:
        """Admit and watch (``gen``: the generation the client's ``offset`` belongs to,
        when it said); :meth:`close_stream` must follow."""

    async def close_stream(self, stream: Stream, code: CloseCode) -> None:
        """Release what :meth:`open_stream` took; ``code`` is counted."""

    def end_stream(self, stream: Stream, code: CloseCode) -> None:
        """:meth:`close_stream`, for code that has no task to await it in."""

    async def guarded(self, stream: Stream, write: Awaitable[Any], timeout_s: float) -> None:
        """One socket write, cut as a slow consumer past ``timeout_s``."""

    def hello(self, stream: Stream) -> bytes:
        """The first message of a stream (which relay, resuming after which offset)."""

    def sent(self, transport: Transport, batch: list[Delivery], nbytes: int) -> None:
        """Account frames written to a socket (metrics)."""

    def sender(self, transport: Transport) -> Callable[[list[Delivery], int], None]:
        """:meth:`sent` for one transport, one callable shared by all its sockets."""

    def refuse(self, reject: Reject) -> web.Response:
        """The answer to a request refused before streaming (counted)."""

    async def preflight(self, request: web.Request) -> web.Response:
        """The CORS preflight answer."""
