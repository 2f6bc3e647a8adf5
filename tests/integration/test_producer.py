"""The producer API (relay/producer) against the real cluster: a turn's frames, its
integrity, the adapters, the refusals (one type per cause), a stop seen through the
stop record, and the worker's store reading the same lock."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from relay.broker.rediscluster.publisher import read_backlog
from relay.broker.rediscluster.store import RedisStore
from relay.producer import (
    CANCELLED,
    MAX_DELTA_BYTES,
    CoalescePolicy,
    FrameTooLarge,
    InvalidSession,
    PresencePolicy,
    Producer,
    StaleEpoch,
    StopReason,
    TurnBusy,
    TurnClosed,
    pipe,
    pipe_chat_completion,
    pipe_responses,
    pipe_text,
)
from relay.protocol.auth import verify_token
from relay.protocol.frame import Frame, decode
from worker.chat.cancel import request_stop

pytestmark = pytest.mark.integration

SECRET = secrets.token_urlsafe(32)


def _sid() -> str:
    return "p-" + secrets.token_hex(6)


async def _frames(redis: RedisCluster, sid: str) -> list[Frame]:
    raw, _, _ = await read_backlog(redis, sid, 0, 100_000)
    return [decode(f) for f in raw]


@pytest.fixture
async def producer(redis: RedisCluster) -> Producer:
    return Producer(redis, keys=SECRET, producer_id="test-producer",
                   presence=PresencePolicy(grace_s=30, interval_s=0.2))  # fmt: skip


async def test_a_turn_writes_meta_tokens_and_done(producer: Producer, redis: RedisCluster) -> None:
    s = producer.session(_sid())
    claims = verify_token(SECRET, s.token(), s.id, time.time())
    assert claims.session == s.id
    turn = await s.start_turn("hi", meta={"model": "mine"})
    for piece in ["Hel", "lo ", "wör", "ld"]:
        turn.write(piece)
    at = await turn.done(finish_reason="stop")
    frames = await _frames(redis, s.id)
    assert [f.offset for f in frames] == list(range(1, len(frames) + 1))
    assert frames[0].kind == "meta"
    assert frames[0].meta is not None
    assert frames[0].meta["message"] == "hi"
    assert frames[0].meta["model"] == "mine"
    assert frames[0].meta["message_id"] == f"{s.id}-1-user"
    assert frames[-1].kind == "done"
    assert frames[-1].offset == at
    text = "".join(f.text for f in frames if f.kind == "token")
    assert text == "Hello wörld"
    meta = frames[-1].meta or {}
    assert meta["chars"] == len(text)
    assert meta["tokens"] == 4
    assert meta["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert {f.epoch for f in frames} == {turn.epoch}
    assert {f.turn for f in frames} == {1}
    assert await redis.get(f"tr:{{{s.id}}}:lock") is None  # given back
    with pytest.raises(TurnClosed):
        turn.write("more")


async def test_refusals_one_type_per_cause(producer: Producer, redis: RedisCluster) -> None:
    with pytest.raises(InvalidSession, match="session id"):
        producer.session("bad id!")
    s = producer.session(_sid())
    turn = await s.start_turn("x")
    with pytest.raises(TurnBusy):
        await s.claim(retries=0)
    with pytest.raises(FrameTooLarge):
        turn.write("x" * (MAX_DELTA_BYTES + 1))
    # a newer producer opens the session: the old turn is fenced
    await producer.store.open_generation(s.id)
    turn.write("late")
    with pytest.raises(StaleEpoch):
        await turn.done()


async def test_adapters_carry_usage_and_finish_reason(
    producer: Producer, redis: RedisCluster
) -> None:
    async def chunks() -> AsyncIterator[Any]:
        for t in ["a", "b"]:
            yield SimpleNamespace(choices=[SimpleNamespace(index=0, delta=SimpleNamespace(
                content=t), finish_reason=None)], usage=None)  # fmt: skip
        yield SimpleNamespace(choices=[SimpleNamespace(index=0, delta=SimpleNamespace(
            content=None), finish_reason="length")], usage=None)  # fmt: skip
        yield SimpleNamespace(choices=[], usage=SimpleNamespace(
            prompt_tokens=5, completion_tokens=2, total_tokens=7,
            prompt_tokens_details=SimpleNamespace(cached_tokens=3)))  # fmt: skip

    s = producer.session(_sid())
    await pipe_chat_completion(await s.start_turn("q"), chunks())
    done = (await _frames(redis, s.id))[-1]
    assert done.kind == "done"
    assert done.meta is not None
    assert done.meta["finish_reason"] == "length"
    assert done.meta["prompt_tokens"] == 5
    assert done.meta["usage"] == {"prompt_tokens": 5, "completion_tokens": 2,
                                  "total_tokens": 7, "cached_tokens": 3}  # fmt: skip

    async def events() -> AsyncIterator[Any]:
        yield SimpleNamespace(type="response.created", response=None)
        yield SimpleNamespace(type="response.output_text.delta", delta="hey")
        yield SimpleNamespace(type="response.completed", response=SimpleNamespace(
            usage=SimpleNamespace(input_tokens=4, output_tokens=1, total_tokens=5,
                                  input_tokens_details=None)))  # fmt: skip

    await pipe(await s.start_turn("q2"), events())
    frames = await _frames(redis, s.id)
    assert frames[-1].kind == "done"
    assert (frames[-1].meta or {})["usage"]["total_tokens"] == 5
    assert frames[-2].text == "hey"

    async def text() -> AsyncIterator[str]:
        yield "x"
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        await pipe_text(await s.start_turn("q3"), text())
    last = (await _frames(redis, s.id))[-1]
    assert last.kind == "error"
    assert (last.meta or {})["code"] == "producer_error"
    _ = pipe_responses


async def test_a_stop_is_seen_through_the_stop_record(
    producer: Producer, redis: RedisCluster
) -> None:
    s = producer.session(_sid())
    turn = await s.start_turn("go")

    async def forever() -> AsyncIterator[str]:
        while True:
            yield "."
            await asyncio.sleep(0.01)

    task = asyncio.create_task(pipe_text(turn, forever()))
    await asyncio.sleep(0.1)
    verdict = await request_stop(RedisStore(redis), s.id, turn.turn, 600)
    assert verdict.status == "stopping"
    await asyncio.wait_for(task, 5)
    assert turn.stop_reason is StopReason.CANCELLED
    done = (await _frames(redis, s.id))[-1]
    assert done.kind == "done"
    assert (done.meta or {})["finish_reason"] == CANCELLED
    again = await request_stop(RedisStore(redis), s.id, turn.turn, 600)
    assert again.status == "stopped"
    assert again.offset == done.offset


async def test_without_coalescing_one_frame_per_delta(redis: RedisCluster) -> None:
    p = Producer(redis, coalesce=CoalescePolicy(max_tokens=1))
    s = p.session(_sid())
    turn = await s.start_turn()
    for i in range(20):
        turn.write(str(i))
    await turn.done()
    tokens = [f for f in await _frames(redis, s.id) if f.kind == "token"]
    assert len(tokens) == 20
