"""Probes the fault drills read the stack with: /metrics samples, CLIENT LIST, PING.

I/O helpers of :mod:`bench.faults.drills`, each one round trip to one process or node, on
loopback. Order of use: any, from inside a drill.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from devstack.demo.stack import Stack

__all__ = ["each_node", "ping", "relay_stats", "samples", "sub_connections"]


async def each_node(stack: Stack, *args: Any) -> None:
    cluster = stack.cluster
    assert cluster is not None
    assert cluster.info is not None
    for node in cluster.info.nodes:
        if cluster.procs[node.port].alive:
            c = aioredis.Redis(host=node.host, port=node.port)
            try:
                await c.execute_command(*args)
            finally:
                await c.aclose()


WANTED = ("reaped", "repairs", "connections_lost", "resubscribes", "topology_changes", "gaps")


async def samples(
    http: aiohttp.ClientSession, url: str, timeout_s: float
) -> list[tuple[str, float]] | None:
    """(name with labels, value) of every sample on ``url``/metrics; None if unreachable."""
    try:
        async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    out = []
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        out.append((name, float(value)))
    return out


async def relay_stats(http: aiohttp.ClientSession, stack: Stack) -> dict[str, float]:
    """A few hub counters summed over the relays still alive (from /metrics)."""
    out: dict[str, float] = {}
    for p in stack.of_kind("relay"):
        got = await samples(http, p.url, 5) if p.alive else None
        for name, value in got or []:
            name = name.removesuffix("_total")
            for w in WANTED:
                if name.endswith("hub_" + w) or f'key="{w}"' in name:
                    out[w] = out.get(w, 0.0) + value
    return out


async def sub_connections(stack: Stack, relay: str, masters: dict[int, list[int]]) -> int:
    """How many masters still hold the relay's subscriber connection (CLIENT LIST)."""
    n = 0
    for port in masters:
        c = aioredis.Redis(host="127.0.0.1", port=port)
        try:
            text = (await c.execute_command("CLIENT", "LIST")).decode()
        finally:
            await c.aclose()
        n += f"name=tokenrelay-sub:{relay} " in text
    return n


async def ping(port: int, timeout_s: float) -> tuple[str, float]:
    """PING one node on a fresh connection: (answer or what went wrong, seconds taken)."""
    t0 = time.monotonic()
    c = aioredis.Redis(
        host="127.0.0.1", port=port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
    )
    try:
        answer = "PONG" if await c.ping() else "?"
    except (aioredis.ConnectionError, aioredis.TimeoutError, TimeoutError, OSError):
        answer = "no answer"
    finally:
        await c.aclose()
    return answer, time.monotonic() - t0
