"""An app's routes, registered from the route table (:mod:`relay.service.routes`).

Order of use: ``add_routes(app, "relay", {"wire.sse": handler, ...})`` in the app factory,
once, with a handler for every route of that service in the table (a mapping method ->
handler where methods differ in handler, such as a stream's GET and its preflight). A
route without a handler, a handler without a route, or a method mapping that is not the
route's methods raises :class:`relay.service.routes.RouteTableError` there: the app is
not built.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TypeAlias

from aiohttp import web

from relay.service.routes import RouteTableError, check_handlers, of_service

__all__ = ["Handler", "Handlers", "add_routes"]

Handler: TypeAlias = Callable[[web.Request], Awaitable[web.StreamResponse]]
Handlers: TypeAlias = Mapping[str, Handler | Mapping[str, Handler]]


def add_routes(app: web.Application, service: str, handlers: Handlers) -> None:
    """Register every route of ``service`` in the table, in its order, one aiohttp
    resource per path (so a method a path lacks is aiohttp's 405 with its Allow)."""
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
