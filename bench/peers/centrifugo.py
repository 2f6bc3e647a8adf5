"""Centrifugo, the open-source server, as a system of :mod:`bench.peers.pathcost`: its
build, its configuration, its process, its screens and its history.

- :func:`ensure_centrifugo`: ``go install github.com/centrifugal/centrifugo/v6@`` :data:`PIN`
  (under ``nice -n 10``) into ``~/.cache/tokenrelay/peer-centrifugo`` once per machine;
  the binary, or why there is none (no Go, the build failed). ``python -m
  bench.peers.centrifugo`` builds it ahead (about 10 minutes on two busy cores).
- :func:`config`: its Redis engine on the run's cluster (``engine.redis.cluster_address``),
  one namespace ``ai`` as its docs' AI-streaming example sets it (history and
  ``force_recovery`` on: every publication goes to a Redis stream per channel, offset +
  epoch, and a client that resubscribes gets what it missed from there), the history
  sized for a turn (:data:`HISTORY_SIZE` publications: the mock engine's longest reply),
  anonymous clients (``client.insecure``) and the server API behind a key. Open-source
  Centrifugo has no setting for sharded Pub/Sub on a cluster (Centrifugo PRO's
  ``sharded_pub_sub_partitions``): its publications are classic PUBLISH, which a Redis
  Cluster broadcasts to every node; Redis's own INFO commandstats in each round show
  which (the round's ``redis_commands``).
- :func:`centrifugo_server`: the process, listening on a free loopback port, stopped by
  its pid.
- :class:`CentrifugoReader`: one screen, the official Python SDK (``centrifuge-python``)
  over Centrifugo's WebSocket protocol (JSON), subscribed to ``ai:<session>``; in a storm
  it disconnects and connects again, and the SDK resubscribes with its offset and epoch
  (``recovered`` counts the subscriptions the server said it recovered).
- :func:`history_stamps`: every channel's stamps as Centrifugo's history in Redis holds
  them (the server API's ``history``, one batch): what the readers' losses are counted
  against.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench._util import free_port
from bench.peers.node import peer_cache
from bench.peers.ws_clients import Tally
from bench.relay.harness import STAMP, RelayProc
from devstack.procs import http_ok, launched
from relay.protocol.slotmap import Addr

__all__ = [
    "API_KEY", "HISTORY_SIZE", "MODULE", "NAMESPACE", "PIN", "CentrifugoReader",
    "centrifugo_server", "channel", "config", "ensure_centrifugo", "history_stamps",
]  # fmt: skip

MODULE = "github.com/centrifugal/centrifugo/v6"
PIN = "v6.9.1"
API_KEY = "bench-api-key"
NAMESPACE = "ai"
HISTORY_SIZE = 2_000  # publications: the mock engine's longest reply, one per token
_BUILD_S = 1_800.0


def channel(sid: str) -> str:
    return f"{NAMESPACE}:{sid}"


def ensure_centrifugo(cache: Path | None = None, *, build: bool = True) -> Path | str:
    """The ``centrifugo`` binary at :data:`PIN` (built here once per cache unless
    ``build`` is false), or why there is none."""
    cache = cache or peer_cache("peer-centrifugo")
    binary, stamp = cache / "centrifugo", cache / "installed.txt"
    with contextlib.suppress(OSError):  # go install leaves the version out of the binary
        if binary.is_file() and stamp.read_text().strip() == f"{MODULE}@{PIN}":
            return binary
    if not build:
        return f"not built here (python -m bench.peers.centrifugo builds it into {cache})"
    go = shutil.which("go")
    if go is None:
        return "Go is needed to build Centrifugo (go install; not on PATH)"
    cache.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GOBIN": str(cache)}
    try:
        argv = ["nice", "-n", "10", go, "install", f"{MODULE}@{PIN}"]
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=_BUILD_S, check=False
        )
    except subprocess.TimeoutExpired:
        return f"go install {MODULE}@{PIN} took more than {_BUILD_S:.0f} s"
    if done.returncode != 0 or not binary.is_file():
        tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        return f"go install {MODULE}@{PIN} failed ({done.returncode}): {tail[0][:200]}"
    stamp.write_text(f"{MODULE}@{PIN}\n")
    return binary


def config(seed: Addr, port: int) -> dict[str, Any]:
    """Centrifugo's configuration for the run (see the module's docstring)."""
    namespace = {
        "name": NAMESPACE, "history_size": HISTORY_SIZE, "history_ttl": "300s",
        "force_recovery": True, "allow_subscribe_for_client": True,
    }  # fmt: skip
    redis = {"cluster_address": [f"{seed.host}:{seed.port}"]}
    return {
        "http_server": {"address": "127.0.0.1", "port": str(port)},
        "client": {"insecure": True, "allowed_origins": ["*"]},
        "http_api": {"key": API_KEY},
        "health": {"enabled": True},  # what the bench waits for before a round
        "engine": {"type": "redis", "redis": redis},
        "channel": {"namespaces": [namespace]},
        "log": {"level": "warn"},
    }


@contextlib.asynccontextmanager
async def centrifugo_server(binary: Path, seed: Addr, log_dir: Path) -> AsyncIterator[RelayProc]:
    """``centrifugo --config <file>`` listening on a free loopback port; stopped by pid."""
    port = free_port()
    path = log_dir / f"centrifugo-{port}.json"
    path.write_text(json.dumps(config(seed, port), indent=2))
    async with launched(
        [str(binary), "--config", str(path)], log=log_dir / f"centrifugo-{port}.log",
        ready=http_ok(f"http://127.0.0.1:{port}/health"), name="Centrifugo",
    ) as proc:  # fmt: skip
        yield RelayProc(proc, port)


async def api(port: int, method: str, body: dict[str, Any], timeout_s: float = 60) -> Any:
    """One call of Centrifugo's server HTTP API (``POST /api/<method>``): its JSON."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"http://127.0.0.1:{port}/api/{method}", json=body,
                  headers={"X-API-Key": API_KEY},
                  timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp,
    ):  # fmt: skip
        resp.raise_for_status()
        return await resp.json()


async def history_stamps(port: int, sids: Sequence[str]) -> dict[str, set[int]]:
    """Every session's stamps as its channel's history holds them (one batch of
    ``history`` calls through the server API)."""
    cmds = [{"history": {"channel": channel(s), "limit": HISTORY_SIZE * 2}} for s in sids]
    got = await api(port, "batch", {"commands": cmds, "parallel": True})
    out: dict[str, set[int]] = {}
    for sid, reply in zip(sids, got.get("replies", []), strict=True):
        if "error" in reply:
            raise RuntimeError(f"Centrifugo history of {channel(sid)}: {reply['error']}")
        pubs = reply.get("history", {}).get("publications", [])
        out[sid] = {int(s) for p in pubs for s in STAMP.findall(json.dumps(p["data"]).encode())}
    return out


class CentrifugoReader:
    """One screen on ``ai:<sid>`` through ``centrifuge-python`` (see the module's
    docstring); each publication's ``text`` goes to :meth:`Tally.note`."""

    def __init__(self, tally: Tally, sid: str, port: int) -> None:
        from centrifuge import Client, PublicationContext, SubscribedContext
        from centrifuge import SubscriptionEventHandler as Events

        self.tally = tally
        self.recovered = 0
        reader = self

        class _Events(Events):  # type: ignore[misc]  # the SDK ships no types
            async def on_publication(self, ctx: PublicationContext) -> None:
                data = ctx.pub.data
                reader.tally.note(data.get("text", "") if isinstance(data, dict) else str(data))

            async def on_subscribed(self, ctx: SubscribedContext) -> None:
                if ctx.was_recovering and ctx.recovered:
                    reader.recovered += 1
                elif ctx.was_recovering:
                    reader.tally.errors.append(f"centrifugo: {ctx.channel} not recovered")

        url = f"ws://127.0.0.1:{port}/connection/websocket"
        self.client = Client(url, proxy=None, timeout=30.0, max_reconnect_delay=2.0)
        self.sub = self.client.new_subscription(channel(sid), events=_Events())

    async def open(self) -> None:
        await self.sub.subscribe()
        await self.client.connect()
        await self.sub.ready(timeout=60)

    async def reconnect(self, resume: bool) -> None:
        """Drop the connection and connect again: the SDK resubscribes with its position
        (Centrifugo recovers it: ``force_recovery``)."""
        await self.client.disconnect()
        await self.client.connect()
        await self.sub.ready(timeout=60)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await self.client.disconnect()


if __name__ == "__main__":  # build it once: minutes on two cores
    got = ensure_centrifugo()
    print(got)
    raise SystemExit(0 if isinstance(got, Path) else 1)
