"""Viewer accounting for a front that reads the store itself (Durable Streams' view of
a session): while its block runs, the session is watched on the hub (presence, its
connection count) like an SSE screen; it takes no frames; it leaves no trace."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from relay.broker.memory import MemoryBroker
from relay.edge.conn.reader import open_reader
from relay.edge.fanout.hub import Hub
from relay.edge.fanout.presence import viewing

SID = "viewed"


@pytest.fixture
async def hub() -> AsyncIterator[Hub]:
    h = Hub(MemoryBroker("unit"), unsubscribe_delay_s=0.05, reap_interval_s=0,
            screens_interval_s=0)  # fmt: skip
    await h.start()
    try:
        yield h
    finally:
        await h.close()


async def test_a_viewer_is_counted_while_it_reads(hub: Hub) -> None:
    broker = hub.broker
    assert isinstance(broker, MemoryBroker)
    assert SID not in broker.presence
    async with viewing(hub, SID) as v:
        assert SID in broker.presence
        assert hub._watched(SID) == 1
        broker.append(SID, "token", "a")  # fed nothing, and nothing breaks
        assert not v.closed
    assert SID not in broker.presence
    assert hub._watched(SID) == 0


async def test_a_viewer_and_a_screen_count_as_two_and_the_last_leaving_ends_presence(
    hub: Hub,
) -> None:
    broker = hub.broker
    assert isinstance(broker, MemoryBroker)
    screen = await open_reader(hub, SID, None)
    async with viewing(hub, SID):
        assert hub._watched(SID) == 2
    assert SID in broker.presence  # the screen still watches
    await screen.close()
    assert SID not in broker.presence
