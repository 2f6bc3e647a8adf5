"""GET on a Durable Stream: catch-up, long-poll and SSE reads of a :class:`Source` (a
stream of :mod:`relay.durable.store`, or a chat session's frames,
:mod:`relay.durable.sessions`), with Stream-Next-Offset, Stream-Up-To-Date,
Stream-Closed, Stream-Cursor, ETag / If-None-Match and Cache-Control as the protocol's
sections 5.6-5.8 and 10 say.

Memory: every read of messages reserves, before it reaches the store, the most one read
can return (:attr:`ReadOptions.reserve`) from the relay-wide replay budget (the hub's
:class:`relay.edge.fanout.budget.ByteBudget`, ``--replay-budget-bytes``), keeps what the
read returned until its response is written and gives the rest back at once; past the
budget a read waits its turn. The body is written in slices within
``--write-timeout-s`` each (:func:`relay.service.paced.write_paced`): a reader that does
not read is cut and what it held is freed. Long-poll waits with no messages read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

from aiohttp import web

from relay.durable import core
from relay.durable.auth import Refused
from relay.durable.core import BadRequest, format_offset
from relay.durable.live import Waker
from relay.durable.store import View
from relay.protocol import sse
from relay.service.paced import SlowReader, write_paced

if TYPE_CHECKING:
    from relay.edge.fanout.budget import ByteBudget

__all__ = ["SECURITY", "ReadOptions", "Source", "get"]

SECURITY: Final = {
    "X-Content-Type-Options": "nosniff",
    "Cross-Origin-Resource-Policy": "cross-origin",
}
CHUNK_MESSAGES: Final = 1000
CHUNK_BYTES: Final = 1 << 20
TAIL_RESERVE: Final = 64 << 10  # reserved for a read at the tail (what one append adds)
_MODES: Final = (None, "long-poll", "sse")


class Source(Protocol):
    channel: str

    async def read(self, start: int | None, count: int) -> View | None: ...


@dataclass(frozen=True)
class ReadOptions:
    long_poll_s: float
    sse_close_s: float
    public: bool
    budget: ByteBudget | None = None  # the relay-wide budget of read bytes in memory
    reserve: int = CHUNK_BYTES  # reserved before a read: the most one read returns
    write_timeout_s: float = 10.0  # a slice of a body not taken in this long: cut
    headers: Mapping[str, str] = field(default_factory=lambda: dict(SECURITY))  # on every body
    key: str | None = None  # whose share of the budget (the client address)


class _Hold:
    """What one read holds of the budget (see the module docstring)."""

    def __init__(self, opt: ReadOptions, behind: bool) -> None:
        self.budget, self.wait_s = opt.budget, opt.write_timeout_s
        self.key = opt.key if behind else None
        self.reserved = 0

    async def take(self, n: int) -> None:
        """Reserve ``n`` more bytes, waiting at most ``--write-timeout-s`` (:class:`Busy`)."""
        if self.budget is None:
            return
        try:
            async with asyncio.timeout(self.wait_s):
                self.reserved += await self.budget.acquire(n, self.key)
        except TimeoutError:
            raise Busy from None

    async def keep(self, n: int) -> None:
        """Hold ``n`` bytes from now on (give back the rest, or reserve more)."""
        if self.budget is None:
            return
        if n > self.reserved:
            await self.take(n - self.reserved)
        else:
            self.budget.release(self.reserved - n, self.key)
            self.reserved = n


class Busy(Exception):
    """The relay's read budget (or this client's share of it) stayed spent too long."""


BUSY_REASON: Final = (
    "this relay holds as many bytes of reads as it may (--replay-budget-bytes; a client "
    "address a quarter of it): retry"
)


@contextlib.asynccontextmanager
async def _reserved(opt: ReadOptions, behind: bool) -> AsyncIterator[_Hold]:
    """A read's hold on the budget: ``behind`` (a catch-up: the reader is behind the tail)
    reserves the most one read returns, within the client's share; a read at the tail
    (woken by an append) reserves :data:`TAIL_RESERVE` and more only if it got more."""
    hold = _Hold(opt, behind)
    try:
        await hold.take(opt.reserve if behind else TAIL_RESERVE)
        yield hold
    finally:
        if hold.budget is not None:
            hold.budget.release(hold.reserved, hold.key)


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
    return out, view.after(len(out)) >= view.next


def _cursor(request: web.Request) -> str:
    return core.cursor(time.time(), request.query.get("cursor"), random.randint(1, 3600))


def _binary(view: View) -> bool:
    return not (view.media_type.startswith("text/") or view.json_mode)


async def _load(source: Source, start: int | None, count: int = CHUNK_MESSAGES) -> View:
    view = await source.read(start, count)
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
    if start is None and live is None:  # offset=now: the tail, never cached
        view = await _load(source, start, 0)
        h = _headers(view, view.next, True, request)
        h["Cache-Control"] = "no-store"
        return web.Response(body=core.join_body([], view.json_mode), headers=h)
    behind = True
    if live == "long-poll":  # wait with no messages read, then read under the budget
        view = await _load(source, start, 0)
        at = view.next if start is None else start
        first_next = view.next
        if at >= view.next and not view.closed:
            view = await _long_poll(source, waker, at, opt.long_poll_s)
        if at >= view.next:
            h = _headers(view, view.next, True, request)
            return web.Response(status=204, headers=h)
        behind = at < first_next  # else it waited at the tail
        start = at
    try:
        async with _reserved(opt, behind) as hold:
            view = await _load(source, start)
            msgs, up_to_date = _cut(view)
            await hold.keep(sum(len(m) for m in msgs))
            return await _chunk(request, view, opt, msgs, up_to_date)
    except Busy:
        raise Refused(503, BUSY_REASON, {"Retry-After": "1"}) from None


async def _chunk(
    request: web.Request, view: View, opt: ReadOptions, msgs: list[bytes], up_to_date: bool
) -> web.StreamResponse:
    end = view.after(len(msgs))
    h = _headers(view, end, up_to_date, request)
    tag = core.etag(view.gen, view.start, end, view.closed and up_to_date)
    h["ETag"] = tag
    h["Cache-Control"] = core.cache_control(public=opt.public, tail=False)
    if request.headers.get("If-None-Match") == tag:
        return web.Response(status=304, headers=h)
    if view.json_mode:  # "[" m1 "," m2 ... "]", never joined into one more copy
        parts = [b"["]
        for i, m in enumerate(msgs):
            parts += (b"," if i else b"", m)
        parts.append(b"]")
    else:
        parts = msgs
    resp = web.StreamResponse(headers={**h, **opt.headers})
    resp.content_length = sum(len(p) for p in parts)
    await resp.prepare(request)
    try:
        await write_paced(request, resp, parts, timeout_s=opt.write_timeout_s)
    except SlowReader:
        return resp  # cut: the connection is gone, and what it held with it
    await resp.write_eof()
    return resp


async def _long_poll(source: Source, waker: Waker, at: int, wait_s: float) -> View:
    """The stream read at ``at`` once it holds more, is closed or ``wait_s`` passed."""
    deadline = time.monotonic() + wait_s
    async with waker.wakeups(source.channel) as wake:
        while True:
            view = await _load(source, at, 0)
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
    view = await _load(source, start, 0)  # errors before the 200
    at = view.next if start is None else start
    h = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **opt.headers}
    if _binary(view):
        h["Stream-SSE-Data-Encoding"] = "base64"
    resp = web.StreamResponse(headers=h)
    await resp.prepare(request)
    deadline = time.monotonic() + opt.sse_close_s
    sent_control, behind = False, at < view.next
    async with waker.wakeups(source.channel) as wake:
        while True:
            try:
                async with _reserved(opt, behind) as hold:
                    page = await source.read(at, CHUNK_MESSAGES)
                    if page is None:  # deleted under us: end; the reconnect gets 404
                        break
                    msgs, up_to_date = _cut(page)
                    ended = page.closed and up_to_date
                    event = b""
                    if msgs:
                        at = page.after(len(msgs))
                        event = core.sse_data(msgs, page.json_mode, _binary(page))
                    if msgs or not sent_control or ended:
                        # the data and its control in one write: a reader sees both or neither
                        event += _control(page, at, up_to_date, request)
                    del msgs, page  # only the event is held while it is written
                    await hold.keep(len(event))
                    if event:
                        try:
                            await write_paced(request, resp, [event], timeout_s=opt.write_timeout_s)
                        except SlowReader:
                            return resp  # cut: the connection is gone, and what it held with it
                        sent_control = True
            except Busy:
                break  # the reader reconnects, as at --durable-sse-close-s
            if ended:
                break
            behind = not up_to_date
            if behind:
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await wake.wait(left)
            if time.monotonic() >= deadline:
                break
    await resp.write_eof()
    return resp
