"""Hostile connections against a real relay: WebSocket garbage and oversized frames, an
SSE reader that never reads (slowloris), 10,000 connection attempts in a burst,
unfinished request heads.

The connection burst runs the relay as a subprocess
(:func:`tests.support.relay.relay_process`) so that its file descriptors can be
counted in ``/proc/<pid>/fd``.

What each test checks, with the harness of :mod:`tests.support.hostile`: the status or
close code and the documented reason, a bystander session unharmed, no crash logged.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import resource
import socket
import struct
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import WSMsgType

from relay.broker.rediscluster.publisher import Publisher
from relay.protocol.keys import new_session_id
from tests.support.hostile import bystander, stack, tok
from tests.support.relay import STEP, relay_process, send_expect_close, ws_frames
from tests.support.sse import SSEClient

pytestmark = pytest.mark.integration


# -- 5. WebSocket garbage and oversized frames ------------------------------------------


def _ws_handshake(sid: str, token: str) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (
        f"GET /v1/sessions/{sid}/ws?token={token} HTTP/1.1\r\nHost: x\r\n"
        "Upgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


def _masked(opcode_byte: int, payload: bytes, length_field: bytes | None = None) -> bytes:
    mask = os.urandom(4)
    body = bytes(c ^ mask[i % 4] for i, c in enumerate(payload))
    if length_field is None:
        n = len(payload)
        length_field = (
            bytes([0x80 | n])
            if n < 126
            else bytes([0x80 | 126]) + struct.pack(">H", n)
            if n < 65536
            else bytes([0x80 | 127]) + struct.pack(">Q", n)
        )
    return bytes([opcode_byte]) + length_field + mask + body


async def _raw_ws_close(port: int, sid: str, token: str, payload: bytes) -> tuple[int, bytes]:
    """Handshake by hand, read the hello, send ``payload``; the server's close (code,
    reason). Frames before the close are skipped."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_ws_handshake(sid, token))
        await writer.drain()
        async with asyncio.timeout(STEP):
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 101"), head
            writer.write(payload)
            await writer.drain()
            while True:
                b0, b1 = await reader.readexactly(2)
                n = b1 & 0x7F
                if n == 126:
                    n = struct.unpack(">H", await reader.readexactly(2))[0]
                elif n == 127:
                    n = struct.unpack(">Q", await reader.readexactly(8))[0]
                data = await reader.readexactly(n)
                if b0 & 0x0F == 0x8:
                    return struct.unpack(">H", data[:2])[0], data[2:]
    finally:
        writer.close()


async def test_websocket_garbage_and_oversized_frames_get_close_codes(cluster, redis):
    async with (
        stack(cluster, redis, ws_max_message_bytes=256) as env,
        bystander(env) as b,
    ):
        relay = env.relay
        sid = new_session_id()
        t = tok(sid)
        # through a client library: messages the protocol does not allow
        cases: list[tuple[str | bytes, int, str]] = [
            ("not json", 4400, 'client messages must be {"type":"ping"}'),
            ('{"type":"subscribe","session":"' + b.sid + '"}', 4400, "client messages must be"),
            ('{"type":"ping","pad":"' + "x" * 80 + '"}', 4400, "client messages must be"),
            ("[1,2]", 4400, "client messages must be"),
            (b"\x00\x01\x02", 1003, "binary messages are not supported"),
            ("x" * 1000, 1009, ""),
        ]
        for payload, code, reason in cases:
            async with relay.http.ws_connect(relay.url(sid, "ws"), params={"token": t}) as ws:
                assert (await ws_frames(ws, 1))[0]["type"] == "hello"
                await ws.send_str('{"type":"ping"}')  # ignored
                msg = await send_expect_close(ws, payload)
                assert msg.data == code, (payload, msg)
                assert (msg.extra or "").startswith(reason), msg
        # raw frames no client library would send
        hello = b'{"type":"ping"}'
        raw_cases: list[tuple[bytes, int]] = [
            (bytes([0xF1]) + bytes([0x80 | 5]) + b"abcd" + b"hello", 1002),  # RSV bits set
            (_masked(0x83, b""), 1002),  # reserved opcode 3
            (_masked(0x81, b"", bytes([0x80 | 127]) + struct.pack(">Q", 2**63 - 1)), 1009),
            (_masked(0x81, b"\xff\xfe"), 1007),  # text that is not UTF-8
            (_masked(0x01, b"a" * 200) + _masked(0x80, b"b" * 200), 1009),  # fragments add up
            (_masked(0x89, b"p" * 126, bytes([0x80 | 126]) + struct.pack(">H", 126)), 1002),
            (b"\xff" * 64, 1002),
            (_masked(0x81, hello) + b"\x81\x05hello", 1002),  # unmasked (RFC 6455 5.1)
        ]
        for payload, code in raw_cases:
            got, _reason = await _raw_ws_close(env.relay_port, sid, t, payload)
            assert got == code, (payload[:8], got, _reason)
        async with asyncio.timeout(STEP):
            while len(relay.server.streams) > 1:  # only the bystander's
                await asyncio.sleep(0.02)
        closes = relay.server.metrics.closes
        assert closes.labels("ws", "bad_message")._value.get() >= 4
        assert closes.labels("ws", "binary")._value.get() == 1
        assert closes.labels("ws", "internal")._value.get() == 0


# -- 6. slowloris: an SSE reader that never reads ---------------------------------------


async def test_an_sse_reader_that_never_reads_is_cut_without_stalling_others(cluster, redis):
    limits: dict[str, Any] = {"write_timeout_s": 0.5, "queue_frames": 64, "hard_limit_frames": 256}
    async with stack(cluster, redis, **limits) as env, bystander(env):
        relay = env.relay
        sid = new_session_id()
        t = tok(sid)
        # two good watchers of the SAME session as the slow one
        sse_resp = await relay.http.get(relay.url(sid), params={"token": t})
        assert sse_resp.status == 200
        good_sse = SSEClient(sse_resp)
        good_ws = await relay.http.ws_connect(relay.url(sid, "ws"), params={"token": t})
        await ws_frames(good_ws, 1)
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(slow, ("127.0.0.1", env.relay_port))
        await loop.sock_sendall(
            slow, f"GET /v1/sessions/{sid}/events?token={t} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        )
        got_sse: list[int] = []
        got_ws: list[int] = []

        async def read_sse() -> None:
            while True:
                ev = await good_sse.next_event()
                assert ev is not None
                got_sse.append(int(ev[0]))
                if ev[1] == "done":
                    return

        async def read_ws() -> None:
            while True:
                msg = await good_ws.receive()
                assert msg.type is WSMsgType.TEXT, msg
                f = msg.json()
                if f["kind"] == "presence":  # the screen count, outside the order
                    continue
                got_ws.append(f["offset"])
                if f["kind"] == "done":
                    return

        readers = [asyncio.create_task(read_sse()), asyncio.create_task(read_ws())]
        try:
            async with asyncio.timeout(STEP):
                while len(relay.server.streams) < 4:  # bystander + 2 good + slow
                    await asyncio.sleep(0.01)
            gen = await Publisher(redis).open_generation(sid)
            pad = "x" * 20_000
            m = relay.server.metrics
            started = time.monotonic()
            published = 0
            async with asyncio.timeout(STEP * 2):
                while m.closes.labels("sse", "slow_consumer")._value.get() < 1:
                    await gen.meta({"pad": pad})
                    published += 1
                    if published % 16 == 0:
                        await asyncio.sleep(0)  # let the readers run
            cut_after = time.monotonic() - started
            last = await gen.done()
            async with asyncio.timeout(STEP):
                await asyncio.gather(*readers)
            assert got_sse == got_ws == list(range(1, last + 1))
            assert len(relay.server.streams) == 3  # the slow one is gone
            assert cut_after < STEP
        finally:
            for r in readers:
                r.cancel()
            slow.close()
            sse_resp.close()
            await good_ws.close()


# -- 7. 10,000 connection attempts in a burst -------------------------------------------


def _fds(pid: int) -> tuple[int, int]:
    """(all open fds, sockets accepted on ``port``-less listeners i.e. client connections)
    of process ``pid``: the second counts TCP sockets whose local port is a listening
    port of the process (HTTP clients), the rest are Redis connections, files, pipes."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    names = os.listdir(fd_dir)
    for name in names:
        with contextlib.suppress(OSError):
            link = os.readlink(f"{fd_dir}/{name}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    rows = []
    with open(f"/proc/{pid}/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            rows.append((int(parts[1].split(":")[1], 16), parts[3], parts[9]))
    listening = {port for port, state, ino in rows if state == "0A" and ino in inodes}
    clients = sum(1 for port, state, ino in rows if port in listening and state != "0A"
                  and ino in inodes)  # fmt: skip
    return len(names), clients


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_ten_thousand_connection_attempts_in_a_burst(cluster, redis, tmp_path):
    attempts, window, max_conn = 10_000, 1_000, 200
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = window * 2 + 512
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(need, soft), hard), hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < need:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {need}")
    sid = new_session_id()
    t = tok(sid)
    # one token, one address for every attempt: this measures the relay's capacity, so
    # the per-token and per-address limits (tests/hostile/test_hostile_access.py) are lifted
    flags = ("--max-connections", str(max_conn), "--heartbeat-s", "1",
             "--max-streams-per-address", "0", "--max-streams-per-token", "0",
             "--max-connections-per-address", "0")  # fmt: skip
    async with (
        relay_process(cluster, tmp_path, "edge-burst", *flags) as relay,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
    ):
        proc, base, port = relay.proc, relay.base, relay.port
        # warm up: one stream, so the relay's Redis connections exist before counting
        async with http.get(base + f"/v1/sessions/{sid}/events", params={"token": t}) as r:
            assert r.status == 200
            await r.content.readline()
        await asyncio.sleep(1.5)
        before = _fds(proc.pid)

        outcomes: dict[str, int] = {}
        sem = asyncio.Semaphore(window)
        requests = [
            b"",  # connect and hang up
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
            f"GET /v1/sessions/{sid}/events?token={t} HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
            b"GET /v1/sessions/%7Bx%7D/events HTTP/1.1\r\nHost: x\r\n\r\n",
            b"GET /v1/sessio",  # half a request line, then hang up
        ]

        async def attempt(i: int) -> None:
            req = requests[i % len(requests)]
            async with sem:
                key = "?"
                writer = None
                try:
                    async with asyncio.timeout(10):
                        reader, writer = await asyncio.open_connection("127.0.0.1", port)
                        if not req or not req.endswith(b"\r\n\r\n"):
                            writer.write(req)
                            key = "hung_up"
                        else:
                            writer.write(req)
                            line = await reader.readline()
                            key = line.split(b" ")[1].decode() if line else "eof"
                except TimeoutError:
                    key = "timeout"
                except OSError as exc:
                    key = type(exc).__name__
                finally:
                    if writer is not None:
                        writer.close()
                outcomes[key] = outcomes.get(key, 0) + 1

        started = time.monotonic()
        async with asyncio.timeout(180):
            await asyncio.gather(*(attempt(i) for i in range(attempts)))
        took = time.monotonic() - started
        assert sum(outcomes.values()) == attempts
        assert proc.returncode is None, "the relay died"
        served = outcomes.get("200", 0) + outcomes.get("503", 0) + outcomes.get("400", 0)
        print(f"burst: {attempts} attempts in {took:.1f}s: {outcomes}")
        assert outcomes.get("500", 0) == 0, relay.proc.tail(40)
        assert served >= attempts * 3 // 5 * 0.9, outcomes  # 3 of 5 kinds get an answer
        # every stream ends (heartbeat 1 s finds the closed sockets) and every fd goes
        live: list[str] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            async with http.get(base + "/metrics") as r:
                text = await r.text()
            live = [
                ln for ln in text.splitlines()
                if ln.startswith("tokenrelay_relay_connections{")
            ]  # fmt: skip
            if all(ln.endswith(" 0.0") for ln in live) and _fds(proc.pid)[1] <= 1:
                break
            await asyncio.sleep(0.5)
        assert all(ln.endswith(" 0.0") for ln in live), live
        after = _fds(proc.pid)
        print(f"relay fds before {before}, after {after} (all, client sockets)")
        # no client socket is left (1: this test's keep-alive connection); the other
        # fds may grow by the Redis connections opened for concurrent watches, which
        # redis-py keeps pooled: at most one per admitted stream (max_connections)
        assert after[1] <= 1, (before, after)
        assert after[0] - after[1] <= before[0] - before[1] + max_conn, (before, after)
        # and a normal client works right after
        async with http.get(base + "/healthz") as r:
            assert r.status == 200
        async with http.get(
            base + f"/v1/sessions/{sid}/events", params={"token": t, "last_event_id": "0"}
        ) as r:
            assert r.status == 200
            client = SSEClient(r)
            gen = await Publisher(redis).open_generation(sid)
            off = await gen.token("after the burst")
            ev = await asyncio.wait_for(client.next_event(), STEP)
            assert ev is not None
            assert int(ev[0]) == off


@pytest.mark.timeout(120)
async def test_unfinished_request_heads_get_408_and_free_their_sockets(cluster, tmp_path):
    """Slowloris on the head: 500 connections each send part of a request head and
    stall. Each gets 408 with the reason at the head deadline and is closed (the relay's
    client sockets go back to 0); a normal request is served meanwhile; the relay counts
    them as rejected{reason="head_timeout"}."""
    n, deadline_s = 500, 1.0
    flags = ("--head-timeout-s", str(deadline_s))
    async with (
        relay_process(cluster, tmp_path, "edge-heads", *flags) as relay,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
    ):
        partial = [b"", b"GET /v1/sessio", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"]
        conns = []
        for i in range(n):
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            writer.write(partial[i % len(partial)])
            conns.append((reader, writer))
        started = time.monotonic()
        async with http.get(relay.base + "/healthz") as r:  # served while they stall
            assert r.status == 200
        async with asyncio.timeout(30):
            answers = await asyncio.gather(*(r.read() for r, _ in conns))
        took = time.monotonic() - started
        for _, w in conns:
            w.close()
        assert all(a.startswith(b"HTTP/1.1 408 Request Timeout\r\n") for a in answers)
        assert all(a.endswith(b"request head not received in time\n") for a in answers)
        assert took < deadline_s + 15
        async with asyncio.timeout(10):
            while _fds(relay.proc.pid)[1] > 1:  # 1: this test's keep-alive connection
                await asyncio.sleep(0.1)
        async with http.get(relay.base + "/metrics") as r:
            text = await r.text()
        line = next(ln for ln in text.splitlines() if 'reason="head_timeout"' in ln)
        assert float(line.rsplit(" ", 1)[1]) == n
