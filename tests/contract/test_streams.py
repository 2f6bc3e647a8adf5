"""Durable Streams' store rules, once for every store: append, read, fork, delete."""

from __future__ import annotations

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
