"""The chat controls' rules on the relay, without a server: the real hub and connections
on the in-memory broker (relay.broker.memory), which answers as the Redis scripts do.

What is checked: a deleted session's streams end with its notice, then the close (SSE,
WebSocket, the UI stream, a reader), its channel goes at once, and a new stream of it is
refused (live and resumed); the presence frame (the count over relays, debounced, what a
late joiner gets, outside the order, its SSE event without an id, skipped by the UI
stream); a compacted join (finished turns as three frames across replay pages, the
running turn and the live frames as they are, the UI stream's reply so far as one
delta). (The same against a real Redis Cluster, through the HTTP streams:
tests/integration/test_relay_controls.py.) In real time: the presence's debounce and the
streams' ends run on the loop's timers, hence not in tests/unit.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from relay.broker.errors import SessionDeleted, WatchClosed
from relay.broker.memory import MemoryBroker
from relay.edge.conn.base import Conn
from relay.edge.conn.reader import Reader, open_reader
from relay.edge.conn.sse import SseConn
from relay.edge.conn.ws import WsConn
from relay.edge.core.resume import Delivery
from relay.edge.fanout.hub import Hub
from relay.edge.fanout.notices import BATCH
from relay.fronts.aisdk.conn import UiConn
from relay.protocol.codes import CloseCode, WsClose
from relay.protocol.frame import decode, first_offset

SID = "controls"


class Recorder:
    """A transport that keeps every byte written, and whether it was closed."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0


@pytest.fixture
async def broker() -> MemoryBroker:
    return MemoryBroker("unit")


@pytest.fixture
async def hub(broker: MemoryBroker) -> AsyncIterator[Hub]:
    h = Hub(broker, unsubscribe_delay_s=0.05, reap_interval_s=0)
    await h.start()
    try:
        yield h
    finally:
        await h.close()


async def collect(r: Reader, until: int, within_s: float = 2.0) -> list[Delivery]:
    """Frames of ``r`` until one at offset ``until`` (or later) arrived."""
    out: list[Delivery] = []
    async with asyncio.timeout(within_s):
        while not out or max(d.offset for d in out) < until:
            out += await r.next()
    return out


async def attached(conn: Conn, hub: Hub) -> Recorder:
    await hub.open(conn)
    t = Recorder()
    conn.attach(cast(Any, t))
    return t


def ws_messages(data: bytes) -> list[tuple[int, bytes]]:
    """The server's unmasked WebSocket frames in ``data``: (first byte, payload)."""
    out: list[tuple[int, bytes]] = []
    while data:
        n, at = data[1], 2
        if n == 126:
            n, at = int.from_bytes(data[2:4], "big"), 4
        out.append((data[0], data[at : at + n]))
        data = data[at + n :]
    return out


async def until_closed(t: Recorder, within_s: float = 2.0) -> None:
    async with asyncio.timeout(within_s):
        while not t.closed:
            await asyncio.sleep(0.005)


# -- a deleted session ---------------------------------------------------------------


async def test_a_deleted_sessions_reader_gets_the_notice_then_the_close(
    hub: Hub, broker: MemoryBroker
) -> None:
    readers = [await open_reader(hub, SID, None) for _ in range(3)]
    broker.append(SID, text="a")
    for r in readers:
        await collect(r, 1)
    broker.delete(SID)
    for r in readers:
        last = await r.next()
        notice = decode(last[0].data)
        assert (notice.kind, notice.offset, notice.meta) == (
            "reset", 0, {"code": "session_deleted"}
        )  # fmt: skip
        with pytest.raises(WatchClosed) as closed:
            await r.next()
        assert closed.value.code is CloseCode.SESSION_DELETED
    assert broker.subscribed == set()  # at once, no linger: the next stream reads again
    assert broker.presence == set()
    assert hub.stats()["channels"] == 0
    assert hub.stats()["deleted"] == 1


@pytest.mark.parametrize("offset", [None, 0, 3])
async def test_a_new_stream_of_a_deleted_session_is_refused(
    hub: Hub, broker: MemoryBroker, offset: int | None
) -> None:
    for _ in range(3):
        broker.append(SID)
    broker.delete(SID)
    with pytest.raises(SessionDeleted):
        await open_reader(hub, SID, offset)
    assert hub.stats()["channels"] == 0
    assert broker.presence == set()


async def test_a_stream_that_joins_a_watched_session_after_a_lost_notice_is_refused(
    hub: Hub, broker: MemoryBroker
) -> None:
    r = await open_reader(hub, SID, None)
    broker.append(SID)
    await collect(r, 1)
    broker.unsubscribe(SID)  # the notice is lost on its way (a dropped connection)
    broker.delete(SID)
    broker.subscribed.add(SID)
    with pytest.raises(SessionDeleted):  # its own first read finds the tombstone
        await open_reader(hub, SID, None)
    notice = await r.next()  # and the read ended the session's other streams here too
    assert decode(notice[0].data).meta == {"code": "session_deleted"}
    with pytest.raises(WatchClosed):
        await r.next()


async def test_a_deleted_sessions_sse_stream_ends_with_the_notice_and_the_close_comment(
    hub: Hub, broker: MemoryBroker
) -> None:
    conn = SseConn(hub, SID, None)
    t = await attached(conn, hub)
    broker.append(SID, text="a")
    await asyncio.sleep(0.01)
    broker.delete(SID)
    await until_closed(t)
    text = bytes(t.data).decode()
    events = [e for e in text.split("\n\n") if not e.startswith("event: presence")]
    assert events[0].startswith("id: 1\nevent: token\n")
    assert events[1].startswith("id: 0\nevent: reset\ndata: ")
    assert json.loads(events[1].split("data: ", 1)[1])["meta"]["code"] == "session_deleted"
    assert events[2] == "retry: 1000\n: close session_deleted the session was deleted"
    assert conn.stop == (CloseCode.SESSION_DELETED, "the session was deleted")


async def test_a_deleted_sessions_websocket_gets_the_notice_then_close_4410(
    hub: Hub, broker: MemoryBroker
) -> None:
    conn = WsConn(hub, SID, None)
    t = await attached(conn, hub)
    broker.delete(SID)
    async with asyncio.timeout(2):
        while b"\x88" not in t.data:  # a close frame
            await asyncio.sleep(0.005)
    msgs = [m for m in ws_messages(bytes(t.data)) if b'"kind":"presence"' not in m[1]]
    (op, text), (op_close, close) = msgs
    assert op == 0x81  # the notice: one text message
    notice = json.loads(text)
    assert notice["kind"] == "reset"
    assert notice["meta"] == {"code": "session_deleted"}
    assert op_close == 0x88
    assert int.from_bytes(close[:2], "big") == WsClose.SESSION_DELETED
    assert int(WsClose.SESSION_DELETED) == 4410
    assert close[2:] == b"the session was deleted"
    conn.connection_lost(None)  # the client's close never comes here: let the wait end


async def test_a_deleted_sessions_ui_stream_ends_with_an_error_part(
    hub: Hub, broker: MemoryBroker
) -> None:
    turn = broker.open_turn(SID)
    broker.append(SID, "meta")
    broker.append(SID, text="Hel")
    conn = UiConn(hub, SID, turn, 0)
    t = await attached(conn, hub)
    await asyncio.sleep(0.01)
    broker.delete(SID)
    await until_closed(t)
    parts = [p for p in bytes(t.data).decode().split("\n\n") if p.startswith("data: ")]
    assert parts[-1] == "data: [DONE]"
    error, finish = (json.loads(p[6:]) for p in parts[-3:-1])
    assert error == {"type": "error", "errorText": "the session was deleted"}
    assert finish == {"type": "finish", "finishReason": "error"}


# -- the presence frame ----------------------------------------------------------------


@pytest.fixture
async def quick(broker: MemoryBroker) -> AsyncIterator[Hub]:
    """A hub that writes a session's screen count at most every 0.1 s."""
    h = Hub(broker, unsubscribe_delay_s=0.05, reap_interval_s=0, screens_interval_s=0.1)
    await h.start()
    try:
        yield h
    finally:
        await h.close()


def screens(ds: list[Delivery]) -> list[int]:
    """The counts of the presence frames among ``ds``, in order."""
    return [decode(d.data).meta["screens"] for d in ds if d.kind == "presence"]  # type: ignore[index]


async def count_is(r: Reader, n: int, within_s: float = 2.0) -> list[Delivery]:
    """Read ``r`` until a presence frame says ``n`` screens; what was read."""
    out: list[Delivery] = []
    async with asyncio.timeout(within_s):
        while not screens(out) or screens(out)[-1] != n:
            out += await r.next()
    return out


async def test_every_screen_learns_the_count_and_it_follows_joins_and_leaves(
    quick: Hub, broker: MemoryBroker
) -> None:
    a = await open_reader(quick, SID, None, notices=True)
    await count_is(a, 1)
    b = await open_reader(quick, SID, None, notices=True)
    await count_is(a, 2)
    await count_is(b, 2)
    await b.close()
    await count_is(a, 1)
    assert broker.screen_counts[SID] == {"unit": 1}
    await a.close()
    async with asyncio.timeout(2):  # the last one gone: this relay's field goes too
        while broker.screen_counts[SID]:
            await asyncio.sleep(0.01)


async def test_a_burst_of_screens_is_one_or_two_writes_not_one_each(
    quick: Hub, broker: MemoryBroker
) -> None:
    first = await open_reader(quick, SID, None, notices=True)
    readers = [await open_reader(quick, SID, None, notices=True) for _ in range(19)]
    await count_is(first, 20)
    await asyncio.sleep(0.3)
    assert broker.screen_writes <= 3  # the first at once, then at most one per interval
    for r in readers:
        await r.close()
    await count_is(first, 1)
    assert broker.screen_writes <= 5


async def test_a_screen_that_drops_and_comes_back_within_the_settle_time_writes_nothing(
    broker: MemoryBroker,
) -> None:
    hub = Hub(broker, reap_interval_s=0, screens_interval_s=0.4)  # settles in 0.2 s
    await hub.start()
    try:
        a = await open_reader(hub, SID, None, notices=True)
        b = await open_reader(hub, SID, None, notices=True)
        await count_is(a, 2)
        writes = broker.screen_writes
        await b.close()  # a reconnect: gone, and back well within the settle time
        b = await open_reader(hub, SID, None, notices=True)
        await asyncio.sleep(1.0)  # past the settle time and the interval
        assert broker.screen_writes == writes  # the count never moved: nothing written
        await b.close()  # a real leave is written, once settled
        await count_is(a, 1)
        assert broker.screen_writes == writes + 1
    finally:
        await hub.close()


async def test_the_counts_of_many_sessions_due_together_go_in_one_call(
    broker: MemoryBroker,
) -> None:
    hub = Hub(broker, reap_interval_s=0, screens_interval_s=0.1)
    await hub.start()
    try:
        sids = [f"s{i:02d}" for i in range(2 * BATCH + 5)]
        readers = await asyncio.gather(*(open_reader(hub, s, None, notices=True) for s in sids))
        for r in readers:
            await count_is(r, 1)
        assert broker.screen_writes == len(sids)
        assert broker.screen_calls <= 6, (
            broker.screen_calls
        )  # batches of BATCH, a tick or two apart
    finally:
        await hub.close()


async def test_a_screen_that_joins_late_gets_the_count_at_once(broker: MemoryBroker) -> None:
    hub = Hub(broker, reap_interval_s=0, screens_interval_s=30)  # the next write is far off
    await hub.start()
    try:
        a = await open_reader(hub, SID, None, notices=True)
        await count_is(a, 1)
        late = await open_reader(hub, SID, None, notices=True)
        got = await late.next()  # no write happened since: the count this relay knows
        assert screens(got) == [1]
        assert broker.screen_writes == 1
    finally:
        await hub.close()


async def _written(broker: MemoryBroker, writes: int) -> None:
    """Until the hub has written ``writes`` screen counts (each once settled), 5 s at most."""
    async with asyncio.timeout(5):
        while broker.screen_writes < writes:
            await asyncio.sleep(0.01)


async def test_presence_frames_are_outside_the_order(quick: Hub, broker: MemoryBroker) -> None:
    r = await open_reader(quick, SID, None, notices=True)
    seen: list[Delivery] = []
    for i in range(30):
        broker.append(SID, text=f"t{i}")
        if i % 10 == 0:  # the count moves meanwhile: up, written once settled, then down
            writes = broker.screen_writes
            other = await open_reader(quick, SID, None)
            await _written(broker, writes + 1)  # a fixed sleep lost to a loaded machine
            await other.close()
            await _written(broker, writes + 2)
        seen += await r.next()
    async with asyncio.timeout(2):
        while max(d.offset for d in seen) < 30:
            seen += await r.next()
    frames = [d for d in seen if d.kind != "presence"]
    assert [d.offset for d in frames] == list(range(1, 31))  # no hole, no duplicate
    assert len(screens(seen)) >= 3
    assert all(d.offset == 0 for d in seen if d.kind == "presence")
    assert r.watch.last == 30  # the resume point is the frames', whatever came between
    assert quick.stats()["gaps"] == 0


async def test_other_relays_count_while_their_presence_lives(
    quick: Hub, broker: MemoryBroker
) -> None:
    broker.peer(SID, "edge-b", 3)
    a = await open_reader(quick, SID, None, notices=True)
    await count_is(a, 4)  # this relay's 1, and edge-b's 3
    broker.expire(SID, "edge-b")  # edge-b died: its entry expired, its count goes
    await count_is(a, 1)
    broker.peer(SID, "edge-c", 2)
    broker.live_peers[SID].discard("edge-c")  # a field whose relay has no live entry
    b = await open_reader(quick, SID, None, notices=True)
    await count_is(b, 2)  # edge-c's 2 does not count, and is dropped
    assert broker.screen_counts[SID] == {"unit": 2}


async def test_the_sse_presence_event_has_no_id_and_the_ui_stream_skips_it(
    quick: Hub, broker: MemoryBroker
) -> None:
    conn = SseConn(quick, SID, None)
    t = await attached(conn, quick)
    broker.open_turn(SID)
    broker.append(SID, "meta")
    ui = UiConn(quick, SID, 1, 0)
    tu = await attached(ui, quick)
    async with asyncio.timeout(2):
        while b'"screens":2' not in t.data:
            await asyncio.sleep(0.01)
    events = bytes(t.data).decode().split("\n\n")
    presence = [e for e in events if "event: presence" in e]
    assert presence
    assert all(e.startswith("event: presence\ndata: {") for e in presence)  # no id: line
    assert b"presence" not in tu.data


async def test_a_closing_relay_takes_its_count_back(broker: MemoryBroker) -> None:
    hub = Hub(broker, reap_interval_s=0, screens_interval_s=0.05)
    await hub.start()
    r = await open_reader(hub, SID, None, notices=True)
    await count_is(r, 1)
    await hub.close()
    assert broker.screen_counts[SID] == {}


async def test_a_deleted_session_gets_no_count_written(quick: Hub, broker: MemoryBroker) -> None:
    r = await open_reader(quick, SID, None, notices=True)
    await count_is(r, 1)
    broker.delete(SID)
    writes = broker.screen_writes
    await asyncio.sleep(0.3)
    assert broker.screen_writes == writes
    assert SID not in broker.screen_counts


# -- a compacted join ------------------------------------------------------------------


def long_session(broker: MemoryBroker, turns: int, tokens: int) -> str:
    """``turns`` finished turns of ``tokens`` token frames, then a running one of 3; the
    reply texts, all turns joined."""
    texts = []
    for _ in range(turns + 1):
        t = broker.open_turn(SID)
        broker.append(SID, "meta")
        n = tokens if t <= turns else 3
        for i in range(n):
            broker.append(SID, text=f"{t}.{i} ")
            texts.append(f"{t}.{i} ")
        if t <= turns:
            broker.append(SID, "done")
    return "".join(texts)


@pytest.mark.parametrize("page", [512, 7])  # one page; turns cut by page ends
async def test_a_compacted_join_gets_three_frames_per_finished_turn(
    broker: MemoryBroker, page: int
) -> None:
    hub = Hub(broker, reap_interval_s=0, backlog_page=page, screens_interval_s=0)
    await hub.start()
    try:
        text = long_session(broker, 40, 12)
        last = broker.sessions[SID].offset
        r = Reader(hub, SID, 0, compact=True)
        await hub.open(r)
        got = await collect(r, last)
        finished = got[: 40 * 3]
        assert [d.kind for d in finished] == ["meta", "token", "done"] * 40
        assert [d.kind for d in got[40 * 3 :]] == ["meta", "token", "token", "token"]
        assert [d.offset for d in got[-3:]] == [last - 2, last - 1, last]  # frame by frame
        prev = 0
        for d in got:  # continuous for a client: each frame starts right after the last
            f = decode(d.data)
            assert first_offset(f) == prev + 1
            prev = f.offset
        assert "".join(decode(d.data).text for d in got if d.kind == "token") == text
        assert hub.stats()["compacted"] == 40 * 11
        broker.append(SID, text="live1")  # live frames are never merged
        broker.append(SID, text="live2")
        live = await collect(r, last + 2)
        assert [(d.offset, decode(d.data).meta) for d in live] == [
            (last + 1, {"gen": broker.sessions[SID].gen}),
            (last + 2, {"gen": broker.sessions[SID].gen}),
        ]
    finally:
        await hub.close()


async def test_a_full_join_is_every_frame(hub: Hub, broker: MemoryBroker) -> None:
    long_session(broker, 5, 12)
    last = broker.sessions[SID].offset
    r = await open_reader(hub, SID, 0)
    assert [d.offset for d in await collect(r, last)] == list(range(1, last + 1))


async def test_a_compacted_ui_stream_gets_the_reply_so_far_as_one_delta(
    hub: Hub, broker: MemoryBroker
) -> None:
    long_session(broker, 2, 5)  # turn 3 runs, 3 tokens in
    after = broker.sessions[SID].offset - 4  # right before turn 3's meta
    conn = UiConn(hub, SID, 3, after, compact=True)
    t = await attached(conn, hub)
    async with asyncio.timeout(2):
        while b"text-delta" not in t.data:
            await asyncio.sleep(0.01)
    broker.append(SID, text="live")
    broker.append(SID, "done")
    await until_closed(t)
    parts = [json.loads(p[6:]) for p in bytes(t.data).decode().split("\n\n")
             if p.startswith("data: {")]  # fmt: skip
    deltas = [p["delta"] for p in parts if p["type"] == "text-delta"]
    assert deltas == ["3.0 3.1 3.2 ", "live"]
    assert parts[-1]["type"] == "finish"
