"""The worker-death reaper against a real cluster: a turn whose worker died (its turn
lock expired) ends with exactly one ``error`` frame, within the deadline, and the dead
producer is fenced."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio.cluster import RedisCluster

from relay.broker.errors import Fenced
from relay.broker.rediscluster.broker import RedisBroker
from relay.broker.rediscluster.publisher import WORKER_LOST, Publisher, read_backlog, reap
from relay.edge.conn.reader import Reader, open_reader
from relay.edge.fanout.hub import Hub
from relay.protocol.frame import decode
from relay.protocol.keys import KeyKind, key, meta_key, new_session_id

pytestmark = pytest.mark.integration

LOCK_TTL_MS = 1500  # the test's "worker" lock; production uses 5 s (worker/api.py)


async def _take_lock(redis: RedisCluster, sid: str) -> None:
    """What worker.chat.store.SessionStore.acquire_lock does (SET NX PX)."""
    assert await redis.set(key(sid, KeyKind.LOCK), "w1:abc {}", nx=True, px=LOCK_TTL_MS)


async def _kinds_until_terminal(w: Reader, timeout_s: float) -> list[tuple[int, str]]:
    seen: list[tuple[int, str]] = []
    async with asyncio.timeout(timeout_s):
        while not seen or seen[-1][1] not in ("done", "error"):
            seen.extend((d.offset, d.kind) for d in await w.next())
    return seen


async def test_a_silent_turn_whose_lock_expired_ends_with_one_error_frame(
    redis: RedisCluster,
) -> None:
    hub = Hub(RedisBroker(redis, "reaper-1"), reap_after_s=0.5, reap_interval_s=0.25)
    await hub.start()
    try:
        sid = new_session_id()
        w = await open_reader(hub, sid, 0)
        await _take_lock(redis, sid)
        gen = await Publisher(redis).open_generation(sid)
        await gen.meta({"message": "hi"})
        for t in ("a", "b", "c"):
            await gen.token(t)
        t0 = time.monotonic()  # the worker dies here: no refresh, no terminal frame
        seen = await _kinds_until_terminal(w, timeout_s=10)
        took = time.monotonic() - t0
        assert seen == [(1, "meta"), (2, "token"), (3, "token"), (4, "token"), (5, "error")]
        # lock TTL + stall threshold + one interval, plus round trips
        assert took < LOCK_TTL_MS / 1000 + 0.5 + 0.25 + 1.0
        frames, _, last = await read_backlog(redis, sid, 4, 10)
        err = decode(frames[0])
        assert (last, err.kind, err.text, err.turn) == (5, "error", WORKER_LOST, gen.turn)
        assert err.meta == {"code": "worker_lost", "reaped_by": "reaper-1", "gen": gen.gen}
        assert err.epoch == gen.epoch + 1
        assert hub.stats()["reaped"] == 1
        assert await redis.hget(meta_key(sid), "open") is None
    finally:
        await hub.close()


async def test_nothing_is_reaped_while_the_lock_is_alive(redis: RedisCluster) -> None:
    hub = Hub(RedisBroker(redis, "reaper-2"), reap_after_s=0.2, reap_interval_s=0.1)
    await hub.start()
    try:
        sid = new_session_id()
        w = await open_reader(hub, sid, 0)
        await _take_lock(redis, sid)
        gen = await Publisher(redis).open_generation(sid)
        await gen.token("a")
        for _ in range(10):  # the worker is alive but the engine is slow: refresh only
            await asyncio.sleep(0.2)
            await redis.pexpire(key(sid, KeyKind.LOCK), LOCK_TTL_MS)
        assert hub.stats()["reap_checks"] >= 3
        assert hub.stats()["reaped"] == 0
        assert (await reap(redis, sid, reaper="x")).status == "locked"
        await gen.done()  # still ours: not fenced
        assert await _kinds_until_terminal(w, 5) == [(1, "token"), (2, "done")]
        await redis.delete(key(sid, KeyKind.LOCK))
        assert (await reap(redis, sid, reaper="x")).status == "idle"  # the turn is closed
    finally:
        await hub.close()


async def test_concurrent_reaps_write_one_error_frame(redis: RedisCluster) -> None:
    sid = new_session_id()
    gen = await Publisher(redis).open_generation(sid)
    await gen.token("a")
    results = await asyncio.gather(*(reap(redis, sid, reaper=f"r{i}") for i in range(8)))
    assert sorted(r.status for r in results) == ["idle"] * 7 + ["reaped"]
    frames, _, last = await read_backlog(redis, sid, 0, 10)
    assert [decode(f).kind for f in frames] == ["token", "error"]
    assert last == 2


async def test_a_reaped_producer_that_wakes_up_is_fenced_and_writes_nothing(
    redis: RedisCluster,
) -> None:
    sid = new_session_id()
    gen = await Publisher(redis).open_generation(sid)
    await gen.token("a")
    assert (await reap(redis, sid, reaper="r")).status == "reaped"
    with pytest.raises(Fenced):
        await gen.token("b")
    with pytest.raises(Fenced):
        await gen.done()
    frames, _, last = await read_backlog(redis, sid, 0, 10)
    assert [decode(f).kind for f in frames] == ["token", "error"]
    assert last == 2
    nxt = await Publisher(redis).open_generation(sid)  # the next turn continues
    assert await nxt.token("c") == 3


async def test_a_turn_that_ended_is_never_reaped(redis: RedisCluster) -> None:
    sid = new_session_id()
    gen = await Publisher(redis).open_generation(sid)
    await gen.token("a")
    await gen.error("engine failed")
    assert (await reap(redis, sid, reaper="r")).status == "idle"
    assert (await read_backlog(redis, sid, 0, 0))[2] == 2
