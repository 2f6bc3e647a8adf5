"""The worker's session store against a real cluster: the turn lock and idempotency
claims survive a retried SET NX (redis-py sends a command again after a connection
error; when the first one had landed, the second finds the key set)."""

from __future__ import annotations

import pytest
from redis.asyncio.cluster import RedisCluster

from relay.protocol.keys import KeyKind, key, new_session_id
from worker.chat.store import SessionStore

pytestmark = pytest.mark.integration


async def test_the_lock_is_ours_when_our_own_set_landed_before(redis: RedisCluster) -> None:
    store = SessionStore(redis)
    sid = new_session_id()
    assert await store.acquire_lock(sid, "w1:aaaa") is None
    # the same SET NX again (what a retry after a lost reply does): still ours
    assert await store.acquire_lock(sid, "w1:aaaa") is None
    holder = await store.acquire_lock(sid, "w1:bbbb")  # another attempt: refused
    assert holder is not None
    assert holder.owner == "w1:aaaa"
    # an owner that is a prefix of the holder's is not the holder
    assert await store.acquire_lock(sid, "w1:aa") is not None
    stored = await redis.get(key(sid, KeyKind.LOCK))
    assert isinstance(stored, bytes)
    assert stored.startswith(b"w1:aaaa ")


async def test_an_idempotency_claim_is_ours_when_our_own_set_landed_before(
    redis: RedisCluster,
) -> None:
    store = SessionStore(redis)
    sid = new_session_id()
    assert await store.claim_idempotency(sid, "key-1", "w1:aaaa") is None
    assert await store.claim_idempotency(sid, "key-1", "w1:aaaa") is None
    assert await store.claim_idempotency(sid, "key-1", "w1:bbbb") == "pending"
    await store.resolve_idempotency(sid, "key-1", {"turn": 1})
    assert await store.claim_idempotency(sid, "key-1", "w1:aaaa") == {"turn": 1}


async def test_history_is_bounded_in_bytes_oldest_first_and_keeps_the_newest_exchange(
    redis: RedisCluster,
) -> None:
    store = SessionStore(redis, max_messages=64, max_bytes=4_000, ttl_s=60)
    sid = new_session_id()
    for i in range(10):  # 10 exchanges of ~1 KB each: far over the 4 KB bound
        await store.append_exchange(
            sid,
            [{"role": "user", "content": f"q{i} " + "u" * 500},
             {"role": "assistant", "content": f"a{i} " + "a" * 500}],
            None,
        )  # fmt: skip
    stored = await redis.lrange(key(sid, KeyKind.HIST), 0, -1)
    assert sum(len(x) for x in stored) <= 4_000
    hist = await store.load(sid)
    assert hist.messages[-1]["content"].startswith("a9 ")  # the newest stays
    assert hist.messages[0]["content"].startswith(("q6 ", "q7 ", "a6 ")), hist.messages[0]
    huge = SessionStore(redis, max_messages=64, max_bytes=100, ttl_s=60)
    sid2 = new_session_id()
    await huge.append_exchange(
        sid2, [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "y"}], None
    )
    assert len(await redis.lrange(key(sid2, KeyKind.HIST), 0, -1)) == 2  # never cut itself
