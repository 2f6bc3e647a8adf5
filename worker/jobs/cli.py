"""The ``tokenrelay jobworker`` subcommand: run offline jobs from RabbitMQ.

``tokenrelay jobworker --redis URL --amqp URL --engine URL [--engine URL ...]`` consumes
the job queue (:mod:`worker.jobs.queue`) with a bounded prefetch and runs each job on the
engines through the same prefix-aware router as chat, taking a slot only while the
engine's load stays within its cap less ``--chat-reserve`` slots that only interactive
turns may use (the job worker takes part in the load exchange: it sees the chat workers'
load, they see its requests, and the cap holds cluster-wide).
SIGTERM/SIGINT: stop taking jobs, let running ones finish for ``--shutdown-deadline-s``;
an unfinished job is not acked, so the broker hands it to another job worker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from typing import Any

import aiohttp

from relay.redisio.connect import RedisTLS, add_tls_arguments, connect, mask_url, startup_error
from relay.redisio.errors import RelayError, map_redis_errors
from relay.redisio.publisher import Publisher
from relay.service import runtime
from worker.api import default_worker_id
from worker.chat.store import SessionStore
from worker.engines.client import EngineClient
from worker.jobs.queue import BROKER_DELIVERY_LIMIT, JobRunner, QueueNames, RunnerConfig
from worker.jobs.record import JobStore
from worker.routing.control import parse_engine_arg
from worker.routing.loadshare import LoadExchange
from worker.routing.router import EngineSpec, Router

__all__ = ["register", "run"]

_log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "jobworker",
        help="run offline jobs from RabbitMQ on the engines (below a chat reserve)",
        description="Consume the job queue, run each job on the engines through the "
        "cache-affine router, store the result in Redis, then ack.",
    )
    p.add_argument(
        "--redis",
        default=os.environ.get("TOKENRELAY_REDIS_URL"),
        help="cluster URL (rediss://: TLS)",
    )
    add_tls_arguments(p)
    p.add_argument("--amqp", default=os.environ.get("TOKENRELAY_AMQP_URL"), help="RabbitMQ URL")
    p.add_argument("--engine", action="append", default=[], help="engine URL or ID=URL")
    p.add_argument("--engine-cap", type=int, default=8, help="in-flight requests per engine")
    p.add_argument("--chat-reserve", type=int, default=2, help="slots per engine kept for chat")
    p.add_argument("--model", default="tokenrelay-mock", help="model name sent to engines")
    p.add_argument("--queue", default="tokenrelay.jobs", help="job queue name")
    p.add_argument("--max-attempts", type=int, default=3, help="then the dead-letter queue")
    p.add_argument("--prefetch", type=int, default=2, help="jobs in flight per job worker")
    p.add_argument("--worker-id", default=None, help="unique id (default hostname-pid)")
    p.add_argument("--shutdown-deadline-s", type=float, default=30.0)
    p.add_argument(
        "--health-file",
        default="",
        help="touched every 5 s while the broker connection is up (a container healthcheck "
        "reads its age)",
    )
    p.set_defaults(func=run)


async def serve(args: argparse.Namespace, engines: list[EngineSpec]) -> None:
    worker_id = args.worker_id or f"job-{default_worker_id()}"
    tls = RedisTLS.from_args(args)
    redis = connect(args.redis, tls=tls, socket_timeout=2.0, socket_connect_timeout=2.0)
    with map_redis_errors():
        await redis.initialize()
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    router = Router(engines)
    exchange = LoadExchange(redis, router, worker_id)
    runner = JobRunner(
        args.amqp,
        QueueNames(args.queue, args.max_attempts),
        jobs=JobStore(redis),
        router=router,
        engine=EngineClient(http),
        publisher=Publisher(redis),
        sessions=SessionStore(redis),
        cfg=RunnerConfig(
            worker_id=worker_id,
            model=args.model,
            prefetch=args.prefetch,
            chat_reserve=args.chat_reserve,
        ),
    )
    try:
        async with runtime.stop_on_signals() as stop:
            await exchange.start()
            await runner.start()
            print(f"jobworker {worker_id} consuming {args.queue} on {mask_url(args.amqp)}",
                  flush=True)  # fmt: skip
            beat = asyncio.create_task(_heartbeat(args.health_file, runner, stop))
            await stop.wait()
            beat.cancel()
    finally:
        await runner.stop(args.shutdown_deadline_s)
        with contextlib.suppress(Exception):
            await exchange.stop()
        await http.close()
        with contextlib.suppress(Exception):
            await redis.aclose()


def _touch(path: str) -> None:
    with contextlib.suppress(OSError), open(path, "a", encoding="utf-8"):
        os.utime(path)


async def _heartbeat(path: str, runner: JobRunner, stop: asyncio.Event) -> None:
    while path and not stop.is_set():
        if runner.connected:
            _touch(path)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 5.0)


def run(args: argparse.Namespace) -> int:
    try:
        if not args.redis or not args.amqp:
            raise ValueError("give --redis and --amqp (or TOKENRELAY_REDIS_URL / _AMQP_URL)")
        if not args.engine:
            raise ValueError("give at least one --engine")
        if args.engine_cap < 1 or args.chat_reserve < 0 or args.prefetch < 1:
            raise ValueError("--engine-cap and --prefetch must be >= 1, --chat-reserve >= 0")
        if not 1 <= args.max_attempts < BROKER_DELIVERY_LIMIT:
            raise ValueError(f"--max-attempts must be in 1..{BROKER_DELIVERY_LIMIT - 1}")
        engines = [parse_engine_arg(e, args.engine_cap) for e in args.engine]
        RedisTLS.from_args(args).check(args.redis)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        runtime.run(serve(args, engines))
    except (TimeoutError, RelayError, OSError) as exc:
        print(f"error: {startup_error(args.redis, exc)}", file=sys.stderr)
        return 1
    return 0
