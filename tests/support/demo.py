"""A live demo stack for client tests: relays, workers and mock engines on the session's
cluster behind the demo's front door (one URL, no stickiness), stopped by pid on exit."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from aiohttp import web

from devstack.cluster.launcher import ClusterInfo
from devstack.demo.frontdoor import FrontDoor, make_frontdoor_app
from devstack.demo.stack import Stack, StackSpec
from devstack.procs import free_port

__all__ = ["front_door"]


@asynccontextmanager
async def front_door(
    cluster: ClusterInfo,
    *,
    relays: int = 2,
    decode_tok_per_s: int = 40,
    engine_args: Sequence[str] = (),
    gateway_keys: Sequence[str] = (),
) -> AsyncIterator[tuple[str, Stack]]:
    """The front door's base URL and the stack behind it (1 worker, 2 mock engines at
    ``decode_tok_per_s``, plus ``engine_args``; the worker's OpenAI gateway on with
    ``gateway_keys``, off without)."""
    args = ["--decode-tok-per-s", str(decode_tok_per_s), *engine_args]
    # the live-session cap counts in the suite's shared cluster, for a day: not here
    spec = StackSpec(relays=relays, workers=1, engines=2, redis_url=cluster.url,
                     engine_args=args, worker_args=["--max-sessions-per-address", "0"],
                     gateway_keys=list(gateway_keys))  # fmt: skip
    async with Stack(spec) as stack:
        door = FrontDoor(
            lambda: [p.url for p in stack.of_kind("relay") if p.alive],
            lambda: [p.url for p in stack.of_kind("worker") if p.alive],
            stack_view=lambda: {"redis": stack.redis_url},  # as make demo's /api/stack says
        )
        # as make demo runs it: a client that goes away cancels its handler, so the
        # proxied stream to the relay closes too (as nginx's does), without waiting for
        # the relay's next write to find the client gone
        runner = web.AppRunner(make_frontdoor_app(door), handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            yield f"http://127.0.0.1:{port}", stack
        finally:
            await runner.cleanup()
    stack.remove_logs()  # stopped cleanly: no folder left behind (kept when a test failed)
