"""Clients that outstay their welcome, against a real relay and a real worker: an idle
keep-alive connection after one request, a second request head trickled a byte at a
time, a body that trickles, many idle connections from one address (the relay's file
descriptors), clients that hang up mid-body; and the protocol edges beside them: HEAD
on a streaming route, a WebSocket handshake of another version.

Each runs with the harness of :mod:`tests.support.hostile` (a bystander session keeps
streaming; nothing is logged as a crash) and with short deadlines, so that it takes
seconds; raw sockets, since no client library sends these.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from relay.broker.rediscluster.publisher import Publisher
from relay.protocol.keys import new_session_id
from tests.hostile.test_hostile_connections import _fds
from tests.support.hostile import Env, bystander, stack, tok
from tests.support.relay import STEP, relay_process
from tests.support.sse import SSEClient

pytestmark = pytest.mark.integration

SHORT = 1.0  # every deadline of these tests, seconds
FLAGS: dict[str, Any] = {"head_timeout_s": SHORT, "body_timeout_s": SHORT,
                         "keepalive_timeout_s": SHORT}  # fmt: skip


def _port(env: Env, target: str) -> int:
    return env.relay_port if target == "relay" else env.worker_port


def _guard_count(env: Env, target: str, reason: str) -> float:
    m = env.relay.server.metrics if target == "relay" else env.worker.state.metrics
    return float(m.http_guard.labels(reason)._value.get())


async def _collect(reader: asyncio.StreamReader) -> bytes:
    """What the server sends until it closes (a reset after that ends it too)."""
    got = []
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            got.append(chunk)
    return b"".join(got)


async def _trickle(port: int, first: bytes, then: bytes, every_s: float) -> tuple[bytes, float]:
    """Send ``first`` whole, then ``then`` a byte every ``every_s`` until the server
    closes; (what it sent after the answer to ``first``, if it answers at once, else
    everything it sent; seconds from the first trickled byte to its close)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(first)
        if first.startswith(b"GET /healthz"):  # its answer first: the next head is timed
            async with asyncio.timeout(STEP):
                answer = await reader.readuntil(b"}")
            assert answer.startswith(b"HTTP/1.1 200 OK"), answer
        started = time.monotonic()
        got = asyncio.create_task(_collect(reader))
        for i in range(len(then)):
            if got.done():
                break
            with contextlib.suppress(ConnectionError):
                writer.write(then[i : i + 1])
            await asyncio.sleep(every_s)
        async with asyncio.timeout(STEP):
            return await got, time.monotonic() - started
    finally:
        writer.close()


@pytest.mark.parametrize("target", ["relay", "worker"])
async def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(cluster, redis, target):
    async with stack(cluster, redis, worker=FLAGS, **FLAGS) as env, bystander(env):
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(env, target))
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            async with asyncio.timeout(STEP):
                head = await reader.readuntil(b"}")
                answered = time.monotonic()
                rest = await reader.read()  # then nothing: the server closes it
            idle = time.monotonic() - answered
        finally:
            writer.close()
        assert head.startswith(b"HTTP/1.1 200 OK"), head
        assert rest == b""
        assert SHORT * 0.8 <= idle < SHORT + 3, idle
        assert _guard_count(env, target, "idle_timeout") >= 1


@pytest.mark.parametrize("target", ["relay", "worker"])
async def test_a_second_head_trickled_a_byte_at_a_time_gets_408(cluster, redis, target):
    async with stack(cluster, redis, worker=FLAGS, **FLAGS) as env, bystander(env):
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        got, took = await _trickle(_port(env, target), head, head, every_s=SHORT / 4)
        assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), got
        assert got.endswith(b"request head not received in time\n")
        assert took < SHORT + 3
        assert _guard_count(env, target, "head_timeout") == 1


async def test_a_worker_post_whose_body_trickles_gets_408(cluster, redis):
    async with stack(cluster, redis, worker=FLAGS, **FLAGS) as env, bystander(env):
        sid, token = await env.worker.session()
        head = (
            f"POST /v1/sessions/{sid}/turns HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            "Content-Length: 60000\r\n\r\n"
        ).encode()
        got, took = await _trickle(env.worker_port, head, b'{"message": "' + b"a" * 100, SHORT / 4)
        assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), got
        assert got.endswith(b"request body not received in time\n")
        assert took < SHORT + 3
        assert _guard_count(env, "worker", "body_timeout") == 1
        assert _guard_count(env, "worker", "body_cut") == 0  # the guard cut it, not the client
        # and on the relay, whose routes read no body: answered, then cut at the deadline
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 60000\r\n\r\n"
        got, took = await _trickle(env.relay_port, head, b"a" * 100, SHORT / 4)
        assert got == b""  # its 200 came at once (read by _trickle); then only the close
        assert took < SHORT + 3
        assert _guard_count(env, "relay", "body_timeout") == 1


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.INFO and record.name.startswith(
            ("relay", "worker", "aiohttp")
        ):
            self.records.append(record)


@contextlib.contextmanager
def _records() -> Iterator[_Records]:
    h = _Records()
    logging.getLogger().addHandler(h)
    try:
        yield h
    finally:
        logging.getLogger().removeHandler(h)


async def test_clients_that_hang_up_mid_body_are_counted_not_logged(cluster, redis):
    """20 authenticated POSTs on each body-reading route of the worker, each cut off
    after 10 bytes of a declared 1000: not one log line (aiohttp logged an ERROR with a
    traceback for each), and each counted once as body_cut."""
    async with stack(cluster, redis) as env, bystander(env):
        sid, token = await env.worker.session()
        routes = [f"/v1/sessions/{sid}/turns", f"/v1/sessions/{sid}/tokens", "/v1/chat",
                  "/v1/chat/completions"]  # fmt: skip
        n = 20
        with _records() as logged:
            for i in range(n):
                path = routes[i % len(routes)]
                _reader, writer = await asyncio.open_connection("127.0.0.1", env.worker_port)
                writer.write(
                    f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                    "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                    '{"message"'.encode()
                )
                await writer.drain()
                await asyncio.sleep(0.05)  # the handler is reading the body
                writer.close()
            async with asyncio.timeout(STEP):
                while _guard_count(env, "worker", "body_cut") < n:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)  # what the handlers would log, they have by now
        assert _guard_count(env, "worker", "body_cut") == n
        assert [(r.name, r.levelname, r.getMessage()) for r in logged.records] == []


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
async def test_idle_connections_from_one_address_cannot_take_the_relays_descriptors(
    cluster, redis, tmp_path
):
    """A relay with 256 file descriptors; one address opens 400 connections, each sends
    GET /healthz and stays idle. Before the guard they took every descriptor, and the
    next client (a viewer from another address) was refused. Now: 64 are held (the
    cap), the others get 429, the held ones are closed after the keep-alive timeout,
    and a viewer from 127.0.0.2 streams meanwhile."""
    attackers, cap, idle_s = 400, 64, 2.0
    flags = ("--max-connections-per-address", str(cap), "--keepalive-timeout-s", str(idle_s))
    sid = new_session_id()
    async with (
        relay_process(cluster, tmp_path, "edge-fds", *flags, wrap=("prlimit", "--nofile=256"))
        as relay,
        aiohttp.ClientSession() as http,
    ):  # fmt: skip
        conns = []
        for _ in range(attackers):
            with contextlib.suppress(OSError):
                reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                conns.append((reader, writer))
        opened = time.monotonic()
        answers = [b""] * len(conns)

        async def read(i: int, r: asyncio.StreamReader) -> None:
            with contextlib.suppress(ConnectionError):
                answers[i] = await r.readuntil(b"}")

        async with asyncio.timeout(STEP):
            await asyncio.gather(*(read(i, r) for i, (r, _) in enumerate(conns)))
        # client sockets held: the cap, no more, once the refused ones are closed (their
        # 429s are read above; on a loaded machine the closes land a moment later)
        settle = time.monotonic() + 5
        while _fds(relay.proc.pid)[1] > cap and time.monotonic() < settle:
            await asyncio.sleep(0.05)
        assert _fds(relay.proc.pid)[1] <= cap
        # a viewer from another address streams while they are held
        connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
        async with (
            aiohttp.ClientSession(connector=connector) as other,
            other.get(relay.base + f"/v1/sessions/{sid}/events", params={"token": tok(sid)}) as r,
        ):
            assert r.status == 200, await r.text()
            client = SSEClient(r)
            await r.content.readline()
            off = await (await Publisher(redis).open_generation(sid)).token("hi")
            async with asyncio.timeout(STEP):
                while (ev := await client.next_event()) is not None and ev[1] != "token":
                    pass
            assert ev is not None
            assert int(ev[0]) == off
        statuses = [a.split(b" ", 2)[1] if a else b"reset" for a in answers]
        assert statuses.count(b"200") == cap, {s: statuses.count(s) for s in set(statuses)}
        assert statuses.count(b"429") + statuses.count(b"reset") == len(conns) - cap
        # the held ones are closed once idle past the timeout
        async with asyncio.timeout(idle_s + STEP):
            for held, _ in conns:
                with contextlib.suppress(ConnectionError):
                    await held.read()
        closed_after = time.monotonic() - opened
        for _, w in conns:
            w.close()
        assert closed_after < idle_s + 5
        async with http.get(relay.base + "/metrics") as resp:
            text = await resp.text()
        prefix = "tokenrelay_relay_http_guard_total{"
        counts = {ln.split('reason="')[1].split('"')[0]: float(ln.rsplit(" ", 1)[1])
                  for ln in text.splitlines() if ln.startswith(prefix)}  # fmt: skip
        assert counts["idle_timeout"] >= cap
        assert counts["too_many_connections"] == len(conns) - cap


# -- HEAD on a streaming route; another WebSocket version -------------------------------


async def _raw(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        async with asyncio.timeout(STEP):
            return await _collect(reader)
    finally:
        writer.close()


async def test_head_on_a_streaming_route_has_no_body(cluster, redis):
    async with stack(cluster, redis) as env, bystander(env) as b:
        t = tok(b.sid)
        for path in (f"/v1/sessions/{b.sid}/events", f"/v1/sessions/{b.sid}/ws",
                     f"/v1/sessions/{b.sid}/ui-stream", f"/v1/chat/{b.sid}/stream"):  # fmt: skip
            got = await _raw(env.relay_port, f"HEAD {path}?token={t} HTTP/1.1\r\nHost: x\r\n"
                             "Connection: close\r\n\r\n".encode())  # fmt: skip
            head, _, body = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 405 "), (path, got)
            assert b"\r\nAllow: GET,OPTIONS" in head, head
            assert body == b"", (path, body)
        got = await _raw(
            env.relay_port, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert got.startswith(b"HTTP/1.1 200 OK")
        assert got.endswith(b"\r\n\r\n")
        for path in (f"/v1/sessions/{b.sid}/turns", "/v1/chat", "/v1/chat/completions"):
            got = await _raw(env.worker_port, f"HEAD {path} HTTP/1.1\r\nHost: x\r\nAccept: "
                             "text/event-stream\r\nConnection: close\r\n\r\n".encode())  # fmt: skip
            assert got.startswith(b"HTTP/1.1 405 "), (path, got)
            assert got.endswith(b"\r\n\r\n"), (path, got)  # headers only


@pytest.mark.parametrize("version", ["8", "7", "14", "13, 8", "abc"])
async def test_a_websocket_version_other_than_13_gets_426(cluster, redis, version):
    async with stack(cluster, redis) as env:
        sid = new_session_id()
        key = base64.b64encode(os.urandom(16)).decode()
        got = await _raw(env.relay_port, (
            f"GET /v1/sessions/{sid}/ws?token={tok(sid)} HTTP/1.1\r\nHost: x\r\n"
            "Upgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: {version}\r\n"
            "Connection: close\r\n\r\n"
        ).encode())  # fmt: skip
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 426 Upgrade Required"), got
        assert b"\r\nSec-WebSocket-Version: 13" in head, head
        assert b'"error":"unsupported_ws_version"' in body
        assert len(env.relay.server.streams) == 0
