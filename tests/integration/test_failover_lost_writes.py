"""Writes a failover lost never reach screens silently.

A frame is SPUBLISHed in the script that appends it, before any replica has it. When the
master dies with a session's last frames not yet replicated and their writer is gone
too, the session's next writer (a relay's reaper, or the next turn's ``OPEN``) used to
write other frames at the offsets screens already held: a screen dropped those as
duplicates by offset and kept text Redis no longer had, with no ``gap`` frame. Now the
taker sees that the session's last writes were made in another replication history and
skips past any offset they may have used, with one ``gap`` frame over them.

The test makes the loss deterministic: the replica is frozen (SIGSTOP) and its link cut
on the master (``CLIENT KILL TYPE replica``), so frames written then reach the screen's
subscription and no replica; the master is killed; the replica, resumed, takes over
(``CLUSTER FAILOVER TAKEOVER``). The screen is the client's own rules
(:class:`relay.client.core.Continuity`): every frame it keeps must be the backlog's frame
at that offset, or lie under a ``gap`` frame it was given.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from devstack.cluster.launcher import HOST, LocalCluster
from relay.broker.rediscluster.publisher import Draft, Publisher, read_backlog, reap
from relay.client.core import Continuity
from relay.protocol.frame import Frame, decode
from relay.protocol.keys import live_channel, new_session_id
from relay.protocol.slotmap import slot_of
from tests.conftest import PrivateClusterFactory

pytestmark = pytest.mark.integration


class Screen:
    """One screen of a session: the frames it keeps, by offset, as the client keeps them
    (a frame at an offset it holds is a duplicate and dropped)."""

    def __init__(self) -> None:
        self.rules = Continuity(after=0)
        self.kept: dict[int, Frame] = {}
        self.gaps: list[tuple[int, int]] = []

    def feed(self, data: bytes) -> None:
        f = decode(data)
        deliver, _ = self.rules.accept(f)
        if not deliver:
            return
        if f.kind == "gap":
            m = f.meta or {}
            self.gaps.append((int(m.get("from", f.offset)), int(m.get("to", f.offset))))
        else:
            self.kept[f.offset] = f

    def silently_differs(self, backlog: dict[int, Frame]) -> list[int]:
        """Offsets whose kept frame is not the backlog's, with no gap given over them."""
        return [
            o
            for o, f in sorted(self.kept.items())
            if backlog.get(o) != f and not any(a <= o <= b for a, b in self.gaps)
        ]


async def _listen(port: int, channels: list[str], screens: dict[str, Screen]) -> Any:
    """SSUBSCRIBE on one node; feed each session's screen (a task, cancelled to stop)."""
    conn = aioredis.Redis(host=HOST, port=port)
    ps = conn.pubsub()
    for ch in channels:  # one slot a call
        await ps.ssubscribe(ch)
    by_channel = {live_channel(sid).encode(): s for sid, s in screens.items()}

    async def run() -> None:
        try:
            while True:
                msg = await ps.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if msg is not None and msg["type"] == "smessage":
                    by_channel[msg["channel"]].feed(msg["data"])
        finally:
            await ps.aclose()
            await conn.aclose()

    task = asyncio.create_task(run())
    await asyncio.sleep(0.2)  # subscribed
    return task


async def _synced(master: aioredis.Redis, replica: aioredis.Redis) -> None:
    async with asyncio.timeout(15):
        while True:
            m = (await master.info("replication"))["master_repl_offset"]
            r = (await replica.info("replication")).get("slave_repl_offset", -1)
            if r >= m:
                return
            await asyncio.sleep(0.05)


async def _backlog(redis: RedisCluster, sid: str) -> dict[int, Frame]:
    frames, _, _ = await read_backlog(redis, sid, 0, 100_000)
    return {f.offset: f for f in map(decode, frames)}


async def test_a_taker_after_a_failover_that_lost_frames_skips_them_with_a_gap(
    private_cluster: PrivateClusterFactory,
) -> None:
    local: LocalCluster = await private_cluster(masters=3, replicas=1)
    assert local.info is not None
    shards = await local.shards_now()
    masters = await local.masters_now()
    master = next(iter(shards))
    replica = shards[master][0]
    # two sessions on that master: one a reaper takes over, one the next turn's OPEN
    sids: list[str] = []
    while len(sids) < 2:
        sid = new_session_id()
        if slot_of(live_channel(sid)) in masters[master]:
            sids.append(sid)
    reaped, superseded = sids
    redis = RedisCluster(host=HOST, port=master)
    m = aioredis.Redis(host=HOST, port=master)
    r = aioredis.Redis(host=HOST, port=replica)
    screens = {sid: Screen() for sid in sids}
    listeners = [await _listen(master, [live_channel(s) for s in sids], screens)]
    try:
        pub = Publisher(redis, retry_s=1.0)
        writers = {sid: await pub.open_generation(sid) for sid in sids}
        for g in writers.values():  # replicated: in the replica too
            await g.publish([Draft(kind="meta", meta={"n": 1}), Draft(kind="token", text="kept ")])
        # an ordinary takeover without a failover skips nothing: the next turn supersedes
        # the first at the next offset (and stamps the session with this history)
        base = {sid: (await pub.open_generation(sid)) for sid in sids}
        for sid, g in base.items():
            assert g.offset == writers[sid].offset + 1
            await g.publish([Draft(kind="meta", meta={"n": 2}), Draft(kind="token", text="ok ")])
        await _synced(m, r)
        # the replica stops getting anything: frozen, its link cut on the master's side
        local.pause_node(replica)
        await m.execute_command("CLIENT", "KILL", "TYPE", "replica")
        for g in base.values():  # reach the screens, never the replica
            await g.publish([Draft(kind="token", text=f"lost {i} ") for i in range(5)])
        await asyncio.sleep(0.3)
        lost_end = {sid: base[sid].offset for sid in sids}
        for sid, s in screens.items():
            assert max(s.kept) == lost_end[sid]
        local.kill_node(master)  # and the writers are gone too
        local.resume_node(replica)
        await r.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
        async with asyncio.timeout(20):
            while (await r.execute_command("ROLE"))[0] != b"master":
                await asyncio.sleep(0.1)
        await redis.aclose()
        redis = RedisCluster(host=HOST, port=replica)
        listeners.append(await _listen(replica, [live_channel(s) for s in sids], screens))
        # the takers: a relay's reaper on one session, the next turn on the other
        result = await reap(redis, reaped, reaper="test")
        assert result.status.value == "reaped"
        nxt = await Publisher(redis).open_generation(superseded)
        await nxt.publish([Draft(kind="meta", meta={"n": 3}), Draft(kind="token", text="new")])
        nxt2 = await Publisher(redis).open_generation(reaped)
        await nxt2.publish([Draft(kind="meta", meta={"n": 3}), Draft(kind="token", text="new")])
        await asyncio.sleep(0.5)
        for sid, s in screens.items():
            backlog = await _backlog(redis, sid)
            assert s.silently_differs(backlog) == [], sid
            assert any(a <= lost_end[sid] <= b for a, b in s.gaps), sid  # told, not silence
            gap = next(f for f in backlog.values() if f.kind == "gap")
            assert (gap.meta or {}).get("code") == "lost_in_failover"
            assert max(backlog) == max(s.kept)  # and it went on with the new writer
        # the second turn after the failover is in this history: no skip again
        again = await Publisher(redis).open_generation(superseded)
        assert again.offset == nxt.offset + 1
    finally:
        for t in listeners:
            t.cancel()
        await asyncio.gather(*listeners, return_exceptions=True)
        await redis.aclose()
        await m.aclose()
        await r.aclose()
