"""The edges of a turn's admission and life, on the real cluster: Idempotency-Key
records tied to the turn lock and to the request, a runner that loses its lock, and
tokens that never outlive their session."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.mockengine.reply_length import ReplyLength
from relay.broker.rediscluster.publisher import read_backlog
from relay.protocol.auth import verify_token
from relay.protocol.keys import KeyKind, idem_key, key
from tests.support.worker import SECRET, Harness, wait_turn
from worker.chat.store import IDEM_TTL_S, SessionStore
from worker.chat.turnstate import request_fingerprint

pytestmark = pytest.mark.integration


async def test_the_same_key_with_another_body_is_422(h: Harness, redis: RedisCluster) -> None:
    await h.start_engines(1)
    await h.start_worker()
    sid, token = await h.session()
    hdr = {"Idempotency-Key": "k-1"}
    s1, b1, _ = await h.post_turn(sid, token, {"message": "hi"}, headers=hdr)
    assert s1 == 202, b1
    for other in ({"message": "hello"}, {"message": "hi", "max_tokens": 5}):
        s2, b2, _ = await h.post_turn(sid, token, other, headers=hdr)
        assert (s2, b2["error"]) == (422, "idempotency_key_reused"), b2
    s3, b3, _ = await h.post_turn(sid, token, {"message": "hi"}, headers=hdr)
    assert (s3, b3) == (202, b1)  # the same request still replays its turn
    await wait_turn(redis, sid, b1["turn"])


async def test_a_claim_whose_worker_died_expires_with_the_lock_and_a_retry_starts(
    h: Harness, redis: RedisCluster
) -> None:
    await h.start_engines(1)
    await h.start_worker(lock_ttl_s=1.0)
    sid, token = await h.session()
    body = {"message": "retry me"}
    # a worker claimed the key and died before resolving it (nothing else of it left)
    dead = SessionStore(redis, lock_ttl_s=1.0)
    # a turn without max_tokens is a turn with the worker's default (the fingerprint's)
    fp = request_fingerprint("retry me", None, h.state.cfg.default_max_tokens)
    assert await dead.claim_idempotency(sid, "k-2", "dead:0000", fp) is None
    ttl_ms = await redis.pttl(idem_key(sid, "k-2"))
    assert 0 < ttl_ms <= 1000  # the lock's lifetime, not a day
    s1, b1, _ = await h.post_turn(sid, token, body, headers={"Idempotency-Key": "k-2"})
    assert (s1, b1["error"]) == (409, "idempotency_pending"), b1
    # another body under the pending key: refused as reused, not as pending
    s2, b2, _ = await h.post_turn(sid, token, {"message": "x"}, headers={"Idempotency-Key": "k-2"})
    assert (s2, b2["error"]) == (422, "idempotency_key_reused"), b2
    await asyncio.sleep(1.2)
    s3, b3, _ = await h.post_turn(sid, token, body, headers={"Idempotency-Key": "k-2"})
    assert s3 == 202, b3  # the claim expired: the retry starts the turn
    frames = await wait_turn(redis, sid, b3["turn"])
    assert frames[-1].kind == "done"
    stored = await redis.get(idem_key(sid, "k-2"))
    assert stored is not None
    assert 3000 < await redis.ttl(idem_key(sid, "k-2")) <= IDEM_TTL_S  # kept for retries


async def test_a_runner_that_lost_its_lock_stops_publishing_and_aborts_the_engine(
    h: Harness, redis: RedisCluster
) -> None:
    (engine,) = await h.start_engines(
        1, decode_tok_per_s=50.0, reply=ReplyLength(mean=400, min_tokens=400, sigma=0)
    )
    await h.start_worker()
    sid, token = await h.session()
    status, body, _ = await h.post_turn(sid, token, {"message": "a long one"})
    assert status == 202, body
    lock = key(sid, KeyKind.LOCK)
    async with asyncio.timeout(10):
        while len((await read_backlog(redis, sid, 0, 100))[0]) < 4:
            await asyncio.sleep(0.05)
    # the lock expired during an outage and another worker took it
    await redis.set(lock, 'other:1234 {"turn": 0, "offset": 0}', px=30_000)
    async with asyncio.timeout(5):
        while (sid, body["turn"], "lock_lost") not in h.state.turns.outcomes:
            await asyncio.sleep(0.05)
    _, _, last = await read_backlog(redis, sid, 0, 0)
    await asyncio.sleep(1.0)
    frames, _, last_after = await read_backlog(redis, sid, 0, 10_000)
    assert last_after == last  # nothing published after it stopped
    kinds = [f.split(b'"kind":"')[1].split(b'"')[0] for f in frames]
    assert b"done" not in kinds
    assert b"error" not in kinds  # the reaper or the newer turn ends the stream
    assert engine.engine.metrics.aborted._value.get() == 1  # the engine request aborted
    held = await redis.get(lock)
    assert isinstance(held, bytes)
    assert held.startswith(b"other:1234 ")  # not released: not ours
    assert h.state.turns.running == {}


async def test_a_token_never_outlives_the_session(h: Harness) -> None:
    await h.start_engines(1)
    await h.start_worker(session_ttl_s=600, token_ttl_s=86_400)
    sid, token = await h.session()
    verify_token(SECRET, token, sid, time.time() + 590, need="write")
    with pytest.raises(Exception, match="expired"):
        verify_token(SECRET, token, sid, time.time() + 610, need="write")


async def test_naming_the_turn_retakes_an_expired_lock_but_never_anothers(
    redis: RedisCluster,
) -> None:
    store = SessionStore(redis, lock_ttl_s=5.0)
    sid = f"edge-{time.time_ns()}"
    assert await store.acquire_lock(sid, "w:1") is None
    await redis.delete(key(sid, KeyKind.LOCK))  # expired during a slow admission
    assert await store.set_lock_turn(sid, "w:1", 1, 1) is True
    assert await store.refresh_lock(sid, "w:1") is True
    await redis.set(key(sid, KeyKind.LOCK), 'w:2 {"turn": 2, "offset": 9}')
    assert await store.set_lock_turn(sid, "w:1", 1, 1) is False
    assert await store.refresh_lock(sid, "w:1") is False
