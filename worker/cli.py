"""The ``tokenrelay worker`` subcommand: serve the turn API.

``register(subparsers)`` is the entry point of the group ``tokenrelay.commands``
(``worker = "worker.cli:register"``); ``tokenrelay.cli`` calls it to add the parser (one
flag per setting of :class:`worker.config.WorkerConfig`) and then the parser's default
``func`` (:func:`run`) with the parsed arguments. ``run`` loads the config
(:func:`config_from_args`) and serves :func:`serve` on uvloop when available. Works the
same against a real vLLM / SGLang / Ollama (``--engine http://gpu-1:8000 --model
<served name> --engine-cap <max seqs>``).

Shutdown on SIGTERM/SIGINT: the worker stops taking turns at once (POSTs and /readyz
answer 503 while the listener is still open, so a load balancer drains it), lets running
turns finish for ``--shutdown-deadline-s``, ends the rest with an ``error`` frame
"worker shutdown", then closes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from relay.service import runtime, settings
from relay.service.httpguard import GUARD, GuardedSite
from worker.api import begin_drain, make_app
from worker.config import WorkerConfig
from worker.state import STATE, access_check

__all__ = ["config_from_args", "register", "run", "serve"]


def register(subparsers: Any) -> None:
    """Add ``worker`` to the ``tokenrelay`` subcommands."""
    p = subparsers.add_parser(
        "worker",
        help="run a worker: turn API, cache-affine routing to engines, token publishing",
        description="Stateless worker pod: keeps chat history in Redis, routes each turn "
        "to an OpenAI-compatible engine with bounded-load consistent hashing and "
        "publishes the streamed tokens to the session's shard channel. " + settings.ENV_NOTE,
    )
    settings.add_arguments(p, WorkerConfig)
    p.set_defaults(func=run)


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> WorkerConfig:
    """Flags > environment (``os.environ`` unless given) > defaults, checked; ValueError
    (one line) for a configuration the worker refuses, signing keys and the trusted
    proxies included."""
    cfg = settings.load(WorkerConfig, args, environ)
    access_check(cfg)  # a signing key, readable key files, a valid proxy list
    return cfg


async def serve(cfg: WorkerConfig, host: str, port: int) -> int:
    """Serve until SIGTERM/SIGINT, then drain (see the module docstring); 1 when Redis
    cannot be reached at start, 2 when the port cannot be listened on."""
    app = make_app(cfg)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=cfg.shutdown_deadline_s + 5)
    if (busy := runtime.cannot_listen(host, port)) is not None:
        print(f"error: {busy}", file=sys.stderr)  # before Redis: the one thing to say
        return 2
    async with runtime.stop_on_signals() as stop:
        if not await runtime.set_up(runner, cfg.redis_url):
            return 1
        try:
            # slow heads and bodies get 408, idle connections are closed, an address capped
            site = GuardedSite(runner, host, port, guard=app[GUARD], backlog=4096)
            try:
                await site.start()
            except OSError as exc:  # taken since the check: one line, never a traceback
                print(f"error: {runtime.listen_error(host, port, exc)}", file=sys.stderr)
                return 2
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
    return runtime.run(serve(cfg, cfg.host, cfg.port))
