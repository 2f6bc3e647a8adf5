"""End to end against the real cluster, with third-party clients:

- many sockets (SSE and WebSocket) on two relay processes (``tokenrelay relay``) watch one
  session while a producer streams a few hundred frames, some joining mid-stream with
  resume offset 0: every socket receives the same frames, byte for byte as in the
  backlog, in order, no gap, no duplicate, ending with ``done``;
- SSE read with ``httpx-sse`` (a real SSE client, not the suite's own parser), dropped
  mid-stream and resumed with the ``Last-Event-ID`` header, and WebSocket read with
  aiohttp's client and resumed with ``?from=``: across the two connections, no gap and no
  duplicate, ending with ``done``; the resume goes to the same relay and to the other one;
- both clients hanging up every few frames and resuming on the other relay while the
  producer streams on, ungated.

The relays run as subprocesses (:func:`tests.support.relay.relay_process`, stopped by pid)
once for the module, with ``--reap-after-s 0``: the producer here is a bare generation
(no worker, no turn lock) that a relay must not reap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import httpx
import pytest
from aiohttp import WSMsgType
from httpx_sse import ServerSentEvent, aconnect_sse
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from relay.broker.rediscluster.publisher import Generation, Publisher, read_backlog
from relay.protocol.auth import issue_token
from relay.protocol.frame import decode
from relay.protocol.keys import new_session_id
from tests.support.relay import RelayProcess, relay_process
from tests.support.worker import SECRET

pytestmark = pytest.mark.integration

# What a socket received: (offset, kind, the frame JSON exactly as sent).
Received = tuple[int, str, str]

STREAM_S = 30.0  # any one socket's whole stream must arrive within this


@pytest.fixture(scope="module")
async def relays(
    cluster: ClusterInfo, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[RelayProcess, RelayProcess]]:
    """Two ``tokenrelay relay`` processes on the session's cluster."""
    log_dir = tmp_path_factory.mktemp("relays")
    flags = ("--reap-after-s", "0", "--heartbeat-s", "5")
    async with (
        relay_process(cluster, log_dir, "edge-a", *flags) as a,
        relay_process(cluster, log_dir, "edge-b", *flags) as b,
    ):
        yield a, b


def relay_id(relay: RelayProcess) -> str:
    return relay.log_path.stem  # relay_process names the log after the relay id


def token(sid: str) -> str:
    return issue_token(SECRET, sid, 300, time.time())


def token_text(i: int) -> str:
    """Token deltas that an SSE writer or reader could get wrong: newlines, CR, a colon,
    non-ASCII, a leading space."""
    return ("tok", " lead", "a\nb", "c\r\nd", "id: 9", "é中🙂", "x" * 40)[i % 7] + f"#{i}"


async def publish_paced(gen: Generation, first: int, n: int, pause_s: float = 0.002) -> None:
    """Publish ``n`` token frames, one round trip each, pausing so that the relays
    interleave delivery with publishing."""
    for i in range(first, first + n):
        await gen.token(token_text(i))
        if pause_s:
            await asyncio.sleep(pause_s)


async def backlog(redis: RedisCluster, sid: str) -> list[Received]:
    """The session's frames as stored: what every socket must have received."""
    raw, first, last = await read_backlog(redis, sid, 0, 100_000)
    assert first == 1
    frames = [decode(x) for x in raw]
    assert [f.offset for f in frames] == list(range(1, last + 1))
    return [(f.offset, f.kind, x.decode()) for f, x in zip(frames, raw, strict=True)]


def check_stream(got: list[Received], want: list[Received], who: str) -> None:
    assert got, f"{who}: no frame"
    offsets = [o for o, _, _ in got]
    assert offsets == list(range(1, len(got) + 1)), f"{who}: gap, duplicate or disorder"
    assert got[-1][1] == "done", f"{who}: ended with {got[-1][1]}, not done"
    assert got == want, f"{who}: frames differ from the backlog"


def sse_received(event: ServerSentEvent) -> Received:
    """An httpx-sse event as (offset, kind, data); the SSE id and event name must agree
    with the frame they carry."""
    data = json.loads(event.data)
    assert event.id == str(data["offset"]), (event.id, data)
    assert event.event == data["kind"], (event.event, data)
    return int(event.id), event.event, event.data


def is_presence(text: str) -> bool:
    """A presence frame (the screen count): outside the session's order, skipped here."""
    return bool(json.loads(text).get("kind") == "presence")


def ws_received(text: str) -> Received:
    data = json.loads(text)
    return int(data["offset"]), str(data["kind"]), text


# -- many sockets on two relay processes ------------------------------------------------


async def sse_watch(
    http: httpx.AsyncClient,
    relay: RelayProcess,
    sid: str,
    ready: asyncio.Event,
    out: list[Received],
    offset: int | None = None,
) -> None:
    """One SSE socket (httpx-sse) until ``done``; live, or resumed after ``offset``."""
    url = f"{relay.base}/v1/sessions/{sid}/events"
    headers = {"Authorization": f"Bearer {token(sid)}"}
    if offset is not None:
        headers["Last-Event-ID"] = str(offset)
    async with (
        asyncio.timeout(STREAM_S),
        aconnect_sse(http, "GET", url, headers=headers) as source,
    ):
        assert source.response.status_code == 200, await source.response.aread()
        async with contextlib.aclosing(source.aiter_sse()) as events:
            async for event in events:
                if event.event == "presence":  # the screen count, outside the order
                    assert event.id != "0", "a presence event moved the resume point"
                    continue
                if event.event == "hello":
                    hello = event.json()
                    assert hello == {"type": "hello", "relay": relay_id(relay), "from": offset}
                    ready.set()
                    continue
                out.append(sse_received(event))
                if event.event in ("done", "error"):
                    return
    raise AssertionError(f"SSE stream ended after {len(out)} frames")


async def ws_watch(
    http: aiohttp.ClientSession,
    relay: RelayProcess,
    sid: str,
    ready: asyncio.Event,
    out: list[Received],
    offset: int | None = None,
) -> None:
    """One WebSocket (aiohttp's client) until ``done``; live, or resumed after ``offset``."""
    url = f"{relay.base}/v1/sessions/{sid}/ws"
    params = {"token": token(sid)}
    if offset is not None:
        params["from"] = str(offset)
    async with (
        asyncio.timeout(STREAM_S),
        http.ws_connect(url, params=params) as ws,
    ):
        hello = await ws.receive_json()
        assert hello == {"type": "hello", "relay": relay_id(relay), "from": offset}
        ready.set()
        while True:
            msg = await ws.receive()
            assert msg.type is WSMsgType.TEXT, (msg.type, msg.data, ws.close_code)
            if is_presence(msg.data):
                continue
            out.append(ws_received(msg.data))
            if out[-1][1] in ("done", "error"):
                return


@pytest.mark.timeout(90)
async def test_many_sockets_on_two_relay_processes_get_identical_ordered_frames(
    relays: tuple[RelayProcess, RelayProcess], redis: RedisCluster
) -> None:
    """32 sockets (16 SSE, 16 WebSocket, half on each relay process) watch live from
    before the first frame; 8 more (4 + 4) join a third of the way through with resume
    offset 0 while the producer keeps streaming (backlog replay racing live frames).
    All 40 must hold the backlog exactly."""
    n_live, n_late, n_tokens, late_at = 32, 8, 300, 100
    sid = new_session_id()
    received: dict[str, list[Received]] = {}
    live_ready: list[asyncio.Event] = []
    late_ready: list[asyncio.Event] = []
    limits = httpx.Limits(max_connections=n_live + n_late)
    async with (
        httpx.AsyncClient(timeout=httpx.Timeout(10, read=STREAM_S), limits=limits) as sse_http,
        aiohttp.ClientSession() as ws_http,
        asyncio.TaskGroup() as tg,
    ):

        def start(i: int, late: bool) -> asyncio.Event:
            relay, transport = relays[i % 2], ("sse", "ws")[i // 2 % 2]
            name = f"{transport}{i}{'-late' if late else ''}@{relay_id(relay)}"
            out, ev = received.setdefault(name, []), asyncio.Event()
            offset = 0 if late else None
            if transport == "sse":
                tg.create_task(sse_watch(sse_http, relay, sid, ev, out, offset))
            else:
                tg.create_task(ws_watch(ws_http, relay, sid, ev, out, offset))
            return ev

        live_ready = [start(i, late=False) for i in range(n_live)]
        # every live socket is subscribed (the hello comes after the watch opened)
        async with asyncio.timeout(15):
            await asyncio.gather(*(ev.wait() for ev in live_ready))
        gen = await Publisher(redis).open_generation(sid)
        await gen.meta({"engine": "e2e"})
        await publish_paced(gen, 0, late_at, pause_s=0.001)
        late_ready = [start(i, late=True) for i in range(n_late)]
        await publish_paced(gen, late_at, n_tokens - late_at, pause_s=0.001)
        await gen.done({"tokens": n_tokens})
    assert all(ev.is_set() for ev in late_ready)
    want = await backlog(redis, sid)
    assert len(want) == n_tokens + 2
    assert len(received) == n_live + n_late
    for name, got in received.items():
        check_stream(got, want, name)


# -- resume with third-party clients ------------------------------------------------------


class Producer:
    """A producer in three phases, gated by the test, so that a resume is mid-stream for
    sure: ``before`` frames while the first connection reads; ``while_away`` frames while
    no connection is open (they reach the second one only from the backlog); then, once
    the second connection said hello, ``after`` frames paced with its backlog replay and
    live delivery, and ``done``."""

    def __init__(self, redis: RedisCluster, sid: str) -> None:
        self.redis, self.sid = redis, sid
        self.before, self.while_away, self.after = 120, 60, 180
        self.gone = asyncio.Event()
        self.back = asyncio.Event()
        self.finished = False

    @property
    def total(self) -> int:
        return self.before + self.while_away + self.after + 1

    async def run(self) -> None:
        gen = await Publisher(self.redis).open_generation(self.sid)
        await publish_paced(gen, 0, self.before)
        await self.gone.wait()
        await publish_paced(gen, self.before, self.while_away, pause_s=0)
        await self.back.wait()
        await publish_paced(gen, self.before + self.while_away, self.after)
        await gen.done()
        self.finished = True


RESUME_AFTER = 50  # frames the first connection reads before it drops


@pytest.mark.timeout(60)
@pytest.mark.parametrize("to", ["same", "other"])
async def test_sse_last_event_id_reconnect_mid_stream_no_gap_no_duplicate(
    relays: tuple[RelayProcess, RelayProcess], redis: RedisCluster, to: str
) -> None:
    """httpx-sse reads a live stream, drops it mid-stream, reconnects (to the same relay
    or the other) with ``Last-Event-ID`` = the last id it got, as a browser does."""
    sid = new_session_id()
    first_relay, second_relay = relays[0], relays[0 if to == "same" else 1]
    producer = Producer(redis, sid)
    headers = {"Authorization": f"Bearer {token(sid)}"}
    first: list[Received] = []
    second: list[Received] = []
    last_id = ""
    async with (
        asyncio.timeout(STREAM_S),
        httpx.AsyncClient(timeout=httpx.Timeout(10, read=STREAM_S)) as http,
        asyncio.TaskGroup() as tg,
    ):
        url = f"{first_relay.base}/v1/sessions/{sid}/events"
        async with aconnect_sse(http, "GET", url, headers=dict(headers)) as source:
            assert source.response.status_code == 200
            assert source.response.headers["content-type"].startswith("text/event-stream")
            async with contextlib.aclosing(source.aiter_sse()) as events:
                async for event in events:
                    if event.event == "presence":  # the screen count, outside the order
                        continue
                    if event.event == "hello":
                        assert event.retry == 1000  # the relay's default, before hello
                        assert event.id == ""  # the hello does not move the resume point
                        assert event.json()["from"] is None
                        tg.create_task(producer.run())
                        continue
                    first.append(sse_received(event))
                    last_id = event.id
                    if len(first) == RESUME_AFTER:
                        break  # hang up mid-stream: the response is closed unread
        producer.gone.set()
        await asyncio.sleep(0.05)  # let frames pile up while no connection is open
        url = f"{second_relay.base}/v1/sessions/{sid}/events"
        resume = {**headers, "Last-Event-ID": last_id}
        async with aconnect_sse(http, "GET", url, headers=resume) as source:
            assert source.response.status_code == 200
            assert source.response.headers["x-relay-id"] == relay_id(second_relay)
            async with contextlib.aclosing(source.aiter_sse()) as events:
                async for event in events:
                    if event.event == "presence":  # the screen count, outside the order
                        continue
                    if event.event == "hello":
                        assert event.json()["from"] == int(last_id)
                        assert not producer.finished
                        producer.back.set()
                        continue
                    second.append(sse_received(event))
                    if event.event in ("done", "error"):
                        break
    assert last_id == str(RESUME_AFTER)
    assert second[0][0] == RESUME_AFTER + 1, second[:2]
    want = await backlog(redis, sid)
    assert len(want) == producer.total
    check_stream(first + second, want, "sse")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("to", ["same", "other"])
async def test_websocket_from_reconnect_mid_stream_no_gap_no_duplicate(
    relays: tuple[RelayProcess, RelayProcess], redis: RedisCluster, to: str
) -> None:
    """aiohttp's WebSocket client reads a live stream, closes mid-stream and reconnects
    (to the same relay or the other) with ``?from=`` the last offset it got."""
    sid = new_session_id()
    first_relay, second_relay = relays[0], relays[0 if to == "same" else 1]
    producer = Producer(redis, sid)
    first: list[Received] = []
    second: list[Received] = []
    async with (
        asyncio.timeout(STREAM_S),
        aiohttp.ClientSession() as http,
        asyncio.TaskGroup() as tg,
    ):
        url = f"{first_relay.base}/v1/sessions/{sid}/ws"
        async with http.ws_connect(url, params={"token": token(sid)}) as ws:
            hello = await ws.receive_json()
            assert hello == {"type": "hello", "relay": relay_id(first_relay), "from": None}
            tg.create_task(producer.run())
            while len(first) < RESUME_AFTER:
                msg = await ws.receive()
                assert msg.type is WSMsgType.TEXT, (msg.type, msg.data, ws.close_code)
                if is_presence(msg.data):
                    continue
                first.append(ws_received(msg.data))
        # leaving the block closed the socket (close handshake) mid-stream
        producer.gone.set()
        await asyncio.sleep(0.05)
        last = first[-1][0]
        url = f"{second_relay.base}/v1/sessions/{sid}/ws"
        params = {"token": token(sid), "from": str(last)}
        async with http.ws_connect(url, params=params) as ws:
            hello = await ws.receive_json()
            assert hello == {"type": "hello", "relay": relay_id(second_relay), "from": last}
            assert not producer.finished
            producer.back.set()
            while not second or second[-1][1] not in ("done", "error"):
                msg = await ws.receive()
                assert msg.type is WSMsgType.TEXT, (msg.type, msg.data, ws.close_code)
                if is_presence(msg.data):
                    continue
                second.append(ws_received(msg.data))
    assert last == RESUME_AFTER
    assert second[0][0] == RESUME_AFTER + 1, second[:2]
    want = await backlog(redis, sid)
    assert len(want) == producer.total
    check_stream(first + second, want, "ws")


async def sse_segment(
    http: httpx.AsyncClient, relay: RelayProcess, sid: str, after: int, n: int
) -> list[Received]:
    """Up to ``n`` frames over one SSE connection resumed after ``after`` (httpx-sse)."""
    url = f"{relay.base}/v1/sessions/{sid}/events"
    headers = {"Authorization": f"Bearer {token(sid)}", "Last-Event-ID": str(after)}
    out: list[Received] = []
    async with aconnect_sse(http, "GET", url, headers=headers) as source:
        assert source.response.status_code == 200
        async with contextlib.aclosing(source.aiter_sse()) as events:
            async for event in events:
                if event.event == "presence":  # the screen count, outside the order
                    continue
                if event.event == "hello":
                    assert event.json()["from"] == after
                    continue
                out.append(sse_received(event))
                if len(out) == n or event.event in ("done", "error"):
                    break
    return out


async def ws_segment(
    http: aiohttp.ClientSession, relay: RelayProcess, sid: str, after: int, n: int
) -> list[Received]:
    """Up to ``n`` frames over one WebSocket resumed with ``?from=after`` (aiohttp)."""
    url = f"{relay.base}/v1/sessions/{sid}/ws"
    out: list[Received] = []
    async with http.ws_connect(url, params={"token": token(sid), "from": str(after)}) as ws:
        assert (await ws.receive_json())["from"] == after
        while len(out) < n and (not out or out[-1][1] not in ("done", "error")):
            msg = await ws.receive()
            assert msg.type is WSMsgType.TEXT, (msg.type, msg.data, ws.close_code)
            if is_presence(msg.data):
                continue
            out.append(ws_received(msg.data))
    return out


@pytest.mark.timeout(60)
async def test_reconnect_every_few_frames_while_streaming_alternating_relays(
    relays: tuple[RelayProcess, RelayProcess], redis: RedisCluster
) -> None:
    """No gates: the producer streams on while an SSE client and a WebSocket client each
    hang up every few frames and resume on the other relay (backlog replay races live
    frames at every reconnect). Both end with exactly the backlog."""
    sid = new_session_id()
    n_tokens = 400
    # the producer starts first, so the clients resume into a stream already moving
    gen = await Publisher(redis).open_generation(sid)
    got: dict[str, list[Received]] = {"sse": [], "ws": []}
    reconnects = {"sse": 0, "ws": 0}

    async def produce() -> None:
        await publish_paced(gen, 0, n_tokens, pause_s=0.002)
        await gen.done()

    async def follow(http: httpx.AsyncClient | aiohttp.ClientSession) -> None:
        transport = "sse" if isinstance(http, httpx.AsyncClient) else "ws"
        out = got[transport]
        while not out or out[-1][1] != "done":
            relay = relays[reconnects[transport] % 2]
            after = out[-1][0] if out else 0
            n = 7 + reconnects[transport] % 23  # vary where the hang-ups fall
            if isinstance(http, httpx.AsyncClient):
                out.extend(await sse_segment(http, relay, sid, after, n))
            else:
                out.extend(await ws_segment(http, relay, sid, after, n))
            reconnects[transport] += 1

    async with (
        asyncio.timeout(STREAM_S),
        httpx.AsyncClient(timeout=httpx.Timeout(10, read=STREAM_S)) as sse_http,
        aiohttp.ClientSession() as ws_http,
        asyncio.TaskGroup() as tg,
    ):
        tg.create_task(produce())
        tg.create_task(follow(sse_http))
        tg.create_task(follow(ws_http))
    want = await backlog(redis, sid)
    assert len(want) == n_tokens + 1
    for transport, out in got.items():
        check_stream(out, want, transport)
        assert reconnects[transport] >= 10, reconnects
