"""The benchmark client of ``bench.peers.socketio`` does what the relay's protocol tells a
client to do, so that the benchmark counts a loss only where a real client would have
one: a handshake refused with 503 + ``Retry-After`` is tried again after that delay, and
a stream closed with 4008 (slow consumer) reconnects with ``from=<last offset>``.

The server here is a small aiohttp app that speaks the relay's WebSocket protocol for
one session (hello, frames, a 4008 close); the client is the benchmark's own.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from bench.peers.ws_clients import Tally, close_clients, open_clients
from relay.protocol.frame import Frame, encode


def _frame(offset: int) -> str:
    text = f"{time.time_ns():019d};"
    return encode(Frame(session="s", turn=1, offset=offset, kind="token", text=text)).decode()


@pytest.fixture
async def relay_like() -> AsyncIterator[tuple[int, list[str | None]]]:
    """The port of a server that refuses the first handshake (503, Retry-After: 1),
    sends frames 1..3 on the next and closes it with 4008, then frame 4 on the one after;
    and the ``from`` of every accepted handshake."""
    froms: list[str | None] = []
    refused = False

    async def ws(request: web.Request) -> web.StreamResponse:
        nonlocal refused
        if not refused:
            refused = True
            return web.json_response(
                {"error": "overloaded"}, status=503, headers={"Retry-After": "1"}
            )
        froms.append(request.query.get("from"))
        sock = web.WebSocketResponse()
        await sock.prepare(request)
        await sock.send_str(json.dumps({"type": "hello", "relay": "t", "from": None}))
        if len(froms) == 1:
            for off in (1, 2, 3):
                await sock.send_str(_frame(off))
            await sock.close(code=4008, message=b"slow_consumer")
        else:
            await sock.send_str(_frame(4))
            await sock.receive()  # until the client closes
        return sock

    app = web.Application()
    app.router.add_get("/v1/sessions/{sid}/ws", ws)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        yield port, froms
    finally:
        await runner.cleanup()


@pytest.mark.timeout(30)
async def test_client_retries_a_503_and_resumes_after_4008(
    relay_like: tuple[int, list[str | None]],
) -> None:
    port, froms = relay_like
    tally = Tally(time.time_ns)
    clients = await open_clients("tokenrelay", port, ["s"], tally, 1)
    try:
        async with asyncio.timeout(10):
            while tally.received < 4:
                await asyncio.sleep(0.01)
    finally:
        await close_clients(clients)
    assert tally.retries == 1
    assert tally.resumes == 1
    assert froms == [None, "3"]  # live first, then from the last offset it had
    assert tally.received == 4
    assert tally.messages == 4
    assert tally.errors == []
