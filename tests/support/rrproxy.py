"""A round-robin HTTP proxy on loopback for the Durable Streams conformance run: each
request goes to the next relay in turn (so consecutive requests of one test land on
different relays), bodies streamed both ways (chunked appends, SSE), and the stream
paths mounted under a prefix (``/v1/stream/X`` -> ``/v1/stream/<mount>X``, the
``Location`` header mapped back) so that the run's streams fall under the relays'
``--durable-open-prefix`` (and so a fork's ``Stream-Forked-From``).

Order of use::

    async with round_robin([a.base, b.base], mount="conformance/") as url:
        ...  # point the suite at url
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Final

import aiohttp
from aiohttp import web

__all__ = ["round_robin"]

STREAM: Final = "/v1/stream/"
_HOP: Final = frozenset(
    h.lower() for h in ("Connection", "Keep-Alive", "Transfer-Encoding", "Host", "Content-Length")
)


@asynccontextmanager
async def round_robin(backends: Sequence[str], mount: str) -> AsyncIterator[str]:
    turn = itertools.cycle(backends)
    session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout())
    counts = dict.fromkeys(backends, 0)

    async def handle(request: web.Request) -> web.StreamResponse:
        base = next(turn)
        counts[base] += 1
        path = request.raw_path
        if path.startswith(STREAM):
            path = STREAM + mount + path[len(STREAM) :]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        for k, v in headers.items():  # a fork's source is a stream path too
            if k.lower() == "stream-forked-from" and v.startswith(STREAM):
                headers[k] = STREAM + mount + v[len(STREAM) :]
        body = request.content if request.body_exists else None
        async with session.request(
            request.method,
            base + path,
            headers=headers,
            data=body,
            allow_redirects=False,
            skip_auto_headers=("Content-Type",),  # the client's own, or none
        ) as up:
            out = {k: v for k, v in up.headers.items() if k.lower() not in _HOP}
            if "Location" in out:
                out["Location"] = out["Location"].replace(base, str(request.url.origin()))
                out["Location"] = out["Location"].replace(STREAM + mount, STREAM, 1)
            resp = web.StreamResponse(status=up.status, reason=up.reason, headers=out)
            if up.headers.get("Content-Length") is not None and request.method != "HEAD":
                resp.content_length = int(up.headers["Content-Length"])
            await resp.prepare(request)
            try:
                if request.method != "HEAD" and up.status not in (204, 304):
                    async for chunk in up.content.iter_any():
                        await resp.write(chunk)
                await resp.write_eof()
            except (ConnectionError, aiohttp.ClientConnectionResetError):
                pass  # the suite's client went away mid-stream (its SSE tests do): done
            return resp

    app = web.Application(client_max_size=64 << 20)
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await session.close()
