"""docs/openapi.yaml stays equal to the code, and the live services keep to it.

- The packaged copy (relay/service/openapi.json, what the services serve) equals the YAML.
- The document, and each service's part, is valid OpenAPI 3.1.
- Every route of the relay's and the worker's aiohttp router is documented for that
  service, and every documented operation is routed: a new route fails here until it
  is written into the document.
- Every status code a handler can answer with (found in its source and in the sources
  of the functions and methods it calls) is documented for its operation.
- An installed wheel carries the packaged copy.
- schemathesis, as a user would run it, fuzzes a live relay and a live worker from
  their own ``/openapi.json`` with a bounded number of examples: no 5xx, no response
  outside the contract. An authorized SSE and WebSocket stream, which schemathesis cannot
  open (it never holds the token of the session it picks), is checked by hand.
"""

from __future__ import annotations

import inspect
import json
import re
import shutil
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from relay.edge.config import RelayConfig
from relay.edge.http.app import make_app as relay_app
from relay.edge.http.app import make_runner
from relay.edge.http.server import EdgeServer
from relay.protocol.auth import issue_token
from relay.protocol.keys import new_session_id
from relay.service import cors, openapi
from tests.support.cli import run_cli
from tests.support.worker import SECRET, Harness
from worker import api as worker_api
from worker.api import make_app as worker_app
from worker.config import WorkerConfig

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "openapi.yaml"
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def _yaml_doc() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(DOC.read_text())
    return doc


def _apps() -> dict[str, web.Application]:
    return {
        "relay": relay_app(RelayConfig(insecure_no_auth=True)),
        "worker": worker_app(WorkerConfig()),
    }


def _routed(app: web.Application) -> dict[tuple[str, str], Callable[..., Any]]:
    """(METHOD, path template) -> handler, for every route; HEAD routes that aiohttp adds
    beside each GET are left out (they answer like the GET without a body)."""
    out: dict[tuple[str, str], Callable[..., Any]] = {}
    for route in app.router.routes():
        if route.resource is None or route.method == "*":  # the refusals of what no route takes
            continue
        info = route.resource.get_info()
        path = info.get("path") or info.get("formatter")
        assert path, route
        out[(route.method, path)] = route.handler
    gets = {p for m, p in out if m == "GET"}
    return {(m, p): h for (m, p), h in out.items() if not (m == "HEAD" and p in gets)}


def _documented(service: str) -> dict[tuple[str, str], dict[str, Any]]:
    doc = openapi.document(service)
    return {
        (m.upper(), path): op
        for path, item in doc["paths"].items()
        for m, op in item.items()
        if m in METHODS
    }


def test_packaged_copy_equals_the_yaml() -> None:
    packaged = json.loads((ROOT / "relay" / "service" / "openapi.json").read_text())
    assert packaged == _yaml_doc(), "relay/service/openapi.json is stale: run `make openapi`"
    assert openapi.full_document() == packaged


def test_the_document_and_each_part_are_valid_openapi_3_1() -> None:
    validator = pytest.importorskip("openapi_spec_validator")
    doc = _yaml_doc()
    assert doc["openapi"].startswith("3.1")
    validator.validate(doc)
    for service in openapi.SERVICES:
        validator.validate(openapi.document(service))
    tags = {t for item in doc["paths"].values() for op in item.values() for t in op["tags"]}
    assert tags == set(openapi.SERVICES)
    with pytest.raises(ValueError, match="service must be"):
        openapi.document("edge")


@pytest.mark.parametrize("service", openapi.SERVICES)
def test_every_route_is_documented_and_every_operation_routed(service: str) -> None:
    routed = set(_routed(_apps()[service]))
    documented = set(_documented(service))
    assert routed - documented == set(), (
        f"routes of the {service} missing from docs/openapi.yaml: document them there "
        f"(tags: [{service}]), then run `make openapi`"
    )
    assert documented - routed == set(), f"documented for the {service} but not routed"


# Status codes in handler sources: refusal(409, ...), Reject(503, ...), _json(201, ...),
# status=503. AuthError statuses come from relay.protocol.auth.
_STATUS = re.compile(r"\b(?:refusal|Reject|_json)\(\s*(\d{3})|\bstatus=(\d{3})")
_CALL = re.compile(r"(?:self\.)?\b([A-Za-z_]\w*)\(")


def _calls(src: str, opening: str) -> list[str]:
    """The argument text of every call that starts with ``opening`` (parens balanced)."""
    out = []
    for m in re.finditer(re.escape(opening), src):
        depth, i = 1, m.end()
        while depth and i < len(src):
            depth += {"(": 1, ")": -1}.get(src[i], 0)
            i += 1
        out.append(src[m.end() : i - 1])
    return out


def _codes(fn: Callable[..., Any], scope: dict[str, Any], seen: set[str]) -> set[int]:
    """Status codes in ``fn`` and, transitively, in the functions of ``scope`` it calls."""
    src = inspect.getsource(fn)
    codes = {int(a or b) for a, b in _STATUS.findall(src)}
    if "verify_token" in src:
        codes |= {401, 403}
    if any("status=" not in call for call in _calls(src, "json_response(")):
        codes.add(200)  # web.json_response's default
    for name in _CALL.findall(src):
        if name in scope and name not in seen:
            seen.add(name)
            codes |= _codes(scope[name], scope, seen)
    return codes


def _scope(service: str) -> dict[str, Any]:
    shared = {"answer_preflight": cors.preflight("*")}  # both services' stream preflights
    if service == "relay":
        return {n: getattr(EdgeServer, n) for n, _ in inspect.getmembers(EdgeServer)} | shared
    return {n: v for n, v in vars(worker_api).items() if inspect.isfunction(v)} | shared


@pytest.mark.parametrize("service", openapi.SERVICES)
def test_every_status_a_handler_answers_is_documented(service: str) -> None:
    documented = _documented(service)
    scope = _scope(service)
    checked = 0
    for key, handler in _routed(_apps()[service]).items():
        name = getattr(handler, "__name__", "")
        if name not in scope:
            continue  # a handler from another module (relay.service.openapi): nothing to scan
        found = _codes(scope[name], scope, {name})
        codes = {int(c) for c in documented[key]["responses"]}
        assert found - codes == set(), (
            f"{key} answers {sorted(found - codes)}, not in docs/openapi.yaml's responses"
        )
        checked += 1
    assert checked >= 5


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_wheel_ships_the_contract(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a copy: the build writes nothing into the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("relay", "worker", "devstack", "tokenrelay", "bench"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    out = await run_cli(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
        timeout_s=300,
    )
    assert out.code == 0, out.err
    (wheel,) = tmp_path.glob("tokenrelay-*.whl")
    with zipfile.ZipFile(wheel) as z:
        packaged = json.loads(z.read("relay/service/openapi.json"))
    assert packaged == _yaml_doc()


# -- schemathesis against live services ----------------------------------------------------

MAX_EXAMPLES = 25  # per operation and phase: bounded, a few seconds each


async def _schemathesis(base: str, report: Path, *extra: str) -> tuple[int, str]:
    """Run the schemathesis CLI against ``base``/openapi.json; (exit code, output)."""
    cli = Path(sys.executable).parent / "schemathesis"
    if not cli.exists():
        pytest.skip("schemathesis is not installed (pip install schemathesis)")
    ran = await run_cli(
        [str(cli), "run", f"{base}/openapi.json",
        "--checks", "all",
        "--max-examples", str(MAX_EXAMPLES),
        "--seed", "7",
        "--workers", "1",
        "--request-timeout", "10",
        "--generation-database", "none",
        "--no-color",
        "--generation-with-security-parameters", "false",
        "--output-sanitize", "false",  # test tokens only; keeps max_tokens readable
        "--report", "junit", "--report-junit-path", str(report),
        *extra],
        cwd=report.parent,  # its cache directory (.schemathesis) lands there, not in the checkout
        timeout_s=240, merge=True,
    )  # fmt: skip
    return ran.code, ran.out


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_schemathesis_against_a_live_relay(cluster: ClusterInfo, tmp_path: Path) -> None:
    cfg = RelayConfig(secret=SECRET, redis_url=cluster.url, relay_id="fuzzed", reap_after_s=0)
    app = relay_app(cfg)
    runner = make_runner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        base = f"http://127.0.0.1:{port}"
        code, out = await _schemathesis(base, tmp_path / "relay.xml")
        await _streams_keep_to_the_contract(base)
    finally:
        await runner.cleanup()
    assert code == 0, out[-6000:]


async def _streams_keep_to_the_contract(base: str) -> None:
    """What schemathesis cannot reach (it never holds a valid token for the session it
    picks): an authorized stream's status, media type and headers are the documented
    ones, on SSE and WebSocket."""
    sid = new_session_id()
    token = issue_token(SECRET, sid, 60, time.time(), scope="watch")
    ops = _documented("relay")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        sse = ops[("GET", "/v1/sessions/{sid}/events")]["responses"]
        async with http.get(
            f"{base}/v1/sessions/{sid}/events",
            headers={"Authorization": f"Bearer {token}", "Last-Event-ID": "0"},
        ) as r:
            assert str(r.status) in sse
            doc = sse[str(r.status)]
            assert r.content_type in doc["content"]
            assert set(doc.get("headers", {})) <= set(r.headers)
            assert (await r.content.readline()).startswith(b"retry:")
        ws_doc = ops[("GET", "/v1/sessions/{sid}/ws")]["responses"]
        async with http.ws_connect(f"{base}/v1/sessions/{sid}/ws?token={token}&from=0") as ws:
            assert "101" in ws_doc
            hello = await ws.receive_json()
            assert hello["type"] == "hello"


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_schemathesis_against_a_live_worker(
    h: Harness, redis: RedisCluster, tmp_path: Path
) -> None:
    await h.start_engines(2)
    await h.start_worker()
    base = h.url("").rstrip("/")
    # The stateful phase posts turns with the token that POST /v1/sessions returned (the
    # document's link); ignored_auth takes that real token for a generated one and
    # expects a 401. Token checks: tests/unit/test_auth.py, tests/integration/test_worker_api.py.
    code, out = await _schemathesis(
        base, tmp_path / "worker.xml", "--exclude-checks", "ignored_auth"
    )
    assert code == 0, out[-6000:]


@pytest.mark.integration
async def test_an_integral_float_is_an_integer_as_the_contract_says(
    h: Harness, redis: RedisCluster
) -> None:
    """Found by schemathesis: JSON (and the document's schema) has one number type, so
    ``"max_tokens": 3.0`` is the integer 3; 3.5 stays a 400."""
    await h.start_engines(1)
    await h.start_worker()
    sid, token = await h.session()
    status, body, _ = await h.post_turn(sid, token, {"message": "hi", "max_tokens": 3.5})
    assert (status, body["error"]) == (400, "invalid_max_tokens")
    status, body, _ = await h.post_turn(sid, token, {"message": "hi", "max_tokens": 3.0})
    assert status == 202, body
