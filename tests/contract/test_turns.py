"""The turn's rules, once for every store: the lock, the fenced generation, offsets,
the backlog's page and byte bounds, seal, reap, the tombstone after a delete."""

from __future__ import annotations

import asyncio
import time

import pytest

from relay.broker.base import SUPERSEDED, SUPERSEDED_TEXT, ReapStatus
from relay.broker.errors import Fenced, FrameTooLarge, SessionDeleted
from relay.broker.port import Draft, LockState
from relay.protocol.frame import MAX_FRAME_BYTES, decode
from relay.protocol.keys import OWNER_FIELD
from tests.contract.conftest import MAX_BYTES, Stores

TTL_MS = 5000


def tokens(*texts: str) -> list[Draft]:
    return [Draft(kind="token", text=t) for t in texts]


async def test_lock_acquire_refresh_release(stores: Stores) -> None:
    s, sid = stores.store, stores.sid()
    assert await s.acquire_lock(sid, "a:1", TTL_MS) is None
    assert await s.acquire_lock(sid, "a:1", TTL_MS) is None  # ours already: a resent SET
    holder = await s.acquire_lock(sid, "b:2", TTL_MS)
    assert holder is not None
    assert holder.owner == "a:1"
    assert await s.name_turn(sid, "a:1", TTL_MS, 3, 7)
    assert not await s.name_turn(sid, "b:2", TTL_MS, 3, 7)
    holder = await s.acquire_lock(sid, "b:2", TTL_MS)
    assert holder is not None
    assert (holder.turn, holder.offset) == (3, 7)
    assert await s.refresh_lock(sid, "a:1", TTL_MS, 3) is LockState.HELD
    assert await s.refresh_lock(sid, "b:2", TTL_MS, 3) is LockState.LOST
    assert not await s.release_lock(sid, "b:2")  # not its lock
    assert await s.release_lock(sid, "a:1")
    assert await s.refresh_lock(sid, "a:1", TTL_MS, 3) is LockState.LOST
    assert await s.acquire_lock(sid, "b:2", TTL_MS) is None


async def test_stale_generation_is_fenced_and_its_open_turn_ended(stores: Stores) -> None:
    """A turn still open when the next one opens (its producer died or lost its lock)
    ends first with one ``error`` frame (``superseded``) under the new epoch: every turn
    ends with exactly one terminal frame, and the stale producer writes nothing more."""
    s, sid = stores.store, stores.sid()
    old = await s.open_generation(sid)
    assert await old.publish(tokens("a")) == [1]
    new = await s.open_generation(sid)
    assert (new.epoch, new.turn, new.offset, new.gen) == (old.epoch + 1, old.turn + 1, 2, old.gen)
    with pytest.raises(Fenced):
        await old.publish(tokens("stale"))
    assert await new.publish(tokens("b")) == [3]
    assert await new.publish([Draft(kind="done")]) == [4]
    frames = [decode(f) for f in (await stores.edge.read_page(sid, 0, 10, 0)).frames]
    assert [(f.turn, f.kind, f.text) for f in frames] == [
        (1, "token", "a"), (1, "error", SUPERSEDED_TEXT), (2, "token", "b"), (2, "done", ""),
    ]  # fmt: skip
    ended = frames[1]
    assert ended.epoch == new.epoch
    assert ended.meta == {"code": SUPERSEDED, "by_turn": 2, "gen": new.gen}
    after = await s.open_generation(sid)  # a turn that ended is not ended again
    assert after.offset == 4
    assert await after.publish([Draft(kind="done")]) == [5]


async def test_offsets_are_contiguous(stores: Stores) -> None:
    s, sid = stores.store, stores.sid()
    gen = await s.open_generation(sid)
    seen: list[int] = []
    gen.observers.append(lambda off, kind, data: seen.append(off))
    assert await gen.publish([Draft(kind="meta", meta={"role": "user"})]) == [1]
    assert await gen.publish(tokens("a", "b", "c")) == [2, 3, 4]
    assert await gen.publish([Draft(kind="done")]) == [5]
    assert seen == [1, 2, 3, 4, 5]
    assert gen.next_offset == 6
    frames = [decode(f) for f in (await stores.edge.read_page(sid, 0, 100, 0)).frames]
    assert [f.offset for f in frames] == [1, 2, 3, 4, 5]
    assert {f.meta["gen"] for f in frames if f.meta} == {gen.gen}
    nxt = await s.open_generation(sid)  # the next turn continues the offsets
    assert nxt.offset == 5
    assert await nxt.publish(tokens("d")) == [6]


async def test_frame_too_large_writes_nothing(stores: Stores) -> None:
    s, sid = stores.store, stores.sid()
    gen = await s.open_generation(sid)
    with pytest.raises(FrameTooLarge):
        await gen.publish(tokens("ok", "x" * MAX_FRAME_BYTES))
    assert (await stores.edge.read_page(sid, None, 0, 0)).last == 0


async def test_page_bounds_and_byte_budget(stores: Stores) -> None:
    s, sid = stores.store, stores.sid()
    gen = await s.open_generation(sid)
    await gen.publish(tokens(*(f"t{i}" for i in range(10))))
    bounds = await stores.edge.read_page(sid, None, 100, 0)
    assert (bounds.frames, bounds.first, bounds.last, bounds.gen) == ([], 1, 10, gen.gen)
    page = await stores.edge.read_page(sid, 3, 4, 0)
    assert [decode(f).offset for f in page.frames] == [4, 5, 6, 7]
    one = len(page.frames[0])
    budget = await stores.edge.read_page(sid, 0, 100, one * 2 + 1)
    assert len(budget.frames) == 2
    assert len((await stores.edge.read_page(sid, 0, 100, 1)).frames) == 1  # one at least


async def test_backlog_byte_budget_trims_the_oldest(stores: Stores) -> None:
    s, sid = stores.store, stores.sid()
    gen = await s.open_generation(sid)
    for i in range(20):
        await gen.publish(tokens(f"{i:03d}" + "x" * 400))
    page = await stores.edge.read_page(sid, 0, 100, 0)
    held = sum(len(f) for f in page.frames)
    assert page.last == 20
    assert page.first > 1
    assert held <= MAX_BYTES
    assert decode(page.frames[-1]).offset == 20  # the newest always stays
    assert [decode(f).offset for f in page.frames] == list(range(page.first, 21))


async def test_seal_writes_a_gap_over_lost_offsets(stores: Stores) -> None:
    s, sid = stores.store, stores.sid()
    gen = await s.open_generation(sid)
    await gen.publish(tokens("a", "b"))
    assert await stores.edge.seal(sid, 2, gen.gen) == 0  # nothing missing
    assert await stores.edge.seal(sid, 5, "another-gen") == 0
    assert await stores.edge.seal(sid, 5, gen.gen) == 3  # a failover lost 3, 4, 5
    page = await stores.edge.read_page(sid, 2, 10, 0)
    gap = decode(page.frames[0])
    assert (gap.kind, gap.offset, page.last) == ("gap", 5, 5)
    assert gap.meta is not None
    assert (gap.meta["from"], gap.meta["to"]) == (3, 5)


async def test_reap_ends_a_dead_producers_turn(stores: Stores) -> None:
    s, sid = stores.store, stores.sid()
    assert (await stores.edge.reap(sid)).status is ReapStatus.IDLE
    assert await s.acquire_lock(sid, "w:1", TTL_MS) is None
    gen = await s.open_generation(sid)
    await gen.publish([Draft(kind="meta", meta={"role": "user"}), *tokens("a")])
    assert (await stores.edge.reap(sid)).status is ReapStatus.LOCKED  # still alive
    assert await s.release_lock(sid, "w:1")  # what its lock's expiry does
    reaped = await stores.edge.reap(sid)
    assert (reaped.status, reaped.offset, reaped.turn) == (ReapStatus.REAPED, 3, gen.turn)
    err = decode((await stores.edge.read_page(sid, 2, 10, 0)).frames[0])
    assert err.kind == "error"
    assert err.meta is not None
    assert err.meta["code"] == "worker_lost"
    assert (await stores.edge.reap(sid)).status is ReapStatus.IDLE  # exactly once
    with pytest.raises(Fenced):  # should the producer wake up
        await gen.publish(tokens("late"))
    assert await stores.edge.active_turn(sid) is None


async def test_active_turn_and_session_state(stores: Stores) -> None:
    s, sid = stores.store, stores.sid()
    g1 = await s.open_generation(sid)
    await g1.publish([Draft(kind="meta"), *tokens("a"), Draft(kind="done")])
    g2 = await s.open_generation(sid)
    await g2.publish([Draft(kind="meta"), *tokens("b")])
    assert await stores.edge.active_turn(sid) == (g2.turn, 3)
    assert await s.acquire_lock(sid, "w:1", TTL_MS) is None
    st = await s.session_state(sid)
    assert (st.open, st.turn, st.offset, st.gen) == (str(g2.turn), g2.turn, 5, g2.gen)
    assert st.lock.startswith("w:1 ")


async def test_nobody_watches(stores: Stores) -> None:
    s, sid = stores.store, stores.sid()
    assert await s.viewers(sid) == 0


async def test_tombstone_after_delete(stores: Stores) -> None:
    s, sid = stores.store, stores.sid()
    assert await s.acquire_lock(sid, "w:1", TTL_MS) is None
    gen = await s.open_generation(sid)
    await gen.publish(tokens("a"))
    await s.append_history(sid, ['{"role":"user","content":"hi"}'], max_messages=10,
                           max_bytes=0, ttl_s=60)  # fmt: skip
    assert not await s.gone(sid)
    assert await s.delete_session(sid, 60) >= 3
    assert await s.gone(sid)
    with pytest.raises(SessionDeleted):
        await stores.edge.read_page(sid, 0, 10, 0)
    with pytest.raises(SessionDeleted):
        await stores.edge.active_turn(sid)
    assert (await s.history(sid))[0] == []
    assert await s.acquire_lock(sid, "w:2", TTL_MS) is None  # the lock went too


async def test_stop_record(stores: Stores) -> None:
    s, sid = stores.store, stores.sid()
    assert await s.ask_stop(sid, 0, 60) == ("idle", 0, "")
    assert await s.acquire_lock(sid, "w:1", TTL_MS) is None
    status, turn, lock = await s.ask_stop(sid, 0, 60)
    assert (status, turn) == ("admitting", 0)
    assert lock.startswith("w:1 ")
    gen = await s.open_generation(sid)
    await gen.publish([Draft(kind="meta")])
    assert await s.ask_stop(sid, gen.turn + 1, 60) == ("unknown", gen.turn + 1, "")
    assert (await s.ask_stop(sid, 0, 60))[:2] == ("stopping", gen.turn)
    assert await s.refresh_lock(sid, "w:1", TTL_MS, gen.turn) is LockState.STOP_ASKED
    at = (await gen.publish([Draft(kind="done", meta={"finish_reason": "cancelled"})]))[0]
    await s.mark_stopped(sid, gen.turn, at, 60)
    assert await s.ask_stop(sid, gen.turn, 60) == ("stopped", gen.turn, str(at))
    nxt = await s.open_generation(sid)
    await nxt.publish([Draft(kind="meta"), Draft(kind="done")])
    assert await s.ask_stop(sid, nxt.turn, 60) == ("finished", nxt.turn, "")


async def test_lock_holder_and_frames_before(stores: Stores) -> None:
    s, sid = stores.store, stores.sid()
    assert await s.lock_holder(sid) is None
    assert await s.frames_before(sid, None, 10) == []
    assert await s.acquire_lock(sid, "w:1", TTL_MS) is None
    assert await s.name_turn(sid, "w:1", TTL_MS, 1, 1)
    holder = await s.lock_holder(sid)
    assert holder is not None
    assert (holder.owner, holder.turn, holder.offset) == ("w:1", 1, 1)
    gen = await s.open_generation(sid)
    await gen.publish(tokens("a", "b", "c", "d"))
    assert [decode(f).offset for f in await s.frames_before(sid, None, 2)] == [4, 3]
    assert [decode(f).offset for f in await s.frames_before(sid, 3, 10)] == [2, 1]


async def test_frames_after_pages_the_backlog_oldest_first(stores: Stores) -> None:
    s, sid = stores.store, stores.sid()
    assert await s.frames_after(sid, 0, 10) == []
    gen = await s.open_generation(sid)
    await gen.publish(tokens("a", "b", "c", "d"))
    assert [decode(f).offset for f in await s.frames_after(sid, 0, 2)] == [1, 2]
    assert [decode(f).offset for f in await s.frames_after(sid, 2, 10)] == [3, 4]
    assert await s.frames_after(sid, 4, 10) == []


async def test_frames_after_waits_for_the_first_frame_written(stores: Stores) -> None:
    s, sid = stores.store, stores.sid()
    gen = await s.open_generation(sid)
    await gen.publish(tokens("a"))
    t0 = time.monotonic()
    assert await s.frames_after(sid, 1, 10, block_ms=100) == []  # nothing came: waited
    assert time.monotonic() - t0 >= 0.08
    waiting = asyncio.create_task(s.frames_after(sid, 1, 10, block_ms=5000))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await gen.publish(tokens("b", "c"))
    got = await asyncio.wait_for(waiting, 2)
    assert decode(got[0]).offset == 2
    t0 = time.monotonic()  # frames there: no wait
    assert [decode(f).offset for f in await s.frames_after(sid, 0, 1, block_ms=5000)] == [1]
    assert time.monotonic() - t0 < 1


async def test_session_owner_and_tombstone_in_one_answer(stores: Stores) -> None:
    s, sid = stores.store, stores.sid()
    assert await s.session_owner(sid) == ("", False)
    await s.set_state(sid, OWNER_FIELD, "responses", 60)
    assert await s.session_owner(sid) == ("responses", False)
    await s.delete_session(sid, 60)
    assert await s.session_owner(sid) == ("", True)


async def test_ping_answers(stores: Stores) -> None:
    await stores.store.ping()
