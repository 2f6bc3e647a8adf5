"""The ``tokenrelay worker`` subcommand: serve the turn API.

``register(subparsers)`` is the entry point of the group ``tokenrelay.commands``
(``worker = "worker.cli_worker:register"``); ``relay.cli`` calls it to add the parser and
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

from relay import runtime
from relay.errors import RelayError
from relay.httpguard import GuardedSite
from relay.redis_client import RedisTLS, add_tls_arguments, startup_error
from worker.api import STATE, WorkerConfig, begin_drain, default_worker_id, make_app
from worker.coalesce import DEFAULT_POLICY, CoalescePolicy
from worker.control import parse_engine_arg
from worker.presence import PresencePolicy
from worker.router import ROUTING_POLICIES, SPILL_POLICIES

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
    auth = p.add_mutually_exclusive_group()
    auth.add_argument(
        "--secret",
        default=os.environ.get("TOKENRELAY_SECRET"),
        help="HMAC secret for session tokens, shared with relays (or TOKENRELAY_SECRET)",
    )
    auth.add_argument("--insecure-no-auth", action="store_true", help="no tokens (dev only)")
    p.add_argument("--model", default=d.model, help=f"model name sent to engines ({d.model})")
    p.add_argument("--worker-id", default=None, help="unique id (default hostname-pid)")
    p.add_argument("--coalesce-tokens", type=int, default=DEFAULT_POLICY.max_tokens)
    p.add_argument(
        "--coalesce-ms", type=float, default=DEFAULT_POLICY.max_delay_s * 1000, help="flush after"
    )
    p.add_argument("--presence-grace-s", type=float, default=d.presence.grace_s)
    p.add_argument("--history-messages", type=int, default=d.history_messages)
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
        "--admit-wait-s",
        type=float,
        default=d.admit_wait_s,
        help=f"how long a turn waits for an engine slot before 429 ({d.admit_wait_s})",
    )
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    if not args.redis:
        raise ValueError("give --redis (or set TOKENRELAY_REDIS_URL)")
    if not args.insecure_no_auth and not args.secret:
        raise ValueError("give --secret (or TOKENRELAY_SECRET), or --insecure-no-auth")
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
        secret=None if args.insecure_no_auth else args.secret,
        model=args.model,
        worker_id=args.worker_id or default_worker_id(),
        coalesce=CoalescePolicy(args.coalesce_tokens, args.coalesce_ms / 1000),
        presence=PresencePolicy(grace_s=args.presence_grace_s),
        history_messages=args.history_messages,
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
    )
    if cfg.vnodes < 1 or cfg.eps < 0 or cfg.prefix_chars < 0:
        raise ValueError("--vnodes must be >= 1, --eps and --prefix-chars >= 0")
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
