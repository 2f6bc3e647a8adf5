"""A session whose keys expired and restarted: a new generation id, fencing of the old
producer, and readers told with an explicit ``reset`` frame instead of dropping the new
frames as duplicates. Pure resume rules first, then the real cluster through a hub."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from redis.asyncio.cluster import RedisCluster

from relay.edge.hub import Hub
from relay.edge.resume import Delivery, Fetch, Resume, ResumeState
from relay.protocol.frame import decode
from relay.protocol.keys import KeyKind, key, log_key, meta_key, new_session_id
from relay.redisio.errors import Fenced
from relay.redisio.publisher import Publisher, read_backlog, seal


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


@pytest.mark.integration
async def test_keys_expire_a_new_generation_fences_the_old_and_watchers_get_a_reset(
    redis: RedisCluster,
) -> None:
    pub = Publisher(redis, ttl_s=600)
    sid = new_session_id()
    hub = Hub(redis, relay_id="reset-test", reap_interval_s=0)
    await hub.start()
    try:
        old = await pub.open_generation(sid)
        assert old.gen
        assert (await redis.hget(meta_key(sid), "gen")) == old.gen.encode()
        for t in ("a", "b", "c"):
            await old.token(t)
        w = await hub.watch(sid, 0)
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
