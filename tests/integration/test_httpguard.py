"""The HTTP guard: deadlines on heads, bodies and idle keep-alive connections, and the
per-address cap. A real aiohttp app on loopback with raw sockets, no Redis."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from relay.edge.http.app import make_runner
from relay.service.httpguard import (
    GUARD,
    ConnLimits,
    GuardedSite,
    address_key,
    detach_guard,
    guard_app,
)

HEAD_S, BODY_S, IDLE_S = 0.5, 0.6, 0.7
GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


@dataclass
class Served:
    port: int
    counted: list[str] = field(default_factory=list)
    read_errors: list[BaseException] = field(default_factory=list)


async def _stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    await resp.prepare(request)
    for _ in range(4):  # lasts 4 x HEAD_S / 2: longer than every deadline but the idle one
        await resp.write(b"data: x\n\n")
        await asyncio.sleep(HEAD_S / 2)
    return resp


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _slow(request: web.Request) -> web.Response:
    await asyncio.sleep(max(HEAD_S, BODY_S, IDLE_S) * 1.5)  # a long answer: never timed
    return web.Response(text="slow")


@contextlib.asynccontextmanager
async def _serving(**limits: float | int) -> AsyncIterator[Served]:
    app = web.Application()
    served = Served(0)

    async def echo(request: web.Request) -> web.Response:
        try:
            body = await request.read()
        except Exception as exc:
            served.read_errors.append(exc)
            raise
        return web.Response(body=body)

    app.router.add_get("/", _ok)
    app.router.add_get("/slow", _slow)
    app.router.add_get("/stream", _stream)
    app.router.add_post("/echo", echo)
    kw = {"head_timeout_s": HEAD_S, "body_timeout_s": BODY_S, "keepalive_timeout_s": IDLE_S}
    guard_app(app, ConnLimits(**{**kw, **limits}), served.counted.append)  # type: ignore[arg-type]
    runner = web.AppRunner(app, access_log=None)  # as the worker's: handlers not cancelled
    await runner.setup()
    site = GuardedSite(runner, "127.0.0.1", 0, guard=app[GUARD])
    await site.start()
    served.port = site.port
    try:
        yield served
    finally:
        await runner.cleanup()


@pytest.fixture
async def site() -> AsyncIterator[Served]:
    async with _serving() as served:
        yield served


async def _exchange(port: int, chunks: list[bytes], pause_s: float = 0.0) -> tuple[bytes, float]:
    """Send the chunks (``pause_s`` apart), read until the server closes: (what came
    back, seconds from the last chunk sent to the close)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for chunk in chunks:
            writer.write(chunk)
            await asyncio.sleep(pause_s)
        sent = time.monotonic()
        async with asyncio.timeout(10):
            return await reader.read(), time.monotonic() - sent
    finally:
        writer.close()


# -- the head --------------------------------------------------------------------------


async def test_an_unfinished_head_gets_408_with_a_reason_and_is_closed(site: Served) -> None:
    started = time.monotonic()
    got, _ = await _exchange(site.port, [b"GET / HTTP/1.1\r\nHost: x\r\n"])  # no blank line
    took = time.monotonic() - started
    assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert got.endswith(b"\r\n\r\nrequest head not received in time\n")
    assert HEAD_S * 0.8 <= took < HEAD_S + 5
    assert site.counted == ["head_timeout"]


async def test_a_silent_connection_gets_408_too(site: Served) -> None:
    assert (await _exchange(site.port, []))[0].startswith(b"HTTP/1.1 408 ")
    assert site.counted == ["head_timeout"]


async def test_a_head_split_anywhere_within_the_deadline_is_served(site: Served) -> None:
    head = b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    for cut in (len(head) - 1, len(head) - 2, len(head) - 3, 5):
        got, _ = await _exchange(site.port, [head[:cut], head[cut:]], pause_s=0.01)
        assert got.startswith(b"HTTP/1.1 200 OK\r\n"), (cut, got[:80])
    one_byte_at_a_time = [head[i : i + 1] for i in range(len(head))]
    got, _ = await _exchange(site.port, one_byte_at_a_time, pause_s=HEAD_S / len(head) / 4)
    assert got.startswith(b"HTTP/1.1 200 OK\r\n")
    assert site.counted == []


async def test_a_bare_lf_head_counts_as_finished(site: Served) -> None:
    got, _ = await _exchange(site.port, [b"GET / HTTP/1.1\nHost: x\nConnection: close\n\n"])
    assert not got.startswith(b"HTTP/1.1 408")
    assert site.counted == []


async def _collect(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes (a reset after that ends it too)."""
    got = []
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            got.append(chunk)
    return b"".join(got)


async def test_a_second_head_trickled_a_byte_at_a_time_gets_408(site: Served) -> None:
    """After one request, the next head has its own deadline from its first byte: 1
    byte per HEAD_S / 4 never finishes it in time."""
    head = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
    try:
        writer.write(head)
        async with asyncio.timeout(5):
            first = await reader.readuntil(b"ok")
        assert first.startswith(b"HTTP/1.1 200 OK")
        started = time.monotonic()
        rest = asyncio.create_task(_collect(reader))
        for i in range(len(head) - 1):
            if rest.done():
                break
            with contextlib.suppress(ConnectionError):
                writer.write(head[i : i + 1])
            await asyncio.sleep(HEAD_S / 4)
        async with asyncio.timeout(5):
            got = await rest
        took = time.monotonic() - started
    finally:
        writer.close()
    assert got.startswith(b"HTTP/1.1 408 "), got
    assert took < HEAD_S + 1.5
    assert site.counted == ["head_timeout"]


# -- the body --------------------------------------------------------------------------


async def test_a_body_that_trickles_gets_408_and_its_handler_logs_nothing(site: Served) -> None:
    head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 60000\r\n\r\n"
    started = time.monotonic()
    got, _ = await _exchange(site.port, [head, *([b"a"] * 3)], pause_s=BODY_S / 4)
    took = time.monotonic() - started
    assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), got
    assert got.endswith(b"request body not received in time\n")
    assert BODY_S * 0.8 <= took < BODY_S + 2
    assert site.counted == ["body_timeout"]  # not also body_cut: the guard closed it
    await asyncio.sleep(0.05)
    assert [type(e) for e in site.read_errors] == [ConnectionResetError]


async def test_a_chunked_body_in_time_is_served_and_one_that_stops_is_cut(site: Served) -> None:
    head = (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    chunks = [head, b"5\r\nhello\r\n", b"3\r\n", b"abc\r\n", b"0\r\n\r\n"]
    got, _ = await _exchange(site.port, chunks, pause_s=BODY_S / 10)
    assert got.startswith(b"HTTP/1.1 200 OK\r\n")
    assert got.endswith(b"helloabc")
    got, _ = await _exchange(site.port, chunks[:3], pause_s=0.01)
    assert got.startswith(b"HTTP/1.1 408 ")
    assert site.counted == ["body_timeout"]


async def test_a_client_that_leaves_mid_body_is_counted_once(site: Served) -> None:
    _reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.close()
    async with asyncio.timeout(5):
        while not site.read_errors:
            await asyncio.sleep(0.01)
    assert site.counted == ["body_cut"]
    assert isinstance(site.read_errors[0], ConnectionResetError)


# -- idle keep-alive connections ---------------------------------------------------------


async def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(site: Served) -> None:
    got, idle = await _exchange(site.port, [GET])
    assert got.startswith(b"HTTP/1.1 200 OK\r\n")
    assert got.endswith(b"ok")
    assert IDLE_S * 0.8 <= idle < IDLE_S + 2
    assert site.counted == ["idle_timeout"]


async def test_requests_within_the_idle_timeout_keep_the_connection(site: Served) -> None:
    head = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    got, _ = await _exchange(site.port, [head, head, head], pause_s=IDLE_S / 2)
    assert got.count(b"HTTP/1.1 200 OK") == 3
    assert site.counted == ["idle_timeout"]  # after the third


async def test_nothing_is_timed_while_a_request_is_answered(site: Served) -> None:
    got, _ = await _exchange(
        site.port,
        [b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"],
    )  # pipelined: the second is answered after the first, each longer than a deadline
    assert got.count(b"data: x") == 4
    assert got.endswith(b"slow")
    assert site.counted == ["idle_timeout"]  # after the second


# -- per address -----------------------------------------------------------------------


async def test_connections_past_the_cap_of_one_address_get_429() -> None:
    async with _serving(max_per_address=3) as served:
        held = [await asyncio.open_connection("127.0.0.1", served.port) for _ in range(3)]
        got, _ = await _exchange(served.port, [])
        assert got.startswith(b"HTTP/1.1 429 Too Many Requests\r\n"), got
        assert b"Retry-After: 1\r\n" in got
        assert got.endswith(b'"error":"too_many_connections","reason":"too many connections '
                            b'from this address"}')  # fmt: skip
        # another address (127.0.0.2 is loopback too) is served meanwhile
        other = socket.create_connection(
            ("127.0.0.1", served.port), source_address=("127.0.0.2", 0)
        )
        reader, writer = await asyncio.open_connection(sock=other)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        async with asyncio.timeout(5):
            assert (await reader.read()).startswith(b"HTTP/1.1 200 OK")
        writer.close()
        # a freed slot is taken again
        _, w0 = held.pop()
        w0.close()
        await asyncio.sleep(0.05)
        got, _ = await _exchange(
            served.port, [b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"]
        )
        assert got.startswith(b"HTTP/1.1 200 OK")
        for _, w in held:
            w.close()
        assert served.counted == ["too_many_connections"]


async def test_a_detached_connection_leaves_the_guard() -> None:
    """A handler that hands its socket to another protocol (the relay's streams): the
    guard no longer times it nor counts it against its address."""
    app = web.Application()
    kept: list[asyncio.Transport] = []

    class Sink(asyncio.Protocol):
        pass

    async def take(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"taken\n")
        transport = request.transport
        assert transport is not None
        detach_guard(transport)
        transport.set_protocol(Sink())
        request.protocol.transport = None
        request.protocol.connection_lost(None)
        kept.append(transport)
        return resp

    app.router.add_get("/take", take)
    counted: list[str] = []
    limits = ConnLimits(head_timeout_s=HEAD_S, keepalive_timeout_s=IDLE_S, max_per_address=1)
    guard = guard_app(app, limits, counted.append)
    runner = make_runner(app)
    await runner.setup()
    site = GuardedSite(runner, "127.0.0.1", 0, guard=guard)
    await site.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
        writer.write(b"GET /take HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(5):
            await reader.readuntil(b"taken\n")
        assert guard.connections("127.0.0.1") == 0
        await asyncio.sleep(IDLE_S * 1.5)
        assert not kept[0].is_closing()  # not timed
        got, _ = await _exchange(
            site.port, [b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"]
        )
        assert got.startswith(b"HTTP/1.1 404")  # the cap of 1 is free
        assert counted == []
        kept[0].close()
        writer.close()
    finally:
        await runner.cleanup()


def test_address_keys() -> None:
    nets = (__import__("ipaddress").ip_network("10.0.0.0/8"),)
    assert address_key(("127.0.0.1", 5)) == "127.0.0.1"
    assert address_key(("::ffff:203.0.113.6", 5, 0, 0)) == "203.0.113.6"
    assert address_key(("fe80::1%eth0", 5, 0, 2)) == "fe80::1"
    assert address_key(("10.1.2.3", 5), nets) is None  # a trusted proxy: not counted
    assert address_key(None) is None
    assert address_key(("garbage", 1)) is None


def test_limits_must_be_positive() -> None:
    for name in ("head_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
        with pytest.raises(ValueError, match=name):
            ConnLimits(**{name: 0})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_per_address"):
        ConnLimits(max_per_address=-1)


async def test_a_site_needs_its_guard_installed() -> None:
    app = web.Application()
    app.router.add_get("/", _ok)
    from relay.service.httpguard import ConnGuard

    runner = make_runner(app)
    await runner.setup()
    try:
        with pytest.raises(RuntimeError, match="install"):
            await GuardedSite(runner, "127.0.0.1", 0, guard=ConnGuard(ConnLimits())).start()
    finally:
        await runner.cleanup()


def test_on_uvloop_too() -> None:
    """The processes run on uvloop (runtime.run), whose transports are not
    asyncio.Transport subclasses: the same deadlines and pass-through there."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        async with _serving() as served:
            assert (await _exchange(served.port, [b"GET / HTT"]))[0].startswith(b"HTTP/1.1 408 ")
            head = b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            assert (await _exchange(served.port, [head]))[0].count(b"data: x") == 4
            got, _ = await _exchange(served.port, [GET])
            assert got.endswith(b"ok")
            assert served.counted == ["head_timeout", "idle_timeout"]

    uvloop.run(scenario())
