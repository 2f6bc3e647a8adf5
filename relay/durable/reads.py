"""GET on a Durable Stream: catch-up, long-poll and SSE reads of a :class:`Source` (a
stream of :mod:`relay.durable.store`, or a chat session's frames,
:mod:`relay.durable.sessions`), with Stream-Next-Offset, Stream-Up-To-Date,
Stream-Closed, Stream-Cursor, ETag / If-None-Match and Cache-Control as the protocol's
sections 5.6-5.8 and 10 say.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Final, Protocol

from aiohttp import web

from relay.durable import core
from relay.durable.core import BadRequest, format_offset
from relay.durable.live import Waker
from relay.durable.store import View
from relay.protocol import sse

__all__ = ["SECURITY", "ReadOptions", "Source", "get"]

SECURITY: Final = {
    "X-Content-Type-Options": "nosniff",
    "Cross-Origin-Resource-Policy": "cross-origin",
}
CHUNK_MESSAGES: Final = 1000
CHUNK_BYTES: Final = 1 << 20
_MODES: Final = (None, "long-poll", "sse")


class Source(Protocol):
    channel: str

    async def read(self, start: int | None, count: int) -> View | None: ...


@dataclass(frozen=True)
class ReadOptions:
    long_poll_s: float
    sse_close_s: float
    public: bool


class Gone(Exception):
    """The stream was deleted under a live read."""


def _cut(view: View) -> tuple[list[bytes], bool]:
    """The messages of one response (at most :data:`CHUNK_BYTES`, one at least) and
    whether they reach the tail."""
    out: list[bytes] = []
    size = 0
    for m in view.messages:
        if out and size + len(m) > CHUNK_BYTES:
            break
        out.append(m)
        size += len(m)
    return out, view.start + len(out) >= view.next


def _cursor(request: web.Request) -> str:
    return core.cursor(time.time(), request.query.get("cursor"), random.randint(1, 3600))


def _binary(view: View) -> bool:
    return not (view.media_type.startswith("text/") or view.json_mode)


async def _load(source: Source, start: int | None) -> View:
    view = await source.read(start, CHUNK_MESSAGES)
    if view is None:
        raise web.HTTPNotFound(text="no such stream")
    if start is not None and start > view.next:
        raise BadRequest("offset past the stream's tail")
    if start is not None and start < view.low:
        raise web.HTTPGone(text="offset before the earliest retained message")
    return view


def _headers(view: View, end: int, up_to_date: bool, request: web.Request) -> dict[str, str]:
    h = {"Content-Type": view.content_type, "Stream-Next-Offset": format_offset(end)}
    if up_to_date:
        h["Stream-Up-To-Date"] = "true"
    if up_to_date and view.closed:
        h["Stream-Closed"] = "true"
    else:
        h["Stream-Cursor"] = _cursor(request)
    return h


async def get(
    request: web.Request, source: Source, waker: Waker, opt: ReadOptions
) -> web.StreamResponse:
    q = request.query
    live = q.get("live")
    if live not in _MODES:
        raise BadRequest("live must be long-poll or sse")
    if live is not None and "offset" not in q:
        raise BadRequest(f"live={live} needs an offset")
    start = core.parse_offset(q.get("offset"))
    if live == "sse":
        return await _sse(request, source, waker, opt, start)
    view = await _load(source, start)
    if start is None and live is None:  # offset=now: the tail, never cached
        h = _headers(view, view.next, True, request)
        h["Cache-Control"] = "no-store"
        return web.Response(body=core.join_body([], view.json_mode), headers=h)
    if live == "long-poll":
        at = view.next if start is None else start
        if at >= view.next and not view.closed:
            view = await _long_poll(source, waker, at, opt.long_poll_s)
        if view.start >= view.next:
            h = _headers(view, view.next, True, request)
            return web.Response(status=204, headers=h)
    return _chunk(request, view, opt)


def _chunk(request: web.Request, view: View, opt: ReadOptions) -> web.Response:
    msgs, up_to_date = _cut(view)
    end = view.start + len(msgs)
    h = _headers(view, end, up_to_date, request)
    tag = core.etag(view.gen, view.start, end, view.closed and up_to_date)
    h["ETag"] = tag
    h["Cache-Control"] = core.cache_control(public=opt.public, tail=False)
    if request.headers.get("If-None-Match") == tag:
        return web.Response(status=304, headers=h)
    return web.Response(body=core.join_body(msgs, view.json_mode), headers=h)


async def _long_poll(source: Source, waker: Waker, at: int, wait_s: float) -> View:
    """The stream read at ``at`` once it holds more, is closed or ``wait_s`` passed."""
    deadline = time.monotonic() + wait_s
    async with waker.wakeups(source.channel) as wake:
        while True:
            view = await _load(source, at)
            if view.next > at or view.closed:
                return view
            left = deadline - time.monotonic()
            if left <= 0:
                return view
            await wake.wait(left)


def _control(view: View, end: int, up_to_date: bool, request: web.Request) -> bytes:
    c: dict[str, object] = {"streamNextOffset": format_offset(end)}
    if up_to_date and view.closed:
        c["streamClosed"] = True
        c["upToDate"] = True
    else:
        c["streamCursor"] = _cursor(request)
        if up_to_date:
            c["upToDate"] = True
    return sse.event(json.dumps(c).encode(), kind="control", space=False)


async def _sse(
    request: web.Request, source: Source, waker: Waker, opt: ReadOptions, start: int | None
) -> web.StreamResponse:
    view = await _load(source, start)  # errors before the 200
    at = view.next if start is None else start
    h = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **SECURITY}
    if _binary(view):
        h["Stream-SSE-Data-Encoding"] = "base64"
    resp = web.StreamResponse(headers=h)
    await resp.prepare(request)
    deadline = time.monotonic() + opt.sse_close_s
    sent_control = False
    async with waker.wakeups(source.channel) as wake:
        while True:
            now_view = await source.read(at, CHUNK_MESSAGES)
            if now_view is None:  # deleted under us: end; the reconnect gets 404
                break
            view = now_view
            msgs, up_to_date = _cut(view)
            out = b""
            if msgs:
                at = view.start + len(msgs)
                out = core.sse_data(msgs, view.json_mode, _binary(view))
            if msgs or not sent_control or (view.closed and up_to_date):
                # the data and its control in one write: a reader sees both or neither
                await resp.write(out + _control(view, at, up_to_date, request))
                sent_control = True
            if view.closed and up_to_date:
                break
            if not up_to_date:
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await wake.wait(left)
            if time.monotonic() >= deadline:
                break
    await resp.write_eof()
    return resp
