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
import contextlib
import os
import sys
from typing import Annotated, Any

import aiohttp
import msgspec

from relay.broker.errors import RelayError
from relay.broker.rediscluster.connect import RedisTLS, mask_url, startup_error
from relay.broker.rediscluster.store import RedisStore
from relay.protocol.keys import BACKLOG_MAX_BYTES, BACKLOG_MAXLEN, SESSION_TTL_S
from relay.service import runtime, settings
from relay.service.settings import (
    BacklogMaxBytes,
    BacklogMaxlen,
    RedisCA,
    RedisCert,
    RedisKey,
    RedisURL,
    SessionTTL,
    opt,
)
from relay.service.supervise import Supervisor
from worker.chat.store import SessionStore
from worker.config import default_worker_id
from worker.engines.client import EngineClient
from worker.jobs.queue import BROKER_DELIVERY_LIMIT, JobRunner, QueueNames, RunnerConfig
from worker.jobs.record import JobStore
from worker.routing.control import parse_engine_arg
from worker.routing.lease import EngineSpec
from worker.routing.loadshare import LoadExchange
from worker.routing.router import Router

__all__ = ["JobWorkerSettings", "register", "run"]

HEALTH_INTERVAL_S = 5.0


class JobWorkerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The job worker's flags and environment (``TOKENRELAY_<FIELD>``), declared once;
    see :mod:`relay.service.settings`."""

    redis_url: RedisURL = ""
    redis_ca: RedisCA = ""
    redis_cert: RedisCert = ""
    redis_key: RedisKey = ""
    amqp_url: Annotated[
        str, opt("RabbitMQ URL (amqp://user:pass@host:5672/)", flag="--amqp", required=True)
    ] = ""
    engines: Annotated[
        tuple[str, ...],
        opt("engine URL or ID=URL (repeat)", flag="--engine", metavar="[ID=]URL", required=True),
    ] = ()
    engine_cap: Annotated[int, opt("in-flight requests per engine", ge=1)] = 8
    chat_reserve: Annotated[int, opt("slots per engine kept for chat", ge=0)] = 2
    model: Annotated[str, opt("model name sent to engines")] = "tokenrelay-mock"
    jobs_queue: Annotated[str, opt("job queue name", flag="--queue")] = "tokenrelay.jobs"
    max_attempts: Annotated[
        int, opt("then the dead-letter queue", ge=1, lt=BROKER_DELIVERY_LIMIT)
    ] = 3
    prefetch: Annotated[int, opt("jobs in flight per job worker", ge=1)] = 2
    worker_id: Annotated[str, opt("unique id (empty: job-hostname-pid)")] = ""
    # a job of a session reports on it: the same retention as the chat workers and relays
    session_ttl_s: SessionTTL = SESSION_TTL_S
    backlog_maxlen: BacklogMaxlen = BACKLOG_MAXLEN
    backlog_max_bytes: BacklogMaxBytes = BACKLOG_MAX_BYTES
    shutdown_deadline_s: Annotated[
        float, opt("SIGTERM: running jobs may finish for this long", ge=0)
    ] = 30.0
    health_file: Annotated[
        str,
        opt(
            f"touched every {HEALTH_INTERVAL_S:g} s while the broker connection is up (a "
            "container healthcheck reads its age)"
        ),
    ] = ""

    @property
    def redis_tls(self) -> RedisTLS:
        return RedisTLS(ca=self.redis_ca, cert=self.redis_cert, key=self.redis_key)

    def validate(self) -> JobWorkerSettings:
        settings.require_extra("aio_pika", "jobs", "tokenrelay jobworker")
        settings.check_redis(self.redis_url, self.redis_tls)
        return self


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "jobworker",
        help="run offline jobs from RabbitMQ on the engines (below a chat reserve)",
        description="Consume the job queue, run each job on the engines through the "
        "cache-affine router, store the result in Redis, then ack. " + settings.ENV_NOTE,
    )
    settings.add_arguments(p, JobWorkerSettings)
    p.set_defaults(func=run)


async def serve(opts: JobWorkerSettings, engines: list[EngineSpec]) -> None:
    worker_id = opts.worker_id or f"job-{default_worker_id()}"
    store = RedisStore.at(
        opts.redis_url, opts.redis_tls, 2.0, maxlen=opts.backlog_maxlen,
        ttl_s=opts.session_ttl_s, max_bytes=opts.backlog_max_bytes,
    )  # fmt: skip
    await store.reach()
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    router = Router(engines)
    exchange = LoadExchange(store, router, worker_id)
    runner = JobRunner(
        opts.amqp_url,
        QueueNames(opts.jobs_queue, opts.max_attempts),
        jobs=JobStore(store),
        router=router,
        engine=EngineClient(http),
        turns=store,
        sessions=SessionStore(store, ttl_s=opts.session_ttl_s),
        cfg=RunnerConfig(
            worker_id=worker_id,
            model=opts.model,
            prefetch=opts.prefetch,
            chat_reserve=opts.chat_reserve,
        ),
    )
    loops = Supervisor()  # one for the process: load exchange, job consumer, health file
    try:
        async with runtime.stop_on_signals() as stop:
            await exchange.start(loops)
            await runner.start(loops)
            print(f"jobworker {worker_id} consuming {opts.jobs_queue} on "
                  f"{mask_url(opts.amqp_url)}", flush=True)  # fmt: skip
            if opts.health_file:
                path = opts.health_file

                async def touch() -> None:
                    # a stale file tells the orchestrator to restart this process: the
                    # broker is gone or a critical loop (consumer, load exchange) keeps failing
                    if runner.connected and not loops.not_ready():
                        _touch(path)

                loops.every("health-file", HEALTH_INTERVAL_S, touch, critical=False)
            await stop.wait()
    finally:
        await runner.stop(opts.shutdown_deadline_s)  # running jobs finish first
        await loops.stop()
        await exchange.stop()  # never raises: withdraws this worker's load report
        await http.close()
        with contextlib.suppress(Exception):
            await store.aclose()


def _touch(path: str) -> None:
    with contextlib.suppress(OSError), open(path, "a", encoding="utf-8"):
        os.utime(path)


def run(args: argparse.Namespace) -> int:
    try:
        opts = settings.load(JobWorkerSettings, args)
        engines = [parse_engine_arg(e, opts.engine_cap) for e in opts.engines]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        runtime.run(serve(opts, engines))
    except (TimeoutError, RelayError, OSError) as exc:
        print(f"error: {startup_error(opts.redis_url, exc)}", file=sys.stderr)
        return 1
    return 0
