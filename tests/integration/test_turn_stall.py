"""A turn ends even when a Redis call of its presence loop loses its cancellation.

What the redis_stall drill showed (``python -m bench.faults --only redis_stall``): a
master is SIGSTOPped for 1.5 s while turns stream. The presence task's lock refresh is
held up by the stall; when the master resumes, its reply and the turn's end arrive in
the same loop iterations, the turn cancels the presence task and the cancellation is
lost (``refresh_lock`` returned normally while ``task.cancelling() == 1``). The loop,
which only stopped on cancellation, went on refreshing the turn lock every second, and
the turn waited for it without a bound: no terminal frame, lock held for ever (the
relays' reaper never fires), later POSTs 409.

The refresh below loses its first cancellation the same way, deterministically.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from redis.asyncio.cluster import RedisCluster

import relay.producer.turn as producer_turn
from relay.broker.port import TurnStore
from relay.producer.lock import LockState
from relay.producer.lock import refresh as lock_refresh
from relay.protocol.keys import KeyKind, key
from tests.support.worker import Harness, wait_turn

pytestmark = pytest.mark.integration


async def test_a_lost_cancellation_of_the_presence_loop_does_not_hang_the_turn(
    h: Harness, redis: RedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    await h.start_engines(1, decode_tok_per_s=200.0)
    st = await h.start_worker(presence_grace_s=30.0, presence_interval_s=0.02)
    real_refresh = lock_refresh  # what a turn's watch refreshes its lock with
    stalled = asyncio.Event()
    calls = 0

    async def refresh_across_a_stall(
        r: TurnStore, sid: str, owner: str, ttl_ms: int, turn: int
    ) -> LockState:
        nonlocal calls
        calls += 1
        if calls == 1:  # the round trip a stalled master holds up
            stalled.set()
            # the reply arrives with the cancellation, which is lost
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)
        return await real_refresh(r, sid, owner, ttl_ms, turn)

    monkeypatch.setattr(producer_turn, "lock_refresh", refresh_across_a_stall)
    sid, token = await h.session()
    status, body, _ = await h.post_turn(sid, token, {"message": "stall", "max_tokens": 8})
    assert status == 202, body
    await asyncio.wait_for(stalled.wait(), 5.0)
    t0 = time.monotonic()
    frames = await wait_turn(redis, sid, body["turn"], timeout_s=8.0)
    assert frames[-1].kind == "done"
    assert time.monotonic() - t0 < 5.0
    # the turn gave everything back: lock, lease, running entry; the next turn runs
    assert await redis.exists(key(sid, KeyKind.LOCK)) == 0
    assert sid not in st.turns.running
    assert sum(st.router.in_flight().values()) == 0
    status, body2, _ = await h.post_turn(sid, token, {"message": "again", "max_tokens": 4})
    assert status == 202, body2
    assert (await wait_turn(redis, sid, body2["turn"]))[-1].kind == "done"
