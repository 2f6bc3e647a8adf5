"""The HTTP contract (docs/openapi.yaml) as served at ``GET /openapi.json``.

One OpenAPI 3.1 document describes both services; every operation is tagged ``relay`` or
``worker`` (or both, for health, readiness, metrics and this route). The document ships
inside the package as ``relay/service/openapi.json`` (JSON: no YAML parser at run time), so an
installed wheel serves it as well as a checkout. ``make openapi`` writes that copy from
docs/openapi.yaml; tests/integration/test_openapi.py fails when the two differ.

Order of use: ``app.router.add_get("/openapi.json", handler("relay"))`` in the app
factory (``worker.api`` passes ``"worker"``); :func:`document` returns the part a service
serves, :func:`write_packaged` (``python -m relay.service.openapi``) refreshes the copy.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any, Final

import orjson
from aiohttp import web

__all__ = ["SERVICES", "document", "full_document", "handler", "write_packaged"]

SERVICES: Final = ("relay", "worker")
_PACKAGED: Final = "openapi.json"


@functools.cache
def full_document() -> dict[str, Any]:
    """The whole contract, both services (a fresh parse once per process)."""
    raw = resources.files("relay.service").joinpath(_PACKAGED).read_bytes()
    doc: dict[str, Any] = orjson.loads(raw)
    return doc


def document(service: str) -> dict[str, Any]:
    """The operations tagged ``service``, with every component (a valid document)."""
    if service not in SERVICES:
        raise ValueError(f"service must be one of {SERVICES}, not {service!r}")
    full = full_document()
    paths: dict[str, Any] = {}
    for path, item in full["paths"].items():
        ops = {
            k: v for k, v in item.items() if isinstance(v, dict) and service in v.get("tags", ())
        }
        if ops:
            shared = {k: v for k, v in item.items() if k in ("parameters", "summary")}
            paths[path] = {**shared, **ops}
    info = {**full["info"], "title": f"{full['info']['title']} {service}"}
    tags = [t for t in full.get("tags", []) if t["name"] == service]
    return {**full, "info": info, "tags": tags, "paths": paths}


@functools.cache
def _body(service: str) -> bytes:
    return orjson.dumps(document(service))


def handler(service: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler that answers with :func:`document` of ``service`` as JSON."""
    body = _body(service)  # fails at app construction, not at the first request

    async def openapi(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    return openapi


def write_packaged(source: Path, target: Path) -> None:
    """Write ``source`` (YAML) to ``target`` as JSON: the packaged copy. Needs PyYAML."""
    import yaml  # a development dependency (the test extra), never needed at run time

    doc = yaml.safe_load(source.read_text(encoding="utf-8"))
    target.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")


if (
    __name__ == "__main__"
):  # python -m relay.service.openapi docs/openapi.yaml relay/service/openapi.json
    if len(sys.argv) != 3:
        sys.exit("usage: python -m relay.service.openapi SOURCE.yaml TARGET.json")
    write_packaged(Path(sys.argv[1]), Path(sys.argv[2]))
