"""A session whose keys expired and restarted: a new generation id, fencing of the old
producer, and readers told with an explicit ``reset`` frame instead of dropping the new
frames as duplicates. Pure resume rules first, then the real cluster through a hub."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from redis.asyncio.cluster import RedisCluster

from relay.broker.errors import Fenced
from relay.broker.rediscluster.broker import RedisBroker
from relay.broker.rediscluster.publisher import Publisher, read_backlog, seal
from relay.edge.conn.reader import open_reader
from relay.edge.core.resume import Delivery, Fetch, Resume, ResumeState
from relay.edge.fanout.hub import Hub
from relay.protocol.frame import decode
from relay.protocol.keys import KeyKind, key, log_key, meta_key, new_session_id


def g(off: int, gen: str, kind: str = "token") -> Delivery:
    return Delivery(off, kind, b"{}", gen=gen)


def test_a_frame_of_a_new_generation_resets_the_reader_instead_of_being_dropped() -> None:
    r = Resume("s", 0)
    r.subscribed()
    r.backlog([g(1, "A"), g(2, "A"), g(3, "A")], first_available=1, last_offset=3)
    assert r.state is ResumeState.LIVE
    assert r.live(g(3, "A")).emit == []  # same generation: a duplicate
    step = r.live(g(1, "B"))  # the keys expired; the new generation starts at 1
    assert [(x.kind, x.offset) for x in step.emit] == [("reset", 0), ("token", 1)]
    meta = orjson.loads(step.emit[0].data)["meta"]
    assert meta == {"gen": "B", "previous_gen": "A", "code": "session_reset"}
    assert (r.last, r.gen, r.resets) == (1, "B", 1)
    assert [x.offset for x in r.live(g(2, "B")).emit] == [2]


def test_a_new_generation_seen_mid_stream_is_read_from_its_start() -> None:
    r = Resume("s", 0)
    r.subscribed()
    r.backlog([g(1, "A"), g(2, "A")], first_available=1, last_offset=2)
    step = r.live(g(3, "B"))  # frames 1..2 of B were missed
    assert [x.kind for x in step.emit] == ["reset"]
    assert step.fetch == Fetch(0)
    step = r.backlog([g(1, "B"), g(2, "B"), g(3, "B")], first_available=1, last_offset=3)
    assert [x.offset for x in step.emit] == [1, 2, 3]


def test_a_backlog_read_across_a_restart_starts_over_and_an_upstream_reset_passes_on() -> None:
    r = Resume("s", 0)
    r.subscribed()
    r.backlog([g(1, "A"), g(2, "A")], first_available=1, last_offset=2)
    r.repair()
    step = r.backlog([g(3, "B")], first_available=1, last_offset=3)
    assert [x.kind for x in step.emit] == ["reset"]
    assert step.fetch == Fetch(0)
    watcher = Resume("s", 0)
    watcher.subscribed()
    watcher.backlog([g(1, "A"), g(2, "A")], first_available=1, last_offset=2)
    out = watcher.live(step.emit[0]).emit  # the channel's reset, then its frames
    assert [x.kind for x in out] == ["reset"]
    assert [x.offset for x in watcher.live(g(1, "B")).emit] == [1]


def kinds(step_emit: list[Delivery]) -> list[tuple[str, int]]:
    return [(x.kind, x.offset) for x in step_emit]


def test_a_reader_of_another_generation_is_reset_and_read_from_1_whatever_its_offset() -> None:
    for after in (3, 9, 0):  # an offset the new generation reached, one it did not, 0
        r = Resume("s", after, gen="A")
        assert r.subscribed().fetch == Fetch(after)
        step = r.backlog([g(4, "B")] if after == 3 else [], 1, 4, "B")
        assert kinds(step.emit) == [("reset", 0)]
        assert orjson.loads(step.emit[0].data)["meta"] == {
            "gen": "B", "previous_gen": "A", "code": "session_reset"
        }  # fmt: skip
        assert step.fetch == Fetch(0)
        step = r.backlog([g(i, "B") for i in range(1, 5)], 1, 4, "B")
        assert kinds(step.emit) == [("token", i) for i in range(1, 5)]
        assert (r.state, r.last, r.gen, r.resets) == (ResumeState.LIVE, 4, "B", 1)


def test_the_same_generation_past_its_end_is_live_from_now_and_none_now_resets_on_next() -> None:
    r = Resume("s", 9, gen="A")
    r.subscribed()
    assert r.backlog([], 1, 4, "A").emit == []  # a failover lost offsets 5..9: live from 4
    assert (r.state, r.last) == (ResumeState.LIVE, 4)
    assert kinds(r.live(g(5, "A")).emit) == [("token", 5)]
    r = Resume("s", 5, gen="A")  # the session has no generation now (keys expired)
    r.subscribed()
    assert r.backlog([], 1, 0, "").emit == []
    assert (r.state, r.last) == (ResumeState.LIVE, 0)
    step = r.live(g(1, "B"))  # the first frame of a new generation
    assert kinds(step.emit) == [("reset", 0), ("token", 1)]
    assert orjson.loads(step.emit[0].data)["meta"]["previous_gen"] == "A"


def test_a_read_answered_after_a_reset_is_read_again_not_taken_as_another_restart() -> None:
    r = Resume("s", 0, gen="A")
    r.subscribed()  # the read of generation A is in flight
    step = r.live(g(1, "B"))
    assert kinds(step.emit) == [("reset", 0)]
    step = r.backlog([g(1, "A"), g(2, "A")], 1, 2, "A")  # read before the restart
    assert (step.emit, step.fetch) == ([], Fetch(0))
    step = r.backlog([g(1, "B"), g(2, "B")], 1, 2, "B")
    assert kinds(step.emit) == [("token", 1), ("token", 2)]
    assert (r.resets, r.gen) == (1, "B")


def test_a_gap_made_from_a_trimmed_backlog_carries_its_generation() -> None:
    r = Resume("s", 0)
    r.subscribed()
    step = r.backlog([g(5, "A"), g(6, "A")], 5, 6, "A")
    assert kinds(step.emit) == [("gap", 4), ("token", 5), ("token", 6)]
    assert step.emit[0].gen == "A"
    assert orjson.loads(step.emit[0].data)["meta"] == {"from": 1, "to": 4, "gen": "A"}


@pytest.mark.integration
async def test_keys_expire_a_new_generation_fences_the_old_and_watchers_get_a_reset(
    redis: RedisCluster,
) -> None:
    pub = Publisher(redis, ttl_s=600)
    sid = new_session_id()
    hub = Hub(RedisBroker(redis, "reset-test"), reap_interval_s=0)
    await hub.start()
    try:
        old = await pub.open_generation(sid)
        assert old.gen
        assert (await redis.hget(meta_key(sid), "gen")) == old.gen.encode()
        for t in ("a", "b", "c"):
            await old.token(t)
        w = await open_reader(hub, sid, 0)
        got: list[dict[str, object]] = []

        async def take(n: int) -> None:
            async with asyncio.timeout(10):
                while len(got) < n:
                    got.extend(orjson.loads(x.data) for x in await w.next())

        await take(3)
        assert [f["offset"] for f in got] == [1, 2, 3]
        assert all(f["meta"]["gen"] == old.gen for f in got)  # type: ignore[index]
        # the session's keys expire (what ttl_s does after an idle day)
        await redis.delete(meta_key(sid), log_key(sid))
        new = await pub.open_generation(sid)
        assert new.gen != old.gen
        assert new.offset == 0
        with pytest.raises(Fenced):  # the old producer cannot write into the new stream
            await old.token("late")
        await new.token("x")
        await new.token("y")
        await take(6)
        assert [(f["kind"], f["offset"]) for f in got[3:]] == [
            ("reset", 0), ("token", 1), ("token", 2)
        ]  # fmt: skip
        assert got[3]["meta"] == {
            "gen": new.gen, "previous_gen": old.gen, "code": "session_reset"
        }  # fmt: skip
        # a relay that had delivered offset 3 of the old generation must not seal it
        # into the new one
        assert await seal(redis, sid, 3, sealer="reset-test", gen=old.gen) == 0
        frames, _, last = await read_backlog(redis, sid, 0, 100)
        assert last == 2
        assert [decode(f).offset for f in frames] == [1, 2]
        assert await redis.ttl(key(sid, KeyKind.META)) <= 600
    finally:
        await hub.close()
