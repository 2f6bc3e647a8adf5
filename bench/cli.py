"""``tokenrelay bench ...``: the benchmark subcommands, registered through the
``tokenrelay.commands`` entry-point group (``bench = "bench.cli:register"``).

Order of use: :func:`tokenrelay.cli.build_parser` calls :func:`register` with its
subparsers; ``register`` adds a ``bench`` parser and one subcommand per entry of
:data:`BENCHMARKS` (``pubsub``, ``loadtest``, ``affinity``, ``relay_throughput``; another
benchmark is one more entry). Each benchmark module provides ``add_arguments(parser)`` and
``run_from_args(args) -> int``; it is imported when the parser is built and its heavy
dependencies (matplotlib) only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["BENCHMARKS", "register", "register_loadtest"]

# subcommand -> (help text, module with add_arguments / run_from_args)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "pubsub": ("PUBLISH vs SPUBLISH cost on local Redis Clusters", "bench.pubsub.cluster"),
    "loadtest": ("many screens per session while turns stream (SSE + WS)", "bench.load.loadtest"),
    "affinity": (
        "engines' prefix-cache hit rate: ring routing vs round robin",
        "bench.routing.affinity",
    ),
    "relay_throughput": (
        "one relay process: frames/s vs a raw Redis reader, fan-out, latency, RSS per idle conn",
        "bench.relay.throughput",
    ),
    "mq_vs_pubsub": (
        "token streaming: Redis sharded Pub/Sub vs RabbitMQ (queue per connection, topic)",
        "bench.pubsub.mq_vs_pubsub",
    ),
    "peer_socketio": (
        "the relay beside Socket.IO with the sharded Redis adapter: CPU/msg, latency, RSS/conn",
        "bench.peers.socketio",
    ),
}


def register(subparsers: Any) -> None:
    """Add ``bench`` and its subcommands to the ``tokenrelay`` parser."""
    p = subparsers.add_parser("bench", help="benchmarks (see bench/README.md)")
    bsub = p.add_subparsers(dest="bench_cmd", required=True)
    for name, (text, module) in BENCHMARKS.items():
        mod = importlib.import_module(module)
        bp: argparse.ArgumentParser = bsub.add_parser(name, help=text, description=text)
        mod.add_arguments(bp)
        run: Callable[[argparse.Namespace], int] = mod.run_from_args
        bp.set_defaults(func=run)


def register_loadtest(subparsers: Any) -> None:
    """``tokenrelay loadtest``: the load test as a top-level command too."""
    mod = importlib.import_module("bench.load.loadtest")
    p: argparse.ArgumentParser = subparsers.add_parser(
        "loadtest", help="load test: many screens per session while turns stream"
    )
    mod.add_arguments(p)
    run: Callable[[argparse.Namespace], int] = mod.run_from_args
    p.set_defaults(func=run)
