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
import os
import sys
from dataclasses import replace
from typing import Any

from aiohttp import web
from redis.exceptions import RedisClusterException, RedisError

from relay.redisio.connect import RedisTLS, add_tls_arguments, startup_error
from relay.redisio.errors import RelayError
from relay.service import runtime
from relay.service.httpguard import GuardedSite
from worker.api import STATE, WorkerConfig, access_check, begin_drain, default_worker_id, make_app
from worker.chat.coalesce import DEFAULT_POLICY, CoalescePolicy
from worker.chat.presence import PresencePolicy
from worker.routing.control import parse_engine_arg
from worker.routing.router import ROUTING_POLICIES, SPILL_POLICIES

__all__ = ["config_from_args", "register", "run", "serve"]


def register(subparsers: Any) -> None:
    """Add ``worker`` to the ``tokenrelay`` subcommands."""
    d = WorkerConfig()
    p = subparsers.add_parser(
        "worker",
        help="run a worker: turn API, cache-affine routing to engines, token publishing",
        description="Stateless worker pod: keeps chat history in Redis, routes each turn "
        "to an OpenAI-compatible engine with bounded-load consistent hashing and "
        "publishes the streamed tokens to the session's shard channel.",
    )
    p.add_argument("--port", type=int, required=True, help="TCP port (0 picks a free one)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument(
        "--redis",
        default=os.environ.get("TOKENRELAY_REDIS_URL"),
        help="redis://host:port (rediss:// for TLS) of a cluster node (or TOKENRELAY_REDIS_URL)",
    )
    add_tls_arguments(p)
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="[ID=]URL",
        help="an OpenAI-compatible engine (repeat); id defaults to host:port",
    )
    p.add_argument(
        "--engine-cap",
        type=int,
        default=12,
        help="in-flight requests per engine (12): about 1.5 x the engine's concurrent "
        "sequences (vLLM --max-num-seqs; the mock engine runs 8), see docs/ROUTING.md",
    )
    p.add_argument(
        "--discover-engines",
        action="store_true",
        help="also use engines announced in Redis (tr:engines heartbeats)",
    )
    env = os.environ.get
    p.add_argument(
        "--secret",
        default=env("TOKENRELAY_SECRET"),
        help="HS256 secret of session tokens (>= 32 bytes), shared with relays; prefer "
        "TOKENRELAY_SECRET (a flag is visible in ps)",
    )
    p.add_argument(
        "--kid",
        default=env("TOKENRELAY_KID", d.kid),
        help=f"id of the key tokens are signed with (or TOKENRELAY_KID; {d.kid})",
    )
    p.add_argument(
        "--keys",
        dest="keys_file",
        default=env("TOKENRELAY_KEYS_FILE"),
        help="JWK Set file: previous HS256 secrets (rotation) or an ES256/RS256 private key "
        "named by --kid (or TOKENRELAY_KEYS_FILE)",
    )
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        default=env("TOKENRELAY_INSECURE_NO_AUTH", "").lower() in ("1", "true", "yes", "on"),
        help="no tokens (dev only; or TOKENRELAY_INSECURE_NO_AUTH=1)",
    )
    p.add_argument(
        "--trusted-proxy",
        dest="trusted_proxies",
        default=env("TOKENRELAY_TRUSTED_PROXIES", ""),
        help="addresses / CIDRs whose X-Forwarded-For names the client (none)",
    )
    limits = (
        ("--max-token-ttl-s", int, d.max_token_ttl_s,
         "longest token lifetime, also capped by --session-ttl-s"),
        ("--session-rate", float, d.session_rate_per_s,
         "new sessions per second per client address after the burst; 0: off"),
        ("--session-burst", int, d.session_burst, "new sessions at once per client address"),
        ("--turns-per-minute", int, d.turns_per_minute,
         "turn requests per session per minute; 0: off"),
        ("--default-max-tokens", int, d.default_max_tokens,
         "max_tokens of a turn that gives none"),
        ("--max-reply-bytes", int, d.max_reply_bytes,
         "an engine reply is cut (and stored) at this many bytes"),
    )  # fmt: skip
    for flag, kind, default, text in limits:
        p.add_argument(flag, type=kind, default=default, help=f"{text} ({default:g})")
    p.add_argument("--model", default=d.model, help=f"model name sent to engines ({d.model})")
    p.add_argument("--worker-id", default=None, help="unique id (default hostname-pid)")
    p.add_argument("--coalesce-tokens", type=int, default=DEFAULT_POLICY.max_tokens)
    p.add_argument(
        "--coalesce-ms", type=float, default=DEFAULT_POLICY.max_delay_s * 1000, help="flush after"
    )
    p.add_argument("--presence-grace-s", type=float, default=d.presence.grace_s)
    p.add_argument("--history-messages", type=int, default=d.history_messages)
    p.add_argument(
        "--history-max-bytes",
        type=int,
        default=d.history_max_bytes,
        help=f"bytes a session's history may store; the oldest messages go first "
        f"({d.history_max_bytes})",
    )
    p.add_argument("--session-ttl-s", type=int, default=d.session_ttl_s)
    p.add_argument("--max-tokens-limit", type=int, default=d.max_tokens_limit)
    p.add_argument("--first-token-timeout-s", type=float, default=d.first_token_timeout_s)
    p.add_argument("--idle-timeout-s", type=float, default=d.idle_timeout_s)
    p.add_argument("--shutdown-deadline-s", type=float, default=d.shutdown_deadline_s)
    p.add_argument("--spill", choices=SPILL_POLICIES, default=d.spill, help=f"({d.spill})")
    p.add_argument("--vnodes", type=int, default=d.vnodes, help=f"per engine ({d.vnodes})")
    p.add_argument("--eps", type=float, default=d.eps, help=f"bounded-load slack ({d.eps})")
    p.add_argument(
        "--prefix-chars",
        type=int,
        default=d.prefix_chars,
        help=f"characters of the conversation in the routing key ({d.prefix_chars})",
    )
    p.add_argument(
        "--engine-weight",
        action="append",
        default=[],
        metavar="ID=W",
        help="share of the ring and of the load for one engine (default 1; repeatable)",
    )
    p.add_argument(
        "--routing",
        choices=ROUTING_POLICIES,
        default=d.routing,
        help="ring: prefix-aware consistent hashing (default); round_robin: a cache-blind "
        "baseline for measurements",
    )
    p.add_argument("--no-load-exchange", action="store_true", help="do not share load")
    p.add_argument(
        "--amqp",
        default=os.environ.get("TOKENRELAY_AMQP_URL", ""),
        metavar="URL",
        help="RabbitMQ URL (amqp://user:pass@host:5672/): enables POST/GET /v1/jobs "
        "(env TOKENRELAY_AMQP_URL); `tokenrelay jobworker` runs the jobs",
    )
    p.add_argument("--jobs-queue", default=d.jobs_queue, help=f"queue name ({d.jobs_queue})")
    p.add_argument(
        "--gateway-key",
        action="append",
        default=[k for k in os.environ.get("TOKENRELAY_GATEWAY_KEYS", "").split(",") if k],
        metavar="KEY",
        help="a bearer key for the OpenAI-compatible /v1/chat/completions (repeatable; env "
        "TOKENRELAY_GATEWAY_KEYS, comma-separated); without one the gateway answers 401",
    )
    p.add_argument(
        "--admit-wait-s",
        type=float,
        default=d.admit_wait_s,
        help=f"how long a turn waits for an engine slot before 429 ({d.admit_wait_s})",
    )
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    if not args.redis:
        raise ValueError("give --redis (or set TOKENRELAY_REDIS_URL)")
    if args.insecure_no_auth and (args.secret or args.keys_file):
        raise ValueError(
            "a token secret and --insecure-no-auth (TOKENRELAY_INSECURE_NO_AUTH) are both set: "
            "choose one"
        )
    if not args.insecure_no_auth and not (args.secret or args.keys_file):
        raise ValueError("set TOKENRELAY_SECRET (or --keys FILE), or --insecure-no-auth")
    tls = RedisTLS.from_args(args)
    tls.check(args.redis)  # ValueError: a one-line reason
    weights: dict[str, float] = {}
    for item in args.engine_weight:
        eid, sep, w = item.partition("=")
        try:
            weights[eid] = float(w)
        except ValueError:
            sep = ""
        if not sep or not eid or not weights.get(eid, 0) > 0:
            raise ValueError(f"--engine-weight wants ID=W with W > 0, got {item!r}")
    engines = [parse_engine_arg(e, args.engine_cap) for e in args.engine]
    engines = [replace(e, weight=weights.get(e.id, e.weight)) for e in engines]
    unknown = set(weights) - {e.id for e in engines}
    if unknown and not args.discover_engines:
        raise ValueError(f"--engine-weight names no --engine: {', '.join(sorted(unknown))}")
    if not engines and not args.discover_engines:
        raise ValueError("give at least one --engine (or --discover-engines)")
    cfg = WorkerConfig(
        redis_url=args.redis,
        redis_tls=tls,
        engines=engines,
        secret=None if args.insecure_no_auth else (args.secret or None),
        kid=args.kid,
        keys_file=None if args.insecure_no_auth else args.keys_file,
        trusted_proxies=args.trusted_proxies,
        max_token_ttl_s=args.max_token_ttl_s,
        session_rate_per_s=args.session_rate,
        session_burst=args.session_burst,
        turns_per_minute=args.turns_per_minute,
        default_max_tokens=args.default_max_tokens,
        max_reply_bytes=args.max_reply_bytes,
        model=args.model,
        worker_id=args.worker_id or default_worker_id(),
        coalesce=CoalescePolicy(args.coalesce_tokens, args.coalesce_ms / 1000),
        presence=PresencePolicy(grace_s=args.presence_grace_s),
        history_messages=args.history_messages,
        history_max_bytes=args.history_max_bytes,
        session_ttl_s=args.session_ttl_s,
        max_tokens_limit=args.max_tokens_limit,
        first_token_timeout_s=args.first_token_timeout_s,
        idle_timeout_s=args.idle_timeout_s,
        shutdown_deadline_s=args.shutdown_deadline_s,
        spill=args.spill,
        routing=args.routing,
        discover_engines=args.discover_engines,
        load_exchange=not args.no_load_exchange,
        admit_wait_s=args.admit_wait_s,
        vnodes=args.vnodes,
        eps=args.eps,
        prefix_chars=args.prefix_chars,
        gateway_keys=tuple(args.gateway_key),
        amqp_url=args.amqp,
        jobs_queue=args.jobs_queue,
    )
    if cfg.history_max_bytes < 0:
        raise ValueError("--history-max-bytes must be >= 0 (0: no byte bound)")
    if any(len(k) < 16 for k in cfg.gateway_keys):
        raise ValueError("a --gateway-key must be at least 16 characters")
    if cfg.vnodes < 1 or cfg.eps < 0 or cfg.prefix_chars < 0:
        raise ValueError("--vnodes must be >= 1, --eps and --prefix-chars >= 0")
    if not 1 <= cfg.default_max_tokens <= cfg.max_tokens_limit:
        raise ValueError("--default-max-tokens must be in [1, --max-tokens-limit]")
    if cfg.max_reply_bytes < 1024 or cfg.max_token_ttl_s < 1:
        raise ValueError("--max-reply-bytes must be >= 1024, --max-token-ttl-s >= 1")
    if cfg.session_rate_per_s < 0 or cfg.session_burst < 1 or cfg.turns_per_minute < 0:
        raise ValueError("--session-rate and --turns-per-minute must be >= 0, --session-burst >= 1")
    access_check(cfg)  # weak or default secrets, bad key files, bad proxy lists: refused here
    if not 0 <= cfg.admit_wait_s < cfg.lock_ttl_s:  # the session lock is held while waiting
        raise ValueError(f"--admit-wait-s must be in [0, {cfg.lock_ttl_s:g})")
    return cfg


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
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return runtime.run(serve(cfg, args.host, args.port))
