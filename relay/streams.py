"""Per-connection pieces of the edge server: the stream record, refusals, close codes.

Used by :mod:`relay.server` only. :class:`Stream` is one open SSE / WebSocket stream
(its hub watch, its task, why the server ends it); :class:`Reject` is a refusal before
streaming (JSON ``{"error", "reason"}``); :data:`WS_CLOSE` maps every stop code to its
WebSocket close code (the table of docs/PROTOCOL.md).

Order of use: the server builds a :class:`Stream` once the watch is open, calls
:meth:`Stream.kick` to end it from outside (drain) and :meth:`Stream.cut` from a write
timer; the stream's task reads :meth:`Stream.ended` to learn why it ended.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, Final

import orjson
from aiohttp import web

from relay.errors import WatchClosed
from relay.hub import Watch

__all__ = [
    "CORS_HEADERS",
    "GOODBYE_S",
    "RETRY_AFTER",
    "WS_CLOSE",
    "Reject",
    "Stream",
    "client_reason",
    "discard",
    "is_ping",
    "jitter",
]

# WebSocket close codes the server uses, by WatchClosed / server stop code.
WS_CLOSE: Final[dict[str, tuple[int, str]]] = {
    "relay_shutdown": (1012, "service restart"),
    "slow_consumer": (4008, "slow consumer"),
    "token_expired": (4401, "token expired"),
    "bad_message": (4400, "bad message"),
    "binary": (1003, "binary messages are not supported"),
    "too_big": (1009, "message too big"),
    "internal": (1011, "internal error"),
    "closed": (1000, "closed"),
}
CORS_HEADERS: Final = {
    "Access-Control-Allow-Headers": "Authorization, Last-Event-ID, Content-Type",
    "Access-Control-Allow-Methods": "GET, OPTIONS",
    "Access-Control-Expose-Headers": "X-Relay-Id",
    "Access-Control-Max-Age": "600",
}


class Reject(Exception):
    """A request refused before streaming; becomes ``{"error", "reason"}`` JSON."""

    def __init__(
        self, status: int, error: str, reason: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(f"{status} {error}: {reason}")
        self.status, self.error, self.reason = status, error, reason
        self.headers = headers or {}

    def response(self) -> web.Response:
        body = orjson.dumps({"error": self.error, "reason": self.reason})
        return web.Response(
            status=self.status, body=body, content_type="application/json", headers=self.headers
        )


class Stream:
    """One open SSE or WebSocket stream: its watch, its task, why the server ends it."""

    __slots__ = ("offset", "sid", "sock", "stop", "task", "transport", "watch")

    def __init__(self, transport: str, sid: str, offset: int | None, watch: Watch) -> None:
        self.transport, self.sid, self.offset, self.watch = transport, sid, offset, watch
        self.stop: tuple[str, str] | None = None
        self.task: asyncio.Task[Any] | None = asyncio.current_task()
        self.sock: asyncio.Transport | None = None

    def cut(self) -> None:
        """A write did not finish in time: the client is slow. Abort the connection
        (its buffers are full: no goodbye would get through); the pending write fails
        with ConnectionResetError in the stream's task. No task is cancelled."""
        if self.stop is None:
            self.stop = ("slow_consumer", "the client does not read fast enough")
        if self.sock is not None:
            self.sock.abort()

    async def kick(self, code: str, reason: str) -> None:
        """End the stream from outside: its writer wakes with WatchClosed and says why."""
        if self.stop is None:
            self.stop = (code, reason)
        await self.watch.close()

    def ended(self, exc: WatchClosed) -> tuple[str, str]:
        return self.stop if self.stop is not None else (exc.code, exc.reason)


RETRY_AFTER: Final = {"Retry-After": "1"}
GOODBYE_S: Final = 1.0


def jitter(retry_ms: int) -> int:
    """Spread reconnects after a drain over [retry/2, retry] so peers are not stampeded."""
    return retry_ms // 2 + random.randint(0, max(retry_ms // 2, 0))


def discard(task: asyncio.Task[Any] | None) -> None:
    """Cancel a helper task, or consume its outcome if it already finished."""
    if task is None:
        return
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


def is_ping(text: str) -> bool:
    if len(text) > 64:
        return False
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and obj.get("type") == "ping"


def client_reason(code: str) -> str:
    if code == "bad_message":
        return 'client messages must be {"type":"ping"}'
    return WS_CLOSE.get(code, WS_CLOSE["internal"])[1]
