"""A response body written to a client that may not read it: in slices of :data:`SLICE`
bytes, each awaited until the socket's buffer drains (aiohttp's writer waits past 64 KiB
buffered), each within a deadline. A client that does not take a slice in time is cut:
its transport is aborted, which frees what it buffered, and :class:`SlowReader` is
raised for the handler to end on. So a response in flight costs its own bytes (which the
caller holds) plus a slice or two in the transport, never a copy per reader that waits
in the relay for as long as the reader likes.

Order of use::

    resp = web.StreamResponse(headers=h); resp.content_length = len_of(parts)
    await resp.prepare(request)
    try:
        await write_paced(request, resp, parts, timeout_s=10)
    except SlowReader:
        return resp       # the connection is gone
    await resp.write_eof()
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Final

from aiohttp import web

__all__ = ["SLICE", "SlowReader", "write_paced"]

SLICE: Final = 64 * 1024


class SlowReader(Exception):
    """The client did not take a slice of the body within the deadline (it was cut)."""


async def write_paced(
    request: web.BaseRequest,
    resp: web.StreamResponse,
    parts: Iterable[bytes],
    *,
    timeout_s: float,
) -> None:
    """Write ``parts`` to the prepared ``resp`` in slices, each within ``timeout_s``;
    :class:`SlowReader` (the transport aborted) when one is not taken in time. Small parts
    are gathered into one slice (a thousand JSON messages are a few writes, not a
    thousand); a large one is written from its own memory, a slice at a time."""
    pending = bytearray()
    for part in parts:
        if len(pending) + len(part) <= SLICE:
            pending += part
            continue
        if pending:
            await _write(request, resp, pending, timeout_s)
            pending = bytearray()
        view = memoryview(part)
        for i in range(0, len(view), SLICE):
            piece = view[i : i + SLICE]
            if len(piece) < SLICE:  # the tail: gathered with what follows
                pending += piece
            else:
                await _write(request, resp, piece, timeout_s)
    if pending:
        await _write(request, resp, pending, timeout_s)


async def _write(
    request: web.BaseRequest, resp: web.StreamResponse, data: bytes | bytearray | memoryview,
    timeout_s: float,
) -> None:  # fmt: skip
    try:
        async with asyncio.timeout(timeout_s):
            await resp.write(data)
    except TimeoutError:
        transport = request.transport
        if transport is not None:
            transport.abort()
        raise SlowReader(f"no slice of the body taken in {timeout_s:g} s") from None
