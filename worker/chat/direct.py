"""The closed loop: a turn's frames on the POST that started it, no relay in between.

The source article's first choice for streaming: the pod that runs the generation
streams it straight to the client that asked (lowest latency, lightest path). The
frames still go to the backlog and the shard channel as always, so other screens watch
the same stream and a client that drops reconnects through any relay with
``Last-Event-ID`` and misses nothing.

:class:`DirectViewer` is fed by the turn's generation (``Generation.observers``: the
exact bytes relays send) and read by the POST handler, which writes each frame in the
relay's SSE format (:func:`relay.protocol.sse.event`: ``id:`` offset, ``event:`` kind, ``data:``
the frame) and ends the response after the turn's terminal frame. While attached it
counts as a watcher of the session (the "nobody watches" rule sees it); when the client
leaves it detaches and the turn goes on for everyone else. The queue is bounded: a
client that cannot keep up is told to continue through a relay (``: close
slow_consumer``) instead of holding frames in the worker's memory.

Order of use: ``viewer = DirectViewer()``; ``TurnManager.start_turn(..., viewer=viewer)``;
``async for chunk in viewer.sse(hello)``: write each chunk; ``viewer.detach()`` in a
``finally``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Final

from aiohttp import ClientConnectionResetError, web

from relay.protocol import sse

__all__ = ["DEFAULT_MAX_PENDING", "SSE_HEADERS", "DirectViewer", "respond", "wants_stream"]

DEFAULT_MAX_PENDING: Final = 4096
_TERMINAL: Final = frozenset(("done", "error"))


class DirectViewer:
    """One closed-loop client of one turn (see the module docstring)."""

    def __init__(self, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self.attached = True
        self.overflowed = False
        self._q: asyncio.Queue[tuple[int, str, bytes]] = asyncio.Queue()
        self._max = max_pending

    def __call__(self, offset: int, kind: str, data: bytes) -> None:
        """The generation's observer: never blocks, never raises."""
        if not self.attached:
            return
        if self._q.qsize() >= self._max:
            self.overflowed = True
            self.attached = False
            self._q.put_nowait((0, "", b""))  # wakes the reader, which says goodbye
            return
        self._q.put_nowait((offset, kind, data))

    def detach(self) -> None:
        self.attached = False

    async def frames(self) -> AsyncIterator[tuple[int, str, bytes]]:
        """(offset, kind, frame bytes) until the turn's terminal frame; a viewer cut for
        falling behind ends early (``overflowed``)."""
        while True:
            offset, kind, data = await self._q.get()
            if not kind:
                return
            yield offset, kind, data
            if kind in _TERMINAL:
                return

    async def sse(self, hello: bytes, retry_ms: int = 1000) -> AsyncIterator[bytes]:
        """The response body: preamble + hello, then frames until the terminal one."""
        yield sse.preamble(retry_ms, hello)
        while True:
            offset, kind, data = await self._q.get()
            if self.overflowed and not kind:
                yield sse.goodbye("slow_consumer", "continue on a relay from your last offset")
                return
            chunk = [sse.event(data, id=offset, kind=kind)]
            while not self._q.empty():  # what arrived meanwhile goes out in one write
                offset, kind, data = self._q.get_nowait()
                if not kind:
                    break
                chunk.append(sse.event(data, id=offset, kind=kind))
            yield b"".join(chunk)
            if kind in _TERMINAL:
                return


SSE_HEADERS: Final = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


def wants_stream(accept: str | None, body: object) -> bool:
    """The closed loop is asked for by ``Accept: text/event-stream`` or ``"stream": true``
    (a ``stream`` that is not a boolean raises ``ValueError``)."""
    flag = body.get("stream") if isinstance(body, dict) else None
    if flag is not None and not isinstance(flag, bool):
        raise ValueError("'stream' must be a boolean")
    return bool(flag) or "text/event-stream" in (accept or "").lower()


async def respond(request: web.Request, viewer: DirectViewer, hello: bytes) -> web.StreamResponse:
    """Write the turn's frames on the response until its terminal frame, or until the
    client leaves (then the viewer detaches and the turn goes on for the others)."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await resp.prepare(request)
        async for chunk in viewer.sse(hello):
            await resp.write(chunk)
        await resp.write_eof()
    except (ConnectionResetError, ClientConnectionResetError):
        pass  # the client left: the turn goes on for the other viewers
    finally:
        viewer.detach()
    return resp
