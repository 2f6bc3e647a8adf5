"""``tokenrelay relay``: run one edge server (SSE + WebSocket) on uvloop.

Registered through the entry-point group ``tokenrelay.commands``
(``relay = "relay.edge.cli:register"``). Flags override ``TOKENRELAY_*`` environment
variables (see :mod:`relay.edge.config`); ``--fail-fast`` (TOKENRELAY_FAIL_FAST) is declared there.

Order of use: :func:`register` adds the parser; ``tokenrelay relay ...`` calls
:func:`run`, which builds the config, serves the app and, on SIGTERM or SIGINT,
drains (readyz 503, clients told to reconnect, at most ``--drain-deadline-s``), closes
the hub and Redis, and returns 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from relay.broker.rediscluster.connect import mask_url
from relay.edge.config import RelayConfig, add_arguments, from_args
from relay.edge.http.app import SERVER, make_app, make_runner
from relay.service import runtime, settings
from relay.service.httpguard import GUARD, GuardedSite
from relay.service.settings import ConfigError

__all__ = ["register", "run", "serve"]

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "relay",
        help="run an edge server: SSE and WebSocket streams of sessions",
        description="Edge server: SSE and WebSocket streams of sessions. " + settings.ENV_NOTE,
    )
    add_arguments(p)
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    p.set_defaults(func=run)


async def serve(config: RelayConfig, stop: asyncio.Event | None = None) -> int:
    """Serve until ``stop`` is set or SIGTERM / SIGINT arrives; drain; return 0."""
    app = make_app(config)
    runner = make_runner(app, shutdown_timeout=1.0)
    if (busy := runtime.cannot_listen(config.host, config.port)) is not None:
        print(f"error: {busy}", file=sys.stderr)  # before Redis: the one thing to say
        return 2
    async with runtime.stop_on_signals(event=stop) as stopped:
        if not await runtime.set_up(runner, config.redis_url):
            return 1
        try:
            # A reconnect storm (a relay died, its clients come here) arrives as one
            # burst: aiohttp's default listen backlog of 128 would drop SYNs. Slow heads
            # and bodies get 408, idle connections are closed, one address is capped.
            site = GuardedSite(runner, config.host, config.port, guard=app[GUARD], backlog=4096)
            try:
                await site.start()
            except OSError as exc:  # taken since the check: one line, never a traceback
                print(f"error: {runtime.listen_error(config.host, config.port, exc)}",
                      file=sys.stderr)  # fmt: skip
                return 2
            log.info(
                "relay %s listening on http://%s:%d (redis %s, auth %s)",
                config.relay_id, config.host, site.port, mask_url(config.redis_url),
                "on" if config.auth_enabled else "OFF",
            )  # fmt: skip
            await stopped.wait()
            log.info("draining (deadline %.1fs)", config.drain_deadline_s)
            await app[SERVER].drain()
        finally:
            await runner.cleanup()
    log.info("relay %s stopped", config.relay_id)
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = from_args(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return runtime.run(serve(config))
