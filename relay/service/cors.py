"""CORS of the routes a browser reads from another origin: one preflight answer, one
header set on their answers, for the relays and the workers alike.

Which routes: those whose methods in the route table (:mod:`relay.service.routes`)
include ``OPTIONS``. The relays serve every one of them (streams of every front); a
worker serves one, ``/v1/responses/{id}``, because a door that routes by path only (a
Kubernetes Ingress) sends a resumed Responses stream, ``?stream=true``, and its
preflight to a worker, which serves that stream too (Durable Streams answer their own
protocol's preflight: :mod:`relay.durable.http`).

Order of use: register :func:`preflight` (given the process's allowed origin, the
``--cors-origin`` setting) as the route's ``OPTIONS`` handler; put :func:`allow` on its
answers (a relay: on every answer, from its response-prepare signal; a worker: with
``allow_on(paths("worker"), origin)``, on the answers of its cross-origin routes only).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, MutableMapping
from typing import Final

from aiohttp import hdrs, web

from relay.service.register import Handler
from relay.service.routes import of_service, template

__all__ = ["EXPOSED", "PREFLIGHT", "allow", "allow_on", "paths", "preflight"]

EXPOSED: Final = "X-Relay-Id"  # the relay that serves a stream, readable by scripts
PREFLIGHT: Final = {
    "Access-Control-Allow-Headers": "Authorization, Last-Event-ID, Content-Type",
    "Access-Control-Allow-Methods": "GET, OPTIONS",
    "Access-Control-Expose-Headers": EXPOSED,
    "Access-Control-Max-Age": "600",
}

Signal = Callable[[web.Request, web.StreamResponse], Awaitable[None]]


def allow(headers: MutableMapping[str, str], origin: str) -> None:
    """What every answer of a cross-origin route carries: the allowed origin, and the
    headers exposed to scripts (unless the answer names its own)."""
    headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = origin
    headers.setdefault(hdrs.ACCESS_CONTROL_EXPOSE_HEADERS, EXPOSED)


def preflight(origin: str) -> Handler:
    """The handler of a cross-origin route's ``OPTIONS``: 204 with :data:`PREFLIGHT`."""

    async def answer_preflight(request: web.Request) -> web.Response:
        response = web.Response(status=204, headers=PREFLIGHT)
        allow(response.headers, origin)
        return response

    return answer_preflight


def paths(service: str) -> frozenset[str]:
    """The path patterns (``/v1/responses/{rid}``) of ``service``'s cross-origin routes."""
    return frozenset(template(r.path) for r in of_service(service) if "OPTIONS" in r.methods)


def allow_on(paths: Collection[str], origin: str) -> Signal:
    """A response-prepare signal putting :func:`allow` on the answers of the routes
    whose path pattern (the resource's canonical form, ``/v1/responses/{rid}``) is in
    ``paths``."""

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        resource = request.match_info.route.resource
        if resource is not None and resource.canonical in paths:
            allow(response.headers, origin)

    return on_prepare
