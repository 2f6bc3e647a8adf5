"""Catch-up readers of a Durable Stream that never read, against a relay on the suite's
cluster: each holds at most its share of the relay-wide read budget while it lasts, is
cut at ``--write-timeout-s`` with what it held freed, counts against
``--max-streams-per-address``, and another client's read is served meanwhile. Before,
each held its whole response in the relay for as long as it liked (100 of them took a
relay from 74 to 1,235 MiB; ``python -m bench.hostile.slow_readers`` measures the RSS).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import Iterator

import pytest

from devstack.cluster.launcher import ClusterInfo
from tests.support.relay import running

pytestmark = pytest.mark.integration

MIB = 1 << 20
MESSAGE = 4 * MIB  # the default --durable-max-body-bytes


def _slow_reader(port: int, path: str, address: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    s.connect(("127.0.0.1", port))
    s.sendall(
        f"GET /v1/stream/{path}?offset=-1 HTTP/1.1\r\nHost: relay\r\n"
        f"X-Forwarded-For: {address}\r\n\r\n".encode()
    )
    return s


def _drain(s: socket.socket, within_s: float) -> tuple[int, bool, bytes]:
    """Read what the relay sent: (bytes, whether the connection ended, its first line)."""
    s.settimeout(within_s)
    got, head = 0, b""
    try:
        while chunk := s.recv(1 << 20):
            head = head or chunk.split(b"\r\n", 1)[0]
            got += len(chunk)
    except TimeoutError:
        return got, False, head
    except ConnectionResetError:
        return got, True, head
    return got, True, head


@contextlib.contextmanager
def _closing(socks: list[socket.socket]) -> Iterator[list[socket.socket]]:
    try:
        yield socks
    finally:
        for s in socks:
            s.close()


async def test_catch_up_readers_that_never_read_are_bounded_and_cut(cluster: ClusterInfo) -> None:
    kw = {"durable_open_prefix": "/slow/", "trusted_proxies": "127.0.0.1",
          "write_timeout_s": 2.0, "max_streams_per_address": 12}  # fmt: skip
    async with running(cluster, **kw) as relay:
        path = f"slow/{uuid.uuid4().hex}"
        url = f"{relay.base}/v1/stream/{path}"
        octets = {"Content-Type": "application/octet-stream"}
        async with relay.http.put(url, data=os.urandom(MESSAGE), headers=octets) as r:
            assert r.status == 201, await r.text()
        hub = relay.server.hub
        assert hub is not None
        budget = hub.budget
        port = int(relay.base.rsplit(":", 1)[1])
        loop = asyncio.get_running_loop()
        socks = [
            await loop.run_in_executor(None, _slow_reader, port, path, "203.0.113.9")
            for _ in range(12)
        ]
        with _closing(socks):
            await asyncio.sleep(0.5)
            # the address's reads are counted: one more is refused
            more = {"X-Forwarded-For": "203.0.113.9"}
            async with relay.http.get(url, params={"offset": "-1"}, headers=more) as r:
                assert r.status == 429, await r.text()
            # another client is served at once, whole, while they hold
            t0 = time.monotonic()
            other = {"X-Forwarded-For": "198.51.100.77"}
            async with relay.http.get(url, params={"offset": "-1"}, headers=other) as r:
                assert r.status == 200
                assert len(await r.read()) == MESSAGE
            assert time.monotonic() - t0 < 2.0
            # the slow address never held more than its share of the budget
            assert 0 < budget.peak <= budget.share + MESSAGE + (1 << 20)
            # each is cut at its write deadline (or refused 503 after waiting as long)
            await asyncio.sleep(5.0)
            ends = [await loop.run_in_executor(None, _drain, s, 0.5) for s in socks]
        for got, ended, head in ends:  # cut mid-body, or told to come back (503)
            assert got < MESSAGE, ends
            assert ended or head == b"HTTP/1.1 503 Service Unavailable", ends
        assert any(ended and head.startswith(b"HTTP/1.1 200") for _, ended, head in ends)
        async with asyncio.timeout(10):
            while budget.used:  # what they held is given back
                await asyncio.sleep(0.1)
