"""Where each shipped front door sends a request, read from its configuration, and the
figure "fronts reachable through each front door".

- nginx (deploy/nginx.conf): its ``location`` blocks chosen the way nginx chooses (an
  exact match, else the longest prefix if ``^~``, else the first matching regex in the
  file's order, else the longest prefix), then ``return`` (the door answers),
  ``limit_except`` (403) or ``proxy_pass`` (an upstream, through a ``map`` when it is a
  variable);
- the Kubernetes Ingress (deploy/k8s/base/ingress.yaml): ingress-nginx under use-regex
  (every path of the host a case-insensitive regex from the path's start, the longest
  path tried first); an Ingress routes by path only;
- the demo's front door (devstack/demo/frontdoor.py): its aiohttp router resolves the
  request and its handler is run with the proxying replaced by a note of the upstreams
  it picked (so an older front door is measured the same way).

Order of use: ``python -m devstack.doors`` prints, for each door, the fronts whose every
route (each method, at a sample path) reaches the service that serves it, and the
requests that do not; ``--nginx``, ``--ingress`` and ``--frontdoor`` read other files
(another tree's, for a before and after). tests/unit/test_routes.py asserts on the same
functions.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import aiohttp
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from relay.service.routes import FRONTS, Route, public, public_by_path, regex, sample

__all__ = ["Nginx", "frontdoor_service", "fronts_reachable", "ingress_service", "requests"]

ROOT: Final = Path(__file__).resolve().parents[1]
UPSTREAMS: Final = {"relays": "relay", "workers": "worker"}
SERVICES: Final = {"tokenrelay-relay": "relay", "tokenrelay-worker": "worker"}


@dataclass
class Block:
    words: list[str]
    children: list[Block] = field(default_factory=list)

    def find(self, name: str) -> Iterator[Block]:
        return (c for c in self.children if c.words and c.words[0] == name)


def _tokens(text: str) -> Iterator[str]:
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c == "#":
            i = text.find("\n", i) if "\n" in text[i:] else n
        elif c in "{};":
            yield c
            i += 1
        elif c in "'\"":
            j = text.index(c, i + 1)
            yield text[i + 1 : j]
            i = j + 1
        else:
            j = i
            while j < n and not text[j].isspace() and text[j] not in "{};":
                j += 1
            yield text[i:j]
            i = j


def parse_conf(text: str) -> Block:
    """An nginx configuration as nested blocks (directives are blocks without children)."""
    root = Block([])
    stack: list[Block] = [root]
    words: list[str] = []
    for t in _tokens(text):
        if t == ";":
            stack[-1].children.append(Block(words))
            words = []
        elif t == "{":
            block = Block(words)
            stack[-1].children.append(block)
            stack.append(block)
            words = []
        elif t == "}":
            stack.pop()
        else:
            words.append(t)
    return root


class Nginx:
    """deploy/nginx.conf's one server, as nginx routes a request in it."""

    def __init__(self, text: str) -> None:
        http = next(parse_conf(text).find("http"))
        self.server = next(http.find("server"))
        self.maps = {b.words[2]: b for b in http.find("map")}
        self.locations = [b for b in self.server.find("location") if b.words[1][0] != "@"]

    def location(self, path: str) -> Block | None:
        exact = [b for b in self.locations if b.words[1] == "="]
        for b in exact:
            if b.words[2] == path:
                return b
        prefixes = [b for b in self.locations if len(b.words) == 2 or b.words[1] == "^~"]
        best = max(
            (b for b in prefixes if path.startswith(b.words[-1])),
            key=lambda b: len(b.words[-1]),
            default=None,
        )
        if best is not None and best.words[1] == "^~":
            return best
        for b in self.locations:
            if b.words[1] in ("~", "~*"):
                flags = re.IGNORECASE if b.words[1] == "~*" else 0
                if re.search(b.words[2], path, flags):
                    return b
        return best

    def _map(self, name: str, method: str, query: Mapping[str, str]) -> str:
        block = self.maps[name]
        source = re.sub(
            r"\$(request_method|arg_\w+)",
            lambda m: method if m.group(1) == "request_method" else query.get(m.group(1)[4:], ""),
            block.words[1],
        )
        entries = [(c.words[0], c.words[1]) for c in block.children]
        for key, value in entries:
            if key == source:
                return value
        for key, value in entries:
            if key.startswith("~"):
                flags = re.IGNORECASE if key.startswith("~*") else 0
                if re.search(key.lstrip("~*"), source, flags):
                    return value
        return dict(entries)["default"]

    def service(self, method: str, path: str, query: Mapping[str, str]) -> str | None:
        """``relay`` or ``worker``; None when nginx answers itself (404, 403, its own)."""
        loc = self.location(path)
        if loc is None or any(loc.find("return")):
            return None
        for limit in loc.find("limit_except"):
            allowed = set(limit.words[1:]) | ({"HEAD"} if "GET" in limit.words else set())
            if method not in allowed:
                return None
        (proxy,) = loc.find("proxy_pass")
        upstream = proxy.words[1].removeprefix("http://")
        if upstream.startswith("$"):
            upstream = self._map(upstream, method, query)
        return UPSTREAMS[upstream]


@functools.cache
def _ingress_rules(text: str) -> tuple[bool, list[tuple[str, str | None, str]]]:
    import yaml  # a development dependency

    objects = [d for d in yaml.safe_load_all(text) if d and d.get("kind") == "Ingress"]
    regex_host = any(
        o["metadata"].get("annotations", {}).get("nginx.ingress.kubernetes.io/use-regex") == "true"
        for o in objects
    )
    rules = [
        (p["path"], p.get("pathType"), p["backend"]["service"]["name"])
        for o in objects
        for rule in o["spec"]["rules"]
        for p in rule["http"]["paths"]
    ]
    return regex_host, sorted(rules, key=lambda r: -len(r[0]))  # the longest path first


def ingress_service(text: str, path: str) -> str | None:
    """The service an ingress-nginx controller sends ``path`` to (any method)."""
    regex_host, rules = _ingress_rules(text)
    for rule_path, kind, service in rules:
        if regex_host:
            hit = re.match("^" + rule_path, path, re.IGNORECASE) is not None
        elif kind == "Exact":
            hit = path == rule_path
        else:
            hit = path == rule_path or path.startswith(rule_path.rstrip("/") + "/")
        if hit:
            return SERVICES[service]
    return None


class _Routed(Exception):
    pass


class _NoUpstream:
    """The door's HTTP client, for the door's own handlers: every request fails."""

    def get(self, *args: Any, **kwargs: Any) -> Any:
        raise aiohttp.ClientConnectionError("not in this measure")


async def frontdoor_service(module: ModuleType, method: str, path_qs: str) -> str | None:
    """The service ``module``'s front door proxies the request to (None: it answers)."""

    class Recording(module.FrontDoor):  # type: ignore[name-defined,misc]
        async def proxy_http(self, request: web.Request, upstreams: Any) -> web.StreamResponse:
            raise _Routed(upstreams[0])

        async def proxy_ws(self, request: web.Request) -> web.StreamResponse:
            raise _Routed(self._relays()[0])

    door = Recording(lambda: ["relay"], lambda: ["worker"])
    door.http = _NoUpstream()
    app: web.Application = module.make_frontdoor_app(door)
    request = make_mocked_request(method, path_qs, app=app)
    match = await app.router.resolve(request)
    if match.http_exception is not None:
        return None
    request._match_info = match  # as aiohttp's request handler sets it
    try:
        await match.handler(request)
    except _Routed as routed:
        return str(routed.args[0])
    return None


@dataclass(frozen=True)
class Request:
    route: Route
    method: str
    path: str
    query: dict[str, str]

    @property
    def path_qs(self) -> str:
        return self.path + "".join(f"?{k}={v}" for k, v in self.query.items())

    def __str__(self) -> str:
        return f"{self.method} {self.path_qs} ({self.route.name})"


def requests() -> list[Request]:
    """Every public route of the table, each method, at a sample path (with the first
    value of its query condition)."""
    out = []
    for route in public():
        query = {route.query.param: route.query.values[0]} if route.query else {}
        out += [Request(route, m, sample(route.path), query) for m in route.methods]
    return out


def _serves(service: str | None, req: Request) -> bool:
    """Whether ``service`` has a route for the request's method at its path: the route
    itself, or (for a door that cannot read the query) another of its path's routes."""
    if service is None:
        return False
    if req.route.serves(service):
        return True
    (routes,) = (rs for p, rs in public_by_path().items() if re.fullmatch(regex(p), req.path))
    return any(r.serves(service) and req.method in r.methods and r.query is None for r in routes)


def fronts_reachable(
    where: Mapping[str, Callable[[Request], str | None]], *, preflights: bool = True
) -> dict[str, tuple[list[str], list[Request]]]:
    """For each door: (the fronts all of whose requests reach a service that serves
    them, the requests that do not); ``preflights=False``: a CORS preflight (OPTIONS)
    that does not is not counted against its front (a same-origin page sends none)."""
    out = {}
    for door, service_of in where.items():
        missed = [req for req in requests() if not _serves(service_of(req), req)]
        count = [r for r in missed if preflights or r.method != "OPTIONS"]
        fronts = [f.value for f in FRONTS if not any(r.route.front is f for r in count)]
        out[door] = (fronts, missed)
    return out


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("frontdoor_measured", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devstack.doors",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nginx", type=Path, default=ROOT / "deploy" / "nginx.conf")
    parser.add_argument("--ingress", type=Path,
                        default=ROOT / "deploy" / "k8s" / "base" / "ingress.yaml")  # fmt: skip
    parser.add_argument("--frontdoor", type=Path,
                        default=ROOT / "devstack" / "demo" / "frontdoor.py")  # fmt: skip
    args = parser.parse_args(argv)
    nginx = Nginx(args.nginx.read_text())
    ingress = args.ingress.read_text()
    door = _load(args.frontdoor)
    loop = asyncio.new_event_loop()
    where: dict[str, Callable[[Request], str | None]] = {
        "nginx": lambda r: nginx.service(r.method, r.path, r.query),
        "ingress": lambda r: ingress_service(ingress, r.path),
        "frontdoor": lambda r: loop.run_until_complete(
            frontdoor_service(door, r.method, r.path_qs)
        ),
    }
    strict = fronts_reachable(where)
    lenient = fronts_reachable(where, preflights=False)
    for name, (fronts, missed) in strict.items():
        print(f"{name}: {len(fronts)}/{len(FRONTS)} fronts reachable ({', '.join(fronts)}); "
              f"{len(lenient[name][0])}/{len(FRONTS)} not counting CORS preflights")  # fmt: skip
        for m in missed:
            print(f"    not reached: {m}")
    loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
