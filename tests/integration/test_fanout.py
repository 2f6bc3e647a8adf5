"""The fan-out's rules without a server: the real hub and connections on the in-memory
broker (relay.broker.memory), which answers as the Redis scripts do.

What is checked: one subscription per session whatever the number of connections; a
frame lost on the live feed is read back from the backlog once for all of them; a
replay merged with frames that arrive meanwhile; a trimmed backlog's gap; a session
restarted (a new generation) as a reset; a resubscription's repair; a connection that
does not read is cut, after merging; a dead producer's turn reaped once; presence and
the delayed unsubscribe; a live socket written once per read, straight from the
reader. (The same rules against a real Redis Cluster: tests/integration/test_hub.py.)
In real time: the hub's timers and readers run on the loop, hence not in tests/unit.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from bench.relay.micro import CountingTransport
from relay.broker.errors import WatchClosed
from relay.broker.memory import MemoryBroker
from relay.edge.conn.reader import Reader, open_reader
from relay.edge.conn.sse import SseConn
from relay.edge.core.resume import Delivery
from relay.edge.fanout.hub import Hub
from relay.protocol.codes import CloseCode
from relay.protocol.frame import decode

SID = "fanout"


@pytest.fixture
async def broker() -> MemoryBroker:
    return MemoryBroker("unit")


@pytest.fixture
async def hub(broker: MemoryBroker) -> AsyncIterator[Hub]:
    # no screen counts: these tests count frames and writes (the presence frame's rules:
    # tests/integration/test_fanout_controls.py)
    h = Hub(broker, unsubscribe_delay_s=0.05, reap_interval_s=0, screens_interval_s=0)
    await h.start()
    try:
        yield h
    finally:
        await h.close()


async def collect(r: Reader, until: int, within_s: float = 2.0) -> list[Delivery]:
    """Frames of ``r`` until one at offset ``until`` (or later) arrived."""
    out: list[Delivery] = []
    async with asyncio.timeout(within_s):
        while not out or out[-1].offset < until:
            out += await r.next()
    return out


def offsets(ds: list[Delivery]) -> list[int]:
    return [d.offset for d in ds if d.kind not in ("gap", "reset")]


async def test_one_subscription_serves_every_connection_in_order(
    hub: Hub, broker: MemoryBroker
) -> None:
    readers = [await open_reader(hub, SID, None) for _ in range(5)]
    assert broker.subscribed == {SID}
    assert hub.stats()["subscribes"] == 1
    for i in range(10):
        broker.append(SID, text=f"t{i}")
    for r in readers:
        assert offsets(await collect(r, 10)) == list(range(1, 11))


async def test_a_lost_live_frame_is_read_back_once_for_every_connection(
    hub: Hub, broker: MemoryBroker
) -> None:
    readers = [await open_reader(hub, SID, None) for _ in range(4)]
    broker.append(SID)
    for r in readers:
        await collect(r, 1)
    reads = broker.reads
    broker.lose(SID, 2)  # offsets 2 and 3 reach the backlog, not the subscribers
    for _ in range(4):
        broker.append(SID)
    for r in readers:
        assert offsets(await collect(r, 5)) == [2, 3, 4, 5]
    assert broker.reads == reads + 1  # the channel's repair, shared
    assert hub.stats()["repairs"] == 1


async def test_a_replay_merges_with_the_frames_that_arrive_meanwhile(
    hub: Hub, broker: MemoryBroker
) -> None:
    for i in range(50):
        broker.append(SID, text=f"b{i}")
    live = await open_reader(hub, SID, None)  # the channel exists, at offset 50
    r = await open_reader(hub, SID, 20)
    for i in range(10):
        broker.append(SID, text=f"l{i}")
    got = await collect(r, 60)
    assert offsets(got) == list(range(21, 61))  # each once, in order
    assert offsets(await collect(live, 60)) == list(range(51, 61))


async def test_a_resume_past_the_trimmed_backlog_gets_one_gap(
    hub: Hub, broker: MemoryBroker
) -> None:
    for _ in range(30):
        broker.append(SID)
    broker.trim(SID, first=21)
    r = await open_reader(hub, SID, 5)
    got = await collect(r, 30)
    assert [d.kind for d in got[:1]] == ["gap"]
    gap = decode(got[0].data)
    assert gap.meta is not None
    assert (gap.meta["from"], gap.meta["to"]) == (6, 20)
    assert offsets(got) == list(range(21, 31))


async def test_a_restarted_session_is_a_reset_then_offsets_from_one(
    hub: Hub, broker: MemoryBroker
) -> None:
    r = await open_reader(hub, SID, None)
    broker.append(SID)
    broker.append(SID)
    await collect(r, 2)
    broker.restart(SID)  # the keys expired: a new generation
    broker.append(SID, text="new")
    got: list[Delivery] = []
    async with asyncio.timeout(2):
        while not any(d.kind == "token" and d.offset == 1 for d in got):
            got += await r.next()
    assert [d.kind for d in got] == ["reset", "token"]


async def test_a_resubscription_repairs_what_the_switch_lost(
    hub: Hub, broker: MemoryBroker
) -> None:
    r = await open_reader(hub, SID, None)
    broker.append(SID)
    await collect(r, 1)
    broker.lose(SID, 3)  # a failover: three frames never reached this relay
    for _ in range(3):
        broker.append(SID)
    await asyncio.sleep(0.05)
    assert r.pending == 0  # nothing arrived, and no later frame revealed the hole
    broker.resubscribed([SID])
    assert offsets(await collect(r, 4)) == [2, 3, 4]


async def test_a_connection_that_does_not_read_is_merged_then_cut(broker: MemoryBroker) -> None:
    hub = Hub(broker, queue_frames=20, hard_limit_frames=60, reap_interval_s=0)
    await hub.start()
    try:
        slow = await open_reader(hub, SID, None)
        fast = await open_reader(hub, SID, None)
        broker.open_turn(SID)
        for turn in range(1, 120):  # a turn per frame: nothing merges past the first runs
            broker.append(SID, text="x", turn=turn if turn > 40 else 1)
            await asyncio.sleep(0)
            await fast.next()
        assert slow.watch.closed is not None
        assert slow.watch.closed.code is CloseCode.SLOW_CONSUMER
        with pytest.raises(WatchClosed):
            await slow.next()
        assert hub.stats()["conflations"] >= 1
        assert hub.stats()["slow_disconnects"] == 1
    finally:
        await hub.close()


async def test_a_dead_producers_turn_is_reaped_once_and_a_live_ones_not(
    broker: MemoryBroker,
) -> None:
    hub = Hub(broker, reap_after_s=0.05, reap_interval_s=0.02)
    await hub.start()
    try:
        r = await open_reader(hub, SID, None)
        broker.open_turn(SID)  # its producer holds the lock
        broker.append(SID, text="half")
        await collect(r, 1)
        await asyncio.sleep(0.2)
        assert r.pending == 0  # silent, but locked: not reaped
        broker.unlock(SID)  # the producer died: its lock expired
        got = await collect(r, 2)
        assert [d.kind for d in got] == ["error"]
        assert decode(got[0].data).meta == {"code": "worker_lost", "reaped_by": "unit",
                                           "gen": broker.sessions[SID].gen}  # fmt: skip
        await asyncio.sleep(0.2)
        assert r.pending == 0  # once
        assert hub.stats()["reaped"] == 1
    finally:
        await hub.close()


async def test_presence_follows_the_first_and_last_connection_and_the_channel_lingers(
    hub: Hub, broker: MemoryBroker
) -> None:
    a = await open_reader(hub, SID, None)
    b = await open_reader(hub, SID, None)
    assert broker.presence == {SID}
    await a.close()
    assert broker.presence == {SID}
    await b.close()
    assert broker.presence == set()
    assert broker.subscribed == {SID}  # for unsubscribe_delay_s, in case one comes back
    await asyncio.sleep(0.15)
    assert broker.subscribed == set()
    assert hub.stats()["channels"] == 0


async def test_a_live_socket_is_written_once_per_read_straight_from_the_reader(
    hub: Hub, broker: MemoryBroker
) -> None:
    conn = SseConn(hub, SID, None)
    await hub.open(conn)
    t = CountingTransport()  # a socket that takes every write (bench.relay.micro's)
    conn.attach(cast(Any, t))
    broker.append(SID, text="a")
    await asyncio.sleep(0)
    hub._on_message([  # one read of two frames (what the broker's reader hands over)
        [b"smessage", broker.channel(SID), broker.sessions[SID].log[0][1]],  # a duplicate
    ])  # fmt: skip
    broker.append(SID, text="b")
    await asyncio.sleep(0)
    assert t.writes == 2  # one per read, the duplicate dropped by the channel
    assert t.bytes > 0
    assert hub.stats()["writes_direct"] == 2
    assert conn.watch.live
    assert conn.watch.resume is None  # caught up: the resume is gone
    assert conn.watch.last == 2
