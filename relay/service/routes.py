"""The one route table: every route of the relays and the workers, once.

Each :class:`Route` says its methods, its path pattern (aiohttp's syntax, each parameter
with its regex), which service serves it, which front it belongs to, whether it is a
long-lived stream or a WebSocket, and how a front door proxies it (its :class:`Door`
policy: the nginx location and the Ingress object it lands in). Everything else reads it:

- the relay's and the worker's apps register their routes from it
  (:func:`relay.service.register.add_routes`, given name -> handler; a route without a
  handler, or a handler without a route, fails the app's construction);
- the demo's front door builds its proxy routes from it (:func:`select` picks the
  service of a request);
- deploy/nginx.conf's route locations and deploy/k8s/base/ingress.yaml's objects are
  generated from it (``python -m devstack.routegen``); tests/unit/test_routes.py fails
  when a committed file differs, when a door routes a table route to the wrong service or
  a /v1 path the table lacks, and when docs/openapi.yaml's paths and methods differ.

One path may be served by two services only when a query parameter tells them apart
(``GET /v1/responses/{rid}?stream=true``: the relays; the rest of that path: the
workers); a door that cannot read the query (a Kubernetes Ingress) sends the path to the
service of its unconditional routes, which serves that request too (a cross-origin
preflight included: :mod:`relay.service.cors`).

Operator routes (``/healthz``, ``/readyz``, ``/metrics``, ``/openapi.json``,
``/v1/router``) are each process's own: in the table (each app registers them from it)
but no door proxies them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from typing import Final, Literal

__all__ = [
    "ROUTES",
    "Door",
    "Front",
    "Kind",
    "Query",
    "Route",
    "RouteTableError",
    "Service",
    "check_handlers",
    "front_of",
    "match",
    "of_service",
    "public",
    "public_by_path",
    "regex",
    "sample",
    "select",
    "template",
]

Service = Literal["relay", "worker", "both"]


class Front(StrEnum):
    """What a route belongs to: one of the five fronts, jobs, or the operator's."""

    WIRE = "wire"  # tokenrelay's own: SSE, WebSocket, and the session and turn API
    AISDK = "aisdk"  # the Vercel AI SDK's UI message stream
    OPENAI = "openai"  # OpenAI chat completions (and the model list)
    RESPONSES = "responses"  # OpenAI's Responses API
    DURABLE = "durable"  # Durable Streams (docs/DURABLE.md)
    JOBS = "jobs"  # offline jobs
    OPERATOR = "operator"  # per process: health, readiness, metrics, the router, the contract


FRONTS: Final = (Front.WIRE, Front.AISDK, Front.OPENAI, Front.RESPONSES, Front.DURABLE)


class Kind(StrEnum):
    CALL = "call"  # one request, one answer
    STREAM = "stream"  # the answer may stream for long (SSE, long-poll, a streamed reply)
    WEBSOCKET = "websocket"


class Door(StrEnum):
    """How a front door proxies a route: one nginx location and one Ingress object each."""

    # a relay's stream: GET (and a preflight) only, unbuffered, an hour, 5xx retried
    # before it starts
    STREAM = "stream"
    CREATE = "create"  # session creation: rate-limited per address
    API = "api"  # the worker's session, turn and jobs API (a turn may stream its frames)
    GATEWAY = "gateway"  # the worker's LLM APIs that stream their answer
    RESPONSES = "responses"  # the Responses API: workers, its resumed stream from relays
    DURABLE = "durable"  # Durable Streams: relays; reads long-poll and SSE, writes never retried
    NONE = "none"  # not proxied: each process's own (operator routes)


class RouteTableError(RuntimeError):
    """The table and an app's handlers disagree (raised while the app is built)."""


@dataclass(frozen=True, slots=True)
class Query:
    """A query parameter whose value picks this route over another route of the same
    path and method (compared lower-cased)."""

    param: str
    values: tuple[str, ...]

    def matches(self, query: Mapping[str, str]) -> bool:
        return query.get(self.param, "").lower() in self.values


@dataclass(frozen=True, slots=True)
class Route:
    name: str  # the key of its handler in the app's name -> handler
    methods: tuple[str, ...]  # HEAD listed where a GET answers it too
    path: str  # aiohttp's pattern: /v1/sessions/{sid:[^/]+}/events
    service: Service
    front: Front
    door: Door
    kind: Kind = Kind.CALL
    query: Query | None = None

    def serves(self, service: str) -> bool:
        return self.service in (service, "both")


_SID: Final = "{sid:[^/]+}"
_RID: Final = "{rid:[^/]+}"
_STREAM_Q: Final = Query("stream", ("true", "1"))
_GO: Final = ("GET", "OPTIONS")  # a relay's stream: the GET and a cross-origin preflight
_GH: Final = ("GET", "HEAD")
W, A, OAI, R, D, J, OP = (
    Front.WIRE, Front.AISDK, Front.OPENAI, Front.RESPONSES, Front.DURABLE, Front.JOBS,
    Front.OPERATOR,
)  # fmt: skip
S, WS = Kind.STREAM, Kind.WEBSOCKET

# fmt: off
ROUTES: Final[tuple[Route, ...]] = (
    # tokenrelay's own wire: screens read from relays, turns are taken by workers
    Route("wire.sse", _GO, f"/v1/sessions/{_SID}/events", "relay", W, Door.STREAM, S),
    Route("wire.ws", _GO, f"/v1/sessions/{_SID}/ws", "relay", W, Door.STREAM, WS),
    Route("sessions.create", ("POST",), "/v1/sessions", "worker", W, Door.CREATE),
    # a turn POSTed with Accept: text/event-stream streams its frames (the closed loop)
    Route("sessions.turn", ("POST",), f"/v1/sessions/{_SID}/turns", "worker", W, Door.API, S),
    Route("sessions.token", ("POST",), f"/v1/sessions/{_SID}/tokens", "worker", W, Door.API),
    Route("sessions.cancel_turn", ("POST",), f"/v1/sessions/{_SID}/turns/{{turn:[^/]+}}/cancel",
          "worker", W, Door.API),
    Route("sessions.cancel", ("POST",), f"/v1/sessions/{_SID}/cancel", "worker", W, Door.API),
    Route("sessions.messages", _GH, f"/v1/sessions/{_SID}/messages", "worker", W, Door.API),
    Route("sessions.delete", ("DELETE",), f"/v1/sessions/{_SID}", "worker", W, Door.API),
    # the Vercel AI SDK: its chat POST on a worker, its UI stream and resume URL on relays
    Route("aisdk.chat", ("POST",), "/v1/chat", "worker", A, Door.GATEWAY, S),
    Route("aisdk.ui_stream", _GO, f"/v1/sessions/{_SID}/ui-stream", "relay", A, Door.STREAM, S),
    Route("aisdk.resume", _GO, f"/v1/chat/{_SID}/stream", "relay", A, Door.STREAM, S),
    # OpenAI chat completions
    Route("openai.chat", ("POST",), "/v1/chat/completions", "worker", OAI, Door.GATEWAY, S),
    Route("openai.models", _GH, "/v1/models", "worker", OAI, Door.GATEWAY),
    # OpenAI's Responses API: a response's resumed event stream from any relay
    Route("responses.create", ("POST",), "/v1/responses", "worker", R, Door.RESPONSES, S),
    Route("responses.stream", _GO, f"/v1/responses/{_RID}", "relay", R, Door.RESPONSES, S,
          _STREAM_Q),
    # ... and the rest from a worker, which serves that stream too (and its preflight) to a
    # door that routes by path only
    Route("responses.get", _GO, f"/v1/responses/{_RID}", "worker", R, Door.RESPONSES, S),
    Route("responses.delete", ("DELETE",), f"/v1/responses/{_RID}", "worker", R, Door.RESPONSES),
    Route("responses.cancel", ("POST",), f"/v1/responses/{_RID}/cancel", "worker", R,
          Door.RESPONSES),
    Route("responses.input_items", ("GET",), f"/v1/responses/{_RID}/input_items", "worker", R,
          Door.RESPONSES),
    # Durable Streams: every method on one resource (no method meets another route's 405)
    Route("durable.stream", ("GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS"),
          "/v1/stream/{path:.+}", "relay", D, Door.DURABLE, S),
    Route("durable.session", _GO, f"/v1/sessions/{_SID}/stream", "relay", D, Door.DURABLE, S),
    # offline jobs
    Route("jobs.submit", ("POST",), "/v1/jobs", "worker", J, Door.API),
    Route("jobs.get", _GH, "/v1/jobs/{job:[^/]+}", "worker", J, Door.API),
    # each process's own
    Route("healthz", _GH, "/healthz", "both", OP, Door.NONE),
    Route("readyz", _GH, "/readyz", "both", OP, Door.NONE),
    Route("metrics", _GH, "/metrics", "both", OP, Door.NONE),
    Route("openapi", _GH, "/openapi.json", "both", OP, Door.NONE),
    Route("router", _GH, "/v1/router", "worker", OP, Door.NONE),
)
# fmt: on

_PARAM: Final = re.compile(r"\{(\w+)(?::([^{}]+))?\}")
_META: Final = re.compile(r"([.^$*+?()\[\]{}|\\])")


def of_service(service: str) -> tuple[Route, ...]:
    """The routes ``service`` (``relay`` or ``worker``) registers."""
    return tuple(r for r in ROUTES if r.serves(service))


def public() -> tuple[Route, ...]:
    """The routes front doors proxy (all but the operator's)."""
    return tuple(r for r in ROUTES if r.door is not Door.NONE)


def public_by_path() -> dict[str, tuple[Route, ...]]:
    """The public routes grouped by path pattern, in table order."""
    out: dict[str, list[Route]] = {}
    for r in public():
        out.setdefault(r.path, []).append(r)
    return {p: tuple(rs) for p, rs in out.items()}


def template(path: str) -> str:
    """The pattern as OpenAPI writes it: ``/v1/sessions/{sid}/events``."""
    return _PARAM.sub(lambda m: "{" + m.group(1) + "}", path)


def regex(path: str) -> str:
    """The pattern as an unanchored regex (PCRE, RE2 and Python alike): each parameter its
    own regex (``[^/]+`` when it names none), each literal character escaped."""
    out, at = [], 0
    for m in _PARAM.finditer(path):
        out.append(_META.sub(r"\\\1", path[at : m.start()]))
        out.append(m.group(2) or "[^/]+")
        at = m.end()
    out.append(_META.sub(r"\\\1", path[at:]))
    return "".join(out)


def sample(path: str) -> str:
    """A concrete path of the pattern (``.+`` parameters get two segments)."""

    def one(m: re.Match[str]) -> str:
        return f"{m.group(1)}-1/part" if m.group(2) == ".+" else f"{m.group(1)}-1"

    return _PARAM.sub(one, path)


def select(candidates: Sequence[Route], method: str, query: Mapping[str, str]) -> Route | None:
    """Which of one path's routes serves ``method`` with ``query``: a route whose
    :class:`Query` matches, else the route without a query condition; a method only
    conditional routes have goes to them whatever the query (a preflight)."""
    found = [r for r in candidates if method in r.methods]
    for r in found:
        if r.query is not None and r.query.matches(query):
            return r
    plain = [r for r in found if r.query is None]
    chosen = plain or found
    return chosen[0] if chosen else None


def match(method: str, path: str, query: Mapping[str, str]) -> Route | None:
    """The public route a request is for (None: no door should route it)."""
    for pattern, routes in public_by_path().items():
        if re.fullmatch(regex(pattern), path):
            return select(routes, method, query)
    return None


@cache
def _heads() -> tuple[tuple[re.Pattern[str], str, Front], ...]:
    """Each route's full-match regex, its literal head (the pattern before its first
    parameter, without a trailing slash) and its front, in table order."""
    return tuple(
        (re.compile(regex(r.path)), r.path.split("{", 1)[0].rstrip("/"), r.front) for r in ROUTES
    )


def front_of(path: str) -> Front | None:
    """The front a request path belongs to, whether or not a route serves it: the front
    of the route whose pattern it matches, else of the route whose literal head it
    extends by whole segments, the longest head first (``/v1/chat/completions/x``:
    OpenAI's, ``/v1/chat/x``: the AI SDK's); None: no route's (``/v1/x``)."""
    heads = _heads()
    for pattern, _, front in heads:
        if pattern.fullmatch(path):
            return front
    best: tuple[int, Front] | None = None
    for _, head, front in heads:
        if (path == head or path.startswith(head + "/")) and (best is None or len(head) > best[0]):
            best = (len(head), front)
    return None if best is None else best[1]


def check_handlers(service: str, names: Iterable[str]) -> None:
    """Raise :class:`RouteTableError` unless ``names`` are exactly the names of
    ``service``'s routes."""
    want = {r.name for r in of_service(service)}
    given = set(names)
    missing, extra = sorted(want - given), sorted(given - want)
    if missing or extra:
        raise RouteTableError(
            f"the {service}'s handlers and relay/service/routes.py disagree: "
            f"routes without a handler {missing}, handlers without a route {extra}"
        )
