"""The edge server against a real Redis Cluster: SSE and WebSocket streams, resume,
fan-out, refusals, metrics, drain and misbehaving WebSocket clients.

Each test runs its own relay app (:func:`tests.support.relay.running`) on a free
127.0.0.1 port and reads SSE with :mod:`tests.support.sse`; frames are published with
:class:`relay.broker.rediscluster.publisher.Publisher`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import sys
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import WSMsgType, web
from prometheus_client.parser import text_string_to_metric_families

from devstack.procs import Proc
from relay.broker.rediscluster.broker import RedisBroker
from relay.broker.rediscluster.publisher import Publisher
from relay.edge.config import RelayConfig
from relay.edge.conn.reader import open_reader
from relay.edge.fanout.hub import Hub
from relay.edge.http.app import SERVER, make_app
from relay.protocol.auth import issue_token
from relay.protocol.keys import new_session_id
from tests.support.relay import (
    SECRET,
    STEP,
    Relay,
    publish_turn,
    running,
    send_expect_close,
    sse,
    wait_ready,
    ws_frames,
)
from tests.support.sse import SSEClient

pytestmark = pytest.mark.integration


async def test_sse_stream_carries_published_frames_as_id_event_data(cluster, redis):
    sid = new_session_id()
    async with running(cluster) as relay, sse(relay, sid) as client:
        h = client.resp.headers
        assert h["Content-Type"].startswith("text/event-stream")
        assert h["Cache-Control"] == "no-cache"
        assert h["X-Accel-Buffering"] == "no"
        assert h["X-Relay-Id"] == "edge-test"
        assert client.retry == 1000
        offsets = await publish_turn(redis, sid, ["Hel", "lo", "!"])
        events = await client.events(4)
        assert client.hello == {"type": "hello", "relay": "edge-test", "from": None}
        assert [int(i) for i, _, _ in events] == offsets
        assert [k for _, k, _ in events] == ["token", "token", "token", "done"]
        assert all(d["offset"] == int(i) and d["session"] == sid for i, _, d in events)
        assert "".join(d["text"] for _, k, d in events if k == "token") == "Hello!"


async def test_last_event_id_resume_gives_exactly_the_rest(cluster, redis):
    sid = new_session_id()
    first = await publish_turn(redis, sid, [f"t{i}" for i in range(9)])  # offsets 1..10
    async with running(cluster) as relay:
        async with sse(relay, sid, headers={"Last-Event-ID": "4"}) as client:
            events = await client.events(6)
            assert [int(i) for i, _, _ in events] == first[4:]
            more = await publish_turn(redis, sid, ["x", "y"])
            events = await client.events(3)
            assert [int(i) for i, _, _ in events] == more
        # the query form, for clients that cannot set headers; 0 = the whole backlog
        async with sse(relay, sid, params={"last_event_id": "0"}) as client:
            events = await client.events(13)
            assert [int(i) for i, _, _ in events] == list(range(1, 14))
            assert client.hello == {"type": "hello", "relay": "edge-test", "from": 0}


async def test_websocket_from_resumes_after_the_offset(cluster, redis):
    sid = new_session_id()
    offsets = await publish_turn(redis, sid, ["a", "b", "c", "d"])  # 1..5
    async with (
        running(cluster) as relay,
        relay.http.ws_connect(relay.url(sid, "ws"), params={"from": "2", "token": _tok(sid)}) as ws,
    ):
        hello, *frames = await ws_frames(ws, 4)
        assert hello == {"type": "hello", "relay": "edge-test", "from": 2}
        assert [f["offset"] for f in frames] == offsets[2:]
        assert ws._response.headers["X-Relay-Id"] == "edge-test"
        live = await publish_turn(redis, sid, ["e"])
        assert [f["offset"] for f in await ws_frames(ws, 2)] == live


async def test_two_clients_on_one_session_both_get_everything(cluster, redis):
    sid = new_session_id()
    async with (
        running(cluster) as relay,
        sse(relay, sid) as a,
        relay.http.ws_connect(relay.url(sid, "ws"), headers=relay.auth(sid)) as b,
    ):
        assert (await ws_frames(b, 1))[0]["type"] == "hello"
        offsets = await publish_turn(redis, sid, [str(i) for i in range(20)])
        got_a = [int(i) for i, _, _ in await a.events(21)]
        got_b = [f["offset"] for f in await ws_frames(b, 21)]
        assert got_a == got_b == offsets
        assert relay.server.hub is not None
        assert relay.server.hub.stats()["channels"] == 1  # one subscription, two sockets


def _tok(sid: str, **kw: Any) -> str:
    return issue_token(SECRET, sid, kw.pop("ttl", 300), kw.pop("now", time.time()), **kw)


async def test_refusals_are_json_with_a_reason(cluster):
    sid = new_session_id()
    cases = [
        (f"/v1/sessions/{sid}/events", {}, {}, 401, "token_missing"),
        (f"/v1/sessions/{sid}/events", {"token": "junk"}, {}, 403, "token_invalid"),
        (f"/v1/sessions/{sid}/events", {"token": _tok("other")}, {}, 403, "token_wrong_session"),
        (
            f"/v1/sessions/{sid}/events",
            {"token": _tok(sid, ttl=1, now=time.time() - 60)},
            {},
            403,
            "token_expired",
        ),
        (f"/v1/sessions/{sid}/events", {}, {"Authorization": "Basic eDp5"}, 403, "token_invalid"),
        ("/v1/sessions/bad%7Bslot%7D/events", {}, {}, 400, "invalid_session"),
        ("/v1/sessions/" + "x" * 65 + "/ws", {}, {}, 400, "invalid_session"),
        (
            f"/v1/sessions/{sid}/events",
            {"token": _tok(sid)},
            {"Last-Event-ID": "-1"},
            400,
            "invalid_offset",
        ),
        (
            f"/v1/sessions/{sid}/events",
            {"token": _tok(sid), "last_event_id": "x"},
            {},
            400,
            "invalid_offset",
        ),
        (f"/v1/sessions/{sid}/ws", {"token": _tok(sid), "from": "1.5"}, {}, 400, "invalid_offset"),
        (f"/v1/sessions/{sid}/ws", {"token": _tok(sid)}, {}, 400, "not_websocket"),
        (f"/v1/sessions/{sid}/ws", {}, {}, 401, "token_missing"),
    ]
    async with running(cluster) as relay:
        for path, params, headers, status, error in cases:
            async with relay.http.get(relay.base + path, params=params, headers=headers) as r:
                body = await r.json()
                assert (r.status, body["error"]) == (status, error), (path, params, body)
                assert body["reason"]
                assert r.headers["Access-Control-Allow-Origin"] == "*"
                if status == 401:
                    assert r.headers["WWW-Authenticate"].startswith("Bearer")


async def test_insecure_relay_needs_no_token(cluster, redis):
    sid = new_session_id()
    await publish_turn(redis, sid, ["a"])
    async with running(cluster, secret="", insecure_no_auth=True) as relay:
        url = relay.url(sid)
        async with relay.http.get(url, params={"last_event_id": "0"}) as resp:
            assert resp.status == 200
            assert len(await SSEClient(resp).events(2)) == 2


async def test_health_ready_and_metrics(cluster, redis):
    sid = new_session_id()
    async with running(cluster, presence_interval_s=0) as relay:  # frames counted exactly
        async with relay.http.get(relay.base + "/healthz") as r:
            assert r.status == 200
        async with relay.http.get(relay.base + "/readyz") as r:
            assert (r.status, (await r.json())["status"]) == (200, "ready")
        async with sse(relay, sid) as client:
            await publish_turn(redis, sid, ["a", "b"])
            await client.events(3)
            await relay.http.get(relay.url(sid), params={"token": "junk"})
            async with relay.http.get(relay.base + "/metrics") as r:
                assert r.status == 200
                text = await r.text()
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }
        assert samples[("tokenrelay_relay_frames_out_total", (("transport", "sse"),))] == 3
        assert samples[("tokenrelay_relay_connections", (("transport", "sse"),))] == 1
        assert (
            samples[("tokenrelay_relay_auth_failures_total", (("reason", "token_invalid"),))] == 1
        )
        assert samples[("tokenrelay_relay_hop_latency_seconds_count", (("transport", "sse"),))] == 3
        assert samples[("tokenrelay_relay_hub_watches", ())] == 1
        assert sum(v for (n, _), v in samples.items() if n == "tokenrelay_relay_subscriptions") == 1
        for name in (
            "tokenrelay_relay_slow_disconnects_total",
            "tokenrelay_relay_resume_replays_total",
            "tokenrelay_relay_gaps_total",
            "tokenrelay_relay_hub_conflations_total",
        ):
            assert any(n == name for n, _ in samples), name


async def test_drain_fails_readiness_and_tells_every_client_to_reconnect(cluster, redis):
    sid = new_session_id()
    async with (
        running(cluster, retry_ms=400) as relay,
        sse(relay, sid) as a,
        relay.http.ws_connect(relay.url(sid, "ws"), headers=relay.auth(sid)) as b,
    ):
        await ws_frames(b, 1)
        await publish_turn(redis, sid, ["a"])
        await a.events(2)
        await ws_frames(b, 2)
        drain = asyncio.create_task(relay.server.drain(5.0))
        await a.until_end()
        assert any(c.startswith("close relay_shutdown") for c in a.comments)
        assert a.retry is not None
        assert 200 <= a.retry <= 400  # jittered retry hint
        msg = await asyncio.wait_for(b.receive(), STEP)
        assert msg.type is WSMsgType.CLOSE
        # what the server sent (the client's own close_code may read 1006 when the server
        # drops TCP right after its close frame, as aiohttp does when closing from a task
        # other than the reader)
        assert (msg.data, msg.extra) == (1012, "the relay is restarting; reconnect")
        await asyncio.wait_for(drain, STEP)
        async with relay.http.get(relay.base + "/readyz") as r:
            assert (r.status, (await r.json())["status"]) == (503, "draining")
        async with relay.http.get(relay.url(sid), headers=relay.auth(sid)) as r:
            assert (r.status, (await r.json())["error"]) == (503, "draining")
            assert r.headers["Retry-After"] == "1"
        assert not relay.server.streams


async def test_misbehaving_websockets_are_closed_and_others_unaffected(cluster, redis):
    sid, other = new_session_id(), new_session_id()
    async with (
        running(cluster, ws_max_message_bytes=256) as relay,
        relay.http.ws_connect(relay.url(other, "ws"), headers=relay.auth(other)) as good,
    ):
        await ws_frames(good, 1)
        await good.send_str('{"type":"ping"}')  # ignored
        cases: list[tuple[str | bytes, int]] = [
            ("not json", 4400),
            ('{"type":"subscribe"}', 4400),
            (b"\x00\x01", 1003),
            ("x" * 1000, 1009),
        ]
        for payload, code in cases:
            async with relay.http.ws_connect(relay.url(sid, "ws"), headers=relay.auth(sid)) as ws:
                await ws_frames(ws, 1)
                msg = await send_expect_close(ws, payload)
                assert msg.data == code
        offsets = await publish_turn(redis, other, ["still", "here"])
        assert [f["offset"] for f in await ws_frames(good, 3)] == offsets
        async with asyncio.timeout(STEP):
            while relay.server.streams and len(relay.server.streams) > 1:
                await asyncio.sleep(0.01)
        assert len(relay.server.streams) == 1


async def test_max_connections_gives_503(cluster):
    sid = new_session_id()
    async with (
        running(cluster, max_connections=1) as relay,
        sse(relay, sid),
        relay.http.get(relay.url(sid), headers=relay.auth(sid)) as r,
    ):
        assert (r.status, (await r.json())["error"]) == (503, "overloaded")


async def test_idle_sse_stream_gets_heartbeat_comments(cluster):
    sid = new_session_id()
    async with running(cluster, heartbeat_s=0.1) as relay, sse(relay, sid) as client:
        async with asyncio.timeout(STEP):
            while "heartbeat" not in client.comments:
                client.feed(await client.resp.content.readany())


async def test_an_idle_websocket_that_answers_pings_stays_open_and_gets_frames(cluster, redis):
    sid = new_session_id()
    async with (
        running(cluster, heartbeat_s=0.2, presence_interval_s=0) as relay,  # pings only
        relay.http.ws_connect(relay.url(sid, "ws"), headers=relay.auth(sid), autoping=False) as ws,
    ):
        assert (await ws_frames(ws, 1))[0]["type"] == "hello"
        pings = 0
        async with asyncio.timeout(STEP):
            while pings < 5:  # 5 heartbeats, each answered
                msg = await ws.receive()
                assert msg.type is WSMsgType.PING, (msg.type, msg.data)
                pings += 1
                await ws.pong(msg.data)
        offsets = await publish_turn(redis, sid, ["still", " here"])
        frames: list[dict[str, Any]] = []
        async with asyncio.timeout(STEP):
            while len(frames) < len(offsets):
                msg = await ws.receive()
                if msg.type is WSMsgType.PING:
                    await ws.pong(msg.data)
                else:
                    assert msg.type is WSMsgType.TEXT, (msg.type, msg.data)
                    frames.append(json.loads(msg.data))
        assert [f["offset"] for f in frames] == offsets


async def test_an_open_websocket_holds_no_task_and_no_http_connection(cluster, redis):
    """After the upgrade the socket is the relay's own (relay.edge.conn.ws): aiohttp lets
    go of it (its request, parser and handler task are freed) and no task waits per
    idle WebSocket; frames, the client's close and the accounting still work."""
    sid = new_session_id()
    async with running(cluster) as relay:
        assert relay.web_server is not None
        base_tasks = len(asyncio.all_tasks())
        wss = [
            await relay.http.ws_connect(relay.url(sid, "ws"), headers=relay.auth(sid))
            for _ in range(20)
        ]
        for ws in wss:
            assert (await ws_frames(ws, 1))[0]["type"] == "hello"
        assert len(relay.server.streams) == 20
        async with asyncio.timeout(STEP):  # aiohttp's handler of each upgrade has returned
            while relay.web_server.connections:
                await asyncio.sleep(0.02)
        assert len(asyncio.all_tasks()) - base_tasks < 5  # not one per WebSocket
        offsets = await publish_turn(redis, sid, ["a", "b"])
        for ws in wss:
            frames = await ws_frames(ws, len(offsets))
            assert [f["offset"] for f in frames] == offsets
        for ws in wss:
            await ws.close()
            assert ws.close_code == 1000
        async with asyncio.timeout(STEP):
            while relay.server.streams:
                await asyncio.sleep(0.02)
        closes = relay.server.metrics.closes
        assert closes.labels("ws", "client_gone")._value.get() == 20


async def test_an_open_sse_stream_holds_no_task_and_no_http_connection(cluster, redis):
    """After the preamble the socket is the relay's own (relay.edge.conn.sse): aiohttp
    lets go of it and no task waits per idle stream; frames, the relay's goodbye (the
    close comment and the response's last chunk) and the accounting still work."""
    sid = new_session_id()
    async with running(cluster) as relay:
        assert relay.web_server is not None
        base_tasks = len(asyncio.all_tasks())
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(sse(relay, sid)) for _ in range(20)]
            assert len(relay.server.streams) == 20
            async with asyncio.timeout(STEP):  # aiohttp's handler of each request returned
                while relay.web_server.connections:
                    await asyncio.sleep(0.02)
            assert len(asyncio.all_tasks()) - base_tasks < 5  # not one per stream
            offsets = await publish_turn(redis, sid, ["a", "b"])
            for c in clients:
                events = await c.events(len(offsets))
                assert [int(e[0]) for e in events] == offsets
            await relay.server.drain(deadline_s=STEP)  # every stream says goodbye
            for c in clients:
                rest = await asyncio.wait_for(c.resp.content.read(), STEP)  # to the end
                assert b": close relay_shutdown" in rest, rest
        closes = relay.server.metrics.closes
        assert closes.labels("sse", "relay_shutdown")._value.get() == 20
        assert not relay.server.streams


async def test_a_websocket_that_never_answers_a_ping_is_closed_as_gone(cluster):
    sid = new_session_id()
    async with (
        running(cluster, heartbeat_s=0.2) as relay,
        relay.http.ws_connect(relay.url(sid, "ws"), headers=relay.auth(sid), autoping=False) as ws,
    ):
        assert (await ws_frames(ws, 1))[0]["type"] == "hello"
        seen: list[WSMsgType] = []
        async with asyncio.timeout(STEP):  # the relay pings, gets no pong, cuts the socket
            while (msg := await ws.receive()).type not in (WSMsgType.CLOSED, WSMsgType.ERROR):
                seen.append(msg.type)
        assert WSMsgType.PING in seen
        closes = relay.server.metrics.closes
        async with asyncio.timeout(STEP):
            while closes.labels("ws", "client_gone")._value.get() < 1:
                await asyncio.sleep(0.05)
        assert not relay.server.streams


async def test_preflight_allows_the_demo_page(cluster):
    async with (
        running(cluster) as relay,
        relay.http.options(relay.url(new_session_id())) as r,
    ):
        assert r.status == 204
        assert "Authorization" in r.headers["Access-Control-Allow-Headers"]
        assert r.headers["Access-Control-Allow-Origin"] == "*"


async def test_a_client_that_stops_reading_is_cut_as_slow_consumer(cluster, redis):
    sid, other = new_session_id(), new_session_id()
    async with (
        running(cluster, write_timeout_s=0.3, queue_frames=4, hard_limit_frames=8) as relay,
        sse(relay, other) as bystander,
    ):
        host, port = relay.base.removeprefix("http://").split(":")
        token = _tok(sid)
        _reader, writer = await asyncio.open_connection(host, int(port), limit=1024)
        writer.write(
            f"GET /v1/sessions/{sid}/events?token={token} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        )
        await writer.drain()
        try:
            async with asyncio.timeout(STEP):
                while not relay.server.streams or len(relay.server.streams) < 2:
                    await asyncio.sleep(0.01)
            gen = await Publisher(redis).open_generation(sid)
            pad = "x" * 100_000
            m = relay.server.metrics
            async with asyncio.timeout(STEP * 2):
                while m.slow_disconnects.labels("sse")._value.get() < 1:
                    await gen.meta({"pad": pad})
            assert len(relay.server.streams) == 1  # the reader that keeps up stays
            offsets = await publish_turn(redis, other, ["ok"])
            assert [int(i) for i, _, _ in await bystander.events(2)] == offsets
        finally:
            writer.close()


async def test_sigterm_drains_and_exits_zero(cluster, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = (
        "import argparse, sys\n"
        "from relay.edge.cli import register\n"
        "p = argparse.ArgumentParser(); register(p.add_subparsers())\n"
        "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))\n"
    )
    proc = Proc.start(
        [sys.executable, "-c", script, "relay", "--port", str(port), "--redis", cluster.url,
         "--secret", SECRET, "--relay-id", "edge-sig", "--drain-deadline-s", "3"],
        log=None, err_log=tmp_path / "relay.err", name="edge-sig",
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    sid = new_session_id()
    try:
        async with aiohttp.ClientSession() as http:
            await wait_ready(http, base, 20)
            relay = Relay(base, None, http)  # type: ignore[arg-type]
            async with sse(relay, sid) as client:
                assert client.resp.headers["X-Relay-Id"] == "edge-sig"
                proc.send(signal.SIGTERM)
                await client.until_end()
                assert any(c.startswith("close relay_shutdown") for c in client.comments)
        code = await proc.wait(15)
        err = proc.output(stderr=True)
        assert code == 0, err
        assert "draining" in err
    finally:
        await proc.stop()


async def test_an_app_given_a_hub_uses_it_and_leaves_it_open(cluster, redis):
    sid = new_session_id()
    hub = Hub(RedisBroker(redis, "shared-hub"), reap_interval_s=0)
    await hub.start()
    try:
        cfg = RelayConfig(port=0, redis_url=cluster.url, secret=SECRET, relay_id="edge-hub")
        app = make_app(cfg, hub=hub)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with aiohttp.ClientSession() as http:
                relay = Relay(base, app[SERVER], http)
                async with sse(relay, sid) as client:
                    offsets = await publish_turn(redis, sid, ["a"])
                    assert [int(i) for i, _, _ in await client.events(2)] == offsets
        finally:
            await runner.cleanup()
        watch = await open_reader(hub, sid, 0)  # still running after the app is gone
        assert [d.offset for d in await watch.next()] == offsets
        await watch.close()
    finally:
        await hub.close()


@pytest.mark.slow
async def test_readyz_is_503_when_redis_is_gone(private_cluster):
    local = await private_cluster(masters=3, replicas=0)
    assert local.info is not None
    async with running(local.info) as relay:
        async with relay.http.get(relay.base + "/readyz") as r:
            assert r.status == 200
        await local.stop()
        async with relay.http.get(relay.base + "/readyz") as r:
            body = await r.json()
            assert (r.status, body["status"]) == (503, "redis_unreachable")
            assert body["reason"]
        async with relay.http.get(relay.base + "/healthz") as r:
            assert r.status == 200  # alive, just not ready


async def test_an_idle_sse_client_that_leaves_releases_its_watch_before_any_heartbeat(
    cluster, redis
):
    sid = new_session_id()
    async with running(cluster, heartbeat_s=120.0, unsubscribe_delay_s=0.2) as relay:
        hub = relay.server.hub
        assert hub is not None
        async with sse(relay, sid) as client:
            await publish_turn(redis, sid, ["x"])
            await client.events(2)
            assert hub.stats()["watches"] == 1
        # The client hung up while idle: nothing is written for 120 s, so only the
        # handler's cancellation can release the watch and, after the delay, the channel.
        async with asyncio.timeout(STEP):
            while hub.stats()["watches"] or hub.stats()["channels"]:
                await asyncio.sleep(0.05)


async def test_per_hop_latency_counts_live_frames_and_not_replays(cluster, redis):
    sid = new_session_id()
    # no presence frames: a screen count is a live frame too, and whether this client's
    # own count comes before or after its replay is a race of no interest here
    async with running(cluster, presence_interval_s=0) as relay:
        m = relay.server.metrics
        await publish_turn(redis, sid, ["old", "er"])  # in the backlog before anyone watches
        async with sse(relay, sid, headers={"Last-Event-ID": "0"}) as client:
            await client.events(3)  # replayed: no hop of the live path
            assert m.edge_to_socket.labels("sse").total == 0
            assert m.hop_latency.labels("sse").total == 0
            await publish_turn(redis, sid, ["live"])
            await client.events(2)
        counts = {
            s.name: s.value
            for metric in m.registry.collect()
            for s in metric.samples
            if s.name.endswith("_count") and s.labels.get("transport", "sse") == "sse"
        }
        assert counts["tokenrelay_relay_edge_to_socket_seconds_count"] == 2
        assert counts["tokenrelay_relay_publish_to_edge_seconds_count"] == 2
        assert counts["tokenrelay_relay_hop_latency_seconds_count"] == 2
