"""The request-head deadline (slowloris): a real aiohttp app on loopback, no Redis."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from relay.edge.http.app import make_runner
from relay.service.httpguard import GuardedSite

HEAD_TIMEOUT = 0.5


async def _stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    await resp.prepare(request)
    for _ in range(4):  # lasts 4 x HEAD_TIMEOUT / 2 = longer than the head deadline
        await resp.write(b"data: x\n\n")
        await asyncio.sleep(HEAD_TIMEOUT / 2)
    return resp


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.fixture
async def site() -> AsyncIterator[tuple[int, list[int]]]:
    async with _serving() as served:
        yield served


@contextlib.asynccontextmanager
async def _serving() -> AsyncIterator[tuple[int, list[int]]]:
    app = web.Application()
    app.router.add_get("/", _ok)
    app.router.add_get("/stream", _stream)
    runner = make_runner(app)
    await runner.setup()
    timeouts: list[int] = []
    guarded = GuardedSite(
        runner, "127.0.0.1", 0, head_timeout_s=HEAD_TIMEOUT, on_timeout=lambda: timeouts.append(1)
    )
    await guarded.start()
    try:
        yield guarded.port, timeouts
    finally:
        await runner.cleanup()


async def _exchange(port: int, chunks: list[bytes], pause_s: float = 0.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for chunk in chunks:
            writer.write(chunk)
            await asyncio.sleep(pause_s)
        async with asyncio.timeout(10):
            return await reader.read()  # until the server closes
    finally:
        writer.close()


async def test_an_unfinished_head_gets_408_with_a_reason_and_is_closed(site) -> None:
    port, timeouts = site
    started = time.monotonic()
    got = await _exchange(port, [b"GET / HTTP/1.1\r\nHost: x\r\n"])  # no blank line, ever
    took = time.monotonic() - started
    assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert got.endswith(b"\r\n\r\nrequest head not received in time\n")
    assert HEAD_TIMEOUT * 0.8 <= took < HEAD_TIMEOUT + 5
    assert timeouts == [1]


async def test_a_silent_connection_gets_408_too(site) -> None:
    port, timeouts = site
    assert (await _exchange(port, [])).startswith(b"HTTP/1.1 408 ")
    assert timeouts == [1]


async def test_a_head_split_anywhere_within_the_deadline_is_served(site) -> None:
    port, timeouts = site
    head = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    for cut in (len(head) - 1, len(head) - 2, len(head) - 3, 5):
        got = await _exchange(port, [head[:cut], head[cut:]], pause_s=0.01)
        assert got.startswith(b"HTTP/1.1 200 OK\r\n"), (cut, got[:80])
    one_byte_at_a_time = [head[i : i + 1] for i in range(len(head))]
    got = await _exchange(port, one_byte_at_a_time, pause_s=HEAD_TIMEOUT / len(head) / 4)
    assert got.startswith(b"HTTP/1.1 200 OK\r\n")
    assert timeouts == []


async def test_a_bare_lf_head_counts_as_finished(site) -> None:
    port, timeouts = site
    got = await _exchange(port, [b"GET / HTTP/1.1\nHost: x\nConnection: close\n\n"])
    assert not got.startswith(b"HTTP/1.1 408")
    assert timeouts == []


async def test_a_stream_longer_than_the_deadline_is_not_cut(site) -> None:
    port, timeouts = site
    got = await _exchange(port, [b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"])
    assert got.startswith(b"HTTP/1.1 200 OK\r\n")
    assert got.count(b"data: x") == 4
    assert timeouts == []


def test_a_deadline_must_be_positive() -> None:
    with pytest.raises(ValueError, match="head_timeout_s"):
        GuardedSite(object(), "127.0.0.1", 0, head_timeout_s=0)  # type: ignore[arg-type]


def test_on_uvloop_too() -> None:
    """The processes run on uvloop (runtime.run), whose transports are not
    asyncio.Transport subclasses: the same deadline and pass-through there."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        async with _serving() as (port, timeouts):
            assert (await _exchange(port, [b"GET / HTT"])).startswith(b"HTTP/1.1 408 ")
            head = b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            assert (await _exchange(port, [head])).count(b"data: x") == 4
            assert timeouts == [1]

    uvloop.run(scenario())
