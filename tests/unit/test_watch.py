"""The pure watch, driven with plain values: replay page by page as the queue drains,
live frames merged in, conflation, the slow-consumer cutoff in frames and in bytes."""

from __future__ import annotations

from collections.abc import Sequence

from relay.edge.core.resume import Delivery, Fetch
from relay.edge.core.watch import Closed, Intent, Limits, Watch
from relay.protocol.codes import CloseCode
from relay.protocol.frame import Frame, decode, encode

SID = "s" * 22


def frame(offset: int, text: str = "t", kind: str = "token", turn: int = 1) -> Delivery:
    f = Frame(session=SID, turn=turn, offset=offset, kind=kind, text=text)  # type: ignore[arg-type]
    return Delivery(offset, kind, encode(f))


def backlog(after: int, last: int, n: int) -> list[Delivery]:
    return [frame(o) for o in range(after + 1, min(after + n, last) + 1)]


def fetches(intents: Sequence[Intent]) -> list[Fetch]:
    return [i for i in intents if isinstance(i, Fetch)]


def covered(ds: list[Delivery]) -> list[int]:
    out: list[int] = []
    for d in ds:
        meta = decode(d.data).meta or {}
        start = int(meta["from"]) if "merged" in meta else d.offset
        out.extend(range(start, d.offset + 1))
    return out


def test_a_long_replay_is_read_page_by_page_as_the_queue_drains() -> None:
    lim = Limits(queue_frames=64, hard_limit_frames=128, page_frames=512)
    assert lim.replay_page_frames == 32  # a page never pushes the queue past queue_frames
    w = Watch(SID, 0, lim)
    last = 10_000
    (f,) = fetches(w.subscribed())
    got: list[Delivery] = []
    reads = 0
    while True:
        assert f.after is not None
        reads += 1
        intents = w.backlog(backlog(f.after, last, lim.replay_page_frames), 1, last)
        assert w.closed is None
        assert w.pending <= lim.queue_frames
        if not fetches(intents):  # held: the queue is at or above low water
            ds, intents = w.take()  # the socket took everything: the next page is asked
            got.extend(ds)
        if not fetches(intents):
            ds, _ = w.take()
            got.extend(ds)
            break
        (f,) = fetches(intents)
    assert [d.offset for d in got] == list(range(1, last + 1))
    assert reads == last // lim.replay_page_frames + (last % lim.replay_page_frames > 0)
    assert w.live  # caught up: the resume is dropped
    assert w.resume is None


def test_the_next_page_is_held_until_the_socket_takes_the_queue() -> None:
    lim = Limits(queue_frames=8, hard_limit_frames=16, page_frames=4)
    w = Watch(SID, 0, lim)
    assert fetches(w.subscribed()) == [Fetch(0)]
    assert fetches(w.backlog(backlog(0, 100, 4), 1, 100)) == []  # 4 pending = low water
    ds, intents = w.take()
    assert [d.offset for d in ds] == [1, 2, 3, 4]
    assert fetches(intents) == [Fetch(4)]
    assert w.take() == ([], ())  # asked once


def test_live_frames_during_a_replay_wait_and_come_after_it_in_order() -> None:
    lim = Limits(queue_frames=8, hard_limit_frames=16, page_frames=4)
    w = Watch(SID, 0, lim)
    w.subscribed()
    assert not w.offer([frame(11), frame(12)])  # replaying: stashed, no intent
    got: list[Delivery] = []
    intents: Sequence[Intent] = w.backlog(backlog(0, 10, 4), 1, 10)
    while True:
        if not fetches(intents):
            ds, intents = w.take()
            got.extend(ds)
            if not fetches(intents):
                break
        (f,) = fetches(intents)
        assert f.after is not None
        intents = w.backlog(backlog(f.after, 10, 4), 1, 10)
    assert [d.offset for d in got] == list(range(1, 13))
    w.offer([frame(13)])
    assert [d.offset for d in w.take()[0]] == [13]


def test_a_live_consumer_that_does_not_take_gets_merged_frames_then_is_cut() -> None:
    lim = Limits(queue_frames=10, hard_limit_frames=20)
    counters: dict[str, int] = {}
    w = Watch(SID, None, lim, counters)
    w.subscribed()
    w.backlog([], 1, 0)
    for o in range(1, 101):  # tokens of one turn merge
        assert not w.offer([frame(o, f"w{o} ")])
    ds, _ = w.take()
    assert len(ds) < 100
    assert covered(ds) == list(range(1, 101))
    assert "".join(decode(d.data).text for d in ds) == "".join(f"w{o} " for o in range(1, 101))
    assert counters["conflations"] >= 1
    out: Sequence[Intent] = []
    for o in range(101, 130):  # one turn each: nothing merges
        out = w.offer([frame(o, turn=o)])
        if out:
            break
    assert out == [Closed(CloseCode.SLOW_CONSUMER, "more than 20 frames pending after merging")]
    assert counters["slow_disconnects"] == 1
    assert w.take() == ([], ())


def test_pending_bytes_are_bounded_too() -> None:
    lim = Limits(queue_frames=1000, hard_limit_frames=4000, max_pending_bytes=64 * 1024)
    w = Watch(SID, None, lim)
    w.subscribed()
    w.backlog([], 1, 0)
    big = "x" * 8000
    closed: Sequence[Intent] = []
    for o in range(1, 20):
        closed = w.offer([frame(o, big, kind="meta", turn=o)])
        if closed:
            break
    assert closed
    assert isinstance(closed[0], Closed)
    assert closed[0].code == "slow_consumer"
    assert "bytes" in closed[0].reason
    assert o == 9  # 8 frames of ~8 KB fit in 64 KiB, the 9th does not


def test_close_is_an_intent_once() -> None:
    w = Watch(SID, None, Limits())
    assert w.close(CloseCode.CLOSED, "bye") == (Closed(CloseCode.CLOSED, "bye"),)
    assert w.close(CloseCode.CLOSED, "bye") == ()
    assert w.offer([frame(1)]) == ()
