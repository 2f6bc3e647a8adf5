"""Helpers for the worker's integration tests: mock engines and a worker app in-process.

``Harness`` starts mock engines (``devstack.mockengine.server.start_engine``, 127.0.0.1, port 0)
and a worker app on an aiohttp ``TestServer`` (or, with ``guarded=True``, on the HTTP
guard's site, as ``tokenrelay worker`` serves it) against the test's real Redis Cluster
client; ``stop()`` tears everything down in reverse order.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDictProxy
from redis.asyncio.cluster import RedisCluster

from devstack.mockengine import prefix_cache as pc
from devstack.mockengine.reply_length import ReplyLength
from devstack.mockengine.server import EngineConfig, RunningEngine, start_engine
from relay.broker.rediscluster.publisher import read_backlog
from relay.broker.rediscluster.store import RedisStore
from relay.protocol.frame import Frame, decode
from relay.service.httpguard import GUARD, GuardedSite
from worker.api import make_app
from worker.config import WorkerConfig
from worker.state import STATE, WorkerState

__all__ = ["SECRET", "SHORT_REPLIES", "Harness", "expected_reply", "wait_turn"]

SECRET = "test-secret-9d41c7e2b8a05f36c1d4e7a2b9f0"
# the harness's engines answer short (8..48 tokens): tests of the API, not of long replies
SHORT_REPLIES = ReplyLength(mean=28.0, max_tokens=48, min_tokens=8, sigma=0.5)


def expected_reply(
    messages: list[dict[str, str]], max_tokens: int, reply: ReplyLength = SHORT_REPLIES,
    *, seed: int | None = None,
) -> str:  # fmt: skip
    """The mock engine's reply to ``messages`` (engines with the ``reply`` lengths);
    ``seed``: for a turn that regenerates another, its turn number (the worker sends it
    to the engine as ``X-Reply-Seed``)."""
    tokens = pc.prompt_tokens(messages)
    n = reply.length(tokens)
    pieces, _ = pc.reply_pieces(tokens, max_tokens, min_len=n, max_len=n, seed=seed)
    return "".join(pieces)


async def wait_turn(
    redis: RedisCluster, sid: str, turn: int, timeout_s: float = 15.0
) -> list[Frame]:
    """Frames of ``turn`` from the backlog once its terminal frame is there."""
    deadline = time.monotonic() + timeout_s
    while True:
        raw, _, _ = await read_backlog(redis, sid, 0, 10_000)
        frames = [f for f in (decode(x) for x in raw) if f.turn == turn]
        if frames and frames[-1].kind in ("done", "error"):
            return frames
        if time.monotonic() > deadline:
            raise AssertionError(f"turn {turn} did not end: {[f.kind for f in frames]}")
        await asyncio.sleep(0.05)


@dataclass
class Harness:
    redis: RedisCluster
    engines: list[RunningEngine] = field(default_factory=list)
    server: TestServer | None = None
    http: aiohttp.ClientSession | None = None
    runner: web.AppRunner | None = None  # guarded=True: the runner, and the site's base URL
    base: str = ""

    async def start_engines(self, n: int, **kw: Any) -> list[RunningEngine]:
        kw.setdefault("decode_tok_per_s", 400.0)
        kw.setdefault("reply", SHORT_REPLIES)
        kw.setdefault("prefill_tok_per_s", 50_000.0)
        for _ in range(n):
            eid = f"eng-{len(self.engines)}"
            self.engines.append(await start_engine(EngineConfig(port=0, engine_id=eid, **kw)))
        return self.engines[-n:]

    async def start_worker(
        self, cap: int = 8, *, own_redis_url: str = "", guarded: bool = False, **kw: Any
    ) -> WorkerState:
        """An in-process worker; it shares the test's Redis client unless
        ``own_redis_url`` is given (then it connects like a worker process does);
        ``guarded``: served through its HTTP guard (deadlines, per-address cap)."""
        cfg = WorkerConfig(
            redis_url="",
            engine_urls=tuple(f"{e.engine.cfg.engine_id}={e.url}" for e in self.engines),
            engine_cap=cap,
            secret=SECRET,
            worker_id="test-worker",
            load_exchange=False,
            coalesce_tokens=4,
            coalesce_ms=20.0,
            presence_grace_s=30.0,
            shutdown_deadline_s=1.0,
            session_rate_per_s=0.0,  # every test client is 127.0.0.1; limit tests set it
            max_sessions_per_address=0,  # counted in the shared cluster: for the whole run
        )
        cfg = msgspec.structs.replace(cfg, **kw)
        if own_redis_url:
            app = make_app(msgspec.structs.replace(cfg, redis_url=own_redis_url))
        else:
            app = make_app(cfg, store=RedisStore(self.redis))
        if guarded:
            self.runner = web.AppRunner(app, access_log=None)
            await self.runner.setup()
            site = GuardedSite(self.runner, "127.0.0.1", 0, guard=app[GUARD])
            await site.start()
            self.base = f"http://127.0.0.1:{site.port}"
        else:
            self.server = TestServer(app, host="127.0.0.1")
            await self.server.start_server()
        self.http = aiohttp.ClientSession()
        return self.state

    @property
    def state(self) -> WorkerState:
        if self.runner is not None:
            return self.runner.app[STATE]
        assert self.server is not None
        return self.server.app[STATE]

    def url(self, path: str) -> str:
        if self.runner is not None:
            return self.base + path
        assert self.server is not None
        return str(self.server.make_url(path))

    async def session(self) -> tuple[str, str]:
        assert self.http is not None
        async with self.http.post(self.url("/v1/sessions")) as r:
            assert r.status == 201, await r.text()
            body = await r.json()
        return body["session"], body["token"]

    async def post_turn(
        self,
        sid: str,
        token: str | None,
        body: Any,
        *,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
    ) -> tuple[int, dict[str, Any], CIMultiDictProxy[str]]:
        assert self.http is not None
        hdrs = dict(headers or {})
        if token is not None:
            hdrs.setdefault("Authorization", f"Bearer {token}")
        kwargs: dict[str, Any] = {"headers": hdrs}
        if raw is not None:
            kwargs["data"] = raw
        else:
            kwargs["json"] = body
        async with self.http.post(self.url(f"/v1/sessions/{sid}/turns"), **kwargs) as r:
            try:
                data = await r.json(content_type=None)
            except ValueError:
                data = {"text": await r.text()}
            return r.status, data, r.headers

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.close()
        if self.server is not None:
            await self.server.close()
        if self.runner is not None:
            await self.runner.cleanup()
        for e in self.engines:
            await e.stop()
