"""deploy/nginx.conf, run: retries, limits and what is never retried (hostile-suite style).

The file docker-compose.yml mounts as /etc/nginx/nginx.conf is started with the
machine's nginx (Debian: ``apt-get install nginx-light``; skipped with the reason when
there is none), its upstream host names and listen port rewritten to loopback ports
where small stand-in relays and workers answer, so that what is checked is nginx's
behaviour under this configuration:

- a relay answering 503 (draining, full) before a stream starts is skipped for the
  next one: every GET stream gets 200;
- a POST that reached a worker which died mid-request is not sent to another one;
- the 17th concurrent stream from one address gets 429 (JSON, ``Retry-After``) while
  another address still streams;
- a session-creation flood from one address gets 429 with ``Retry-After`` past the
  burst while another address still gets 201;
- Durable Streams reach a real relay (on the local cluster): PUT, POST, a catch-up GET,
  a long-poll woken by an append, a chat session read as a stream;
- a path no route has gets nginx's own JSON 404, in the shape of the path's front.

Each stand-in test keeps a bystander stream from another loopback address (127.0.0.2) open
throughout; it must keep receiving events. The configuration is also checked by
reading it (``nginx -t`` runs on every start here).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from devstack.doors import Block
from devstack.doors import Nginx as NginxConf
from devstack.procs import Proc, free_port, port_open
from relay.protocol.keys import new_session_id
from tests.support.cli import run_cli
from tests.support.relay import publish_turn, running

ROOT = Path(__file__).resolve().parents[2]
NGINX_CONF = ROOT / "deploy" / "nginx.conf"
COMPOSE = ROOT / "docker-compose.yml"
BYSTANDER_ADDR = "127.0.0.2"


# -- stand-in upstreams ----------------------------------------------------------------


@dataclass
class Upstream:
    """``mode``: "stream" (200 SSE, an event every 50 ms until the client leaves),
    "draining" (503 like a draining relay), "ok" (201 JSON), "forbidden" (403 JSON like a
    relay refusing a token), "die" (reads the request,
    then drops the connection without an answer: a worker killed mid-request)."""

    mode: str
    hits: int = 0
    open_streams: int = 0
    methods: list[str] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.read())
        self.hits += 1
        self.methods.append(request.method)
        if self.mode == "draining":
            return web.json_response({"error": "draining"}, status=503)
        if self.mode == "ok":
            return web.json_response({"session": "s", "token": "t"}, status=201)
        if self.mode == "forbidden":
            return web.json_response({"error": "token_invalid", "reason": "r"}, status=403)
        if self.mode == "die":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(1)
            return web.Response(status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.open_streams += 1
        try:
            i = 0
            while True:
                i += 1
                await resp.write(f"id: {i}\nevent: token\ndata: {{}}\n\n".encode())
                await asyncio.sleep(0.05)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.open_streams -= 1
        return resp


@contextlib.asynccontextmanager
async def upstream(mode: str) -> AsyncIterator[tuple[Upstream, int]]:
    u = Upstream(mode)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", u.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield u, port
    finally:
        await runner.cleanup()


# -- nginx with deploy/nginx.conf --------------------------------------------------------


def nginx_binary() -> str:
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if not found:
        pytest.skip("no nginx binary (Debian: apt-get install nginx-light)")
    return found


def local_conf(tmp: Path, port: int, relays: list[int], workers: list[int]) -> Path:
    """deploy/nginx.conf with loopback upstreams, port and files under ``tmp``."""
    text = NGINX_CONF.read_text()
    for i, p in enumerate(relays, 1):
        text = text.replace(f"server relay-{i}:8000", f"server 127.0.0.1:{p}")
    for i, p in enumerate(workers, 1):
        text = text.replace(f"server worker-{i}:8000", f"server 127.0.0.1:{p}")
    text = re.sub(r" server (relay|worker)-\d+:8000[^;]*;", "", text)  # fewer upstreams here
    text = text.replace("listen 8080;", f"listen 127.0.0.1:{port};")
    text = text.replace("worker_processes auto;", "worker_processes 1;")
    text = text.replace("access_log /dev/stdout", f"access_log {tmp}/access.log")
    text = text.replace("error_log /dev/stderr", f"error_log {tmp}/error.log")
    temp = "".join(
        f"    {kind}_temp_path {tmp}/{kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    text = text.replace("http {\n", "http {\n" + temp, 1)
    conf = tmp / "nginx.conf"
    conf.write_text(text)
    return conf


@dataclass
class Nginx:
    base: str
    conf: Path
    tmp: Path

    def access_log(self) -> str:
        path = self.tmp / "access.log"
        return path.read_text() if path.exists() else ""


@contextlib.asynccontextmanager
async def nginx(tmp: Path, relays: list[int], workers: list[int]) -> AsyncIterator[Nginx]:
    binary = nginx_binary()
    port = free_port()
    conf = local_conf(tmp, port, relays, workers)
    globals_ = f"daemon off; pid {tmp}/nginx.pid; user root;"
    check = await run_cli([binary, "-t", "-p", str(tmp), "-c", str(conf), "-g", globals_],
                          merge=True)  # fmt: skip
    assert check.code == 0, check.out
    proc = Proc.start([binary, "-p", str(tmp), "-c", str(conf), "-g", globals_],
                      log=None, name="nginx")  # fmt: skip
    try:
        async with asyncio.timeout(10):
            while not await port_open(port)(proc):
                assert proc.alive, (tmp / "error.log").read_text()
                await asyncio.sleep(0.05)
        yield Nginx(f"http://127.0.0.1:{port}", conf, tmp)
    finally:
        await proc.stop(grace_s=10)  # SIGTERM: the master stops its workers, by our pid


def client(addr: str = "127.0.0.1") -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(local_addr=(addr, 0), limit=0),
        timeout=aiohttp.ClientTimeout(total=30),
    )


class Bystander:
    """A stream from another address, open for the whole test; must keep flowing."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.http = client(BYSTANDER_ADDR)
        self.resp: aiohttp.ClientResponse | None = None
        self.events = 0

    async def open(self) -> Bystander:
        self.resp = await self.http.get(self.base + "/v1/sessions/bystander/events")
        assert self.resp.status == 200, await self.resp.text()
        await self.read(3)
        return self

    async def read(self, n: int) -> None:
        assert self.resp is not None
        async with asyncio.timeout(5):
            seen = 0
            while seen < n:
                line = await self.resp.content.readline()
                assert line, "the bystander's stream ended"
                seen += line.startswith(b"id: ")
        self.events += n

    async def close(self) -> None:
        if self.resp is not None:
            self.resp.close()
        await self.http.close()


@contextlib.asynccontextmanager
async def bystander(base: str) -> AsyncIterator[Bystander]:
    b = await Bystander(base).open()
    try:
        yield b
        await b.read(3)  # still flowing after the hostile part
    finally:
        await b.close()


# -- behaviour ---------------------------------------------------------------------------


async def test_a_draining_relay_is_skipped_and_a_post_is_never_retried(tmp_path: Path) -> None:
    nginx_binary()
    async with (
        upstream("draining") as (draining, r1),
        upstream("stream") as (_, r2),
        upstream("die") as (dying, w1),
        upstream("die") as (dying2, w2),
        nginx(tmp_path, [r1, r2], [w1, w2]) as ng,
        bystander(ng.base) as _b,
        client() as http,
    ):
        for i in range(6):  # round robin would give the draining relay half of them
            async with http.get(f"{ng.base}/v1/sessions/s{i}/events") as r:
                assert r.status == 200, await r.text()
                assert (await r.content.readline()).startswith(b"id: ")
        assert draining.hits >= 1  # it was asked and its 503 was not passed on
        # POSTs to workers that die mid-request: none reaches a second worker (once
        # both are marked failed, nginx answers 502 without asking either)
        for i in range(4):
            async with http.post(f"{ng.base}/v1/sessions/s{i}/turns", json={"m": i}) as r:
                assert r.status == 502, await r.text()
        seen = dying.bodies + dying2.bodies
        assert 1 <= len(seen) == len(set(seen)) <= 4, seen
        assert set(dying.methods + dying2.methods) == {"POST"}
        # a stream location takes GET (and a CORS preflight) only: another method gets
        # the relays' own 405, with Allow, as JSON
        async with http.post(f"{ng.base}/v1/sessions/s0/events") as r:
            assert (r.status, r.headers["Allow"]) == (405, "GET,OPTIONS")
            assert (await r.json())["error"] == "method_not_allowed"
        async with http.options(f"{ng.base}/v1/sessions/s0/events") as r:
            assert r.status != 403
        # tokens in query strings stay out of the access log
        async with http.get(f"{ng.base}/v1/sessions/s9/events?token=SECRET-TOKEN") as r:
            assert r.status == 200
    log = ng.access_log()
    assert "/v1/sessions/s9/events" in log
    assert "SECRET-TOKEN" not in log


async def test_the_seventeenth_stream_from_one_address_gets_429(tmp_path: Path) -> None:
    nginx_binary()
    async with (
        upstream("stream") as (_, r1),
        upstream("stream") as (_, r2),
        upstream("ok") as (_, w1),
        nginx(tmp_path, [r1, r2], [w1]) as ng,
        bystander(ng.base) as b,
        client() as http,
    ):
        streams = []
        try:
            for i in range(16):
                resp = await http.get(f"{ng.base}/v1/sessions/s{i}/events")
                assert resp.status == 200, (i, await resp.text())
                streams.append(resp)
            async with http.get(f"{ng.base}/v1/sessions/s16/events") as r:
                body = await r.json()
                assert r.status == 429
                assert r.headers["Retry-After"] == "1"
            assert body["error"] == "rate_limited"
            await b.read(3)  # another address: unaffected, and may open more
            async with b.http.get(f"{ng.base}/v1/sessions/second/events") as r:
                assert r.status == 200
            streams.pop().close()  # one ends: the next one is admitted
            await asyncio.sleep(0.2)
            async with http.get(f"{ng.base}/v1/sessions/s17/events") as r:
                assert r.status == 200
        finally:
            for s in streams:
                s.close()


async def test_a_session_creation_flood_gets_429_while_another_address_gets_201(
    tmp_path: Path,
) -> None:
    nginx_binary()
    async with (
        upstream("stream") as (_, r1),
        upstream("ok") as (worker, w1),
        nginx(tmp_path, [r1], [w1]) as ng,
        bystander(ng.base) as _b,
        client() as http,
        client(BYSTANDER_ADDR) as other,
    ):
        statuses: list[int] = []
        retry_after: set[str] = set()
        for _ in range(30):
            async with http.post(ng.base + "/v1/sessions") as r:
                statuses.append(r.status)
                if r.status == 429:
                    retry_after.add(r.headers.get("Retry-After", ""))
                    assert (await r.json())["error"] == "rate_limited"
        created = statuses.count(201)
        assert 11 <= created <= 13, statuses  # 1 + a burst of 10 (+ refills meanwhile)
        assert statuses.count(429) == 30 - created
        assert retry_after == {"1"}
        async with other.post(ng.base + "/v1/sessions") as r:
            assert r.status == 201
        assert worker.hits == created + 1  # the refused ones never reached a worker


@pytest.mark.integration
async def test_a_durable_stream_round_trip_through_nginx(
    tmp_path: Path, cluster: ClusterInfo, redis: RedisCluster
) -> None:
    """Durable Streams through deploy/nginx.conf to a real relay on the local cluster:
    PUT, POST, GET (catch-up), a long-poll read woken by an append (unbuffered), and a
    chat session read as a stream."""
    nginx_binary()
    async with (
        running(cluster, durable_open_prefix="/open/", durable_long_poll_s=5.0) as relay,
        upstream("ok") as (_, w1),
        nginx(tmp_path, [int(relay.base.rsplit(":", 1)[1])], [w1]) as ng,
        client() as http,
    ):
        url = f"{ng.base}/v1/stream/open/{uuid.uuid4().hex}"
        text = {"Content-Type": "text/plain"}
        async with http.put(url, headers=text) as r:
            assert r.status == 201, await r.text()
            assert r.headers["X-Relay-Id"] == "edge-test"
        async with http.post(url, headers=text, data=b"hello ") as r:
            assert r.status == 204, await r.text()
        async with http.get(url, params={"offset": "-1"}) as r:
            assert r.status == 200
            assert await r.read() == b"hello "
            tail = r.headers["Stream-Next-Offset"]

        async def long_poll() -> bytes:
            async with http.get(url, params={"offset": tail, "live": "long-poll"}) as r:
                assert r.status == 200, r.status
                return await r.read()

        waiting = asyncio.create_task(long_poll())
        await asyncio.sleep(0.3)  # parked on the relay, through nginx
        async with http.post(url, headers=text, data=b"world") as r:
            assert r.status == 204
        async with asyncio.timeout(4):  # well before the relay's 5 s long-poll timeout
            assert await waiting == b"world"
        sid = new_session_id()
        await publish_turn(redis, sid, ["hel", "lo"])
        async with http.get(f"{ng.base}/v1/sessions/{sid}/stream", headers=relay.auth(sid)) as r:
            assert r.status == 200, await r.text()
            frames = await r.json()
        assert [f["text"] for f in frames if f["kind"] == "token"] == ["hel", "lo"]
    assert "/v1/stream/open/" in ng.access_log()


# -- the file, read -----------------------------------------------------------------------


async def test_a_path_no_route_has_gets_a_json_404_in_its_fronts_shape(tmp_path: Path) -> None:
    """nginx answers it itself: OpenAI's error body under the OpenAI-compatible fronts'
    paths, tokenrelay's own anywhere else, as the relays and workers answer it."""
    cases = [("/nope", False), ("/v1/x", False), ("/v1/chat/x", False),
             ("/v1/sessions/s/x", False), ("/v1/chat/completions/x", True),
             ("/v1/models/x", True), ("/v1/responses/r/x", True)]  # fmt: skip
    async with (
        upstream("ok") as (relay, relay_port),
        upstream("ok") as (worker, worker_port),
        nginx(tmp_path, [relay_port], [worker_port]) as ng,
        client() as http,
    ):
        for path, openai_shaped in cases:
            async with http.post(ng.base + path, data=b"{}") as r:
                assert (r.status, r.content_type) == (404, "application/json"), path
                body = await r.json()
            if openai_shaped:
                assert body["error"]["type"] == "invalid_request_error", path
                assert body["error"]["code"] == "not_found", path
                assert body["error"]["message"], path
            else:
                assert body["error"] == "not_found", path
                assert body["reason"], path
    assert relay.hits == worker.hits == 0


async def test_a_relays_own_403_on_a_stream_passes_through(tmp_path: Path) -> None:
    """The stream location turns its own 403 (another method) into a 405; a relay's 403
    (a token refused) reaches the client as the relay wrote it."""
    async with (
        upstream("forbidden") as (relay, relay_port),
        upstream("ok") as (_, worker_port),
        nginx(tmp_path, [relay_port], [worker_port]) as ng,
        client() as http,
        http.get(f"{ng.base}/v1/sessions/s/events?token=x") as r,
    ):
        assert r.status == 403
        assert await r.json() == {"error": "token_invalid", "reason": "r"}
    assert relay.hits == 1


def test_only_stream_locations_retry_5xx_and_no_location_retries_a_post() -> None:
    conf = NGINX_CONF.read_text()
    nginx = NginxConf(conf)
    sid = new_session_id()
    stream = nginx.location(f"/v1/sessions/{sid}/events")
    assert stream is not None
    for tail in ("ws", "ui-stream"):
        assert nginx.location(f"/v1/sessions/{sid}/{tail}") is stream
    assert nginx.location(f"/v1/chat/{sid}/stream") is stream

    def text(loc: Block) -> str:
        return "\n".join(" ".join(b.words) for b in loc.children)

    assert "proxy_next_upstream error timeout http_502 http_503 http_504" in text(stream)
    assert "limit_except GET OPTIONS" in text(stream)
    assert "limit_conn streams_per_addr 16" in text(stream)
    proxied = [loc for loc in nginx.locations if any(loc.find("proxy_pass"))]
    assert len(proxied) >= 6  # streams, creation, API, gateway, Responses, Durable Streams
    for loc in proxied:
        if loc is not stream:
            (retry,) = loc.find("proxy_next_upstream")
            assert retry.words == ["proxy_next_upstream", "error", "timeout"], text(loc)
    assert "non_idempotent" not in conf.replace("never non_idempotent", "")
    create = nginx.location("/v1/sessions")
    assert create is not None
    assert "limit_req zone=sessions_per_addr" in text(create)


def test_connection_limits_hold_tens_of_thousands_of_streams() -> None:
    conf = NGINX_CONF.read_text()
    connections = int(re.search(r"worker_connections\s+(\d+);", conf).group(1))  # type: ignore[union-attr]
    nofile = int(re.search(r"worker_rlimit_nofile\s+(\d+);", conf).group(1))  # type: ignore[union-attr]
    assert connections // 2 >= 20_000  # two connections per proxied stream
    assert nofile >= connections
    compose = yaml.safe_load(COMPOSE.read_text())
    volumes = compose["services"]["ingress"]["volumes"]
    assert "./deploy/nginx.conf:/etc/nginx/nginx.conf:ro" in volumes  # the events block
    limit = compose["services"]["ingress"]["ulimits"]["nofile"]
    assert limit["soft"] >= nofile  # the container lets nginx raise its limit that far


def test_every_redis_node_caps_memory_and_never_evicts() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    nodes = [s for name, s in services.items() if re.fullmatch(r"redis-\d+", name)]
    assert len(nodes) == 6
    for svc in nodes:
        cmd = svc["command"]
        assert cmd[cmd.index("--maxmemory-policy") + 1] == "noeviction"
        assert cmd[cmd.index("--maxmemory") + 1].startswith("${REDIS_MAXMEMORY:-")
