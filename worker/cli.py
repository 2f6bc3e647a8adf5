"""The ``tokenrelay worker`` subcommand: serve the turn API.

``register(subparsers)`` is the entry point of the group ``tokenrelay.commands``
(``worker = "worker.cli:register"``); ``tokenrelay.cli`` calls it to add the parser and
then the parser's default ``func`` (:func:`run`) with the parsed arguments. ``run``
builds a :class:`worker.api.WorkerConfig` (:func:`config_from_args`) and serves
:func:`serve` on uvloop when available. Works the same against a real vLLM / SGLang /
Ollama (``--engine http://gpu-1:8000 --model <served name> --engine-cap <max seqs>``).

Shutdown on SIGTERM/SIGINT: the worker stops taking turns at once (POSTs and /readyz
answer 503 while the listener is still open, so a load balancer drains it), lets running
turns finish for ``--shutdown-deadline-s``, ends the rest with an ``error`` frame
"worker shutdown", then closes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Annotated, Any, Final

import msgspec
from aiohttp import web
from redis.exceptions import RedisClusterException, RedisError

from relay.broker.errors import RelayError
from relay.broker.rediscluster.connect import RedisTLS, startup_error
from relay.protocol.auth import DEFAULT_KID
from relay.service import runtime, settings
from relay.service.httpguard import GuardedSite
from relay.service.settings import (
    FailFast,
    Host,
    InsecureNoAuth,
    KeysFile,
    Kid,
    RedisCA,
    RedisCert,
    RedisKey,
    RedisURL,
    Secret,
    TrustedProxies,
    opt,
)
from worker.api import begin_drain, make_app
from worker.chat.coalesce import DEFAULT_POLICY, CoalescePolicy
from worker.chat.presence import PresencePolicy
from worker.config import WorkerConfig, default_worker_id
from worker.routing.control import parse_engine_arg
from worker.routing.policy import ROUTING_POLICIES, SPILL_POLICIES
from worker.state import STATE, access_check

__all__ = ["WorkerSettings", "config_from_args", "load_settings", "register", "run", "serve"]

_D: Final = WorkerConfig(worker_id="-")  # the worker's defaults


class WorkerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The worker's flags and environment (``TOKENRELAY_<FIELD>``), declared once; see
    :mod:`relay.service.settings`. :meth:`worker_config` makes the running config."""

    port: Annotated[int, opt("TCP port (0 picks a free one)", ge=0, le=65535, required=True)] = 0
    host: Host = "127.0.0.1"
    redis_url: RedisURL = ""
    redis_ca: RedisCA = ""
    redis_cert: RedisCert = ""
    redis_key: RedisKey = ""
    secret: Secret = ""
    kid: Kid = DEFAULT_KID
    keys_file: KeysFile = ""
    insecure_no_auth: InsecureNoAuth = False
    trusted_proxies: TrustedProxies = ""
    fail_fast: FailFast = False
    engines: Annotated[
        tuple[str, ...],
        opt("an OpenAI-compatible engine (repeat); id defaults to host:port", flag="--engine",
            metavar="[ID=]URL"),
    ] = ()  # fmt: skip
    engine_cap: Annotated[
        int, opt("in-flight requests per engine: about 1.5 x the engine's concurrent sequences "
                 "(vLLM --max-num-seqs; the mock engine runs 8), see docs/ROUTING.md", ge=1)
    ] = 12  # fmt: skip
    engine_weights: Annotated[
        tuple[str, ...],
        opt("share of the ring and of the load for one engine (default 1; repeatable)",
            flag="--engine-weight", metavar="ID=W"),
    ] = ()  # fmt: skip
    discover_engines: Annotated[
        bool, opt("also use engines announced in Redis (tr:engines heartbeats)")
    ] = False
    max_token_ttl_s: Annotated[
        int, opt("longest token lifetime, also capped by --session-ttl-s", ge=1)
    ] = _D.max_token_ttl_s
    session_rate: Annotated[
        float, opt("new sessions per second per client address after the burst; 0: off", ge=0)
    ] = _D.session_rate_per_s
    session_burst: Annotated[int, opt("new sessions at once per client address", ge=1)] = (
        _D.session_burst
    )
    turns_per_minute: Annotated[int, opt("turn requests per session per minute; 0: off", ge=0)] = (
        _D.turns_per_minute
    )
    default_max_tokens: Annotated[int, opt("max_tokens of a turn that gives none", ge=1)] = (
        _D.default_max_tokens
    )
    max_reply_bytes: Annotated[
        int, opt("an engine reply is cut (and stored) at this many bytes", ge=1024)
    ] = _D.max_reply_bytes
    model: Annotated[str, opt("model name sent to engines")] = _D.model
    worker_id: Annotated[str, opt("unique id (empty: hostname-pid)")] = ""
    coalesce_tokens: Annotated[int, opt("flush a frame at this many tokens", ge=1)] = (
        DEFAULT_POLICY.max_tokens
    )
    coalesce_ms: Annotated[float, opt("flush a frame after this many ms", ge=0)] = (
        DEFAULT_POLICY.max_delay_s * 1000
    )
    presence_grace_s: Annotated[
        float, opt("how long a turn may generate with nobody watching", gt=0)
    ] = _D.presence.grace_s
    history_messages: Annotated[int, opt("messages of history sent to the engine", ge=1)] = (
        _D.history_messages
    )
    history_max_bytes: Annotated[
        int, opt("bytes a session's history may store; the oldest messages go first; "
                 "0: no byte bound", ge=0)
    ] = _D.history_max_bytes  # fmt: skip
    session_ttl_s: Annotated[int, opt("a session's lifetime in Redis", ge=1)] = _D.session_ttl_s
    max_tokens_limit: Annotated[int, opt("largest max_tokens a turn may ask for", ge=1)] = (
        _D.max_tokens_limit
    )
    first_token_timeout_s: Annotated[
        float, opt("an engine's first token must come this fast", gt=0)
    ] = _D.first_token_timeout_s
    idle_timeout_s: Annotated[float, opt("longest silence of an engine between tokens", gt=0)] = (
        _D.idle_timeout_s
    )
    shutdown_deadline_s: Annotated[
        float, opt("SIGTERM: running turns may finish for this long", ge=0)
    ] = _D.shutdown_deadline_s
    spill: Annotated[
        str, opt("where a turn goes when its engine is full", choices=SPILL_POLICIES)
    ] = _D.spill
    routing: Annotated[
        str, opt("cost_aware (default): least expected queue wait + prefill of what the "
                 "engine does not hold; ring: prefix-aware consistent hashing; round_robin: "
                 "a cache-blind baseline for measurements", choices=ROUTING_POLICIES)
    ] = _D.routing  # fmt: skip
    route_queue: Annotated[
        float, opt("cost_aware: turns an engine may take past its cap, as a multiple of the "
                   "cap (0: refuse at the cap)", ge=0, le=16)
    ] = _D.route_queue  # fmt: skip
    route_queue_slo_s: Annotated[
        float, opt("cost_aware: a turn queues past the cap only when its first token is "
                   "expected within this many seconds", gt=0)
    ] = _D.route_queue_slo_s  # fmt: skip
    vnodes: Annotated[int, opt("ring points per engine", ge=1)] = _D.vnodes
    eps: Annotated[float, opt("bounded-load slack", ge=0)] = _D.eps
    prefix_chars: Annotated[int, opt("characters of the conversation in the routing key", ge=0)] = (
        _D.prefix_chars
    )
    load_exchange: Annotated[
        bool, opt("do not share load with the other workers", flag="--no-load-exchange")
    ] = True  # fmt: skip
    amqp_url: Annotated[
        str, opt("RabbitMQ URL (amqp://user:pass@host:5672/): enables POST/GET /v1/jobs; "
                 "`tokenrelay jobworker` runs the jobs", flag="--amqp", metavar="URL")
    ] = ""  # fmt: skip
    jobs_queue: Annotated[str, opt("job queue name")] = _D.jobs_queue
    gateway_keys: Annotated[
        tuple[str, ...],
        opt("a bearer key (>= 16 characters) for the OpenAI-compatible /v1/chat/completions "
            "(repeatable; comma-separated in the environment); without one the gateway "
            "answers 401", flag="--gateway-key", metavar="KEY"),
    ] = ()  # fmt: skip
    admit_wait_s: Annotated[
        float, opt("how long a turn waits for an engine slot before 429 (below the session "
                   "lock's TTL, which it holds meanwhile)", ge=0, lt=_D.lock_ttl_s)
    ] = _D.admit_wait_s  # fmt: skip

    @property
    def redis_tls(self) -> RedisTLS:
        return RedisTLS(ca=self.redis_ca, cert=self.redis_cert, key=self.redis_key)

    def validate(self) -> WorkerSettings:
        """The rules between fields (the declared bounds are checked before)."""
        settings.check_redis(self.redis_url, self.redis_tls)
        settings.check_auth(self.secret, self.kid, self.keys_file, self.insecure_no_auth)
        if not self.engines and not self.discover_engines:
            raise settings.ConfigError("give at least one --engine (or --discover-engines)")
        if self.default_max_tokens > self.max_tokens_limit:
            raise settings.ConfigError("--default-max-tokens must be in [1, --max-tokens-limit]")
        if any(len(k) < 16 for k in self.gateway_keys):
            raise settings.ConfigError("a --gateway-key must be at least 16 characters")
        return self

    def worker_config(self) -> WorkerConfig:
        """The running worker's config; ValueError (one line) for what only it can tell
        (engine URLs and weights, signing keys, proxy lists)."""
        weights: dict[str, float] = {}
        for item in self.engine_weights:
            eid, sep, w = item.partition("=")
            try:
                weights[eid] = float(w)
            except ValueError:
                sep = ""
            if not sep or not eid or not weights.get(eid, 0) > 0:
                raise ValueError(f"--engine-weight wants ID=W with W > 0, got {item!r}")
        engines = [parse_engine_arg(e, self.engine_cap) for e in self.engines]
        engines = [replace(e, weight=weights.get(e.id, e.weight)) for e in engines]
        unknown = set(weights) - {e.id for e in engines}
        if unknown and not self.discover_engines:
            raise ValueError(f"--engine-weight names no --engine: {', '.join(sorted(unknown))}")
        auth = not self.insecure_no_auth
        cfg = WorkerConfig(
            redis_url=self.redis_url,
            redis_tls=self.redis_tls,
            engines=engines,
            secret=(self.secret or None) if auth else None,
            kid=self.kid,
            keys_file=(self.keys_file or None) if auth else None,
            trusted_proxies=self.trusted_proxies,
            fail_fast=self.fail_fast,
            max_token_ttl_s=self.max_token_ttl_s,
            session_rate_per_s=self.session_rate,
            session_burst=self.session_burst,
            turns_per_minute=self.turns_per_minute,
            default_max_tokens=self.default_max_tokens,
            max_reply_bytes=self.max_reply_bytes,
            model=self.model,
            worker_id=self.worker_id or default_worker_id(),
            coalesce=CoalescePolicy(self.coalesce_tokens, self.coalesce_ms / 1000),
            presence=PresencePolicy(grace_s=self.presence_grace_s),
            history_messages=self.history_messages,
            history_max_bytes=self.history_max_bytes,
            session_ttl_s=self.session_ttl_s,
            max_tokens_limit=self.max_tokens_limit,
            first_token_timeout_s=self.first_token_timeout_s,
            idle_timeout_s=self.idle_timeout_s,
            shutdown_deadline_s=self.shutdown_deadline_s,
            spill=self.spill,
            routing=self.routing,
            route_queue=self.route_queue,
            route_queue_slo_s=self.route_queue_slo_s,
            discover_engines=self.discover_engines,
            load_exchange=self.load_exchange,
            admit_wait_s=self.admit_wait_s,
            vnodes=self.vnodes,
            eps=self.eps,
            prefix_chars=self.prefix_chars,
            gateway_keys=self.gateway_keys,
            amqp_url=self.amqp_url,
            jobs_queue=self.jobs_queue,
        )
        access_check(cfg)  # a signing key, readable key files, a valid proxy list
        return cfg


def register(subparsers: Any) -> None:
    """Add ``worker`` to the ``tokenrelay`` subcommands."""
    p = subparsers.add_parser(
        "worker",
        help="run a worker: turn API, cache-affine routing to engines, token publishing",
        description="Stateless worker pod: keeps chat history in Redis, routes each turn "
        "to an OpenAI-compatible engine with bounded-load consistent hashing and "
        "publishes the streamed tokens to the session's shard channel. " + settings.ENV_NOTE,
    )
    settings.add_arguments(p, WorkerSettings)
    p.set_defaults(func=run)


def load_settings(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> WorkerSettings:
    """Flags > environment > defaults, checked (:class:`~relay.service.settings.ConfigError`)."""
    return settings.load(WorkerSettings, args, environ)


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> WorkerConfig:
    """The running config from the parsed flags and the environment; ValueError (one
    line) for a configuration the worker refuses."""
    return load_settings(args, environ).worker_config()


async def serve(cfg: WorkerConfig, host: str, port: int) -> int:
    """Serve until SIGTERM/SIGINT, then drain (see the module docstring); 1 when Redis
    cannot be reached at start."""
    app = make_app(cfg)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=cfg.shutdown_deadline_s + 5)
    async with runtime.stop_on_signals() as stop:
        try:
            await runner.setup()  # connects to Redis (TLS handshake included)
        except (RedisError, RedisClusterException, RelayError, OSError) as exc:
            print(f"error: {startup_error(cfg.redis_url, exc)}", file=sys.stderr)
            await runner.cleanup()
            return 1
        try:
            site = GuardedSite(runner, host, port, backlog=4096)  # 408 for slowloris heads
            await site.start()
            bound = runner.addresses[0][1] if runner.addresses else port
            print(f"worker {cfg.worker_id} listening on http://{host}:{bound}", flush=True)
            await stop.wait()
            begin_drain(app)  # 503 from here on, while running turns finish
            await app[STATE].turns.drain(cfg.shutdown_deadline_s)
        finally:
            await runner.cleanup()  # the app's cleanup drains the turns within the deadline
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        opts = load_settings(args)
        cfg = opts.worker_config()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return runtime.run(serve(cfg, opts.host, opts.port))
