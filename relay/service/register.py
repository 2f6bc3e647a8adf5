"""An app's routes, registered from the route table (:mod:`relay.service.routes`).

Order of use: ``add_routes(app, "relay", {"wire.sse": handler, ...})`` in the app factory,
once, with a handler for every route of that service in the table (a mapping method ->
handler where methods differ in handler, such as a stream's GET and its preflight). A
route without a handler, a handler without a route, or a method mapping that is not the
route's methods raises :class:`relay.service.routes.RouteTableError` there: the app is
not built.

Every request no route takes is refused here too, in the refusal shape of the front its
path belongs to (:func:`relay.service.errors.unrouted`): a method a path's routes lack
(405 and its ``Allow``), a path no route has (404). :func:`refuse_unrouted` installs
that on any app (:func:`add_routes` does for the relay and the worker; the demo's front
door calls it after its own routes) without a middleware, which would wrap every
handler, each open stream's too, in two more coroutines: each resource gets a route for
any other method, and one last resource takes any path.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import Final, TypeAlias

from aiohttp import hdrs, web

from relay.service.errors import unrouted
from relay.service.routes import RouteTableError, check_handlers, of_service

__all__ = ["ANY_PATH", "Handler", "Handlers", "add_routes", "refuse_unrouted"]

Handler: TypeAlias = Callable[[web.Request], Awaitable[web.StreamResponse]]
Handlers: TypeAlias = Mapping[str, Handler | Mapping[str, Handler]]
ANY_PATH: Final = "/{unrouted:.*}"  # the last resource: every path no route has


def add_routes(app: web.Application, service: str, handlers: Handlers) -> None:
    """Register every route of ``service`` in the table, in its order, one aiohttp
    resource per path; then :func:`refuse_unrouted` (call it once, after the app's other
    routes)."""
    check_handlers(service, handlers)
    resources: dict[str, web.Resource] = {}
    for route in of_service(service):
        given = handlers[route.name]
        by_method = given if isinstance(given, Mapping) else dict.fromkeys(route.methods, given)
        if set(by_method) != set(route.methods):
            raise RouteTableError(
                f"{service} route {route.name}: handlers for {sorted(by_method)}, "
                f"the table says {sorted(route.methods)}"
            )
        resource = resources.get(route.path)
        if resource is None:
            resource = resources[route.path] = app.router.add_resource(route.path)
        for method in route.methods:
            resource.add_route(method, by_method[method])
    refuse_unrouted(app)


async def _not_allowed(allow: frozenset[str], request: web.Request) -> web.Response:
    return unrouted(request.method, request.path, allow)


async def _not_found(request: web.Request) -> web.Response:
    return unrouted(request.method, request.path)


def refuse_unrouted(app: web.Application) -> None:
    """Answer what ``app``'s routes do not take in the refusal shape of the path's front:
    on each resource a route for any other method (405 with the resource's methods as
    ``Allow``), then a resource for any path (404), which aiohttp tries last (it walks a
    path's parents down to ``/``). A static resource keeps aiohttp's own answers."""
    for resource in list(app.router.resources()):
        if not isinstance(resource, web.Resource):
            continue
        methods = frozenset(route.method for route in resource)
        if hdrs.METH_ANY not in methods:
            resource.add_route(hdrs.METH_ANY, functools.partial(_not_allowed, methods))
    app.router.add_route(hdrs.METH_ANY, ANY_PATH, _not_found)
