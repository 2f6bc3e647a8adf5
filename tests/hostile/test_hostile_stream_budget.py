"""What one stream token and one client address can make Redis hold through Durable
Streams, on relays served as in production and the suite's cluster, every byte bound at
its default: a stream holds at most ``--durable-max-stream-bytes``, a token writes at most
``--durable-token-bytes`` and an address ``--durable-address-bytes`` per window, counted in
Redis (so two relays agree). Before these bounds one token wrote 4 MiB bodies without end
(25 in 11 s: +105 MiB on the masters). The bytes Redis holds are read on the masters
(``INFO memory``, ``MEMORY USAGE``) and printed (``-s``); the test fails past the bounds.

Each client is an address of its own behind the relays' trusted proxy (``X-Forwarded-For``),
so the windows this suite's other tests fill on 127.0.0.1 do not count here.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from relay.broker.port import MESSAGE_OVERHEAD
from relay.durable.auth import token_subject
from relay.durable.store import StreamRef
from relay.edge.config import RelayConfig
from relay.protocol.auth import issue_token
from tests.support.relay import SECRET, Relay, running

pytestmark = pytest.mark.integration

MIB = 1 << 20
BODY = 4 * MIB  # the default --durable-max-body-bytes: the largest write there is
OCTETS = {"Content-Type": "application/octet-stream"}
D = RelayConfig()


def _address() -> str:
    rng = random.Random()
    return f"198.51.{rng.randrange(100, 120)}.{rng.randrange(1, 255)}"


def _token(path: str) -> str:
    return issue_token(SECRET, token_subject(path), 600, time.time(), scope="write")


async def _masters_used(cluster: ClusterInfo) -> int:
    total = 0
    for n in cluster.nodes:
        if n.role != "master":
            continue
        r = aioredis.Redis(host=n.host, port=n.port)
        try:
            total += int((await r.info("memory"))["used_memory"])
        finally:
            await r.aclose()
    return total


async def _held(redis: RedisCluster, paths: list[str]) -> int:
    """``MEMORY USAGE`` of every key of these streams."""
    total = 0
    for path in paths:
        for key in StreamRef.of(path).keys:
            total += int(await redis.execute_command("MEMORY", "USAGE", key, "SAMPLES", "0") or 0)
    return total


class Client:
    """One client address writing through a relay."""

    def __init__(self, relay: Relay, address: str) -> None:
        self.relay, self.address = relay, address

    async def send(
        self, method: str, path: str, token: str, body: bytes = b""
    ) -> tuple[int, str, dict[str, str]]:
        headers = {"Authorization": f"Bearer {token}", "X-Forwarded-For": self.address,
                   **OCTETS}  # fmt: skip
        url = f"{self.relay.base}/v1/stream/{path}"
        async with self.relay.http.request(method, url, headers=headers, data=body) as r:
            return r.status, await r.text(), dict(r.headers)


@contextlib.asynccontextmanager
async def _relays(cluster: ClusterInfo, n: int, **kw: Any) -> AsyncIterator[list[Relay]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(running(cluster, trusted_proxies="127.0.0.1", **kw))
            for _ in range(n)
        ]


async def test_one_stream_token_is_refused_before_the_masters_hold_64_mib(
    cluster: ClusterInfo, redis: RedisCluster
) -> None:
    """One token, 4 MiB bodies until refused, a delete and a new stream at the path, again:
    the stream is refused at its bound (413), the token at its budget (429), and the
    masters never hold 64 MiB more. Old code: every write was taken."""
    assert (D.durable_max_stream_bytes, D.durable_token_bytes) == (16 * MIB, 32 * MIB)
    path = f"budget/{random.randrange(1 << 30)}"
    token, body = _token(path), random.randbytes(BODY)
    before = await _masters_used(cluster)
    peak = 0
    statuses: list[int] = []
    async with _relays(cluster, 2) as relays:
        clients = [Client(r, _address()) for r in relays]  # two addresses, one token
        for round_ in range(4):
            c = clients[round_ % 2]
            status, text, _ = await c.send("PUT", path, token)
            assert status == 201, text
            for _ in range(8):
                status, text, headers = await c.send("POST", path, token, body)
                statuses.append(status)
                peak = max(peak, await _masters_used(cluster) - before)
                if status == 204:
                    continue
                if status == 413:
                    assert "--durable-max-stream-bytes" in text, text
                    break
                assert status == 429, text
                assert "this token may write 32 MiB" in text, text
                assert int(headers["Retry-After"]) > 3600  # the day's window
                break
            held = await _held(redis, [path])
            assert held < 20 * MIB, held
            if status == 429:
                break
            status, text, _ = await c.send("DELETE", path, token)
            assert status == 204, text
        # a bystander's stream on the same relays is written meanwhile
        other = f"budget/{random.randrange(1 << 30)}"
        by = Client(relays[1], _address())
        assert (await by.send("PUT", other, _token(other), b"hello"))[0] == 201
        await by.send("DELETE", other, _token(other))
        await clients[0].send("DELETE", path, token)
    accepted = statuses.count(204)
    print(f"\none token: {accepted} x 4 MiB taken, then {statuses[-1]}; statuses {statuses}; "
          f"masters' used_memory peak +{peak / MIB:.1f} MiB")  # fmt: skip
    assert statuses[-1] == 429  # the token's budget ends it
    per_stream = D.durable_max_stream_bytes // (BODY + MESSAGE_OVERHEAD)
    assert statuses.count(413) >= 1
    assert accepted <= D.durable_token_bytes // BODY
    assert statuses[: per_stream + 1] == [204] * per_stream + [413]
    assert peak < 64 * MIB, peak


async def test_one_address_is_bounded_across_relays_and_streams(cluster: ClusterInfo) -> None:
    """Many streams and tokens from one address over two relays: the address's budget,
    counted in Redis, refuses the write that passes it on whichever relay (429 with
    ``Retry-After``), and a write larger than the whole budget is 413; another address
    is served. Old code: nothing counted bytes per address."""
    budget, body = MIB, random.randbytes(200_000)
    kw = {"durable_address_bytes": budget, "durable_budget_window_s": 3600}
    async with _relays(cluster, 2, **kw) as relays:
        address = _address()
        paths = [f"budget/{random.randrange(1 << 30)}" for _ in range(8)]
        seen = []
        for i, path in enumerate(paths):
            c = Client(relays[i % 2], address)
            status, text, headers = await c.send("PUT", path, _token(path), body)
            seen.append(status)
            if status == 429:
                assert "this client address may write 1 MiB per 3600 s" in text, text
                assert 1 <= int(headers["Retry-After"]) <= 3600
                break
            assert status == 201, text
        assert seen == [201] * (budget // (len(body) + MESSAGE_OVERHEAD)) + [429]
        status, text, _ = await Client(relays[0], _address()).send(
            "PUT", paths[-1], _token(paths[-1]), random.randbytes(2 * MIB)
        )
        assert status == 413, text
        assert "more than this client address may write" in text, text
        fresh = Client(relays[1], _address())
        status, text, _ = await fresh.send("PUT", paths[-1], _token(paths[-1]), body)
        assert status == 201, text
        for i, path in enumerate(paths):
            await Client(relays[i % 2], address).send("DELETE", path, _token(path))


async def test_what_one_address_makes_the_masters_hold(
    cluster: ClusterInfo, redis: RedisCluster
) -> None:
    """Every default: one address writes 4 MiB bodies into streams of its own (a token
    each, a new stream when one is full) until refused; the masters' growth and the bytes
    its streams' keys hold (``MEMORY USAGE``) stay under ``--durable-address-bytes`` x 1.25
    (jemalloc rounds a large allocation up to its size class, four per doubling: a 4 MiB
    message takes 5 MiB) plus a few MiB of the masters' transient buffers: the figure
    RELIABILITY.md adds to the sessions' ceiling. Old code: nothing refused it."""
    assert D.durable_address_bytes == 64 * MIB
    body, address = random.randbytes(BODY), _address()
    paths: list[str] = []
    before = await _masters_used(cluster)
    statuses: list[int] = []
    async with _relays(cluster, 2) as relays:
        status = 204
        while status != 429 and len(statuses) < 40:
            path = f"budget/{random.randrange(1 << 30)}"
            paths.append(path)
            c = Client(relays[len(paths) % 2], address)
            status, text, _ = await c.send("PUT", path, _token(path))
            assert status == 201, text
            while True:
                status, text, _ = await c.send("POST", path, _token(path), body)
                statuses.append(status)
                if status != 204:
                    break
        assert status == 429, statuses
        grew, held = await _masters_used(cluster) - before, await _held(redis, paths)
        for i, path in enumerate(paths):
            await Client(relays[i % 2], address).send("DELETE", path, _token(path))
    accepted = statuses.count(204)
    print(f"\none address: {accepted} x 4 MiB into {len(paths)} streams, then 429; keys hold "
          f"{held / MIB:.1f} MiB, masters' used_memory +{grew / MIB:.1f} MiB")  # fmt: skip
    assert accepted == D.durable_address_bytes // (BODY + MESSAGE_OVERHEAD)
    assert held <= 1.25 * D.durable_address_bytes + MIB, held
    assert grew <= 1.25 * D.durable_address_bytes + 8 * MIB, grew
