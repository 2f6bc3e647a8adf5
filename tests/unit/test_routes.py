"""The route table (relay/service/routes.py) is the one source of every route.

- The table is coherent: unique names, one route per path and method (a query condition
  aside), every sample path matched by its own pattern only.
- The relay's and the worker's apps route exactly the table's routes of their service,
  and an app whose handlers miss a route (or name one the table lacks) is not built.
- docs/openapi.yaml documents exactly the table's routes, each tagged with the services
  that serve it.
- deploy/nginx.conf and deploy/k8s/base/ingress.yaml are what ``make routes`` generates.
- Each door (nginx read as nginx routes, the Ingress as ingress-nginx routes, the demo's
  front door through its aiohttp router) sends every table route, each method, to the
  service that serves it, proxies no operator route, and routes no /v1 path the table
  lacks; streams are unbuffered with long timeouts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from aiohttp import hdrs, web
from aiohttp.test_utils import make_mocked_request

from devstack import doors, routegen
from devstack.demo import frontdoor
from relay.edge.config import RelayConfig
from relay.edge.http.app import make_app as relay_app
from relay.service import errors, register, routes
from relay.service.routes import ROUTES, Door, Kind, RouteTableError
from worker.api import make_app as worker_app
from worker.config import WorkerConfig

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
NGINX = doors.Nginx(routegen.NGINX.read_text())
INGRESS = routegen.INGRESS.read_text()
REQUESTS = doors.requests()
# /v1 paths no route of the table has (a door must answer them itself: 404)
NOT_ROUTES = [
    "/v1", "/v1/", "/v1/x", "/v1/sessions/", "/v1/sessions/s/x", "/v1/sessions/s/turns/t",
    "/v1/sessions/s/turns/t/cancel/x", "/v1/sessions/s/events/x", "/v1/chat/x",
    "/v1/chat/s/stream/x", "/v1/chat/completions/x", "/v1/responses/r/x", "/v1/jobs/j/x",
    "/v1/stream", "/v1/stream/", "/v1/models/x", "/v1/router/x", "/v1/sessions/s/stream/x",
    *(routes.sample(p) + "/x" for p in routes.public_by_path()),
]  # fmt: skip
NOT_ROUTES = [
    p for p in dict.fromkeys(NOT_ROUTES)
    if not any(re.fullmatch(routes.regex(q), p) for q in routes.public_by_path())
]  # fmt: skip
OPERATOR = [r for r in ROUTES if r.door is Door.NONE]


# -- the table ---------------------------------------------------------------------------


def test_the_table_is_coherent() -> None:
    names = [r.name for r in ROUTES]
    assert len(names) == len(set(names)), "route names are handler keys: unique"
    methods = {"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"}
    for r in ROUTES:
        assert r.methods, r.name
        assert set(r.methods) <= methods, r.name
        assert len(set(r.methods)) == len(r.methods), r.name
        assert r.path.startswith("/"), r.name
        assert (r.door is Door.NONE) == (r.front is routes.Front.OPERATOR), r.name
        assert r.service in ("relay", "worker") or r.door is Door.NONE, r.name
    patterns = list(dict.fromkeys(r.path for r in ROUTES))
    for p in patterns:  # each sample matches its own pattern, and only it
        hits = [q for q in patterns if re.fullmatch(routes.regex(q), routes.sample(p))]
        assert hits == [p], (p, hits)
    for path, rs in routes.public_by_path().items():
        for m in {m for r in rs for m in r.methods}:
            plain = [r for r in rs if m in r.methods and r.query is None]
            assert len(plain) <= 1, (path, m, plain)
        for r in rs:  # a query condition tells two services of one path apart
            if r.query is not None:
                assert any(o.service != r.service and o.query is None for o in rs), r.name


def test_select_picks_by_query_and_sends_a_method_only_one_route_has() -> None:
    (rs,) = [rs for p, rs in routes.public_by_path().items() if "responses/{rid" in p and
             p.endswith("}")]  # fmt: skip
    pick = {
        (m, q): getattr(routes.select(rs, m, dict(q)), "name", None)
        for m, q in [("GET", ()), ("GET", (("stream", "true"),)), ("GET", (("stream", "TRUE"),)),
                     ("GET", (("stream", "false"),)), ("OPTIONS", ()),
                     ("OPTIONS", (("stream", "true"),)), ("DELETE", ()),
                     ("PUT", ())]
    }  # fmt: skip
    assert pick == {
        ("GET", ()): "responses.get",
        ("GET", (("stream", "true"),)): "responses.stream",
        ("GET", (("stream", "TRUE"),)): "responses.stream",
        ("GET", (("stream", "false"),)): "responses.get",
        ("OPTIONS", ()): "responses.get",
        ("OPTIONS", (("stream", "true"),)): "responses.stream",
        ("DELETE", ()): "responses.delete",
        ("PUT", ()): None,
    }


# -- the apps ----------------------------------------------------------------------------


def _routed(app: web.Application) -> set[tuple[str, str]]:
    """The app's routes, less those :func:`relay.service.register.refuse_unrouted` adds
    (any method: the refusals of what no route takes)."""
    return {
        (r.method, r.resource.canonical)
        for r in app.router.routes()
        if r.resource and r.method != hdrs.METH_ANY
    }


def _table(service: str) -> set[tuple[str, str]]:
    return {(m, routes.template(r.path)) for r in routes.of_service(service) for m in r.methods}


def test_the_apps_route_exactly_the_table() -> None:
    assert _routed(relay_app(RelayConfig(insecure_no_auth=True))) == _table("relay")
    assert _routed(worker_app(WorkerConfig())) == _table("worker")


async def _ok(request: web.Request) -> web.StreamResponse:
    return web.Response()


def test_registration_fails_on_a_missing_or_extra_handler_or_method() -> None:
    names = {r.name: _ok for r in routes.of_service("worker")}
    register.add_routes(web.Application(), "worker", names)
    missing = {k: v for k, v in names.items() if k != "jobs.get"}
    with pytest.raises(RouteTableError, match=r"without a handler \['jobs.get'\]"):
        register.add_routes(web.Application(), "worker", missing)
    with pytest.raises(RouteTableError, match=r"without a route \['jobs.list'\]"):
        register.add_routes(web.Application(), "worker", {**names, "jobs.list": _ok})
    with pytest.raises(RouteTableError, match=r"jobs\.get: handlers for"):
        register.add_routes(web.Application(), "worker", {**names, "jobs.get": {"GET": _ok}})


# -- what no route takes: refused in the path's front's shape ----------------------------------

UNROUTED = ["/", "/nope", "/v1", "/v1/x", "/healthz/x", *NOT_ROUTES]


def test_front_of_says_whose_path_it_is() -> None:
    for r in ROUTES:
        assert routes.front_of(routes.sample(r.path)) is r.front, r.name
    assert routes.front_of("/v1/chat/completions/x") is routes.Front.OPENAI
    assert routes.front_of("/v1/models/x") is routes.Front.OPENAI
    assert routes.front_of("/v1/responses/r/x") is routes.Front.RESPONSES
    assert routes.front_of("/v1/responses") is routes.Front.RESPONSES
    assert routes.front_of("/v1/chat/x") is routes.Front.AISDK
    assert routes.front_of("/v1/stream") is routes.Front.DURABLE
    assert routes.front_of("/v1/sessions/s/x") is routes.Front.WIRE
    for path in ("/", "/nope", "/v1", "/v1/x", "/v1/modelsx", "/v1/responsesx"):
        assert routes.front_of(path) is None, path


def _shape_ok(path: str, status: int, body: Any) -> bool:
    """The refusal shape of ``path``'s front: OpenAI's for its two fronts, else ours."""
    if routes.front_of(path) in errors.OPENAI_SHAPED:
        err = body["error"]
        return (
            set(err) >= {"message", "type", "code"}
            and err["type"] == "invalid_request_error"
            and err["code"] == ("not_found" if status == 404 else "method_not_allowed")
        )
    return body["error"] == ("not_found" if status == 404 else "method_not_allowed") and bool(
        body["reason"]
    )


async def _answer(app: web.Application, method: str, path: str) -> web.Response:
    request = make_mocked_request(method, path, app=app)
    match = await app.router.resolve(request)
    assert match.http_exception is None, (method, path, "aiohttp's own plain-text answer")
    request._match_info = match  # as aiohttp's request handler sets it
    response = await match.handler(request)
    assert isinstance(response, web.Response)
    return response


APPS = {
    "relay": lambda: relay_app(RelayConfig(insecure_no_auth=True)),
    "worker": lambda: worker_app(WorkerConfig()),
}


@pytest.mark.parametrize("service", ["relay", "worker"])
async def test_the_apps_refuse_an_unrouted_path_in_its_fronts_shape(service: str) -> None:
    app = APPS[service]()
    for path in UNROUTED:
        for method in ("GET", "POST", "DELETE"):
            resp = await _answer(app, method, path)
            assert resp.status == 404, (method, path)
            assert resp.content_type == "application/json"
            assert isinstance(resp.body, bytes)
            assert _shape_ok(path, 404, json.loads(resp.body)), (method, path, resp.body)


@pytest.mark.parametrize("service", ["relay", "worker"])
async def test_the_apps_refuse_a_wrong_method_with_allow_in_its_fronts_shape(service: str) -> None:
    app = APPS[service]()
    by_path: dict[str, set[str]] = {}
    for r in routes.of_service(service):
        by_path.setdefault(r.path, set()).update(r.methods)
    for pattern, methods in by_path.items():
        path = routes.sample(pattern)
        for method in sorted({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH"} - methods):
            resp = await _answer(app, method, path)
            assert resp.status == 405, (method, path)
            assert resp.headers["Allow"] == ",".join(sorted(methods)), (method, path)
            assert isinstance(resp.body, bytes)
            assert _shape_ok(path, 405, json.loads(resp.body)), (method, path, resp.body)


async def test_the_front_door_refuses_an_unrouted_path_in_its_fronts_shape() -> None:
    app = frontdoor.make_frontdoor_app(frontdoor.FrontDoor(list, list))
    for path in UNROUTED:
        if path == "/":
            continue  # the page
        resp = await _answer(app, "GET", path)
        assert resp.status == 404, path
        assert isinstance(resp.body, bytes)
        assert _shape_ok(path, 404, json.loads(resp.body)), (path, resp.body)
    resp = await _answer(app, "PUT", "/v1/chat/completions")
    assert (resp.status, resp.headers["Allow"]) == (405, "POST")
    assert isinstance(resp.body, bytes)
    assert _shape_ok("/v1/chat/completions", 405, json.loads(resp.body))


def test_nginx_refuses_an_unrouted_path_in_its_fronts_shape() -> None:
    for path in UNROUTED:
        if path == "/":
            continue  # the page
        loc = NGINX.location(path)
        assert loc is not None, path
        ((status, body),) = [b.words[1:] for b in loc.find("return")]
        assert status == "404", path
        assert ["application/json"] in [b.words[1:] for b in loc.find("default_type")], path
        assert _shape_ok(path, 404, json.loads(body)), (path, body)


def test_nginx_refuses_a_streams_other_method_as_a_relay_does() -> None:
    """A stream location lets only its routes' methods through (limit_except); what it
    refuses becomes the relays' 405 with Allow, in their shape, not nginx's 403 page."""
    named = {b.words[1]: b for b in NGINX.server.find("location") if b.words[1][0] == "@"}
    for r in ROUTES:
        if r.door is not Door.STREAM:
            continue
        loc = NGINX.location(routes.sample(r.path))
        assert loc is not None, r.name
        pages = {b.words[1]: b.words[-1] for b in loc.find("error_page")}
        assert "429" in pages, "a location's error_page would drop the server's 429 page"
        target = named[pages["403"].removeprefix("=").strip()]
        ((status, body),) = [b.words[1:] for b in target.find("return")]
        headers = {b.words[1]: b.words[2] for b in target.find("add_header")}
        assert status == "405", r.name
        assert headers["Allow"] == ",".join(sorted(r.methods)), r.name
        assert _shape_ok(routes.sample(r.path), 405, json.loads(body)), r.name


# -- docs/openapi.yaml ---------------------------------------------------------------------


def test_openapi_documents_exactly_the_table() -> None:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "docs" / "openapi.yaml").read_text())
    documented = {
        (m.upper(), path): set(op["tags"])
        for path, item in doc["paths"].items()
        for m, op in item.items()
        if isinstance(op, dict) and "tags" in op
    }
    table: dict[tuple[str, str], set[str]] = {}
    for r in ROUTES:
        for m in r.methods:
            if m == "HEAD" and "GET" in r.methods:
                continue  # answered like the GET, without a body: not documented apart
            served = {"relay", "worker"} if r.service == "both" else {r.service}
            table.setdefault((m, routes.template(r.path)), set()).update(served)
    assert set(documented) - set(table) == set(), "documented, not in relay/service/routes.py"
    assert set(table) - set(documented) == set(), "in the table, not in docs/openapi.yaml"
    assert documented == table, "the tags (services) differ from the table's"


# -- the generated files ---------------------------------------------------------------------


@pytest.mark.parametrize("which", ["nginx", "ingress"])
def test_committed_deploy_files_are_what_the_table_generates(which: str) -> None:
    path = routegen.NGINX if which == "nginx" else routegen.INGRESS
    text = path.read_text()
    assert routegen.rendered(which, text) == text, f"{path} is stale: run `make routes`"


# -- the doors --------------------------------------------------------------------------------


@pytest.mark.parametrize("req", REQUESTS, ids=str)
def test_nginx_sends_every_route_to_its_service(req: doors.Request) -> None:
    assert NGINX.service(req.method, req.path, req.query) == req.route.service


@pytest.mark.parametrize("req", REQUESTS, ids=str)
def test_the_ingress_sends_every_path_to_its_service(req: doors.Request) -> None:
    got = doors.ingress_service(INGRESS, req.path)
    if req.route.query is None:
        assert got == req.route.service
    else:  # by path only: to the service of the path's unconditional routes
        (default,) = {r.service for r in routes.public_by_path()[req.route.path] if r.query is None}
        assert got == default  # which serves the request too, a preflight included
        assert routes.select(routes.public_by_path()[req.route.path], req.method, {})


@pytest.mark.parametrize("req", REQUESTS, ids=str)
async def test_the_front_door_sends_every_route_to_its_service(req: doors.Request) -> None:
    assert await doors.frontdoor_service(frontdoor, req.method, req.path_qs) == req.route.service


@pytest.mark.parametrize("path", NOT_ROUTES)
async def test_no_door_routes_a_path_the_table_lacks(path: str) -> None:
    for method in ("GET", "POST", "DELETE"):
        assert NGINX.service(method, path, {}) is None, (method, path)
        assert await doors.frontdoor_service(frontdoor, method, path) is None, (method, path)
    assert doors.ingress_service(INGRESS, path) is None


def test_every_proxying_location_and_ingress_path_is_generated() -> None:
    """A location or Ingress path written by hand beside the generated ones would route
    what the table does not say: there is none."""
    generated = doors.Nginx("http { server { " + routegen.nginx_locations() + " } }")
    heads = [b.words for b in generated.locations if any(b.find("proxy_pass"))]
    assert [b.words for b in NGINX.locations if any(b.find("proxy_pass"))] == heads
    paths = [
        p["path"]
        for o in yaml.safe_load_all(INGRESS)
        for rule in o["spec"]["rules"]
        for p in rule["http"]["paths"]
    ]
    assert paths == [
        p["path"]
        for o in yaml.safe_load_all(routegen.ingress_objects())
        for rule in o["spec"]["rules"]
        for p in rule["http"]["paths"]
    ]


def test_the_front_door_has_no_v1_route_beside_the_table() -> None:
    app = frontdoor.make_frontdoor_app(frontdoor.FrontDoor(list, list))
    v1 = {
        r.resource.canonical
        for r in app.router.routes()
        if r.resource and r.resource.canonical.startswith("/v1")
    }
    assert v1 == {routes.template(p) for p in routes.public_by_path()}


@pytest.mark.parametrize("route", OPERATOR, ids=lambda r: r.name)
async def test_no_door_proxies_an_operator_route(route: routes.Route) -> None:
    path = routes.sample(route.path)
    assert NGINX.service("GET", path, {}) is None
    assert doors.ingress_service(INGRESS, path) is None
    assert await doors.frontdoor_service(frontdoor, "GET", path) is None


def _timeout_s(value: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return float(value[:-1]) * units[value[-1]] if value[-1] in units else float(value)


@pytest.mark.parametrize("req", [r for r in REQUESTS if r.route.kind is not Kind.CALL], ids=str)
def test_streams_are_unbuffered_and_long_at_every_door(req: doors.Request) -> None:
    loc = NGINX.location(req.path)
    assert loc is not None
    words = {b.words[0]: b.words[1:] for b in loc.children}
    assert words["proxy_buffering"] == ["off"]
    assert _timeout_s(words["proxy_read_timeout"][0]) >= 600
    if req.route.service == "relay":  # a relay's streams: an hour at the Ingress too
        (obj,) = [
            o for o in yaml.safe_load_all(INGRESS)
            if re.match("^" + o["spec"]["rules"][0]["http"]["paths"][0]["path"], req.path)
        ]  # fmt: skip
        ann = obj["metadata"]["annotations"]
        assert ann["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
        assert int(ann["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 3600


async def test_every_front_is_reachable_through_every_door() -> None:
    """The figure ``python -m devstack.doors`` prints: all five fronts at each door, every
    request (the Ingress routes by path only, so a cross-origin preflight of a resumed
    Responses stream reaches a worker, which answers it as a relay does)."""
    answers = {
        (req.method, req.path_qs): await doors.frontdoor_service(frontdoor, req.method,
                                                                 req.path_qs)
        for req in REQUESTS
    }  # fmt: skip
    where = {
        "nginx": lambda r: NGINX.service(r.method, r.path, r.query),
        "ingress": lambda r: doors.ingress_service(INGRESS, r.path),
        "frontdoor": lambda r: answers[r.method, r.path_qs],
    }
    for door, (fronts, missed) in doors.fronts_reachable(where).items():
        assert (len(fronts), missed) == (5, []), door


@pytest.mark.parametrize("path", ["/v1/responses/resp_x?stream=true", "/v1/responses/resp_x"])
async def test_the_worker_answers_a_streams_preflight_as_a_relay_does(path: str) -> None:
    got = {}
    for service in ("relay", "worker"):
        app = APPS[service]()
        app.freeze()  # its signals may be sent
        request = make_mocked_request("OPTIONS", path, app=app)
        match = await app.router.resolve(request)
        request._match_info = match
        response = await match.handler(request)
        await app.on_response_prepare.send(request, response)
        got[service] = (response.status, {k: v for k, v in response.headers.items()
                                          if k.startswith("Access-Control-")})  # fmt: skip
    assert got["worker"] == got["relay"]
    assert got["worker"][0] == 204
    assert got["worker"][1]["Access-Control-Allow-Origin"] == "*"


async def test_the_workers_cross_origin_answers_name_the_origin_and_no_other_route() -> None:
    app = worker_app(WorkerConfig(cors_origin="https://app.example"))
    app.freeze()
    for path, crossed in [
        ("/v1/responses/resp_x?stream=true", True),
        ("/v1/sessions/s/messages", False),
        ("/v1/chat/completions", False),
    ]:
        request = make_mocked_request("GET", path, app=app)
        request._match_info = await app.router.resolve(request)
        response = web.Response()
        await app.on_response_prepare.send(request, response)
        origin = response.headers.get("Access-Control-Allow-Origin")
        assert origin == ("https://app.example" if crossed else None), path
