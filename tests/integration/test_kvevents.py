"""KV-cache events over real ZeroMQ: mock engines publish, the worker's follower indexes;
replay after lost messages; bad input counted, never raised; a worker routing precisely.

The engines are in-process mock engines (``kv_events_port=0``: free loopback ports); the
"broken engine" is a raw PUB socket of this test; the worker test runs on the real Redis
Cluster of the fixtures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from redis.asyncio.cluster import RedisCluster

from devstack.mockengine.prefix_cache import prompt_tokens
from devstack.mockengine.server import EngineConfig, RunningEngine, start_engine
from tests.support.worker import SHORT_REPLIES, Harness, wait_turn
from worker.routing.blockindex import BlockIndex
from worker.routing.kvevents import EventSource, KVEventFollower, parse_kv_events_arg
from worker.routing.kvwire import BlockStored, KVEventBatch, encode_batch, encode_seq
from worker.routing.tokens import block_keys, prompt_ids

pytestmark = pytest.mark.integration

BS = 16


def _source(e: RunningEngine) -> EventSource:
    kv = e.engine.kv_events
    assert kv is not None
    return EventSource(e.engine.cfg.engine_id, kv.endpoint, kv.replay_endpoint)


async def _until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def _chat(http: aiohttp.ClientSession, e: RunningEngine, msgs: list[dict[str, str]]) -> None:
    body = {"model": "tokenrelay-mock", "messages": msgs, "stream": True, "max_tokens": 8}
    async with http.post(f"{e.url}/v1/chat/completions", json=body) as r:
        assert r.status == 200
        await r.read()


def _msgs(n: int, text: str = "what now") -> list[dict[str, str]]:
    system = " ".join(f"rule{i}" for i in range(n))
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


def _held(ix: BlockIndex, name: str, msgs: list[dict[str, str]]) -> int:
    return ix.match(block_keys(prompt_ids(msgs), BS)).get(name, -1)


@pytest.fixture
async def engine() -> AsyncIterator[RunningEngine]:
    cfg = EngineConfig(
        port=0, engine_id="kv-0", kv_events_port=0, prefill_tok_per_s=0, decode_tok_per_s=0
    )
    cfg.reply = SHORT_REPLIES
    running = await start_engine(cfg)
    try:
        yield running
    finally:
        await running.stop()


async def test_the_engines_events_reach_the_index(engine: RunningEngine) -> None:
    ix = BlockIndex(BS)
    follower = KVEventFollower(ix, [_source(engine)])
    await follower.start()
    try:
        await _until(lambda: follower.counts["replays"] == 1)  # the connect's replay
        await asyncio.sleep(0.3)  # the SUB socket's connection (ZeroMQ's slow joiner)
        msgs = _msgs(100)
        async with aiohttp.ClientSession() as http:
            await _chat(http, engine, msgs)
        want = engine.engine.cache.peek(prompt_tokens(msgs)) // BS
        assert want >= 6
        await _until(lambda: _held(ix, "kv-0", msgs) == want)
        # the reply's blocks too: stored by the engine after the prompt's, in a later event
        await _until(lambda: ix.blocks("kv-0") == len(engine.engine.cache))
        assert follower.counts["events_applied"] > 0
        assert follower.bad == {}
    finally:
        await follower.stop()


async def test_lost_messages_come_back_by_replay(engine: RunningEngine) -> None:
    pub = engine.engine.kv_events
    assert pub is not None
    first, lost, last = _msgs(60, "one"), _msgs(80, "two"), _msgs(70, "three")
    ix = BlockIndex(BS)
    follower = KVEventFollower(ix, [_source(engine)], replay_timeout_s=2.0)
    async with aiohttp.ClientSession() as http:
        await _chat(http, engine, first)  # before anyone subscribed: only the replay has it
        await follower.start()
        try:
            await _until(lambda: _held(ix, "kv-0", first) > 0)
            await asyncio.sleep(0.3)
            lossy = pytest.MonkeyPatch()
            lossy.setattr(pub, "_send", lambda seq, payload: None)  # the subscriber misses these
            await _chat(http, engine, lost)
            lossy.undo()
            await _chat(http, engine, last)  # the next batch shows the gap
            cache = engine.engine.cache

            def exact() -> bool:
                return all(
                    _held(ix, "kv-0", m) == cache.peek(prompt_tokens(m)) // BS
                    for m in (first, lost, last)
                )

            await _until(lambda: follower.counts["replayed"] >= 2 and exact())
            assert ix.blocks("kv-0") == len(cache)
            assert follower.counts["gaps"] >= 1
            assert follower.counts["replayed"] >= 2
            assert follower.counts["replay_unanswered"] == 0
            assert ix.live("kv-0")
        finally:
            await follower.stop()


@pytest.fixture
async def raw_pub() -> AsyncIterator[tuple[zmq.asyncio.Socket, str]]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield sock, f"tcp://127.0.0.1:{port}"
    finally:
        sock.close(linger=0)
        ctx.term()


def _batch(seq_block: int) -> bytes:
    toks = list(range(seq_block * BS, (seq_block + 1) * BS))
    return encode_batch(KVEventBatch(0.0, [BlockStored([seq_block], None, toks, BS)]))


async def test_bad_input_is_counted_and_the_engine_falls_back(
    raw_pub: tuple[zmq.asyncio.Socket, str],
) -> None:
    sock, endpoint = raw_pub
    # a replay endpoint nobody answers: every gap goes unfilled
    ix = BlockIndex(BS)
    follower = KVEventFollower(
        ix,
        [EventSource("bad", endpoint, "tcp://127.0.0.1:9")],
        replay_timeout_s=0.1,
        resync_s=0.0,
        max_events_per_s=50,
    )
    await follower.start()
    try:
        await asyncio.sleep(0.4)  # the connect's replay times out; SUB connected

        async def send(*frames: bytes) -> None:
            before = follower.counts["messages"]
            await sock.send_multipart(frames)
            await _until(lambda: follower.counts["messages"] > before)

        await send(b"", encode_seq(0), _batch(0))
        assert ix.live("bad")
        assert ix.blocks("bad") == 1
        await send(b"", encode_seq(1), b"\xc1garbage")
        assert follower.bad == {"garbled": 1}
        assert ix.blocks("bad") == 0
        await send(b"", encode_seq(2), msgspec.msgpack.encode([0.0, [["BlockMoved", [1]]]]))
        await send(b"", encode_seq(3), _batch(3)[:-4])
        await send(b"", b"\x01", _batch(4))
        await send(b"", _batch(5))
        assert follower.bad == {"garbled": 2, "unknown_tag": 1, "seq": 1, "frames": 1}
        await send(b"", encode_seq(10), _batch(10))  # applied: the view was dropped
        await send(b"", encode_seq(20), _batch(20))  # a gap nobody fills
        assert follower.counts["gaps"] == 1
        assert follower.counts["replay_unanswered"] == 1
        assert ix.blocks("bad") == 1  # 10's block went with the unfilled gap; 20's is in
        flood = encode_batch(KVEventBatch(0.0, [BlockStored([7], None, [0] * BS, BS)] * 60))
        await send(b"", encode_seq(21), flood)
        assert follower.counts["flood_dropped"] == 1
        assert follower.bad["flood"] == 1
        assert not ix.live("bad") or ix.blocks("bad") == 0
        # the follower is still there: a good batch is applied
        applied = follower.counts["batches_applied"]
        await asyncio.sleep(1.05)  # the next second: no longer a flood
        await send(b"", encode_seq(22), _batch(22))
        await _until(lambda: follower.counts["batches_applied"] > applied)
        follower.tick()
        assert ix.live("bad")
        assert ix.blocks("bad") == 1
    finally:
        await follower.stop()


def test_the_events_flag() -> None:
    src = parse_kv_events_arg("eng-0=tcp://127.0.0.1:5557")
    assert src == EventSource("eng-0", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    src = parse_kv_events_arg("e=tcp://10.0.0.1:7000,tcp://10.0.0.1:7100")
    assert src.replay == "tcp://10.0.0.1:7100"
    for bad in ("tcp://h:5557", "e=http://h:5557", "e=tcp://h", "e=tcp://h:1,udp://h:2"):
        with pytest.raises(ValueError, match="--engine-kv-events"):
            parse_kv_events_arg(bad)


@pytest.mark.parametrize(("policy", "want"), [("precise", "eng-1"), ("cost_aware", "eng-0")])
async def test_a_worker_routes_to_the_engine_the_events_say_holds_the_prefix(
    h: Harness, redis: RedisCluster, policy: str, want: str
) -> None:
    """A first turn on a system prompt eng-1 served before: precise reads it from eng-1's
    events; the estimate (cost_aware) has seen no turn on it and takes the first engine."""
    engines = await h.start_engines(2, kv_events_port=0)
    system = " ".join(f"clause{i}" for i in range(1500))
    async with aiohttp.ClientSession() as http:  # eng-1 served this system prompt before
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
        await _chat(http, engines[1], msgs)
    srcs = [_source(e) for e in engines]  # free ports: the replay's is not the PUB's + 1
    kv = tuple(f"{s.engine}={s.endpoint},{s.replay}" for s in srcs)
    precise = policy == "precise"
    state = await h.start_worker(routing=policy, engine_kv_events=kv if precise else ())
    index = state.router.index
    if precise:
        assert index is not None
        # eng-0's replay answered empty: known to hold nothing; eng-1's brought its blocks
        await _until(lambda: index.blocks("eng-1") > 0 and index.live("eng-0"), 10.0)
        assert index.blocks("eng-0") == 0
    sid, token = await h.session()
    status, body, _ = await h.post_turn(sid, token, {"message": "hello", "system": system})
    assert status == 202, body
    frames = await wait_turn(redis, sid, body["turn"])
    assert frames[0].meta is not None
    assert frames[0].meta["engine"] == want
    if precise:  # eng-1 served the system prompt from its cache (whole blocks of it)
        assert engines[1].engine.cache.stats().hits >= 1400
