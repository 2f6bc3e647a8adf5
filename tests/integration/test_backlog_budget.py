"""A session's backlog is bounded in bytes as well as in frames (lua/backlog.lua), on the
real cluster: the oldest frames go, whole, the newest always stays; the count survives
a lost meta hash; the relays' own frames (reap, seal) keep to it; and a client resuming
from an offset the budget trimmed gets one ``gap`` frame, then every frame held.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import ClusterInfo
from relay.broker.rediscluster.publisher import Draft, Publisher, read_backlog, seal
from relay.protocol.frame import MAX_FRAME_BYTES, decode
from relay.protocol.keys import log_key, meta_key, new_session_id
from tests.support.relay import STEP, running, sse

pytestmark = pytest.mark.integration

BUDGET = MAX_FRAME_BYTES  # the smallest budget a process takes
BIG = 60_000  # characters of one frame's text: four and a bit fit in the budget


Entry = tuple[bytes, dict[bytes, bytes]]


async def _entries(redis: RedisCluster, sid: str) -> list[Entry]:
    """The backlog's entries: (id, fields)."""
    got: Any = await redis.execute_command("XRANGE", log_key(sid), "-", "+")
    return [(bytes(i), dict(fields)) for i, fields in got]


async def _held(redis: RedisCluster, sid: str) -> tuple[list[int], int]:
    """The offsets in the backlog and the bytes of their frames."""
    entries = await _entries(redis, sid)
    offsets = [int(i.split(b"-")[0]) for i, _ in entries]
    return offsets, sum(len(fields[b"f"]) for _, fields in entries)


async def test_the_backlog_keeps_its_newest_frames_within_the_byte_budget(redis: RedisCluster):
    sid = new_session_id()
    gen = await Publisher(redis, max_bytes=BUDGET).open_generation(sid)
    for i in range(12):
        await gen.token(chr(ord("a") + i) * BIG)
    offsets, held = await _held(redis, sid)
    assert held <= BUDGET
    assert held + BIG > BUDGET  # no more was dropped than needed
    assert offsets == list(range(offsets[0], 13))  # the newest, contiguous
    assert offsets[0] > 1
    frames, first, last = await read_backlog(redis, sid, 0, 100)
    assert (first, last) == (offsets[0], 12)
    assert decode(frames[-1]).text == "l" * BIG
    total = int(await redis.hget(meta_key(sid), "bytes") or 0)
    entries = await _entries(redis, sid)
    starts = [int(fields[b"b"]) for _, fields in entries]
    ends = [s + len(fields[b"f"]) for s, (_, fields) in zip(starts, entries, strict=True)]
    assert ends[-1] == total
    assert starts[1:] == ends[:-1]  # each entry starts where the one before it ended
    # a batch larger than the budget keeps its newest frames too
    await gen.publish([Draft(kind="token", text="z" * BIG) for _ in range(6)])
    offsets, held = await _held(redis, sid)
    assert held <= BUDGET
    assert offsets[-1] == 18


async def test_small_frames_are_still_bounded_by_maxlen_and_kept_by_bytes(redis: RedisCluster):
    sid = new_session_id()
    gen = await Publisher(redis, maxlen=100, max_bytes=BUDGET).open_generation(sid)
    await gen.publish([Draft(kind="token", text="x") for _ in range(500)])
    offsets, held = await _held(redis, sid)
    assert held < BUDGET
    assert 100 <= len(offsets) < 500  # MAXLEN ~ trims whole nodes: about 100 stay
    assert offsets[-1] == 500


async def test_a_lost_byte_count_is_recovered_from_the_backlog(redis: RedisCluster):
    """A failover (or an expiry) that loses the meta hash and not the backlog: the next
    write starts its count where the backlog's last entry ends, so the budget holds."""
    sid = new_session_id()
    pub = Publisher(redis, max_bytes=BUDGET)
    gen = await pub.open_generation(sid)
    for _ in range(3):
        await gen.token("q" * BIG)
    before = int(await redis.hget(meta_key(sid), "bytes") or 0)
    await redis.hdel(meta_key(sid), "bytes")
    gen2 = await pub.open_generation(sid)
    for _ in range(4):
        await gen2.token("r" * BIG)
    after = int(await redis.hget(meta_key(sid), "bytes") or 0)
    assert after > before
    _, held = await _held(redis, sid)
    assert held <= BUDGET


async def test_a_seal_writes_within_the_budget(redis: RedisCluster):
    sid = new_session_id()
    gen = await Publisher(redis, max_bytes=BUDGET).open_generation(sid)
    for _ in range(4):
        await gen.token("s" * BIG)
    sealed = await seal(redis, sid, 7, sealer="edge-t", gen=gen.gen, max_bytes=BUDGET)
    assert sealed == 3
    offsets, held = await _held(redis, sid)
    assert held <= BUDGET
    assert offsets[-1] == 7
    entries = await _entries(redis, sid)
    assert json.loads(entries[-1][1][b"f"])["kind"] == "gap"
    assert b"b" in entries[-1][1]


async def test_a_resume_past_the_trimmed_part_gets_a_gap_then_what_is_held(
    cluster: ClusterInfo, redis: RedisCluster
):
    sid = new_session_id()
    gen = await Publisher(redis, max_bytes=BUDGET).open_generation(sid)
    for i in range(10):
        await gen.token(str(i) * BIG)
    offsets, _ = await _held(redis, sid)
    async with (
        running(cluster, backlog_max_bytes=BUDGET) as relay,
        sse(relay, sid, headers={"Last-Event-ID": "0"}) as client,
    ):
        got: list[tuple[str, str, dict[str, Any]]] = []
        async with asyncio.timeout(STEP):
            while len(got) < 1 + len(offsets):
                ev = await client.next_event()
                assert ev is not None
                got.append(ev)
    ident, kind, data = got[0]
    assert kind == "gap"
    assert (data["meta"]["from"], data["meta"]["to"]) == (1, offsets[0] - 1)
    assert int(ident) == offsets[0] - 1
    assert [int(i) for i, _, _ in got[1:]] == offsets
    assert [d["text"][0] for _, _, d in got[1:]] == [str(o - 1) for o in offsets]
