"""Durable Streams' store rules, once for every store: append, read, fork, delete."""

from __future__ import annotations

import asyncio

import pytest

from relay.broker.port import MESSAGE_OVERHEAD, SoftDeleted, StreamWrite, charge
from relay.durable import store
from tests.contract.conftest import Stores

JSON = "application/json"


def put(**kw: object) -> StreamWrite:
    return StreamWrite(op="put", media_type=JSON, content_type=JSON, **kw)  # type: ignore[arg-type]


def post(**kw: object) -> StreamWrite:
    return StreamWrite(op="post", media_type=JSON, content_type=JSON, has_body=True, **kw)  # type: ignore[arg-type]


async def test_append_and_read(stores: Stores) -> None:
    s, ref = stores.store, store.StreamRef.of(f"c/{stores.sid()}")
    assert (await store.write(s, ref, post(), [b"1"])).code == 404
    assert (await store.write(s, ref, put(), [b"1"])).code == 201
    assert (await store.write(s, ref, put(), [])).code == 200  # the same configuration
    assert (await store.write(s, ref, put(ttl=5), [])).code == 409
    r = await store.write(s, ref, post(), [b"2", b"3"])
    assert (r.code, r.next, r.closed) == (204, 3, False)
    view = await store.read(s, ref, 1, count=10)
    assert view is not None
    assert (view.messages, view.next, view.start) == ([b"2", b"3"], 3, 1)
    tail = await store.read(s, ref, None, count=10)
    assert tail is not None
    assert (tail.messages, tail.start) == ([], 3)
    one = await store.read(s, ref, 0, count=10, max_bytes=1)
    assert one is not None
    assert one.messages == [b"1"]
    closed = await store.write(s, ref, post(close=True), [b"4"])
    assert (closed.code, closed.next, closed.closed) == (204, 4, True)
    assert (await store.write(s, ref, post(), [b"5"])).code == 409


async def test_producer_fencing_and_sequence(stores: Stores) -> None:
    s, ref = stores.store, store.StreamRef.of(f"c/{stores.sid()}")
    await store.write(s, ref, put(), [])
    r = await store.write(s, ref, post(producer=("p", 1, 0)), [b"a"])
    assert (r.code, r.a, r.b) == (200, 1, 0)
    dup = await store.write(s, ref, post(producer=("p", 1, 0)), [b"a"])
    assert (dup.code, dup.next) == (204, 1)  # a retry: written once
    gap = await store.write(s, ref, post(producer=("p", 1, 5)), [b"b"])
    assert (gap.code, gap.a, gap.b) == (409, 1, 5)
    assert (await store.write(s, ref, post(producer=("p", 2, 0)), [b"b"])).code == 200
    stale = await store.write(s, ref, post(producer=("p", 1, 1)), [b"c"])
    assert (stale.code, stale.a) == (403, 2)


async def test_fork_and_delete(stores: Stores) -> None:
    s = stores.store
    src = store.StreamRef.of(f"c/{stores.sid()}")
    child = store.StreamRef.of(f"c/{stores.sid()}")
    await store.write(s, src, put(), [b"1", b"2"])
    fork = put(fork=f"{src.path}\n2\n0")
    assert (await store.write(s, child, fork, [b"1", b"2"])).code == 201
    assert await store.fork_ref(s, src, child.path)
    assert await store.delete(s, src) == 204  # soft: the fork holds it
    with pytest.raises(SoftDeleted):
        await store.read(s, src, 0, count=10)
    assert await store.delete(s, src) == 410
    assert not await store.fork_ref(s, src, "another")
    view = await store.read(s, child, 0, count=10)
    assert view is not None
    assert view.messages == [b"1", b"2"]
    assert await store.delete(s, child) == 204  # the last fork: the source goes too
    assert await store.read(s, child, 0, count=10) is None
    assert await store.read(s, src, 0, count=10) is None
    assert await store.delete(s, src) == 404


async def test_a_stream_holds_at_most_its_byte_bound(stores: Stores) -> None:
    """``max_bytes``: a write that would make the stream hold more (each message counted
    as its bytes + MESSAGE_OVERHEAD, since its creation) is 413 and stores nothing."""
    s, ref = stores.store, store.StreamRef.of(f"c/{stores.sid()}")
    per = MESSAGE_OVERHEAD
    bound = 3 * (100 + per)
    too_big = await store.write(s, ref, put(max_bytes=bound), [b"x" * 100] * 4)
    assert (too_big.code, too_big.b) == (413, bound)
    assert await store.read(s, ref, 0, count=10) is None  # nothing created
    assert (await store.write(s, ref, put(max_bytes=bound), [b"x" * 100])).code == 201
    assert (await store.write(s, ref, post(max_bytes=bound), [b"y" * 100])).code == 204
    over = await store.write(s, ref, post(max_bytes=bound), [b"z" * 100, b"z"])
    assert (over.code, over.next, over.a, over.b) == (413, 2, 2 * (100 + per), bound)
    view = await store.read(s, ref, 0, count=10)
    assert view is not None
    assert view.messages == [b"x" * 100, b"y" * 100]  # the refused write left nothing
    assert (await store.write(s, ref, post(max_bytes=bound), [b"z" * 100])).code == 204
    assert (await store.write(s, ref, post(max_bytes=bound), [b"!"])).code == 413
    assert (await store.write(s, ref, post(), [b"!"])).code == 204  # max_bytes 0: no bound
    # a million tiny messages are not a million bytes: each counts its overhead
    assert charge([b"1"] * 1000) == 1000 * (1 + per)
    # deleted: a new stream at the path starts from nothing
    await store.delete(s, ref)
    assert (await store.write(s, ref, put(max_bytes=bound), [b"x" * 100] * 3)).code == 201


async def test_byte_windows(stores: Stores) -> None:
    """``take_bytes``: a sliding window of bytes per key, shared by whoever asks."""
    s = stores.store
    k = f"tr:tok:{{{stores.sid()}}}:bytes"
    assert await s.take_bytes(k, 600, 1000, 3_600_000) == 0
    assert await s.take_bytes(k, 400, 1000, 3_600_000) == 0
    wait = await s.take_bytes(k, 1, 1000, 3_600_000)
    assert 3_500_000 <= wait <= 3_600_000  # when the first bytes stop counting
    assert await s.take_bytes(k, 1001, 1000, 3_600_000) == -1  # never fits
    assert await s.take_bytes(k, -400, 0, 3_600_000) == 0  # given back
    assert await s.take_bytes(k, 400, 1000, 3_600_000) == 0
    assert await s.take_bytes(k, 1, 1000, 3_600_000) > 0
    other = f"tr:tok:{{{stores.sid()}}}:bytes"
    assert await s.take_bytes(other, 1000, 1000, 3_600_000) == 0  # keys apart


async def test_a_write_of_many_messages_is_whole(stores: Stores) -> None:
    """Any number of messages in one write, atomically (Redis: past about 8,000 the
    script's unpack() overflowed, and the failed create left an empty stream)."""
    s, ref = stores.store, store.StreamRef.of(f"c/{stores.sid()}")
    many = [str(i).encode() for i in range(20_000)]
    r = await store.write(s, ref, put(), many)
    assert (r.code, r.next) == (201, 20_000)
    r = await store.write(s, ref, post(), many)
    assert (r.code, r.next) == (204, 40_000)
    view = await store.read(s, ref, 19_998, count=4)
    assert view is not None
    assert view.messages == [b"19998", b"19999", b"0", b"1"]


async def test_a_built_create_is_invisible_until_its_commit(stores: Stores) -> None:
    """``build`` steps append to a stream that reads as absent (404 to every direct
    operation, 409 to another create); the commit with the same id makes it whole; a
    commit of a build that is not there writes nothing (412)."""
    s, ref = stores.store, store.StreamRef.of(f"c/{stores.sid()}")
    step = StreamWrite(op="build", media_type=JSON, content_type=JSON, build="b1")
    assert (await store.write(s, ref, step, [b"1", b"2"])).code == 202
    assert (await store.write(s, ref, step, [b"3"])).next == 3
    assert await store.read(s, ref, 0, count=10) is None
    assert (await store.write(s, ref, post(), [b"x"])).code == 404
    assert (await store.write(s, ref, put(), [])).code == 409
    assert await store.delete(s, ref) == 404
    other = StreamWrite(op="build", media_type=JSON, content_type=JSON, build="b2")
    assert (await store.write(s, ref, other, [b"y"])).code == 409
    assert (await store.write(s, ref, put(build="b2"), [])).code == 412
    r = await store.write(s, ref, put(build="b1", ttl=60), [b"4"])
    assert (r.code, r.next) == (201, 4)
    view = await store.read(s, ref, 0, count=10)
    assert view is not None
    assert (view.messages, view.ttl) == ([b"1", b"2", b"3", b"4"], 60)
    assert (await store.write(s, ref, put(ttl=60), [])).code == 200
    missing = store.StreamRef.of(f"c/{stores.sid()}")
    assert (await store.write(s, missing, put(build="b3"), [b"z"])).code == 412
    assert await store.read(s, missing, 0, count=10) is None


async def test_the_largest_ttl_makes_a_working_stream(stores: Stores) -> None:
    """``Stream-TTL`` 2^53-1 s: the stream is made, read, appended to (Redis refused the
    float the script computed, after it had written the stream's configuration)."""
    s, ref = stores.store, store.StreamRef.of(f"c/{stores.sid()}")
    top = (1 << 53) - 1
    assert (await store.write(s, ref, put(ttl=top), [b"1"])).code == 201
    assert (await store.write(s, ref, post(), [b"2"])).code == 204
    view = await store.read(s, ref, 0, count=10)
    assert view is not None
    assert (view.messages, view.ttl) == ([b"1", b"2"], top)


async def test_a_soft_deleted_source_keeps_no_data(stores: Stores) -> None:
    """Forks hold copies: a source deleted while forked keeps only its tombstone (410,
    its path blocked); once its last fork goes, the path takes a new stream."""
    s = stores.store
    src = store.StreamRef.of(f"c/{stores.sid()}")
    child = store.StreamRef.of(f"c/{stores.sid()}")
    await store.write(s, src, put(), [b"1", b"2"])
    await store.write(s, src, post(producer=("p", 0, 0)), [b"3"])
    assert (
        await store.write(s, child, put(fork=f"{src.path}\n3\n0"), [b"1", b"2", b"3"])
    ).code == 201
    assert await store.fork_ref(s, src, child.path)
    assert await store.delete(s, src) == 204
    assert (await store.write(s, src, put(), [])).code == 409  # the protocol's tombstone
    assert (await store.write(s, src, post(), [b"4"])).code == 410
    assert await store.delete(s, child) == 204
    assert (await store.write(s, src, put(), [b"new"])).code == 201
    view = await store.read(s, src, 0, count=10)
    assert view is not None
    assert view.messages == [b"new"]
    r = await store.write(s, src, post(producer=("p", 0, 0)), [b"again"])
    assert r.code == 200  # the old producer state went with the data


async def test_an_expired_fork_frees_its_deleted_source(stores: Stores) -> None:
    """A fork that expires says nothing to its source: its reference is released when
    the source is deleted or its path re-created, so a tombstone whose forks all
    expired goes, and the path takes a new stream."""
    s = stores.store
    src = store.StreamRef.of(f"c/{stores.sid()}")
    child = store.StreamRef.of(f"c/{stores.sid()}")
    await store.write(s, src, put(), [b"1"])
    assert (await store.write(s, child, put(ttl=1, fork=f"{src.path}\n1\n0"), [b"1"])).code == 201
    assert await store.fork_ref(s, src, child.path)
    assert await s.stream_forks(src, 10) == [child.path]
    assert await store.delete(s, src) == 204  # soft: the fork is alive
    assert (await store.write(s, src, put(), [])).code == 409
    await asyncio.sleep(1.3)
    assert await store.read(s, child, 0, count=1) is None  # expired
    await store.prune(s, src)
    assert (await store.write(s, src, put(), [b"new"])).code == 201
    view = await store.read(s, src, 0, count=10)
    assert view is not None
    assert view.messages == [b"new"]


async def test_the_byte_bound_holds_for_packed_writes_and_built_creates(stores: Stores) -> None:
    """The bound counts every message of a write of any size (Redis: read from the packed
    argument's lengths before anything is written), and a built create's steps and its
    commit add up: the step or commit that would pass it is 413 and stores nothing."""
    s, ref = stores.store, store.StreamRef.of(f"c/{stores.sid()}")
    many = [str(i % 10).encode() for i in range(20_000)]
    bound = charge(many)
    assert bound == 20_000 * (1 + MESSAGE_OVERHEAD)
    over = await store.write(s, ref, put(max_bytes=bound - 1), many)
    assert (over.code, over.b) == (413, bound - 1)
    assert await store.read(s, ref, 0, count=1) is None
    r = await store.write(s, ref, put(max_bytes=bound), many)
    assert (r.code, r.next) == (201, 20_000)
    full = await store.write(s, ref, post(max_bytes=bound), [b"1"])
    assert (full.code, full.next, full.a, full.b) == (413, 20_000, bound, bound)

    built = store.StreamRef.of(f"c/{stores.sid()}")
    page = [b"x" * 100] * 3
    cap = 2 * charge(page) + charge([b"y" * 10])
    step = StreamWrite(op="build", media_type=JSON, content_type=JSON, build="b1", max_bytes=cap)
    assert (await store.write(s, built, step, page)).code == 202
    assert (await store.write(s, built, step, page)).code == 202
    past = await store.write(s, built, step, page)
    assert (past.code, past.next, past.a, past.b) == (413, 6, 2 * charge(page), cap)
    commit = await store.write(s, built, put(build="b1", max_bytes=cap), [b"y" * 11])
    assert (commit.code, commit.a) == (413, 2 * charge(page))
    assert await store.read(s, built, 0, count=10) is None  # still unseen
    r = await store.write(s, built, put(build="b1", max_bytes=cap), [b"y" * 10])
    assert (r.code, r.next) == (201, 7)
    assert (await store.write(s, built, post(max_bytes=cap), [b"z"])).code == 413  # all held
    assert (await store.write(s, built, post(max_bytes=cap + 17), [b"z"])).code == 204
