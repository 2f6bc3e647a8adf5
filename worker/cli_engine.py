"""The ``tokenrelay engine`` subcommand: run one mock inference engine.

``register(subparsers)`` is the entry point of the group ``tokenrelay.commands``
(``engine = "worker.cli_engine:register"``); ``relay.cli`` calls it to add the parser,
then calls the parser's default ``func`` (``run``) with the parsed arguments. ``run``
builds an ``EngineConfig`` and serves ``worker.mock_engine.run_engine`` on uvloop
(plain asyncio where uvloop is missing) until SIGTERM or SIGINT.
``python -m worker.cli_engine --port P ...`` does the same without the entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from worker.mock_engine import EngineConfig, run_engine

__all__ = ["config_from_args", "main", "register", "run"]


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
    p.add_argument("--id", dest="engine_id", default=d.engine_id, help="engine id")
    p.add_argument("--model", default=d.model, help="model name served")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        port=args.port,
        host=args.host,
        kv_tokens=args.kv_tokens,
        prefill_tok_per_s=args.prefill_tok_per_s,
        decode_tok_per_s=args.decode_tok_per_s,
        max_concurrency=args.max_concurrency,
        engine_id=args.engine_id,
        model=args.model,
    )


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code."""
    cfg = config_from_args(args)
    try:
        import uvloop
    except ImportError:
        asyncio.run(run_engine(cfg))
    else:
        uvloop.run(run_engine(cfg))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone ``python -m worker.cli_engine`` (same options as ``tokenrelay engine``)."""
    parser = argparse.ArgumentParser(prog="python -m worker.cli_engine")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["engine", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
