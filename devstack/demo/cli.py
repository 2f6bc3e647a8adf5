"""``tokenrelay demo``: the whole stack behind one URL, stopped by Ctrl-C.

Starts a local Redis Cluster (3 masters + 3 replicas), 3 mock engines (or the engine
URLs given with ``--engine``), 2 relays, 2 workers, and, where a RabbitMQ broker answers
(``--amqp``, default the local one), a job worker for offline jobs (each a child process,
stopped by pid) and, in this process, the front door that serves the page and spreads requests
over relays and workers without stickiness.

The token secret comes from ``TOKENRELAY_SECRET`` when set (``make demo`` sets a random
one per run), else is generated here; either way the children get it in their
environment, never on a command line. A weak or example secret is refused (exit 2).

The front door's process control (the page's kill/restart buttons) needs a token made per
run and printed only here, on the terminal (see :mod:`devstack.demo.frontdoor`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
from typing import Any

import aiohttp
from aiohttp import web

from devstack.demo.frontdoor import FrontDoor, make_frontdoor_app
from devstack.demo.stack import Stack, StackSpec
from relay.protocol.auth import WeakSecret, check_secret
from relay.redisio.connect import mask_url
from relay.service import runtime
from relay.service.httpguard import GuardedSite

__all__ = ["register", "run_demo", "stack_view"]


async def stack_view(stack: Stack, http: aiohttp.ClientSession) -> dict[str, Any]:
    """Processes, engines' in-flight against their caps (summed over workers), and the
    most recent placements of sessions on the ring."""
    processes = [
        {"name": p.name, "kind": p.kind, "pid": p.pid, "alive": p.alive, "url": p.url}
        for p in stack.procs.values()
    ]
    engines: dict[str, dict[str, Any]] = {}
    placements: list[dict[str, Any]] = []
    for proc in stack.of_kind("worker"):
        if not proc.alive:
            continue
        try:
            async with http.get(
                proc.url + "/v1/router", timeout=aiohttp.ClientTimeout(total=1)
            ) as resp:
                snap = await resp.json()
        except (TimeoutError, aiohttp.ClientError, ValueError):
            continue
        for e in snap.get("engines", []):
            agg = engines.setdefault(
                e["id"], {"id": e["id"], "in_flight": 0, "cap": e.get("cap", 0), "healthy": True}
            )
            agg["in_flight"] += e.get("in_flight", 0)
            agg["healthy"] = agg["healthy"] and e.get("healthy", True)
        placements.extend(snap.get("placements", []))
    placements.sort(key=lambda p: p.get("ts", 0), reverse=True)
    return {
        "processes": processes,
        "engines": sorted(engines.values(), key=lambda e: e["id"]),
        "placements": placements[:20],
        "redis": stack.redis_url,
    }


DEFAULT_AMQP = "amqp://guest:guest@127.0.0.1:5672/"


async def _broker_answers(url: str) -> bool:
    """True when an AMQP broker accepts a connection at ``url`` (3 s at most)."""
    import aio_pika

    try:
        conn = await asyncio.wait_for(aio_pika.connect(url), 3.0)
    except Exception:  # unreachable, refused, bad credentials: no jobs in this demo
        return False
    await conn.close()
    return True


async def run_demo(args: argparse.Namespace) -> int:
    amqp = None
    if not args.no_jobs:
        wanted = args.amqp or DEFAULT_AMQP
        if await _broker_answers(wanted):
            amqp = wanted
            print(f"offline jobs: on (RabbitMQ at {mask_url(wanted)})", flush=True)
        elif args.amqp:
            print(f"error: no RabbitMQ answers at {mask_url(wanted)} (--amqp)", file=sys.stderr)
            return 1
        else:
            print(f"offline jobs: off (no RabbitMQ at {mask_url(wanted)}; --amqp URL)", flush=True)
    spec = StackSpec(
        amqp_url=amqp,
        relays=args.relays,
        workers=args.workers,
        engines=args.engines,
        engine_urls=list(args.engine or []),
        model=args.model,
        insecure_no_auth=args.insecure_no_auth,
        secret=args.secret,
        engine_cap=args.engine_cap,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print("starting: Redis Cluster, engines, relays, workers ...", flush=True)
    async with Stack(spec) as stack, aiohttp.ClientSession() as http:

        async def control(action: str, name: str) -> Any:
            if name not in stack.procs:
                raise KeyError(f"no process named {name}")
            if action == "kill":
                return {"pid": stack.kill(name)}
            if action == "restart":
                await stack.restart(name)
                return {"pid": stack.procs[name].pid}
            raise ValueError(f"unknown action {action}")

        door = FrontDoor(
            lambda: [p.url for p in stack.of_kind("relay") if p.alive],
            lambda: [p.url for p in stack.of_kind("worker") if p.alive],
            stack_view=lambda: stack_view(stack, http),
            control=control,
        )
        runner = web.AppRunner(
            make_frontdoor_app(door), handle_signals=False, handler_cancellation=True
        )
        await runner.setup()
        site = GuardedSite(runner, args.host, args.port, backlog=4096)
        await site.start()
        try:
            for p in stack.procs.values():
                print(f"  {p.name:<9} pid {p.pid:<7} {p.url}", flush=True)
            print(f"  redis     {stack.redis_url}", flush=True)
            page = f"http://{args.host}:{args.port}/"
            print(f"\nopen {page}  (Ctrl-C stops everything)", flush=True)
            # The kill/restart buttons need this run's control token; it is printed here
            # only (the page keeps it from the #fragment, which no request carries).
            print(f"kill/restart buttons: open {page}#control={door.control_token}\n", flush=True)
            await stop.wait()
        finally:
            print("stopping ...", flush=True)
            await runner.cleanup()
    print("stopped: every process this demo started has exited.", flush=True)
    return 0


def _main(args: argparse.Namespace) -> int:
    secret = os.environ.get("TOKENRELAY_SECRET", "")
    if args.insecure_no_auth and secret:
        print("error: TOKENRELAY_SECRET and --insecure-no-auth are both set: choose one",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        args.secret = check_secret(secret).decode() if secret else secrets.token_urlsafe(32)
    except (WeakSecret, UnicodeDecodeError) as exc:
        print(f"error: TOKENRELAY_SECRET: {exc}", file=sys.stderr)
        return 2
    return runtime.run(run_demo(args))


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="the whole stack behind one URL (Ctrl-C stops it)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--relays", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--engines", type=int, default=3, help="mock engines (ignored with --engine)")
    p.add_argument(
        "--engine", action="append", help="URL of a real OpenAI-compatible engine (repeatable)"
    )
    p.add_argument("--model", default="mock", help="model name sent to the engines")
    p.add_argument(
        "--engine-cap",
        type=int,
        default=12,
        help="in-flight cap per engine: 1.5 x its concurrent sequences (the mocks run 8)",
    )
    p.add_argument("--insecure-no-auth", action="store_true")
    p.add_argument(
        "--amqp",
        default=None,
        metavar="URL",
        help=f"RabbitMQ for offline jobs (default: {DEFAULT_AMQP} when it answers)",
    )
    p.add_argument("--no-jobs", action="store_true", help="no offline jobs (no RabbitMQ)")
    p.set_defaults(func=_main)
