"""deploy/nginx.conf's route locations and deploy/k8s/base/ingress.yaml's Ingress objects,
generated from the route table (:mod:`relay.service.routes`).

Each :class:`relay.service.routes.Door` policy is one nginx location (a regex of its
routes' paths, anchored, so that a /v1 path the table lacks matches none) and one
Ingress object (ingress-nginx annotations are per object). What a policy does at the
door (retries, buffering, timeouts, limits) is written here once per door; which routes
it takes comes from the table. The text between the marker comments of each file is
replaced; the rest of the file is left as written.

Order of use: ``python -m devstack.routegen`` (``make routes``) rewrites both files;
``--check`` exits 1 naming a file that differs from what the table generates
(tests/unit/test_routes.py runs :func:`rendered` for the same comparison).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import orjson

from relay.protocol.codes import Refusal
from relay.service.errors import OPENAI_SHAPED, error_body
from relay.service.routes import ROUTES, Door, Route, regex

__all__ = [
    "INGRESS",
    "NGINX",
    "UPSTREAM",
    "ingress_objects",
    "nginx_locations",
    "nginx_maps",
    "path_regex",
    "rendered",
]

ROOT: Final = Path(__file__).resolve().parents[1]
NGINX: Final = ROOT / "deploy" / "nginx.conf"
INGRESS: Final = ROOT / "deploy" / "k8s" / "base" / "ingress.yaml"
UPSTREAM: Final = {"relay": "relays", "worker": "workers"}  # nginx's upstream blocks
SERVICE: Final = {"relay": "tokenrelay-relay", "worker": "tokenrelay-worker"}  # k8s Services
_STREAM_METHOD: Final = "@stream_method"  # the stream location's 405
NO_ROUTE: Final = "no route for this path"  # a door's 404: the reason it gives
_GEN: Final = "generated from relay/service/routes.py by `python -m devstack.routegen`"
MARKS: Final = {"maps": ("# BEGIN ROUTE MAPS", "# END ROUTE MAPS"),
                 "routes": ("# BEGIN ROUTES", "# END ROUTES")}  # fmt: skip

_XFF: Final = (
    "# Replaces whatever the client sent: the applications trust this proxy's",
    "# X-Forwarded-For, so it must carry the peer address and nothing forged.",
    "proxy_set_header X-Forwarded-For $remote_addr;",
)
_WORKER: Final = (
    "proxy_http_version 1.1;",
    "proxy_set_header X-Forwarded-For $remote_addr;",
    "client_max_body_size 1m;",
    "proxy_buffering off;",
    "proxy_read_timeout 10m;",
    "proxy_next_upstream error timeout;   # never non_idempotent: a POST is not retried",
)
# (comment above the location, its directives); proxy_pass comes from the table
_NGINX: Final[dict[Door, tuple[str, tuple[str, ...]]]] = {
    Door.STREAM: (
        "SSE and WebSocket streams (and the AI SDK's UI stream and resume URL) go to a\n"
        "relay, unbuffered. A relay that answers 502, 503 (draining, or full) or 504 before\n"
        "the stream starts is skipped for the next one: a browser's EventSource that gets a\n"
        "non-200 answer stops for good. Only GET (a stream is always a GET) and OPTIONS (a\n"
        "cross-origin page's preflight) reach this location; nginx never retries a\n"
        "non-idempotent request anyway.",
        ("limit_conn streams_per_addr 16;", "{proxy_pass}", "proxy_http_version 1.1;",
         "proxy_set_header Upgrade $http_upgrade;",
         "proxy_set_header Connection $connection_upgrade;", *_XFF, "proxy_buffering off;",
         "proxy_cache off;", "proxy_read_timeout 1h;",
         "proxy_next_upstream error timeout http_502 http_503 http_504;",
         "proxy_next_upstream_tries 2;", "proxy_next_upstream_timeout 10s;"),
    ),
    Door.CREATE: (
        "Session creation: rate-limited per client address, then to a worker.",
        ("limit_req zone=sessions_per_addr burst=10 nodelay;", "{proxy_pass}",
         "proxy_http_version 1.1;", "proxy_set_header X-Forwarded-For $remote_addr;",
         "client_max_body_size 1m;",
         "proxy_next_upstream error timeout;   # never non_idempotent: a POST is not retried"),
    ),
    Door.API: (
        "Turns, the chat controls, tokens and offline jobs go to a worker; a turn POSTed\n"
        "with Accept: text/event-stream streams its frames on the response (the closed\n"
        "loop), so nothing here is buffered.",
        ("{proxy_pass}", *_WORKER),
    ),
    Door.GATEWAY: (
        "The AI SDK's chat POST and the OpenAI-compatible gateway go to a worker and\n"
        "stream their answer: unbuffered.",
        ("{proxy_pass}", *_WORKER),
    ),
    Door.RESPONSES: (
        "OpenAI's Responses API: created, cancelled and deleted on a worker, its stream\n"
        "resumed on a relay (the map above picks); streams are unbuffered and long.",
        ("{proxy_pass}", "proxy_http_version 1.1;",
         "proxy_set_header X-Forwarded-For $remote_addr;", "client_max_body_size 1m;",
         "proxy_buffering off;", "proxy_read_timeout 1h;",
         "proxy_next_upstream error timeout;   # never non_idempotent: a POST is not retried"),
    ),
    Door.DURABLE: (
        "Durable Streams (a stream's every method, a session read as a stream) go to a\n"
        "relay. Reads long-poll or stream SSE: unbuffered, with long read timeouts. An\n"
        "append (POST) is never retried; PUT and DELETE, idempotent, only when no relay\n"
        "answered. Bodies up to the relays' default --durable-max-body-bytes; the relays\n"
        "count live reads per token and per address themselves.",
        ("{proxy_pass}", "proxy_http_version 1.1;", *_XFF, "client_max_body_size 4m;",
         "proxy_buffering off;", "proxy_cache off;", "proxy_read_timeout 1h;",
         "proxy_next_upstream error timeout;   # never non_idempotent: a POST is not retried"),
    ),
}  # fmt: skip

_PRE: Final = "nginx.ingress.kubernetes.io/"
_LONG: Final = {"proxy-read-timeout": "3600", "proxy-send-timeout": "3600"}
# Ingress object: (its doors, its annotations without the prefix, use-regex aside)
_INGRESS: Final[dict[str, tuple[tuple[Door, ...], dict[str, str]]]] = {
    "tokenrelay-streams": ((Door.STREAM,), {
        "proxy-buffering": "off", "proxy-request-buffering": "off", **_LONG,
        "proxy-http-version": "1.1", "proxy-next-upstream": "error timeout"}),
    "tokenrelay-api": ((Door.CREATE, Door.API), {
        "proxy-body-size": "1m", "proxy-read-timeout": "30",
        "proxy-next-upstream": "error timeout"}),
    "tokenrelay-openai": ((Door.GATEWAY, Door.RESPONSES), {
        "proxy-body-size": "1m", "proxy-buffering": "off", **_LONG,
        "proxy-next-upstream": "error timeout"}),
    "tokenrelay-durable": ((Door.DURABLE,), {
        "proxy-body-size": "4m", "proxy-buffering": "off", "proxy-request-buffering": "off",
        **_LONG, "proxy-http-version": "1.1", "proxy-next-upstream": "error timeout"}),
}  # fmt: skip
HOST: Final = "tokenrelay.example.com"


def _routes(doors: Sequence[Door]) -> list[Route]:
    return [r for r in ROUTES if r.door in doors]


def _paths(routes: Sequence[Route]) -> list[str]:
    return list(dict.fromkeys(r.path for r in routes))


def path_regex(paths: Sequence[str]) -> str:
    """One anchored-at-the-end regex for ``paths`` (their common leading directories
    written once): ``/v1/(?:sessions/[^/]+/events|chat/[^/]+/stream)$``."""
    if len(paths) == 1:
        return regex(paths[0]) + "$"
    head = paths[0].split("{")[0]
    for p in paths[1:]:
        while not p.startswith(head):
            head = head[:-1]
    head = head[: head.rfind("/") + 1]
    return regex(head) + "(?:" + "|".join(regex(p[len(head) :]) for p in paths) + ")$"


def _default_service(routes: Sequence[Route]) -> str:
    """The service of the routes without a query condition (one, or the table is wrong)."""
    services = {r.service for r in routes if r.query is None}
    if len(services) != 1:
        raise ValueError(f"routes {[r.name for r in routes]} need one default service")
    return services.pop()


def _map_name(door: Door) -> str:
    return f"${door.value}_upstream"


def nginx_maps() -> str:
    """The ``map`` blocks (http level) that pick an upstream where one location serves
    two services: by method, and by the query parameter a route's condition names."""
    out: list[str] = []
    for door in _NGINX:
        routes = _routes([door])
        if len({r.service for r in routes}) < 2:
            continue
        (param,) = {r.query.param for r in routes if r.query is not None}
        default = _default_service(routes)
        entries = []
        for r in routes:
            if r.query is None:
                continue
            for m in r.methods:
                if any(m in o.methods and o.query is None for o in routes):
                    entries += [f'"{m}:{v}" {UPSTREAM[r.service]};' for v in r.query.values]
                else:
                    entries.append(f"~^{m}: {UPSTREAM[r.service]};")
        entries.append(f"default {UPSTREAM[default]};")
        out.append(f'map "$request_method:$arg_{param}" {_map_name(door)} {{ '
                   + " ".join(entries) + " }")  # fmt: skip
    return "".join(f"    {line}\n" for line in out)


def nginx_locations() -> str:
    """One location per door policy, in the server block."""
    out: list[str] = []
    for door, (comment, directives) in _NGINX.items():
        routes = _routes([door])
        paths = _paths(routes)
        services = {r.service for r in routes}
        upstream = UPSTREAM[services.pop()] if len(services) == 1 else _map_name(door)
        if len(paths) == 1 and "{" not in paths[0]:
            head = f"location = {paths[0]}"
        else:
            pattern = "^" + path_regex(paths)
            if re.search(r"[\s{};'\"]", pattern):
                raise ValueError(f"{pattern!r} needs quoting in nginx.conf")
            head = f"location ~ {pattern}"
        body = [d.replace("{proxy_pass}", f"proxy_pass http://{upstream};") for d in directives]
        if door is Door.STREAM:  # only the methods of its routes reach a relay's stream
            methods = " ".join(dict.fromkeys(m for r in routes for m in r.methods))
            body[:0] = [f"limit_except {methods} {{ deny all; }}",
                        f"error_page 403 = {_STREAM_METHOD};   # that refusal: a JSON 405",
                        "error_page 429 = @too_many;   # (a location's error_page drops the "
                        "server's)"]  # fmt: skip
        out += [""] + [f"# {c}" for c in comment.splitlines()]
        out += textwrap.wrap("routes: " + " ".join(r.name for r in routes), 86,
                             initial_indent="# ", subsequent_indent="#   ")  # fmt: skip
        out += [head + " {", *(f"    {d}" for d in body), "}"]
    out += ["", *_stream_method(), "", *_openai_unrouted()]
    return "".join(f"        {line}\n" if line else "\n" for line in out[1:])


def _stream_method() -> list[str]:
    """The named location that turns the stream location's ``limit_except`` refusal into
    the relays' own answer to that request: 405 ``method_not_allowed`` with ``Allow``."""
    routes = _routes([Door.STREAM])
    if any(r.front in OPENAI_SHAPED for r in routes):
        raise ValueError("a stream location of an OpenAI-shaped front needs OpenAI's 405")
    methods = sorted({m for r in routes for m in r.methods})
    body = orjson.dumps({"error": Refusal.METHOD_NOT_ALLOWED.value,
                         "reason": f"a stream takes {', '.join(methods)}"}).decode()  # fmt: skip
    return [
        "# A stream location's refusal of another method (its limit_except), as a relay",
        "# answers it: 405 with Allow, in tokenrelay's JSON shape.",
        f"location {_STREAM_METHOD} {{",
        "    default_type application/json;",
        f'    add_header Allow "{",".join(methods)}" always;',
        f"    return 405 '{body}';",
        "}",
    ]


def _openai_unrouted() -> list[str]:
    """The location that answers a path under the OpenAI-shaped fronts' paths that no
    route above takes: 404 in OpenAI's error shape, as the workers and relays answer it
    (:func:`relay.service.errors.unrouted`); any other path meets the file's own JSON 404."""
    heads = dict.fromkeys(r.path.split("{", 1)[0].rstrip("/") for r in ROUTES
                          if r.front in OPENAI_SHAPED)  # fmt: skip
    pattern = "^(?:" + "|".join(regex(h) for h in heads) + ")(?:/|$)"
    if re.search(r"[\s{};'\"]", pattern):
        raise ValueError(f"{pattern!r} needs quoting in nginx.conf")
    body = orjson.dumps(error_body(NO_ROUTE, "invalid_request_error", Refusal.NOT_FOUND.value),
                        option=orjson.OPT_SORT_KEYS).decode()  # fmt: skip
    if "'" in body or "$" in body:
        raise ValueError(f"{body!r} needs escaping in nginx.conf")
    return [
        "# A path under the OpenAI-compatible fronts' paths that no location above takes:",
        "# a 404 in OpenAI's error shape, which their SDKs parse (any other path: the JSON",
        "# 404 at the end of the file, in tokenrelay's own shape).",
        f"location ~ {pattern} {{",
        "    default_type application/json;",
        f"    return 404 '{body}';",
        "}",
    ]


def ingress_objects() -> str:
    """The Ingress objects: one per group of door policies, one regex path each (all
    paths of the host are regexes under use-regex: each is anchored at its end)."""
    docs = []
    for name, (doors, notes) in _INGRESS.items():
        routes = _routes(doors)
        service = SERVICE[_default_service(routes)]
        ann = {"use-regex": "true", **notes}
        lines = [
            "apiVersion: networking.k8s.io/v1",
            "kind: Ingress",
            "metadata:",
            f"  name: {name}",
            "  annotations:",
            *(f"    {_PRE}{k}: {json.dumps(v)}" for k, v in ann.items()),
            "spec:",
            "  ingressClassName: nginx",
            "  rules:",
            f"    - host: {HOST}",
            "      http:",
            "        paths:",
            *textwrap.wrap(
                "routes: " + " ".join(r.name for r in routes),
                88,
                initial_indent="          # ",
                subsequent_indent="          #   ",
            ),
            f"          - path: {json.dumps(path_regex(_paths(routes)))}",
            "            pathType: ImplementationSpecific",
            "            backend:",
            f"              service: {{name: {service}, port: {{name: http}}}}",
        ]
        docs.append("\n".join(lines) + "\n")
    return "---\n".join(docs)


def _between(text: str, marks: tuple[str, str], body: str, where: Path) -> str:
    begin, end = marks
    found = rf"^([ \t]*){re.escape(begin)}\b[^\n]*\n.*?^[ \t]*{re.escape(end)}$"
    m = re.search(found, text, re.M | re.S)
    if m is None:
        raise ValueError(f"{where}: no '{begin}' ... '{end}' markers")
    indent = m.group(1)
    new = f"{indent}{begin}: {_GEN}\n{body}{indent}{end}"
    return text[: m.start()] + new + text[m.end() :]


def rendered(which: str, text: str) -> str:
    """``text`` (the file ``which``: "nginx" or "ingress") with its generated parts
    replaced by what the table generates now."""
    if which == "nginx":
        text = _between(text, MARKS["maps"], nginx_maps(), NGINX)
        return _between(text, MARKS["routes"], nginx_locations(), NGINX)
    if which == "ingress":
        return _between(text, MARKS["routes"], ingress_objects(), INGRESS)
    raise ValueError(f"which must be nginx or ingress, not {which!r}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devstack.routegen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 on a diff")
    args = parser.parse_args(argv)
    stale = []
    for which, path in (("nginx", NGINX), ("ingress", INGRESS)):
        old = path.read_text(encoding="utf-8")
        new = rendered(which, old)
        if new != old:
            stale.append(str(path.relative_to(ROOT)))
            if not args.check:
                path.write_text(new, encoding="utf-8")
    if args.check and stale:
        print("differs from the route table (run `make routes`): " + ", ".join(stale))
        return 1
    print(("rewrote " + ", ".join(stale)) if stale else "deploy files match the route table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
