"""Every exit path of a turn releases its lease once and ends with a terminal frame.

Paths: done (test_worker_api), engine killed mid-stream, engine timeout, no viewers
(presence), engine left the ring (control plane), fenced, worker shutdown. Real Redis
Cluster, in-process mock engines; presence is written the way relay/edge/fanout/hub.py writes
it, and once through a real Hub watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.mockengine.reply_length import ReplyLength
from relay.broker.rediscluster.broker import RedisBroker
from relay.broker.rediscluster.presence import WRITE_LUA
from relay.broker.rediscluster.publisher import Publisher, read_backlog
from relay.broker.rediscluster.store import RedisStore
from relay.edge.conn.reader import Reader, open_reader
from relay.edge.fanout.hub import Hub
from relay.producer.presence import present_relays
from relay.protocol.frame import decode
from relay.protocol.keys import presence_key
from tests.support.worker import Harness, wait_turn
from worker.routing.lease import EngineSpec

pytestmark = pytest.mark.integration

FAST_PRESENCE: dict[str, Any] = {"presence_grace_s": 1.0, "presence_interval_s": 0.2}
LONG_48 = ReplyLength(mean=48, max_tokens=48, min_tokens=48, sigma=0)  # every reply 48 tokens


async def _until_tokens(redis: RedisCluster, sid: str, n: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        raw, _, _ = await read_backlog(redis, sid, 0, 10_000)
        if sum(1 for x in raw if decode(x).kind == "token") >= n:
            return
        assert time.monotonic() < deadline, "tokens did not arrive"
        await asyncio.sleep(0.05)


async def _outcome(h: Harness, sid: str, timeout_s: float = 5.0) -> str:
    """The turn's recorded outcome: recorded just after its terminal frame is out (and
    the lock given back), so a test that saw the frame may have to wait a moment."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [o for s, _, o in h.state.turns.outcomes if s == sid]
        if found or time.monotonic() > deadline:
            return found[0] if found else "none recorded"
        await asyncio.sleep(0.01)


async def _watched(redis: RedisCluster, sid: str, stop: asyncio.Event, relay: str = "r1") -> None:
    """Refresh presence like relay.broker.rediscluster.presence: expiry = Redis TIME + 2 s,
    every 0.3 s."""
    while not stop.is_set():
        await redis.eval(WRITE_LUA, 1, presence_key(sid), relay, 2_000)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.3)


async def test_engine_killed_mid_stream_ends_with_error_and_releases(
    h: Harness, redis: RedisCluster
):
    engines = await h.start_engines(1, decode_tok_per_s=10.0)
    await h.start_worker(control_interval_s=60.0)  # the stream itself must notice
    sid, token = await h.session()
    status, body, _ = await h.post_turn(sid, token, {"message": "tell me a long story"})
    assert status == 202
    await _until_tokens(redis, sid, 2)
    await engines[0].stop()
    frames = await wait_turn(redis, sid, body["turn"])
    assert frames[-1].kind == "error"
    assert frames[-1].meta is not None
    assert frames[-1].meta["code"] == "engine_error"
    assert await _outcome(h, sid) == "engine_error"
    assert h.state.router.in_flight() == {"eng-0": 0}
    assert h.state.router.snapshot()["counters"]["double_releases"] == 0
    h.engines.clear()


async def test_first_token_timeout_ends_with_error(h: Harness, redis: RedisCluster):
    await h.start_engines(1, prefill_tok_per_s=2.0)  # seconds of prefill
    await h.start_worker(first_token_timeout_s=0.4)
    sid, token = await h.session()
    status, body, _ = await h.post_turn(sid, token, {"message": "a b c d e f g"})
    assert status == 202
    frames = await wait_turn(redis, sid, body["turn"])
    assert frames[-1].kind == "error"
    assert "timeout" in frames[-1].text
    assert await _outcome(h, sid) == "timeout"
    assert h.state.router.in_flight() == {"eng-0": 0}


async def test_nobody_watching_aborts_the_engine_request(h: Harness, redis: RedisCluster):
    engines = await h.start_engines(1, decode_tok_per_s=10.0)
    await h.start_worker(**FAST_PRESENCE)
    sid, token = await h.session()
    t0 = time.monotonic()
    status, body, _ = await h.post_turn(sid, token, {"message": "nobody reads this"})
    assert status == 202
    frames = await wait_turn(redis, sid, body["turn"])
    elapsed = time.monotonic() - t0
    assert frames[-1].kind == "error"
    assert frames[-1].text == "no viewers"
    assert 1.0 <= elapsed < 3.0
    assert await _outcome(h, sid) == "no_viewers"
    assert h.state.router.in_flight() == {"eng-0": 0}
    await asyncio.sleep(0.2)
    assert engines[0].engine.gate.running == 0  # the engine saw the disconnect
    assert engines[0].engine.metrics.aborted._value.get() == 1
    assert 'tokenrelay_worker_cancellations_total{reason="no_viewers"} 1.0' in (
        h.state.metrics.render().decode()
    )


async def test_a_watched_turn_runs_to_the_end(h: Harness, redis: RedisCluster):
    await h.start_engines(1, decode_tok_per_s=20.0, reply=LONG_48)  # 2.4 s > grace
    await h.start_worker(**FAST_PRESENCE)
    sid, token = await h.session()
    stop = asyncio.Event()
    status, body, _ = await h.post_turn(sid, token, {"message": "someone reads this"})
    assert status == 202
    await asyncio.sleep(0.6)  # the viewer connects late, within the grace period
    watcher = asyncio.create_task(_watched(redis, sid, stop))
    try:
        await asyncio.sleep(0.1)
        assert await present_relays(RedisStore(redis), sid) == 1
        frames = await wait_turn(redis, sid, body["turn"])
    finally:
        stop.set()
        await watcher
    assert frames[-1].kind == "done"
    assert await _outcome(h, sid) == "done"


async def test_a_viewer_leaving_for_longer_than_the_grace_cancels(h: Harness, redis: RedisCluster):
    await h.start_engines(1, decode_tok_per_s=10.0, reply=LONG_48)  # 4.8 s: outlives the grace
    await h.start_worker(**FAST_PRESENCE)
    sid, token = await h.session()
    stop = asyncio.Event()
    status, body, _ = await h.post_turn(sid, token, {"message": "left halfway"})
    watcher = asyncio.create_task(_watched(redis, sid, stop))
    await asyncio.sleep(1.5)
    stop.set()
    await watcher
    await redis.zrem(presence_key(sid), "r1")  # what the hub does when its last watcher leaves
    frames = await wait_turn(redis, sid, body["turn"])
    assert status == 202
    assert frames[-1].text == "no viewers"
    assert sum(1 for f in frames if f.kind == "token") >= 2


async def test_a_real_hub_watch_keeps_the_turn_alive(h: Harness, redis: RedisCluster):
    await h.start_engines(1, decode_tok_per_s=20.0)
    await h.start_worker(**FAST_PRESENCE)
    hub = Hub(RedisBroker(redis, "lifecycle-hub"))
    await hub.start()
    try:
        sid, token = await h.session()
        status, _body, _ = await h.post_turn(sid, token, {"message": "watched by a hub"})
        assert status == 202
        watch = await open_reader(hub, sid, 0)
        kinds: list[str] = []
        text = ""
        async with asyncio.timeout(15):
            while not kinds or kinds[-1] not in ("done", "error"):
                for d in await watch.next():
                    f = decode(d.data)
                    kinds.append(f.kind)
                    text += f.text if f.kind == "token" else ""
        await watch.close()
    finally:
        await hub.close()
    assert kinds[0] == "meta"
    assert kinds[-1] == "done"
    assert text


async def test_engine_leaving_the_ring_ends_its_streams(h: Harness, redis: RedisCluster):
    engines = await h.start_engines(2, decode_tok_per_s=10.0)
    await h.start_worker(control_interval_s=0.2)
    st = h.state
    sid, token = await h.session()
    status, body, _ = await h.post_turn(sid, token, {"message": "on a doomed engine"})
    assert status == 202
    await _until_tokens(redis, sid, 1)
    doomed = next(t for t in st.turns.running.values()).lease.engine.id
    survivor = next(e for e in engines if e.engine.cfg.engine_id != doomed)
    # The control plane sees the engine vanish (health probes fail).
    st.control.static[doomed] = EngineSpec(id=doomed, url="http://127.0.0.1:9", cap=8)
    frames = await wait_turn(redis, sid, body["turn"])
    assert frames[-1].kind == "error"
    assert frames[-1].text == "engine down"
    assert await _outcome(h, sid) == "engine_down"
    assert [s.id for s in st.router.engines()] == [survivor.engine.cfg.engine_id]
    assert st.router.in_flight().get(doomed, 0) == 0
    sid2, token2 = await h.session()
    s2, b2, _ = await h.post_turn(sid2, token2, {"message": "new turns go elsewhere"})
    assert s2 == 202
    f2 = await wait_turn(redis, sid2, b2["turn"])
    assert f2[0].meta is not None
    assert f2[0].meta["engine"] == survivor.engine.cfg.engine_id


async def test_fenced_turn_releases_and_writes_nothing_more(h: Harness, redis: RedisCluster):
    await h.start_engines(1, decode_tok_per_s=20.0)
    await h.start_worker()
    sid, token = await h.session()
    status, _body, _ = await h.post_turn(sid, token, {"message": "about to be fenced"})
    assert status == 202
    await _until_tokens(redis, sid, 1)
    newer = await Publisher(redis).open_generation(sid)  # a newer producer takes over
    deadline = time.monotonic() + 10
    while not h.state.turns.outcomes:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert await _outcome(h, sid) == "fenced"
    assert h.state.router.in_flight() == {"eng-0": 0}
    await newer.done({"by": "newer"})
    raw, _, _ = await read_backlog(redis, sid, 0, 10_000)
    frames = [decode(x) for x in raw]
    assert all(f.epoch <= newer.epoch for f in frames)
    assert frames[-1].epoch == newer.epoch
    assert [f for f in frames if f.epoch == newer.epoch - 1 and f.kind in ("done", "error")] == []


async def test_engine_killed_mid_stream_the_next_turn_goes_to_the_other_engine(
    h: Harness, redis: RedisCluster
):
    engines = await h.start_engines(2, decode_tok_per_s=10.0)
    await h.start_worker(control_interval_s=0.2)
    sid, token = await h.session()
    status, body, _ = await h.post_turn(sid, token, {"message": "a long story, please"})
    assert status == 202
    await _until_tokens(redis, sid, 2)
    raw, _, _ = await read_backlog(redis, sid, 0, 10_000)
    meta = next(f for f in map(decode, raw) if f.kind == "meta").meta
    assert meta is not None
    victim = meta["engine"]
    await next(e for e in engines if e.engine.cfg.engine_id == victim).stop()  # kill it
    frames = await wait_turn(redis, sid, body["turn"])
    assert frames[-1].kind == "error"
    assert frames[-1].meta is not None
    # the broken stream or the control plane's probe, whichever notices first
    assert frames[-1].meta["code"] in ("engine_error", "engine_down")
    assert h.state.router.in_flight().get(victim, 0) == 0  # its lease was released
    status, body2, _ = await h.post_turn(sid, token, {"message": "and now?", "max_tokens": 8})
    assert status == 202, body2
    frames2 = await wait_turn(redis, sid, body2["turn"])
    assert frames2[-1].kind == "done", [f.kind for f in frames2]
    assert frames2[-1].meta is not None
    assert frames2[-1].meta["engine"] != victim  # routed elsewhere
    assert h.state.router.snapshot()["counters"]["double_releases"] == 0
    h.engines[:] = [e for e in h.engines if e.engine.cfg.engine_id != victim]


async def _read_turn(watch: Reader, until: int | None = None) -> list[tuple[int, str, str]]:
    """(offset, kind, text) from a hub watch: up to the terminal frame, or ``until``
    token frames."""
    out: list[tuple[int, str, str]] = []
    async with asyncio.timeout(20):
        while True:
            for d in await watch.next():
                f = decode(d.data)
                out.append((f.offset, f.kind, f.text))
                if f.kind in ("done", "error"):
                    return out
                if until is not None and sum(1 for _, k, _ in out if k == "token") >= until:
                    return out


async def test_the_last_viewer_leaving_releases_the_engine_slot_after_the_grace(
    h: Harness, redis: RedisCluster
):
    engines = await h.start_engines(1, decode_tok_per_s=10.0)
    await h.start_worker(**FAST_PRESENCE)  # grace 1 s
    hub = Hub(RedisBroker(redis, "leaving-hub"))
    await hub.start()
    try:
        sid, token = await h.session()
        status, body, _ = await h.post_turn(sid, token, {"message": "a long story, please"})
        assert status == 202
        watch = await open_reader(hub, sid, 0)
        await _read_turn(watch, until=2)
        assert engines[0].engine.gate.running == 1
        left_at = time.monotonic()
        await watch.close()  # the last (only) viewer leaves
        frames = await wait_turn(redis, sid, body["turn"])
        ended_after = time.monotonic() - left_at
    finally:
        await hub.close()
    assert frames[-1].kind == "error"
    assert frames[-1].text == "no viewers"
    # not before the grace period, counted from the worker's last look that found the
    # viewer (every 0.2 s, so up to 0.2 s before the close removed the entry)
    assert ended_after >= FAST_PRESENCE["presence_grace_s"] - 0.2
    assert h.state.router.in_flight() == {"eng-0": 0}  # the slot is back
    async with asyncio.timeout(5):
        while engines[0].engine.gate.running:  # the engine request was aborted too
            await asyncio.sleep(0.05)


async def test_a_viewer_back_within_the_grace_resumes_from_the_backlog(
    h: Harness, redis: RedisCluster
):
    await h.start_engines(1, decode_tok_per_s=20.0)
    await h.start_worker(**FAST_PRESENCE)  # grace 1 s
    hub = Hub(RedisBroker(redis, "returning-hub"))
    await hub.start()
    try:
        sid, token = await h.session()
        status, body, _ = await h.post_turn(sid, token, {"message": "a long story, please"})
        assert status == 202
        watch = await open_reader(hub, sid, 0)
        first = await _read_turn(watch, until=3)
        await watch.close()
        await asyncio.sleep(0.4)  # away for less than the grace period
        watch = await open_reader(hub, sid, first[-1][0])  # resume after the last offset seen
        rest = await _read_turn(watch)
        await watch.close()
    finally:
        await hub.close()
    offsets = [o for o, _, _ in first + rest]
    assert offsets == list(range(offsets[0], offsets[0] + len(offsets)))  # no gap, no dup
    assert rest[-1][1] == "done"
    frames = await wait_turn(redis, sid, body["turn"])
    assert "".join(t for _, k, t in first + rest if k == "token") == "".join(
        f.text for f in frames if f.kind == "token"
    )
