"""The ``tokenrelay engine`` subcommand: run one mock inference engine.

``register(subparsers)`` is the entry point of the group ``tokenrelay.commands``
(``engine = "devstack.mockengine.cli:register"``); ``tokenrelay.cli`` calls it to add the parser,
then calls the parser's default ``func`` (``run``) with the parsed arguments. ``run``
builds an ``EngineConfig`` and serves ``devstack.mockengine.server.run_engine`` on uvloop
(plain asyncio where uvloop is missing) until SIGTERM or SIGINT.
``python -m devstack.mockengine.cli --port P ...`` does the same without the entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from devstack.mockengine.reply_length import ReplyLength
from devstack.mockengine.server import EngineConfig, run_engine
from relay.redisio.connect import RedisTLS, add_tls_arguments
from relay.service import runtime

__all__ = ["config_from_args", "main", "register", "run", "serve"]


def register(subparsers: Any) -> None:
    """Add ``engine`` to the ``tokenrelay`` subcommands."""
    d = EngineConfig()
    p = subparsers.add_parser(
        "engine",
        help="run a mock OpenAI-compatible engine with a simulated prefix cache",
        description="A GPU-free stand-in for vLLM/SGLang: streams deterministic text, "
        "simulates prefill of uncached prompt tokens and an LRU prefix cache, and serves "
        "vLLM-style /metrics.",
    )
    p.add_argument("--port", type=int, required=True, help="TCP port (0 picks a free one)")
    p.add_argument("--host", default=d.host, help=f"bind address (default {d.host})")
    p.add_argument("--kv-tokens", type=int, default=d.kv_tokens, help="prefix-cache capacity")
    p.add_argument("--prefill-tok-per-s", type=float, default=d.prefill_tok_per_s)
    p.add_argument("--decode-tok-per-s", type=float, default=d.decode_tok_per_s)
    p.add_argument("--max-concurrency", type=int, default=d.max_concurrency)
    p.add_argument(
        "--id", dest="engine_id", default=None, help="engine id (default mock-PORT: unique)"
    )
    p.add_argument("--model", default=d.model, help="model name served")
    p.add_argument(
        "--reply-mean-tokens",
        type=float,
        default=d.reply.mean,
        help=f"mean natural reply length, log-normal per prompt (default {d.reply.mean:g})",
    )
    p.add_argument(
        "--reply-max-tokens",
        type=int,
        default=d.reply.max_tokens,
        help=f"longest natural reply, the tail's end (default {d.reply.max_tokens})",
    )
    p.add_argument("--reply-min-tokens", type=int, default=d.reply.min_tokens)
    p.add_argument(
        "--reply-sigma",
        type=float,
        default=d.reply.sigma,
        help=f"spread of the log-normal (default {d.reply.sigma:g}; 0: every reply the mean)",
    )
    p.add_argument(
        "--redis",
        default=None,
        help="announce this engine to workers (tr:engines heartbeats) on this cluster",
    )
    add_tls_arguments(p)
    p.add_argument(
        "--announce-url", default=None, help="URL workers should use (default http://HOST:PORT)"
    )
    p.add_argument("--cap", type=int, default=None, help="announced in-flight cap (default C)")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        port=args.port,
        host=args.host,
        kv_tokens=args.kv_tokens,
        prefill_tok_per_s=args.prefill_tok_per_s,
        decode_tok_per_s=args.decode_tok_per_s,
        max_concurrency=args.max_concurrency,
        engine_id=args.engine_id or f"mock-{args.port}",
        model=args.model,
        reply=ReplyLength(
            mean=args.reply_mean_tokens,
            max_tokens=args.reply_max_tokens,
            min_tokens=args.reply_min_tokens,
            sigma=args.reply_sigma,
        ),
    )


async def serve(cfg: EngineConfig, args: argparse.Namespace) -> None:
    """Run the engine; with ``--redis``, announce it with expiring heartbeats meanwhile
    (withdrawn on a clean stop; after a crash the heartbeat expires by itself)."""
    if not getattr(args, "redis", None):
        await run_engine(cfg)
        return
    from relay.redisio.connect import connect
    from worker.routing.control import EngineAnnouncer
    from worker.routing.router import EngineSpec

    url = args.announce_url or f"http://{cfg.host}:{cfg.port}"
    redis = connect(args.redis, tls=RedisTLS.from_args(args))
    announcer = EngineAnnouncer(
        redis, EngineSpec(id=cfg.engine_id, url=url, cap=args.cap or cfg.max_concurrency)
    )
    try:
        await redis.initialize()
        engine = asyncio.create_task(run_engine(cfg))
        await asyncio.sleep(0.2)  # listening before workers are told about it
        if not engine.done():
            await announcer.start()
        await engine
    finally:
        await announcer.stop()
        await redis.aclose()


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code."""
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "redis", None) and cfg.port == 0 and not args.announce_url:
        print("error: --redis needs a fixed --port (or --announce-url)", file=sys.stderr)
        return 2
    if getattr(args, "redis", None):
        try:
            RedisTLS.from_args(args).check(args.redis)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    runtime.run(serve(cfg, args))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone ``python -m devstack.mockengine.cli`` (same options as ``tokenrelay engine``)."""
    parser = argparse.ArgumentParser(prog="python -m devstack.mockengine.cli")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["engine", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
