"""The edge server's aiohttp app: its routes, and the runner every relay uses.

Order of use: ``app = make_app(config)`` (creates the RedisCluster client, its broker and
the hub on startup, closes them on cleanup; pass ``hub=`` to use one you own), run it
with :func:`make_runner`; on SIGTERM ``await app[SERVER].drain()`` then clean up (see
:mod:`relay.edge.cli`). The server's state and admission: :mod:`relay.edge.http.server`;
the stream handlers: :mod:`relay.edge.http.handlers`.
"""

from __future__ import annotations

from typing import Any, Final

from aiohttp import web

from relay.durable import http as durable_http
from relay.edge.config import RelayConfig
from relay.edge.fanout.hub import Hub
from relay.edge.http import handlers
from relay.edge.http.server import EdgeServer
from relay.fronts.aisdk import http as aisdk
from relay.fronts.responses import http as responses
from relay.service import openapi, runtime
from relay.service.httpguard import ConnLimits, guard_app
from relay.service.register import add_routes

__all__ = ["SERVER", "make_app", "make_runner"]

SERVER: Final = web.AppKey("tokenrelay_edge", EdgeServer)


def make_app(config: RelayConfig, hub: Hub | None = None) -> web.Application:
    """The aiohttp app of one edge server. ``hub``: use this started hub (the caller
    closes it); otherwise the app creates and closes a RedisCluster client and a hub."""
    config = config.validate()
    server = EdgeServer(config, hub)
    # No middleware: with one, aiohttp wraps every handler in two more coroutines, which
    # every open stream would hold; the stream handlers answer Reject themselves.
    app = web.Application()
    app[SERVER] = server
    app.on_startup.append(server.startup)
    app.on_shutdown.append(server.on_shutdown)
    app.on_cleanup.append(server.cleanup)
    app.on_response_prepare.append(server.on_prepare)
    durable = durable_http.Durable(server)
    app.on_cleanup.append(durable.cleanup)  # its body parser's process

    # The routes come from the table (relay/service/routes.py): the own wire's streams
    # (relay.edge.http.handlers), then each front's handlers() (relay/fronts/, and
    # relay/durable/: Durable Streams). A stream's GET has no HEAD (stream_route says why).
    add_routes(app, "relay", {
        **handlers.handlers(server),  # the own wire: SSE and WebSocket
        **aisdk.handlers(server),  # the AI SDK's UI stream and its resume URL
        **responses.handlers(server),  # the Responses API's events, ?stream=true
        **durable_http.handlers(durable),  # docs/DURABLE.md
        "healthz": server.healthz,
        "readyz": server.readyz,
        "metrics": server.metrics_handler,
        "openapi": openapi.handler("relay"),  # docs/openapi.yaml
    })  # fmt: skip
    limits = ConnLimits(
        head_timeout_s=config.head_timeout_s,
        body_timeout_s=config.body_timeout_s,
        keepalive_timeout_s=config.keepalive_timeout_s,
        max_per_address=config.max_connections_per_address,
        exempt=server.trusted,
    )
    http_guard = server.metrics.http_guard
    guard_app(app, limits, lambda reason: http_guard.labels(reason).inc())  # app[GUARD]
    return app


def make_runner(app: web.Application, **kwargs: Any) -> web.AppRunner:
    """The runner every relay uses. ``handler_cancellation``: a client that goes away
    cancels its stream handler at once, so a stream still opening does not hold its
    watch (and the shard subscription) until its first write fails."""
    kwargs.setdefault("access_log", None)
    runtime.quiet_client_errors()
    return web.AppRunner(app, handler_cancellation=True, **kwargs)
