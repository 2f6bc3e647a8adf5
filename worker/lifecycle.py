"""The worker app's startup and cleanup: connect, build the parts, run the loops.

Startup (:func:`lifecycle`, the app's cleanup context):

1. the Redis store (:meth:`relay.broker.rediscluster.store.RedisStore.at`, unless the
   app was given one) and one attempt at the first connection. When it fails,
   ``fail_fast`` (or a cause no retry can fix: a server certificate the worker does not
   trust, a refused password) ends the start with the error (the CLI prints one line
   and exits 1); otherwise the worker starts anyway with the condition
   ``redis_unreachable`` raised (``/readyz`` 503, turns 503) and the loop
   ``redis_connect`` retries in the background until the cluster answers;
2. the router, engine client, session store, turn manager, control plane,
   load exchange, gateway and jobs API;
3. the background loops, all on one :class:`relay.service.supervise.Supervisor` in the
   worker's metrics registry: ``engine_probes`` at once; ``engine_heartbeats`` and
   ``load_exchange`` once Redis has been reached (they need it; before that the
   condition says why the worker is not ready).

Cleanup: drain the turns, stop the supervisor (every loop and task), withdraw the load
report, close the HTTP session, the jobs submitter and the Redis store: each step runs
whatever the one before it raised.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final

import aiohttp
from aiohttp import web

from relay.broker.errors import RelayError
from relay.broker.rediscluster.connect import mask_url
from relay.broker.rediscluster.errors import beyond_retry
from relay.broker.rediscluster.store import RedisStore
from relay.service.supervise import Supervisor
from worker.chat.store import SessionStore
from worker.chat.turn import TurnManager
from worker.chat.turnstate import TurnConfig
from worker.config import WorkerConfig
from worker.engines.client import EngineClient
from worker.engines.props import PropsReader
from worker.engines.tokenizer import EngineTokenizer
from worker.fronts.base import GATEWAY, Gateway, GatewayConfig
from worker.jobs.api import JOBS, JobsApi
from worker.jobs.queue import JobSubmitter, QueueNames
from worker.jobs.record import JobStore
from worker.metrics import WorkerMetrics
from worker.routing.blockindex import BlockIndex
from worker.routing.control import ControlPlane
from worker.routing.kvevents import KVEventFollower
from worker.routing.loadshare import LoadExchange
from worker.routing.profile import Profiles
from worker.routing.router import Router
from worker.routing.tokens import MOCK_MODEL
from worker.state import STATE, WorkerState, access_check

__all__ = ["CFG", "REDIS_UNREACHABLE", "STORE", "lifecycle"]

log = logging.getLogger(__name__)

CFG: Final = web.AppKey("tokenrelay_worker_cfg", WorkerConfig)
STORE: Final = web.AppKey("tokenrelay_worker_store", RedisStore)
REDIS_UNREACHABLE: Final = "redis_unreachable"
_CONNECT_INTERVAL_S: Final = 1.0  # between connection attempts; failures back off longer
_PROPS_INTERVAL_S: Final = 30.0  # between reads of the engines' /props (slots, context)


async def _first_connection(store: RedisStore) -> RelayError | None:
    """One attempt at the cluster's first connection; the error, or None."""
    try:
        await store.reach()
    except RelayError as exc:
        return exc
    return None


def _connect_in_background(
    sup: Supervisor,
    store: RedisStore,
    cfg: WorkerConfig,
    on_connected: Callable[[], Awaitable[None]],
) -> None:
    """Keep trying the first connection on ``sup`` (loop ``redis_connect``: failures are
    logged and backed off there); on success clear the condition and call ``on_connected``
    once."""
    connected = False

    async def attempt() -> None:
        nonlocal connected
        if connected:
            return
        await store.reach()
        connected = True
        sup.set_condition(REDIS_UNREACHABLE, False)
        log.info("redis at %s reached", mask_url(cfg.redis_url))
        await on_connected()

    # not critical: while it fails the condition redis_unreachable already says why
    sup.every("redis_connect", _CONNECT_INTERVAL_S, attempt, critical=False)


def _engine_down(
    abort: Callable[[str, str], object], follower: KVEventFollower | None
) -> Callable[[str, str], object]:
    """The control plane lost an engine: its turns end, the block index forgets it."""

    def down(engine_id: str, reason: str) -> object:
        if follower is not None:
            follower.engine_down(engine_id)
        return abort(engine_id, reason)

    return down


def _tick(follower: KVEventFollower) -> Callable[[], Awaitable[None]]:
    async def tick() -> None:
        follower.tick()

    return tick


async def _always(*steps: Callable[[], Awaitable[object]]) -> None:
    """Run every cleanup step, whatever an earlier one raised (logged)."""
    for step in steps:
        try:
            await step()
        except Exception:
            log.exception("worker cleanup step failed")


async def lifecycle(app: web.Application) -> AsyncIterator[None]:
    """The app's cleanup context: see the module docstring."""
    cfg = app[CFG]
    given = app.get(STORE)
    own = given is None
    # its client waits for a pooled connection in a burst instead of failing
    shared = given or RedisStore.at(cfg.redis_url, cfg.redis_tls, cfg.redis_timeout_s)
    # the worker's writes: the shared client, this worker's backlog bounds and lifetime
    store = RedisStore(
        shared.redis,
        maxlen=cfg.backlog_maxlen,
        ttl_s=cfg.session_ttl_s,
        max_bytes=cfg.backlog_max_bytes,
    )
    unreachable: RelayError | None = None
    if own:
        unreachable = await _first_connection(store)
        if unreachable is not None and (cfg.fail_fast or beyond_retry(unreachable)):
            with contextlib.suppress(Exception):
                await store.aclose()
            raise unreachable  # the CLI prints it as one line and exits 1
    metrics = WorkerMetrics()
    sup = Supervisor(metrics.registry)
    http = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
    )
    engines = cfg.engines  # the static ones (--engine), parsed once
    kv_sources = cfg.kv_event_sources
    index = BlockIndex(cfg.kv_block_size) if kv_sources else None
    follower = KVEventFollower(index, kv_sources) if index is not None else None
    profiles = Profiles(cfg.profiles)  # the flags; the engines' reports fill the rest
    router = Router(
        engines,
        profiles=profiles,
        vnodes=cfg.vnodes,
        eps=cfg.eps,
        spill=cfg.spill,
        policy=cfg.routing,
        queue=cfg.route_queue,
        queue_slo_s=cfg.route_queue_slo_s,
        index=index,
    )
    metrics.bind_router(router)
    if follower is not None:
        metrics.bind_kv_events(follower)
    engine = EngineClient(
        http,
        max_reply_bytes=cfg.max_reply_bytes,
        connect_timeout_s=cfg.connect_timeout_s,
        first_token_timeout_s=cfg.first_token_timeout_s,
        idle_timeout_s=cfg.idle_timeout_s,
    )
    sessions = SessionStore(
        store,
        max_messages=cfg.history_messages,
        max_bytes=cfg.history_max_bytes,
        ttl_s=cfg.session_ttl_s,
        lock_ttl_s=cfg.lock_ttl_s,
    )
    # precise routing for a model other than the mock's: its tokenizer, asked of the engines
    tokenizer = (
        EngineTokenizer(http, router.engines, cfg.model).ids
        if cfg.routing == "precise" and cfg.model != MOCK_MODEL
        else None
    )
    turns = TurnManager(
        store=sessions,
        router=router,
        engine=engine,
        tokenizer=tokenizer,
        metrics=metrics,
        worker_id=cfg.worker_id,
        config=TurnConfig(
            model=cfg.model,
            coalesce=cfg.coalesce,
            presence=cfg.presence,
            admit_wait_s=cfg.admit_wait_s,
            prefix_chars=cfg.prefix_chars,
        ),
        supervisor=sup,
    )
    control = ControlPlane(
        router,
        http,
        engines,
        redis=store,
        discover=cfg.discover_engines,
        interval_s=cfg.control_interval_s,
        on_engine_down=_engine_down(turns.abort_engine, follower),
    )
    exchange = LoadExchange(store, router, cfg.worker_id) if cfg.load_exchange else None
    access = access_check(cfg)
    app[STATE] = WorkerState(
        cfg, store, http, router, metrics, turns, control, exchange, own, access, sup, follower
    )
    app[GATEWAY] = Gateway(
        GatewayConfig(
            model=cfg.model,
            keys=cfg.gateway_keys,
            auth=access.keys is not None,
            default_max_tokens=cfg.default_max_tokens,
            max_tokens_limit=cfg.max_tokens_limit,
            admit_wait_s=cfg.admit_wait_s,
            prefix_chars=cfg.prefix_chars,
            max_body_bytes=cfg.max_body_bytes,
        ),
        router,
        engine,
        metrics,
        draining=lambda: turns.draining,
        turns=turns,
        access=access,
        records=store,
    )
    submitter = JobSubmitter(cfg.amqp_url, QueueNames(cfg.jobs_queue)) if cfg.amqp_url else None
    if submitter is not None:
        app[JOBS] = JobsApi(
            store=JobStore(store, ttl_s=cfg.job_ttl_s),
            submitter=submitter,
            access=access,
            api_keys=cfg.gateway_keys,
            default_max_tokens=cfg.default_max_tokens,
            max_tokens_limit=cfg.max_tokens_limit,
            max_prompt_chars=cfg.max_message_chars,
            max_body_bytes=cfg.max_body_bytes,
        )

    async def redis_reached() -> None:
        turns.redis_ready = True
        await turns.control.start(sup)  # stops asked of this worker's turns elsewhere
        control.start_discovery()
        if exchange is not None:
            await exchange.start(sup)

    await control.start(sup, discovery=False)
    props = PropsReader(http, router.profiles, router.engines)
    sup.every("engine_props", _PROPS_INTERVAL_S, props.step, critical=False)  # first: now
    if follower is not None:
        await follower.start()
        sup.every("kv_events_tick", 1.0, _tick(follower), critical=False)
    if unreachable is None:
        await redis_reached()
    else:
        log.warning(
            "redis at %s unreachable (%s); retrying in the background",
            mask_url(cfg.redis_url),
            unreachable,
        )
        turns.redis_ready = False
        sup.set_condition(REDIS_UNREACHABLE, True)
        _connect_in_background(sup, store, cfg, redis_reached)
    try:
        yield
    finally:

        async def close_redis() -> None:
            if own:
                await store.aclose()

        async def close_submitter() -> None:
            if submitter is not None:
                await submitter.close()

        async def withdraw() -> None:
            if exchange is not None and turns.redis_ready:
                await exchange.withdraw()

        async def stop_follower() -> None:
            if follower is not None:
                await follower.stop()

        await _always(
            lambda: turns.drain(cfg.shutdown_deadline_s),
            sup.stop,
            stop_follower,
            turns.control.close,
            withdraw,
            http.close,
            close_submitter,
            close_redis,
        )
