"""The resume merge (pure): backlog + live, each offset exactly once, in order."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.edge.core.resume import (
    TRANSITIONS,
    Delivery,
    Fetch,
    InvalidTransition,
    Resume,
    ResumeState,
)

SID = "s1"


def d(off: int, kind: str = "token") -> Delivery:
    return Delivery(off, kind, f'{{"offset":{off}}}'.encode())


def offsets(ds: list[Delivery]) -> list[int]:
    return [x.offset for x in ds]


def state(r: Resume) -> ResumeState:
    return r.state  # a call, so that mypy does not narrow across events


def backlog(lo: int, hi: int) -> list[Delivery]:
    return [d(i) for i in range(lo, hi + 1)]


def test_resume_from_offset_replays_backlog_then_goes_live() -> None:
    r = Resume(SID, 2)
    step = r.subscribed()
    assert step.fetch == Fetch(2)
    assert state(r) is ResumeState.REPLAYING
    step = r.backlog(backlog(3, 5), first_available=1, last_offset=5)
    assert offsets(step.emit) == [3, 4, 5]
    assert step.fetch is None
    assert state(r) is ResumeState.LIVE
    assert offsets(r.live(d(6)).emit) == [6]


def test_live_frames_during_replay_are_buffered_and_deduplicated() -> None:
    r = Resume(SID, 0)
    assert r.live(d(4)).emit == []  # before the subscription is confirmed
    r.subscribed()
    assert r.live(d(5)).emit == []
    assert r.live(d(4)).emit == []  # duplicate while buffered
    step = r.backlog(backlog(1, 4), first_available=1, last_offset=4)
    assert offsets(step.emit) == [1, 2, 3, 4, 5]
    assert state(r) is ResumeState.LIVE
    assert r.live(d(5)).emit == []
    assert r.duplicates >= 2


def test_live_only_starts_at_current_end() -> None:
    r = Resume(SID, None)
    r.live(d(10))
    step = r.subscribed()
    assert step.fetch == Fetch(None)
    step = r.backlog([], first_available=3, last_offset=9)
    assert offsets(step.emit) == [10]
    assert r.last == 10


def test_hole_in_live_asks_for_repair_instead_of_emitting() -> None:
    r = Resume(SID, 0)
    r.subscribed()
    r.backlog([], first_available=1, last_offset=0)
    assert offsets(r.live(d(1)).emit) == [1]
    step = r.live(d(3))
    assert step.emit == []
    assert step.fetch == Fetch(1)
    assert state(r) is ResumeState.REPLAYING
    assert r.live(d(4)).emit == []  # still repairing: buffered
    step = r.backlog(backlog(2, 4), first_available=1, last_offset=4)
    assert offsets(step.emit) == [2, 3, 4]
    assert state(r) is ResumeState.LIVE


def test_offset_older_than_backlog_gives_explicit_gap_frame() -> None:
    r = Resume(SID, 2)
    r.subscribed()
    step = r.backlog(backlog(8, 10), first_available=8, last_offset=10)
    assert [x.kind for x in step.emit] == ["gap", "token", "token", "token"]
    gap = json.loads(step.emit[0].data)
    assert gap["kind"] == "gap"
    assert gap["meta"] == {"from": 3, "to": 7}
    assert step.emit[0].offset == 7
    assert offsets(step.emit[1:]) == [8, 9, 10]
    assert r.gaps == 1


def test_empty_trimmed_backlog_reports_gap_up_to_last_offset() -> None:
    r = Resume(SID, 0)
    r.subscribed()
    step = r.backlog([], first_available=6, last_offset=5)
    assert [x.kind for x in step.emit] == ["gap"]
    assert json.loads(step.emit[0].data)["meta"] == {"from": 1, "to": 5}


def test_backlog_pages_until_last_offset() -> None:
    r = Resume(SID, 0)
    r.subscribed()
    step = r.backlog(backlog(1, 2), first_available=1, last_offset=5)
    assert offsets(step.emit) == [1, 2]
    assert step.fetch == Fetch(2)
    step = r.backlog(backlog(3, 5), first_available=1, last_offset=5)
    assert offsets(step.emit) == [3, 4, 5]
    assert state(r) is ResumeState.LIVE


def test_reader_ahead_of_session_restarts_at_its_end() -> None:
    r = Resume(SID, 50)
    r.subscribed()
    step = r.backlog([], first_available=1, last_offset=0)
    assert step.emit == []
    assert offsets(r.live(d(1)).emit) == [1]


def test_repair_rereads_after_last_emitted() -> None:
    r = Resume(SID, 0)
    r.subscribed()
    r.backlog(backlog(1, 3), first_available=1, last_offset=3)
    step = r.repair()
    assert step.fetch == Fetch(3)
    step = r.backlog(backlog(4, 6), first_available=1, last_offset=6)
    assert offsets(step.emit) == [4, 5, 6]
    assert state(r) is ResumeState.LIVE


def test_repair_during_fetch_reads_once_more() -> None:
    r = Resume(SID, 0)
    r.subscribed()
    assert r.repair().fetch is None  # one fetch outstanding at most
    step = r.backlog(backlog(1, 2), first_available=1, last_offset=2)
    assert step.fetch == Fetch(2)
    step = r.backlog([], first_available=1, last_offset=2)
    assert state(r) is ResumeState.LIVE


def test_hole_that_backlog_cannot_fill_becomes_gap_after_two_reads() -> None:
    r = Resume(SID, 0)
    r.subscribed()
    r.live(d(5))
    step = r.backlog(backlog(1, 2), first_available=1, last_offset=2)
    assert step.fetch == Fetch(2)
    step = r.backlog([], first_available=1, last_offset=2)
    assert step.fetch == Fetch(2)
    step = r.backlog([], first_available=1, last_offset=2)
    assert [x.kind for x in step.emit] == ["gap", "token"]
    assert r.last == 5


def test_buffer_overflow_forgets_frames_and_reads_them_back() -> None:
    r = Resume(SID, 0, max_buffer=2)
    r.subscribed()
    for i in (1, 2, 3, 4):
        r.live(d(i))
    assert r.overflow == 2
    step = r.backlog([], first_available=1, last_offset=0)
    assert offsets(step.emit) == [1, 2]
    assert step.fetch == Fetch(2)  # 3 and 4 were forgotten: read them back
    step = r.backlog(backlog(3, 4), first_available=1, last_offset=4)
    assert offsets(step.emit) == [3, 4]
    assert state(r) is ResumeState.LIVE


def test_closed_machine_ignores_everything() -> None:
    r = Resume(SID, 0)
    r.close()
    assert r.live(d(1)).emit == []
    assert r.repair().fetch is None
    r.close()
    assert state(r) is ResumeState.CLOSED


def test_backlog_without_fetch_is_a_driver_bug() -> None:
    r = Resume(SID, 0)
    with pytest.raises(InvalidTransition):
        r.backlog([], 1, 0)


def test_transitions_table_covers_the_lifecycle() -> None:
    states = {s for pair in TRANSITIONS for s in (pair[0],)} | set(TRANSITIONS.values())
    assert states == set(ResumeState)


# -- property: any interleaving yields each offset exactly once, in order --------------

ops = st.lists(
    st.tuples(
        st.sampled_from(  # weighted: publishing and racing reads are what matters
            ["publish"] * 3
            + ["deliver"] * 3
            + ["read"] * 2
            + ["answer"] * 2
            + ["dup", "drop", "trim", "repair"]
        ),
        st.integers(0, 1000),
    ),
    max_size=120,
)


@settings(max_examples=1000, deadline=None)
@given(
    ops=ops,
    start=st.one_of(st.none(), st.integers(0, 30)),
    pre=st.integers(0, 20),
    page=st.integers(1, 7),
    max_buffer=st.integers(1, 20),
    sub_at=st.integers(0, 30),
)
def test_any_interleaving_yields_each_offset_once_in_order(
    ops, start, pre, page, max_buffer, sub_at
) -> None:
    server_last = pre  # frames 1..pre exist before the reader arrives
    trimmed = 0  # frames <= trimmed are gone from the backlog
    inflight: list[Delivery] = []
    r = Resume(SID, start, max_buffer=max_buffer)
    fetch: Fetch | None = None
    out: list[Delivery] = []
    subscribed = False
    tail_at: int | None = None

    snapshot: tuple[list[Delivery], int, int] | None = None

    def read() -> tuple[list[Delivery], int, int]:
        """What the backlog says now for the outstanding fetch."""
        nonlocal tail_at
        assert fetch is not None
        first_avail = max(trimmed + 1, 1) if server_last > trimmed else server_last + 1
        if tail_at is None:
            tail_at = server_last  # the session's end at the first read
        if fetch.after is None:
            return [], first_avail, server_last
        lo = max(fetch.after + 1, trimmed + 1)
        return backlog(lo, min(server_last, lo + page - 1)), first_avail, server_last

    def answer() -> None:
        """Deliver the read (taken earlier, or now): live frames may have raced it."""
        nonlocal fetch, snapshot
        entries, first_avail, last = snapshot if snapshot is not None else read()
        fetch, snapshot = None, None
        apply(r.backlog(entries, first_avail, last))

    def apply(step) -> None:
        nonlocal fetch
        out.extend(step.emit)
        if step.fetch is not None:
            assert fetch is None, "two fetches outstanding"
            fetch = step.fetch

    for i, (op, n) in enumerate(ops):
        if not subscribed and i >= sub_at:
            subscribed = True
            apply(r.subscribed())
        if op == "publish":
            server_last += 1
            if subscribed:
                inflight.append(d(server_last))
        elif op in ("deliver", "dup", "drop") and inflight:
            k = n % len(inflight)
            msg = inflight[k] if op == "dup" else inflight.pop(k)
            if op != "drop":
                apply(r.live(msg))
        elif op == "read" and fetch is not None and snapshot is None:
            snapshot = read()
        elif op == "answer" and fetch is not None:
            answer()
        elif op == "trim":
            trimmed = max(trimmed, min(server_last, n % (server_last + 1)))
        elif op == "repair":
            apply(r.repair())
    if not subscribed:
        apply(r.subscribed())
    while inflight:
        apply(r.live(inflight.pop(0)))
    apply(r.repair())
    for _ in range(10_000):
        if fetch is None:
            break
        answer()
    assert fetch is None

    offs = offsets(out)
    assert offs == sorted(set(offs)), "out of order or duplicated"
    assert tail_at is not None
    # a reader ahead of the session restarts at its end
    begin = tail_at if start is None else min(start, tail_at)
    covered: list[int] = []
    prev = begin
    for x in out:
        if x.kind == "gap":
            meta = json.loads(x.data)["meta"]
            assert meta["from"] == prev + 1
            assert meta["to"] <= trimmed, "gap over frames the backlog still holds"
            covered.extend(range(meta["from"], meta["to"] + 1))
        else:
            covered.append(x.offset)
        prev = x.offset
    assert covered == list(range(begin + 1, server_last + 1))
    assert state(r) is ResumeState.LIVE
