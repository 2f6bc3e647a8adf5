"""What the engine client's tests share: the engines and servers a test starts (stopped
at its end), and a client with short timeouts.

A test module takes the fixtures by assignment, so that one definition serves every module
without making generic names global in a conftest::

    servers = pytest.fixture(engines.servers)
    mock = pytest.fixture(engines.mock)
    serve = pytest.fixture(engines.serve)
    session = pytest.fixture(engines.session)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from devstack.mockengine.server import EngineConfig, RunningEngine, start_engine
from worker.engines.client import EngineClient

__all__ = ["Handler", "client", "mock", "serve", "servers", "session"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def servers() -> AsyncIterator[list[Any]]:
    """Everything started by a test; stopped at its end, last first."""
    started: list[Any] = []
    yield started
    for s in reversed(started):
        if isinstance(s, RunningEngine):
            await s.stop()
        else:
            await s.cleanup()


def mock(servers: list[Any]) -> Callable[..., Awaitable[RunningEngine]]:
    """Start a mock engine ``e1`` (no prefill or decode delay unless given)."""

    async def _start(**kw: Any) -> RunningEngine:
        kw.setdefault("prefill_tok_per_s", 0.0)
        kw.setdefault("decode_tok_per_s", 0.0)
        eng = await start_engine(EngineConfig(port=0, engine_id="e1", **kw))
        servers.append(eng)
        return eng

    return _start


def serve(servers: list[Any]) -> Callable[[Handler], Awaitable[str]]:
    """Serve one handler for POST /v1/chat/completions; returns the base URL."""

    async def _serve(handler: Handler) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        servers.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    return _serve


async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def client(session: aiohttp.ClientSession, **kw: Any) -> EngineClient:
    """An engine client with timeouts short enough for a test."""
    kw.setdefault("connect_timeout_s", 1.0)
    kw.setdefault("first_token_timeout_s", 5.0)
    kw.setdefault("idle_timeout_s", 5.0)
    return EngineClient(session, **kw)
